"""capabilities.probe(): real probing in a scratch namespace that never outlives the probe; and
netns.call_in, the one way in-process work enters a namespace."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

from testbed.kernel import capabilities, netns
from testbed.kernel.capabilities import Capabilities, probe

# only the tests that probe or enter namespaces are marked netns (tests/conftest.py skips them,
# with the reason, where root or namespaces are missing); the pure-Python ones run everywhere


def _tc_netem_works() -> bool:
    """Independent check with the tc binary, in our own scratch namespace."""
    ns = f"nzt-captest-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "d0", "type", "veth", "peer",
                        "name", "d1"], check=True)
        r = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "d0", "root", "netem",
                            "delay", "1ms"], capture_output=True)
        return r.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


@pytest.mark.netns
def test_probe_reports_this_kernel_and_leaves_nothing_behind():
    t0 = time.monotonic()
    caps = probe(refresh=True)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0, f"probe took {elapsed:.3f}s"
    assert not netns.exists(f"nzt-probe-{os.getpid()}")
    for feature in ("netns", "veth", "bridge", "htb", "tbf", "nftables"):
        assert getattr(caps, feature), f"{feature}: {caps.details.get(feature)}"
    # netem: whatever the probe says must agree with tc itself; here (no sch_netem) it is False
    assert caps.netem == _tc_netem_works()
    assert caps.details["netem"]
    if not caps.netem:
        assert "netem" in caps.details["netem"] and "failed" in caps.details["netem"]
        assert caps.loss_method == "nftables"
    else:
        assert caps.loss_method == "netem"
    assert caps.iperf3 == (shutil.which("iperf3") is not None)
    assert caps.mnexec == (shutil.which("mnexec") is not None)
    mptcp_on = open("/proc/sys/net/mptcp/enabled").read().strip() == "1" \
        if os.path.exists("/proc/sys/net/mptcp/enabled") else False
    assert caps.mptcp == mptcp_on


@pytest.mark.netns
def test_probe_is_cached_and_refreshable():
    a = probe()
    assert probe() is a
    b = probe(refresh=True)
    assert b is not a and b == a
    assert probe() is b


@pytest.mark.netns
def test_probe_cleans_up_on_error(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("injected")
    monkeypatch.setattr(capabilities, "_probe_nft", boom)
    caps = probe(refresh=True)
    assert not netns.exists(f"nzt-probe-{os.getpid()}")
    assert caps.nftables is False and "injected" in caps.details["nftables"]
    assert caps.htb  # what was probed before the failure is still reported
    monkeypatch.undo()
    assert probe(refresh=True).nftables   # leave the real capabilities cached for later tests


def test_rows_and_loss_method():
    caps = Capabilities(netns=True, htb=True, nftables=True,
                        details={"netem": "adding a netem qdisc failed: unknown"})
    rows = caps.as_rows()
    names = [r[0] for r in rows]
    assert names[:10] == list(capabilities.FEATURES)
    assert ("netem", False, "adding a netem qdisc failed: unknown") in rows
    assert rows[-1] == ("loss_method", True, "nftables")
    assert caps.loss_method == "nftables"
    assert Capabilities(netem=True, nftables=True).loss_method == "netem"
    assert Capabilities().loss_method is None
    assert caps.to_dict()["loss_method"] == "nftables"
    with pytest.raises(Exception):
        caps.htb = False  # frozen


@pytest.mark.netns
def test_call_in_enters_the_namespace_on_a_worker_only():
    """fn runs inside the namespace (its sockets stay there); the caller's thread never moves,
    errors come back to the caller, and a worker calling call_in again does not deadlock."""
    ns = f"nzt-callin-{os.getpid()}"
    own = os.readlink("/proc/thread-self/ns/net")
    netns.create(ns)
    try:
        names = [n for _, n in netns.call_in(ns, socket.if_nameindex)]
        assert names == ["lo"]
        assert "lo" in [n for _, n in netns.call_in(None, socket.if_nameindex)]
        nested = netns.call_in(None, netns.call_in, ns, socket.if_nameindex)
        assert [n for _, n in nested] == ["lo"]
        with pytest.raises(ZeroDivisionError):
            netns.call_in(ns, lambda: 1 / 0)
        assert netns.call_in(None, os.readlink, "/proc/thread-self/ns/net") == own
        assert os.readlink("/proc/thread-self/ns/net") == own
    finally:
        netns.remove(ns)
