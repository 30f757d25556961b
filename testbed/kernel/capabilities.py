"""What this kernel and machine can actually do, found by trying it (never by guessing).

``probe()`` builds a scratch namespace ``nzt-probe-<pid>`` with a veth pair, tries to add each
qdisc the testbed uses, loads an nftables netdev table with a ``numgen random`` rule, checks
MPTCP and the helper binaries, and removes the namespace again (also on error). The result is
cached per process; ``probe(refresh=True)`` probes again.
"""
from __future__ import annotations

import os
import shutil
import socket
import threading
from dataclasses import dataclass, field, fields
from typing import Optional

from testbed.kernel import netns, tc
from testbed.kernel.nftables import NFT_MOD, ingress_chain_script, nft_rule, nft_run

IPPROTO_MPTCP = getattr(socket, "IPPROTO_MPTCP", 262)
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
    """None if ``kind`` works as a root qdisc of ``idx``, else why not."""
    e = tc.try_qdisc(ipr, idx, kind, **kw)
    if e is None:
        return None
    error = _err(e)
    if getattr(e, "code", None) == 2:    # NetlinkError ENOENT "Specified qdisc kind is unknown"
        error += ": the qdisc kind is unknown to this kernel"
    return error


def _probe_kernel(ns: str, res: dict, details: dict) -> None:
    from pyroute2 import IPRoute

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
    # the shaper's own loss rule and chain (numgen random mod 1000000 < 1 counter drop)
    script = ingress_chain_script("probe", dev, [nft_rule(1 / NFT_MOD)])
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
        if netns.exists(ns):
            try:
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
