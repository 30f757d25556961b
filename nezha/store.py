"""A small TCP key-value store for rendezvous (like torch's TCPStore), authenticated and bounded.

Handshake (fixed-size messages, nothing allocated from what a stranger sends; see auth.py)::

    server -> client   b"NZS2" status(1: 0 ready, 2 busy) auth(1) Ns(32)
    client -> server   b"NZS2" auth(1) Nc(32) HMAC(secret, "client", Ns, Nc)
    server -> client   verdict(1: 0 ok, 1 bad proof, 3 secret on one side only)
                       HMAC(secret, "server", Nc, Ns)

``auth`` says whether that side has a job secret; the client refuses a store that does not
prove the secret it has, and the server refuses a client that does not prove its own. Then
every request and reply is ``u32 length`` + JSON object + HMAC(key, direction, sequence
number, JSON) with key = HMAC(secret, "session", Ns, Nc): a message cannot be forged,
replayed or reordered without the secret. Without a secret on both sides the same protocol
runs with an empty key (unauthenticated; the Context warns). Values travel as latin-1
strings of bytes. Commands: set, get (waits up to a timeout), add (atomic counter), wait
(several keys), check, delete. A wait ends early with an error when the store's abort key is
set: that is how one failing rank makes every other rank fail fast.

Bounds: at most ``max_clients`` connections (the Context uses NEZHA_STORE_MAX_CLIENTS, by
default 4 x world size + 16; more are told "busy" and closed, the client retries until its
timeout); the handshake must complete within HANDSHAKE_TIMEOUT and a request, once its first
byte has arrived, within READ_TIMEOUT; a length prefix above MAX_MESSAGE closes the connection
before anything is allocated, and buffers grow only as bytes arrive; keys up to MAX_KEY
bytes, values up to ``max_value``, all data up to ``max_total``; timeouts must be finite
numbers >= 0 (JSON's Infinity and NaN are refused). Every refusal is a ``store_refused``
event (peer, reason) in the serving rank's event log, and counted in ``StoreServer.refused``.

Served by rank 0 inside its Context (or stand-alone: ``python -m nezha.store --host H
--port P``, with NEZHA_JOB_SECRET in its environment).
"""
from __future__ import annotations

import argparse
import json
import math
import socket
import struct
import threading
import time
from typing import Optional

from . import auth
from .errors import AuthenticationError, ConfigError, RendezvousAborted, StoreError, StoreTimeout

_LEN = struct.Struct("!I")
_SEQ = struct.Struct("!Q")
ABORT_KEY = "__abort__"
PROTO = b"NZS2"
READY, BUSY = 0, 2                         # server hello status
OK, BAD_PROOF, MODE_MISMATCH = 0, 1, 3     # server verdict

SERVER_HELLO = len(PROTO) + 2 + auth.NONCE_BYTES
CLIENT_HELLO = len(PROTO) + 1 + auth.NONCE_BYTES + auth.TAG_BYTES
VERDICT = 1 + auth.TAG_BYTES

HANDSHAKE_TIMEOUT = 5.0     # s from accept to a proven client
READ_TIMEOUT = 10.0         # s for the rest of a message once its first byte arrived
MAX_MESSAGE = 8 << 20       # bytes of one JSON message (a max_value value, escaped, fits)
MAX_KEY = 1024              # bytes of a key
MAX_VALUE = 1 << 20         # bytes of a value (default)
MAX_TOTAL = 64 << 20        # bytes of all keys and values (default)
MAX_KEYS = 1 << 16          # keys in one wait / check
DEFAULT_MAX_CLIENTS = 256   # stand-alone store; a Context passes 4 x world + 16

_C2S, _S2C = b"nezha-store-c2s", b"nezha-store-s2c"


class _Busy(Exception):
    """The server is at its connection cap (the client retries)."""


class _Refused(Exception):
    """A request the server will not carry out (the reason goes back to the client)."""


def _no_constants(name):
    raise ValueError(f"{name} is not a number the store accepts")


def _recv(sock, n: int, deadline: Optional[float], what: str) -> bytes:
    """Exactly ``n`` bytes, growing the buffer only as they arrive; ``deadline`` (monotonic)
    bounds the whole read, None waits for ever."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is None:
            sock.settimeout(None)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"{what}: timed out")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 16))
        if not chunk:
            raise ConnectionError(f"store connection closed during {what}")
        buf += chunk
    return bytes(buf)


class _Channel:
    """One store connection after its handshake: numbered, MACed JSON messages."""

    def __init__(self, sock, key: bytes, send_label: bytes, recv_label: bytes):
        self.sock, self.key = sock, key
        self.send_label, self.recv_label = send_label, recv_label
        self.tx = self.rx = 0

    def send(self, obj, timeout: float) -> None:
        body = json.dumps(obj, ensure_ascii=False, allow_nan=False).encode()
        if len(body) > MAX_MESSAGE:
            raise _Refused(f"message of {len(body)} bytes (at most {MAX_MESSAGE})")
        tag = auth.mac(self.key, self.send_label, _SEQ.pack(self.tx), body)
        self.tx += 1
        self.sock.settimeout(timeout)
        self.sock.sendall(_LEN.pack(len(body)) + body + tag)

    def recv(self, first: Optional[float], rest: float) -> dict:
        """The next message: its first byte by ``first`` (a deadline, None: for ever), the
        rest within ``rest`` seconds after that. Raises StoreError on anything not sent by
        the other side of this handshake."""
        head = _recv(self.sock, 1, first, "message")
        deadline = time.monotonic() + rest
        head += _recv(self.sock, _LEN.size - 1, deadline, "message length")
        (n,) = _LEN.unpack(head)
        if n > MAX_MESSAGE:        # refused before anything is allocated for it
            raise StoreError(f"message of {n} bytes announced (at most {MAX_MESSAGE})")
        data = _recv(self.sock, n + auth.TAG_BYTES, deadline, "message")
        body, tag = data[:n], data[n:]
        if not auth.same(tag, auth.mac(self.key, self.recv_label, _SEQ.pack(self.rx), body)):
            raise StoreError("message authentication failed (forged, replayed or reordered)")
        self.rx += 1
        try:
            obj = json.loads(body, parse_constant=_no_constants)
        except ValueError as e:
            raise StoreError(f"bad message: {e}") from None
        if not isinstance(obj, dict):
            raise StoreError("bad message: not a JSON object")
        return obj


def _client_handshake(sock, secret: bytes, deadline: float, where: str) -> bytes:
    """The client's side (module docstring); returns the connection's message key."""
    hello = _recv(sock, SERVER_HELLO, deadline, "store hello")
    if hello[:len(PROTO)] != PROTO:
        raise AuthenticationError(f"{where} is not a nezha store of this version "
                                  f"(hello {hello[:8]!r})")
    status, server_auth, ns = hello[4], hello[5], hello[6:]
    if status == BUSY:
        raise _Busy()
    if server_auth and not secret:
        raise AuthenticationError(f"the store at {where} requires the job secret "
                                  f"(NEZHA_JOB_SECRET or Context(secret=...)); this rank has none")
    if secret and not server_auth:
        raise AuthenticationError(f"the store at {where} has no job secret but this rank has "
                                  f"one: refusing to trust it")
    nc = auth.nonce()
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    sock.sendall(PROTO + bytes([1 if secret else 0]) + nc
                 + auth.mac(secret, b"nezha-store-client", ns, nc))
    verdict = _recv(sock, VERDICT, deadline, "store verdict")
    if verdict[0] != OK:
        why = {BAD_PROOF: "a different job secret", MODE_MISMATCH: "a secret on one side only"}
        raise AuthenticationError(f"the store at {where} refused this rank: "
                                  f"{why.get(verdict[0], f'verdict {verdict[0]}')}")
    if not auth.same(verdict[1:], auth.mac(secret, b"nezha-store-server", nc, ns)):
        raise AuthenticationError(f"the store at {where} did not prove the job secret")
    return auth.mac(secret, b"nezha-store-session", ns, nc)


class StoreServer:
    """Threaded store server. ``port=0`` picks a free port (see ``.port``). ``secret``: the
    job secret (None: unauthenticated); ``events``: where refusals are logged (an Events)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret=None,
                 max_clients: int = DEFAULT_MAX_CLIENTS, events=None,
                 max_value: int = MAX_VALUE, max_total: int = MAX_TOTAL,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT,
                 read_timeout: float = READ_TIMEOUT):
        self._secret = auth.secret_bytes(secret)
        self.max_clients = int(max_clients)
        self.max_value, self.max_total = int(max_value), int(max_total)
        self.handshake_timeout, self.read_timeout = handshake_timeout, read_timeout
        self._events = events
        self._data: dict[str, str] = {}
        self._bytes = 0                       # keys + values held
        self._cond = threading.Condition()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise StoreError(f"cannot serve the store on {host}:{port}: {e}") from e
        self._sock.listen(128)
        self.host, self.port = self._sock.getsockname()[:2]
        self._closed = False
        self._clients: set[socket.socket] = set()
        self._clients_lock = threading.Lock()
        self.refused = 0
        self._thread = threading.Thread(target=self._accept_loop, name="nezha-store", daemon=True)
        self._thread.start()

    @property
    def clients(self) -> int:
        """Connections open now (handshaking or served)."""
        with self._clients_lock:
            return len(self._clients)

    def _refuse(self, peer, reason: str) -> None:
        self.refused += 1
        if self._events is not None:
            self._events.emit("store_refused", peer=f"{peer[0]}:{peer[1]}" if peer else None,
                              reason=reason[:300])

    def _accept_loop(self):
        """Accepts only: the handshake and the requests run in the client's own thread, so
        a slow or silent client never holds up the next one."""
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            with self._clients_lock:
                full = len(self._clients) >= self.max_clients
                if not full:
                    self._clients.add(conn)
            if full:
                self._refuse(addr, f"too many connections (at most {self.max_clients})")
                try:
                    conn.setblocking(False)
                    conn.send(PROTO + bytes([BUSY, 1 if self._secret else 0]) + bytes(auth.NONCE_BYTES))
                except OSError:
                    pass
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                             name="nezha-store-client").start()

    def _handshake(self, conn, addr) -> Optional[bytes]:
        """The server's side; the message key, or None (refused, logged)."""
        secret = self._secret
        deadline = time.monotonic() + self.handshake_timeout
        ns = auth.nonce()
        try:
            conn.settimeout(self.handshake_timeout)
            conn.sendall(PROTO + bytes([READY, 1 if secret else 0]) + ns)
            hello = _recv(conn, CLIENT_HELLO, deadline, "client hello")
        except (OSError, ConnectionError) as e:
            self._refuse(addr, f"handshake: {type(e).__name__}: {e}")
            return None
        if hello[:len(PROTO)] != PROTO:
            self._refuse(addr, f"handshake: not a nezha store client ({hello[:8]!r})")
            return None
        client_auth, nc, tag = hello[4], hello[5:5 + auth.NONCE_BYTES], hello[5 + auth.NONCE_BYTES:]
        if bool(client_auth) != bool(secret):
            verdict, why = MODE_MISMATCH, ("the client has no job secret" if secret else
                                           "the client has a job secret, the store has none")
        elif not auth.same(tag, auth.mac(secret, b"nezha-store-client", ns, nc)):
            verdict, why = BAD_PROOF, "the client did not prove the job secret"
        else:
            verdict, why = OK, ""
        proof = auth.mac(secret, b"nezha-store-server", nc, ns) if verdict == OK else bytes(32)
        try:
            conn.sendall(bytes([verdict]) + proof)
        except OSError:
            pass
        if verdict != OK:
            self._refuse(addr, f"handshake: {why}")
            return None
        return auth.mac(secret, b"nezha-store-session", ns, nc)

    def _wait_for(self, keys, timeout):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if ABORT_KEY in self._data:
                    return {"abort": self._data[ABORT_KEY]}
                if all(k in self._data for k in keys):
                    return {"ok": True}
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return {"timeout": [k for k in keys if k not in self._data]}
                self._cond.wait(min(left, 0.5))

    # ------------------------------------------------------------------ request checks
    @staticmethod
    def _key(req, name="key") -> str:
        k = req.get(name)
        if not isinstance(k, str):
            raise _Refused(f"{name} must be a string")
        if len(k.encode()) > MAX_KEY:
            raise _Refused(f"key of {len(k.encode())} bytes (at most {MAX_KEY})")
        return k

    @classmethod
    def _keys(cls, req) -> list:
        ks = req.get("keys")
        if not isinstance(ks, list) or len(ks) > MAX_KEYS:
            raise _Refused(f"keys must be a list of at most {MAX_KEYS} strings")
        return [cls._key({"key": k}) for k in ks]

    @staticmethod
    def _timeout(req) -> float:
        t = req.get("timeout")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise _Refused(f"timeout must be a finite number of seconds >= 0, got {t!r}")
        return float(t)

    def _put(self, key: str, value: str) -> None:
        """Store ``key`` (under the condition), within the value size and the total quota."""
        if len(value) > self.max_value:
            raise _Refused(f"value of {len(value)} bytes for {key!r} (at most {self.max_value})")
        old = self._data.get(key)
        size = self._bytes + len(key) + len(value) - (0 if old is None else len(key) + len(old))
        if size > self.max_total:
            raise _Refused(f"store full: {key!r} would make {size} bytes (at most {self.max_total})")
        self._data[key] = value
        self._bytes = size
        self._cond.notify_all()

    def _handle(self, req: dict) -> dict:
        cmd = req.get("cmd")
        if cmd == "set":
            key, value = self._key(req), req.get("value")
            if not isinstance(value, str):
                raise _Refused("value must be a string")
            with self._cond:
                self._put(key, value)
            return {"ok": True}
        if cmd == "add":
            key, delta = self._key(req), req.get("delta")
            if isinstance(delta, bool) or not isinstance(delta, int) or abs(delta) >= 1 << 63:
                raise _Refused("delta must be an integer")
            with self._cond:
                try:
                    v = int(self._data.get(key, "0")) + delta
                except ValueError:
                    raise _Refused(f"{key!r} does not hold an integer") from None
                self._put(key, str(v))
            return {"value": v}
        if cmd == "get":
            key, timeout = self._key(req), self._timeout(req)
            rep = self._wait_for([key], timeout)
            if "ok" in rep:
                with self._cond:
                    rep = {"value": self._data[key]} if key in self._data else {"timeout": [key]}
            return rep
        if cmd == "wait":
            keys, timeout = self._keys(req), self._timeout(req)
            return self._wait_for(keys, timeout)
        if cmd == "check":
            keys = self._keys(req)
            with self._cond:
                return {"value": all(k in self._data for k in keys)}
        if cmd == "delete":
            key = self._key(req)
            with self._cond:
                old = self._data.pop(key, None)
                if old is not None:
                    self._bytes -= len(key) + len(old)
            return {"value": old is not None}
        raise _Refused(f"unknown command {cmd!r}")

    def _serve(self, conn, addr):
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            key = self._handshake(conn, addr)
            if key is None:
                return
            ch = _Channel(conn, key, _S2C, _C2S)
            while not self._closed:
                try:
                    # an authenticated client may stay idle; a started request must finish
                    req = ch.recv(None, self.read_timeout)
                except (StoreError, socket.timeout) as e:
                    self._refuse(addr, f"{type(e).__name__}: {e}")
                    return
                try:
                    rep = self._handle(req)
                except _Refused as e:
                    self._refuse(addr, f"{req.get('cmd')!r}: {e}")
                    rep = {"error": f"store refused {req.get('cmd')!r}: {e}"}
                ch.send(rep, self.read_timeout)
        except (OSError, ConnectionError, _Refused):
            pass
        finally:
            with self._clients_lock:
                self._clients.discard(conn)
            conn.close()

    def linger(self, timeout: float) -> int:
        """Wait until no client is connected (every rank closed its client, or its process
        ended), at most ``timeout`` s; the clients still connected. The rank serving the
        store may be done with its last operation while others still connect on demand
        (rendezvous.PeerInfos reads a peer's record then): on 9 ranks, a broadcast from
        rank 5 lost its store when rank 0 closed after receiving its copy."""
        end = time.monotonic() + timeout
        while self.clients and time.monotonic() < end:
            time.sleep(0.01)
        return self.clients

    def close(self):
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._clients_lock:
            clients = list(self._clients)
        for c in clients:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                c.close()
            except OSError:
                pass


class StoreClient:
    """Client of a StoreServer. Each call is one request/reply; thread-safe. ``secret``: the
    job secret (None: unauthenticated; then so must the store be)."""

    def __init__(self, host: str, port: int, timeout: float = 30.0, secret=None):
        self.host, self.port, self.timeout = host, int(port), self._finite(timeout, "timeout")
        if self.timeout <= 0:
            raise ConfigError(f"store timeout must be > 0, got {timeout!r}")
        secret = auth.secret_bytes(secret)
        self._lock = threading.Lock()
        where = f"{host}:{self.port}"
        deadline = time.monotonic() + self.timeout
        last, busy = None, False
        while True:
            s = None
            try:
                s = socket.create_connection((host, self.port),
                                             timeout=max(0.01, min(2.0, deadline - time.monotonic())))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                key = _client_handshake(s, secret, min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT),
                                        where)
                break
            except AuthenticationError:
                s.close()
                raise
            except (OSError, ConnectionError, _Busy) as e:
                if s is not None:
                    s.close()
                busy = busy or isinstance(e, _Busy)
                last = e
                if time.monotonic() >= deadline:
                    why = "the store is at its connection limit" if busy else last
                    raise StoreTimeout(f"cannot reach the store at {where} within "
                                       f"{self.timeout:g} s: {why}") from None
                time.sleep(0.05)
        self._sock = s
        self._ch = _Channel(s, key, _C2S, _S2C)

    @staticmethod
    def _finite(t, what: str) -> float:
        try:
            t = float(t)
        except (TypeError, ValueError):
            raise ConfigError(f"store {what} must be a number of seconds, got {t!r}") from None
        if not math.isfinite(t) or t < 0:
            raise ConfigError(f"store {what} must be a finite number of seconds >= 0, got {t!r}")
        return t

    def _call(self, req, timeout=None):
        wait = self.timeout if timeout is None else timeout
        with self._lock:
            try:
                self._ch.send(req, wait + 5.0)
                rep = self._ch.recv(time.monotonic() + wait + 5.0, READ_TIMEOUT)
            except (OSError, ConnectionError, ValueError, _Refused) as e:
                raise StoreError(f"store at {self.host}:{self.port} failed: {e}") from e
        if "error" in rep:
            raise StoreError(rep["error"])
        if "abort" in rep:
            raise RendezvousAborted(rep["abort"])
        if "timeout" in rep:
            raise StoreTimeout(f"store keys not set within {wait:g} s: {rep['timeout']}")
        return rep

    def set(self, key: str, value) -> None:
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("latin-1")
        self._call({"cmd": "set", "key": key, "value": str(value)})

    def get(self, key: str, timeout: float | None = None) -> str:
        t = self.timeout if timeout is None else self._finite(timeout, "timeout")
        return self._call({"cmd": "get", "key": key, "timeout": t}, t)["value"]

    def add(self, key: str, delta: int = 1) -> int:
        return int(self._call({"cmd": "add", "key": key, "delta": int(delta)})["value"])

    def wait(self, keys, timeout: float | None = None) -> None:
        t = self.timeout if timeout is None else self._finite(timeout, "timeout")
        self._call({"cmd": "wait", "keys": list(keys), "timeout": t}, t)

    def check(self, keys) -> bool:
        return bool(self._call({"cmd": "check", "keys": list(keys)})["value"])

    def delete(self, key: str) -> bool:
        return bool(self._call({"cmd": "delete", "key": key})["value"])

    def abort(self, reason: str) -> None:
        """Make every current and future wait on this store fail with ``reason``."""
        try:
            self.set(ABORT_KEY, reason)
        except StoreError:
            pass

    def close(self):
        try:
            self._sock.close()
        except OSError:
            pass


def main(argv=None):
    from .config import Config
    p = argparse.ArgumentParser(description="Run a stand-alone nezha store (the job secret "
                                            "comes from NEZHA_JOB_SECRET).")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (the master address)")
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--max-clients", type=int, default=DEFAULT_MAX_CLIENTS)
    a = p.parse_args(argv)
    secret = Config.from_env().job_secret
    srv = StoreServer(a.host, a.port, secret=secret, max_clients=a.max_clients)
    if not secret:
        auth.warn(None, "store")
    print(f"nezha store listening on {srv.host}:{srv.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.close()


if __name__ == "__main__":
    main()
