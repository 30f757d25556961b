"""What this kernel and machine can actually do, found by trying it (never by guessing).

``probe()`` builds a scratch namespace ``nzt-probe-<pid>`` with a veth pair, tries to add each
qdisc the testbed uses, loads an nftables netdev table with a ``numgen random`` rule, checks
MPTCP and the helper binaries, and removes the namespace again (also on error). The result is
cached per process; ``probe(refresh=True)`` probes again.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import socket
import subprocess
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Optional

IPPROTO_MPTCP = getattr(socket, "IPPROTO_MPTCP", 262)
NFT_TABLE = "nezha_testbed"
FEATURES = ("netns", "veth", "bridge", "htb", "tbf", "netem", "nftables", "mptcp",
            "iperf3", "mnexec")


@dataclass(frozen=True)
class Capabilities:
    netns: bool = False
    veth: bool = False
    bridge: bool = False
    htb: bool = False
    tbf: bool = False
    netem: bool = False
    nftables: bool = False
    mptcp: bool = False
    iperf3: bool = False
    mnexec: bool = False
    congestion_controls: tuple = ()   # TCP congestion control algorithms the kernel has loaded
    details: dict = field(default_factory=dict, compare=False)  # feature -> why (or what)

    def congestion_control(self, topo) -> Optional[str]:
        """The TCP congestion control the run's sockets use: the topology's
        ``tcp.congestion_control``, else cubic (Linux's default, so results do not depend on what
        this machine's root namespace was set to), else None (the kernel's default)."""
        cc = topo.tcp.get("congestion_control")
        if cc:
            return cc
        return "cubic" if "cubic" in self.congestion_controls else None

    @property
    def loss_method(self) -> Optional[str]:
        """How packet loss is emulated: netem's loss, else an nftables drop rule, else None."""
        if self.netem:
            return "netem"
        if self.nftables:
            return "nftables"
        return None

    def as_rows(self) -> list[tuple[str, bool, str]]:
        """(feature, ok, detail) rows for the ``doctor`` table."""
        rows = [(name, bool(getattr(self, name)), self.details.get(name, ""))
                for name in FEATURES]
        rows.append(("loss_method", self.loss_method is not None, self.loss_method or
                     "none: neither netem nor nftables works"))
        return rows

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "details"}
        d["details"] = dict(self.details)
        d["loss_method"] = self.loss_method
        return d


_lock = threading.Lock()
_cached: Optional[Capabilities] = None


def probe(refresh: bool = False) -> Capabilities:
    """Probe once per process (thread-safe); ``refresh=True`` probes again."""
    global _cached
    with _lock:
        if _cached is None or refresh:
            _cached = _probe()
        return _cached


def _err(e: BaseException) -> str:
    code = getattr(e, "code", None)
    args = getattr(e, "args", ())
    if code is not None and len(args) >= 2:
        return f"{args[1]} (errno {code})"
    return f"{type(e).__name__}: {e}"


class NftResult:
    """The outcome of one nft invocation (same fields as subprocess.CompletedProcess)."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


CLONE_NEWNET = 0x40000000
_NFT_CTX_OUTPUT_HANDLE = 1 << 3
_NFT_CTX_OUTPUT_JSON = 1 << 4
_libc = None
_libnft = None
_nft_pools: dict[str, ThreadPoolExecutor] = {}
_pools_pid = os.getpid()
_nft_lock = threading.Lock()


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


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc = libc
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _in_netns(ns: Optional[str], fn, *args):
    """Call ``fn(*args)`` with THIS thread inside named namespace ``ns``, then come back.
    Only ever called on our worker threads: the caller's threads never change namespace."""
    if ns is None:
        return fn(*args)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            return fn(*args)
        finally:
            _setns(own)
    finally:
        os.close(own)


def run_in_netns(ns: Optional[str], fn, *args, timeout: float = 10.0):
    """Run ``fn(*args)`` on the namespace worker thread, inside ``ns``; sockets ``fn`` opens
    belong to ``ns``. Returns fn's result (or raises its exception)."""
    return _pool("nft-netns").submit(_in_netns, ns, fn, *args).result(timeout)


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
    """Runs on a worker thread (never the caller's): libnftables or the nft binary."""
    args = list(args)
    json_out = "-j" in args
    plain = [a for a in args if a != "-j"]
    if ns is not None and not os.path.exists(f"/run/netns/{ns}"):
        return NftResult(1, "", f"no namespace {ns}")
    if _load_libnftables() is not None and (plain[:2] == ["-f", "-"] or
                                            not any(a.startswith("-") for a in plain)):
        text = stdin if plain[:2] == ["-f", "-"] else " ".join(plain)
        return _in_netns(ns, _nft_text, text or "", json_out)
    cmd = ["nft", *args]
    if ns is not None:
        cmd = ["nsenter", f"--net=/run/netns/{ns}", *cmd]
    run = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
    return NftResult(run.returncode, run.stdout, run.stderr)


def _pool(name: str) -> ThreadPoolExecutor:
    global _pools_pid
    with _nft_lock:
        if _pools_pid != os.getpid():    # forked: the parent's worker threads are not here
            _nft_pools.clear()
            _pools_pid = os.getpid()
        if name not in _nft_pools:
            _nft_pools[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        return _nft_pools[name]


def nft_run(ns: Optional[str], args: list[str], stdin: Optional[str] = None,
            timeout: float = 10.0) -> NftResult:
    """Run ``nft ARGS`` (``-f -`` reads ``stdin``; ``-j`` for JSON output) inside the named
    namespace ``ns``. In-process through libnftables, on a worker thread that enters the
    namespace only for the call (about 1 ms), so the caller's thread never changes namespace;
    without libnftables, ``nsenter --net=/run/netns/NS nft ...`` (about 7 ms)."""
    return _pool("nft-netns").submit(_nft_call, ns, args, stdin, timeout).result(timeout + 5)


def nft_run_background(ns: Optional[str], args: list[str], stdin: Optional[str] = None,
                       timeout: float = 10.0) -> Future:
    """Like nft_run, but queued on a separate thread and not waited for (for deletions, which
    the kernel acknowledges only after an RCU grace period, 8-40 ms here)."""
    return _pool("nft-netns-bg").submit(_nft_call, ns, args, stdin, timeout)


def _probe_binaries(res: dict, details: dict) -> None:
    for name in ("iperf3", "mnexec"):
        path = shutil.which(name)
        res[name] = path is not None
        details[name] = path or f"{name} not found on PATH"


def _probe_mptcp(res: dict, details: dict) -> None:
    try:
        with open("/proc/sys/net/mptcp/enabled") as f:
            enabled = f.read().strip()
    except OSError as e:
        res["mptcp"] = False
        details["mptcp"] = f"no net.mptcp.enabled sysctl ({e.strerror}): kernel without MPTCP"
        return
    if enabled != "1":
        res["mptcp"] = False
        details["mptcp"] = f"net.mptcp.enabled = {enabled}"
        return
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, IPPROTO_MPTCP)
        s.close()
    except OSError as e:
        res["mptcp"] = False
        details["mptcp"] = f"socket(IPPROTO_MPTCP) failed: {e.strerror}"
        return
    res["mptcp"] = True
    details["mptcp"] = "net.mptcp.enabled = 1, IPPROTO_MPTCP socket works"


def _try_qdisc(ipr, idx: int, kind: str, **kw) -> Optional[str]:
    """Add ``kind`` as root qdisc of ``idx`` and remove it; None if it worked, else the error."""
    try:
        ipr.tc("add", kind, index=idx, handle=0x10000, **kw)
    except Exception as e:  # NetlinkError: ENOENT "Specified qdisc kind is unknown", ...
        error = _err(e)
        if getattr(e, "code", None) == 2:
            error += ": the qdisc kind is unknown to this kernel"
        return error
    del_root_qdisc(ipr, idx)
    return None


def del_root_qdisc(ipr, idx: int) -> bool:
    """Delete whatever root qdisc ``idx`` has; False if there was none to delete."""
    try:
        ipr.tc("del", index=idx, parent=0xFFFFFFFF)
        return True
    except Exception:
        return False


def _probe_kernel(ns: str, res: dict, details: dict) -> None:
    from pyroute2 import IPRoute, netns

    try:
        netns.create(ns)
    except Exception as e:
        for k in ("netns", "veth", "bridge", "htb", "tbf", "netem", "nftables"):
            res[k] = False
            details[k] = f"cannot create a network namespace: {_err(e)}"
        return
    res["netns"] = True
    details["netns"] = "named namespaces work"
    with IPRoute(netns=ns) as ipr:
        try:
            ipr.link("add", ifname="pa", kind="veth", peer={"ifname": "pb"})
            res["veth"] = True
            details["veth"] = "veth pairs work"
        except Exception as e:
            res["veth"] = False
            details["veth"] = f"adding a veth pair failed: {_err(e)}"
        try:
            ipr.link("add", ifname="pbr", kind="bridge")
            res["bridge"] = True
            details["bridge"] = "bridges work"
        except Exception as e:
            res["bridge"] = False
            details["bridge"] = f"adding a bridge failed: {_err(e)}"
        dev = "pa" if res["veth"] else None
        if dev is None:
            try:
                ipr.link("add", ifname="pd", kind="dummy")
                dev = "pd"
            except Exception as e:
                for k in ("htb", "tbf", "netem", "nftables"):
                    res[k] = False
                    details[k] = f"no link to probe on (veth and dummy failed: {_err(e)})"
                return
        idx = ipr.link_lookup(ifname=dev)[0]
        ipr.link("set", index=idx, state="up")
        probes = {
            "htb": {"default": 0x10},
            "tbf": {"rate": 125000, "burst": 10000, "latency": "50ms"},
            "netem": {"delay": 1000, "limit": 1000},
        }
        for kind, kw in probes.items():
            error = _try_qdisc(ipr, idx, kind, **kw)
            res[kind] = error is None
            details[kind] = (f"{kind} qdisc works" if error is None
                             else f"adding a {kind} qdisc failed: {error}"
                             + (" (kernel lacks sch_netem)" if kind == "netem" else ""))
    _probe_nft(ns, dev, res, details)


def _probe_nft(ns: str, dev: str, res: dict, details: dict) -> None:
    if shutil.which("nft") is None:
        res["nftables"] = False
        details["nftables"] = "nft not found on PATH (apt-get install nftables)"
        return
    script = (f"add table netdev {NFT_TABLE}\n"
              f"add chain netdev {NFT_TABLE} probe {{ type filter hook ingress device \"{dev}\" "
              f"priority -500; policy accept; }}\n"
              f"add rule netdev {NFT_TABLE} probe numgen random mod 1000000 < 1 counter drop\n")
    try:
        run = nft_run(ns, ["-f", "-"], stdin=script)
    except Exception as e:
        res["nftables"] = False
        details["nftables"] = f"running nft failed: {e}"
        return
    if run.returncode != 0:
        res["nftables"] = False
        details["nftables"] = ("loading a netdev ingress table with a numgen random rule failed: "
                               + (run.stderr.strip().splitlines() or ["?"])[0])
        return
    res["nftables"] = True
    details["nftables"] = "netdev ingress table with numgen random drop rule loads"


def _probe() -> Capabilities:
    res: dict = {}
    details: dict = {}
    _probe_binaries(res, details)
    _probe_mptcp(res, details)
    ns = f"nzt-probe-{os.getpid()}"
    try:
        _probe_kernel(ns, res, details)
    except Exception as e:  # anything unexpected: report rather than crash the doctor
        for k in ("netns", "veth", "bridge", "htb", "tbf", "netem", "nftables"):
            if k not in res:
                res[k] = False
                details[k] = f"probe failed: {_err(e)}"
    finally:
        if os.path.exists(f"/run/netns/{ns}"):
            try:
                from pyroute2 import netns
                netns.remove(ns)
            except Exception:
                pass
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            ccs = tuple(f.read().split())
    except OSError:
        ccs = ()
    return Capabilities(**{k: bool(res.get(k, False)) for k in FEATURES}, details=details,
                        congestion_controls=ccs)
