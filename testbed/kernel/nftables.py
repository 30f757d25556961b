"""nftables inside a named namespace: run nft, and encode/decode the loss rules the testbed uses.

``nft_run`` runs in-process through libnftables (ctypes) on the netns worker thread, which
enters the namespace only for the call (``netns.call_in``): about 1 ms per batch, against about
7 ms for ``nsenter --net=NETNS_DIR/NS nft ...``, which is the fallback without libnftables.
``nft_run_background`` queues on a separate worker and does not wait: deletions are acknowledged
by the kernel only after an RCU grace period (8-40 ms on this machine), so they are kept off
the path of a runtime change. A runtime loss change's new rules do not come through here
either: testbed.kernel.nfnl encodes them and sends them on the namespace's own netfilter
socket (about 0.1 ms a batch).

The loss rules: ``numgen random mod 1000000 < N counter drop`` followed by ``accept`` (100 %:
``counter drop``; 0 %: ``accept``). Which chain, which device and when to change it is the
shaper's business (testbed.fabric.shaper); here is only the encoding and its JSON decoding.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
from concurrent.futures import Future
from typing import Any, Optional

from testbed.kernel import netns

NFT_TABLE = "nezha_testbed"
NFT_MOD = 1_000_000
_NFT_CTX_OUTPUT_HANDLE = 1 << 3
_NFT_CTX_OUTPUT_JSON = 1 << 4
_libnft: Any = None


class NftResult:
    """The outcome of one nft invocation (same fields as subprocess.CompletedProcess)."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


# ------------------------------------------------------------------------------ running nft
def _load_libnftables():
    """libnftables through ctypes, or None (then the nft binary is run instead)."""
    global _libnft
    if _libnft is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("nftables") or "libnftables.so.1",
                              use_errno=True)
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
            lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
            lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
            lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            _libnft = lib
        except (OSError, AttributeError):
            _libnft = False
    return _libnft or None


def _nft_text(text: str, json_out: bool) -> NftResult:
    lib = _libnft
    ctx = lib.nft_ctx_new(0)
    if not ctx:
        return NftResult(1, "", "nft_ctx_new failed")
    try:
        lib.nft_ctx_buffer_output(ctx)
        lib.nft_ctx_buffer_error(ctx)
        lib.nft_ctx_output_set_flags(ctx, _NFT_CTX_OUTPUT_HANDLE | (
            _NFT_CTX_OUTPUT_JSON if json_out else 0))
        rc = lib.nft_run_cmd_from_buffer(ctx, text.encode())
        out = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode()
        err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode()
        return NftResult(0 if rc == 0 else 1, out, err)
    finally:
        lib.nft_ctx_free(ctx)


def _nft_call(ns: Optional[str], args: list[str], stdin: Optional[str],
              timeout: float) -> NftResult:
    """Runs on a netns worker thread (never the caller's): libnftables or the nft binary."""
    args = list(args)
    json_out = "-j" in args
    plain = [a for a in args if a != "-j"]
    if ns is not None and not netns.exists(ns):
        return NftResult(1, "", f"no namespace {ns}")
    if _load_libnftables() is not None and (plain[:2] == ["-f", "-"] or
                                            not any(a.startswith("-") for a in plain)):
        text = stdin if plain[:2] == ["-f", "-"] else " ".join(plain)
        return netns.call_in(ns, _nft_text, text or "", json_out)
    cmd = ["nft", *args]
    if ns is not None:
        cmd = netns.command(ns, cmd)
    run = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
    return NftResult(run.returncode, run.stdout, run.stderr)


def nft_run(ns: Optional[str], args: list[str], stdin: Optional[str] = None,
            timeout: float = 10.0) -> NftResult:
    """Run ``nft ARGS`` (``-f -`` reads ``stdin``; ``-j`` for JSON output) inside the named
    namespace ``ns`` (None: this one). In-process through libnftables, on the netns worker
    thread, so the caller's thread never changes namespace; else ``nsenter ... nft``."""
    return netns.call_in(None, _nft_call, ns, args, stdin, timeout, timeout=timeout + 5)


def nft_run_background(ns: Optional[str], args: list[str], stdin: Optional[str] = None,
                       timeout: float = 10.0) -> Future:
    """Like nft_run, but queued on a separate worker thread and not waited for (for deletions,
    which the kernel acknowledges only after an RCU grace period, 8-40 ms here)."""
    return netns.submit_in(None, _nft_call, ns, args, stdin, timeout, lane="netns-bg")


# ------------------------------------------------------------------------- loss rules: encode
def loss_threshold(loss: float) -> int:
    """N of ``numgen random mod 1000000 < N``: 1000000 drops every packet."""
    if not 0.0 <= loss <= 1.0:
        raise ValueError(f"loss {loss!r} is not a fraction in 0..1")
    return int(round(loss * NFT_MOD))


def nft_rule(loss: float) -> str:
    """The drop rule for a loss fraction; 100 % (a black hole) is an unconditional drop, as
    nft refuses ``< 1000000`` for a ``mod 1000000`` value."""
    n = loss_threshold(loss)
    if n >= NFT_MOD:
        return "counter drop"
    return f"numgen random mod {NFT_MOD} < {n} counter drop"


def nft_generation(loss: float) -> list[str]:
    """The rules, head first, that give every packet its verdict for ``loss``: a numgen drop
    followed by an unconditional accept (so rules behind them are never reached)."""
    n = loss_threshold(loss)
    if n == 0:
        return ["accept"]
    if n >= NFT_MOD:
        return ["counter drop"]
    return [nft_rule(loss), "accept"]


def ingress_chain_script(chain: str, device: str, rules: list[str]) -> str:
    """An ``nft -f`` script creating table ``NFT_TABLE`` (netdev), a chain hooked on ingress of
    ``device`` at priority -500 (before anything else sees the packet), and ``rules``."""
    base = f"netdev {NFT_TABLE} {chain}"
    return (f"add table netdev {NFT_TABLE}\n"
            f"add chain {base} {{ type filter hook ingress device \"{device}\" "
            f"priority -500; policy accept; }}\n"
            + "".join(f"add rule {base} {r}\n" for r in rules))


# ------------------------------------------------------------------------- loss rules: decode
def _is_accept(expr: list) -> bool:
    return bool(expr) and all(isinstance(e, dict) and ("accept" in e or "counter" in e)
                              for e in expr) and any("accept" in e for e in expr)


def decode_nft_chain(exprs: list[list]) -> tuple[float, int]:
    """(loss, number of head rules in force) of our chain's rules (nft JSON ``expr`` lists,
    in chain order). Raises ValueError for anything that is not a generation of ours."""
    if not exprs:
        return 0.0, 0
    if _is_accept(exprs[0]):
        return 0.0, 1
    loss = decode_nft_rule(exprs[0])
    if loss is None:
        raise ValueError(f"head rule is not a loss rule of ours: {exprs[0]}")
    if loss >= 1.0:
        return 1.0, 1
    if len(exprs) < 2 or not _is_accept(exprs[1]):
        raise ValueError("numgen drop rule not followed by an accept: later rules would "
                         "drop again")
    return loss, 2


def decode_nft_rule(expr: list) -> Optional[float]:
    """The loss of a ``numgen random mod M < N ... drop`` rule in nft JSON, None if not ours."""
    if not any(isinstance(e, dict) and "drop" in e for e in expr):
        return None
    if all(isinstance(e, dict) and ("drop" in e or "counter" in e) for e in expr):
        return 1.0      # unconditional drop: a black hole
    for e in expr:
        m = e.get("match") if isinstance(e, dict) else None
        if not m or not isinstance(m.get("left"), dict) or "numgen" not in m["left"]:
            continue
        ng = m["left"]["numgen"]
        if ng.get("mode") != "random" or ng.get("offset", 0) != 0:
            return None
        mod, right, op = int(ng["mod"]), m.get("right"), m.get("op")
        if op == "<" and isinstance(right, int):
            return min(right, mod) / mod
        return None
    return None


def rule_packets(expr: list) -> Optional[int]:
    """The packet count of a rule's ``counter`` (nft JSON), None if it has none."""
    return next((e["counter"].get("packets") for e in expr
                 if isinstance(e, dict) and isinstance(e.get("counter"), dict)), None)
