"""The job secret: HMAC-SHA256 challenge-response for the store and the rails.

Every rank of a job is given the same secret (``NEZHA_JOB_SECRET`` or ``Context(secret=...)``;
the testbed draws one per run). It never crosses the wire: each side of a store connection or a
rail connection sends a fresh random nonce and proves the secret by an HMAC over both nonces
(and over who is talking to whom), under a label of its own, so that

* a stranger without the secret can neither pass as a rank nor as the store,
* a recorded handshake replayed later fails (the other side's nonce is new), and
* one side's proof cannot be reflected back as the other side's (different labels).

Protocols: ``store.py`` (store connections; every store message then carries an HMAC under a
per-connection key) and ``rendezvous.py`` (rail HELLO / AUTH). Without a secret the same code
runs with an empty key: nothing is authenticated, and the Context says so once (``warn``).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct

from .errors import ConfigError

NONCE_BYTES = 32
TAG_BYTES = 32
MIN_SECRET = 16          # characters (bytes) of a job secret

log = logging.getLogger("nezha")
_warned = False


def secret_bytes(secret, what: str = "secret") -> bytes:
    """The job secret as bytes (b"" when there is none). A secret shorter than MIN_SECRET is
    refused: an attacker who recorded a handshake could guess it offline."""
    if secret is None or secret == "" or secret == b"":
        return b""
    b = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(b) < MIN_SECRET:
        raise ConfigError(f"{what}: a job secret needs at least {MIN_SECRET} characters "
                          f"(e.g. python -c 'import secrets; print(secrets.token_hex(16))')")
    return b


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 under ``key`` of ``label`` and every part, each length-prefixed (so the
    transcript cannot be cut differently)."""
    h = hmac.new(key, label, hashlib.sha256)
    for p in parts:
        h.update(struct.pack("!I", len(p)))
        h.update(p)
    return h.digest()


def same(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(a, b)


def warn(events, where: str) -> None:
    """No job secret: one ``unauthenticated`` event, and one log line per process."""
    global _warned
    msg = (f"nezha {where} runs without a job secret (NEZHA_JOB_SECRET): anyone who can reach "
           f"the store or the rails can read the store and race the ranks for their connections")
    if events is not None:
        events.emit("unauthenticated", message=msg)
    if not _warned:
        _warned = True
        log.warning(msg)
