"""The Mininet backend builds the same fabric as the pyroute2 one: same names, addresses and
read-back shaping; link faults cut one rail only; nothing is left behind."""
from __future__ import annotations

import os
import re
import time

import pytest

from testbed.kernel import netns
from testbed.run import probes
from testbed.model import spec
from testbed.fabric import state
from testbed.fabric import Fabric
from testbed.fabric.mininet_backend import MininetFabric, fabric_class

pytestmark = pytest.mark.netns


TOPO = """
name: mn3x2
backend: mininet
hosts: 3
rails:
  - {name: r0, bandwidth: 100mbit}
  - {name: r1, bandwidth: 40mbit}
links:
  h3.r0: {bandwidth: 20mbit}
"""


@pytest.fixture(scope="module")
def mn():
    with MininetFabric(spec.loads(TOPO)) as fab:
        yield fab


def test_fabric_class_picks_the_backend():
    assert fabric_class(spec.loads(TOPO)) is MininetFabric
    assert fabric_class(spec.loads("hosts: 2\nrails: [{name: r0}]\n")) is Fabric


def test_names_namespaces_like_the_pyroute2_backend(mn):
    run = mn.state.run_id
    assert mn.state.backend == "mininet"
    expected = {f"nzt-{run}-{h}" for h in ("h1", "h2", "h3")} | \
        {f"nzt-{run}-sw-{r}" for r in ("r0", "r1")}
    assert set(mn.state.namespaces) == expected
    for ns in expected:
        assert netns.exists(ns)
    # each named namespace is the Mininet node's own: its shell runs inside it
    for name, node in mn.nodes.items():
        assert node.pid in netns.pids_in(f"nzt-{run}-{name}")
    # the rail switch's bridge is br0, with one port per host
    r = netns.run(f"nzt-{run}-sw-r1", ["ip", "-o", "link", "show", "master", "br0"])
    assert sorted(re.findall(r"^\d+: (h\d)@", r.stdout, re.M)) == ["h1", "h2", "h3"]


def test_addresses(mn):
    for h in ("h1", "h2", "h3"):
        out = mn.hosts[h].run(["ip", "-4", "-o", "addr"], check=True).stdout
        for rail in ("r0", "r1"):
            assert f"{rail}    inet {mn.topo.address(h, rail)}/" in out or \
                re.search(rf"{rail}\s+inet {re.escape(mn.topo.address(h, rail))}/", out), out
    # Mininet's own view agrees (used by its CLI for `h1 ping h2`)
    assert mn.net.get("h2").IP() == mn.topo.address("h2", "r0")


def test_reachability_per_rail(mn):
    for rail in ("r0", "r1"):
        for dst in ("h2", "h3"):
            assert probes.reachable(mn, "h1", dst, rail)
    # Mininet's node API reaches the same addresses
    out = mn.net.get("h1").cmd(f"ping -c1 -W1 {mn.topo.address('h2', 'r1')}")
    assert " 0% packet loss" in out


def test_shaping_is_ours_and_read_back(mn):
    assert mn.links["h1.r1"].up_shaper.read_back().rate_bps == pytest.approx(40e6, rel=0.01)
    assert mn.links["h1.r1"].down_shaper.read_back().rate_bps == pytest.approx(40e6, rel=0.01)
    assert mn.links["h3.r0"].up_shaper.read_back().rate_bps == pytest.approx(20e6, rel=0.01)
    assert mn.links["h2.r0"].down_shaper.read_back().rate_bps == pytest.approx(100e6, rel=0.01)


@pytest.mark.timing            # a TCP rate measured over 3 s
@pytest.mark.flaky(reruns=1, reruns_delay=2)
def test_iperf3_rate_on_one_rail(mn):
    measured = probes.iperf3(mn, "h1", "h2", "r1", seconds=3)
    assert measured == pytest.approx(40e6, rel=0.05), f"{measured / 1e6:.1f} Mbit/s"


def test_link_down_cuts_one_rail_only(mn):
    link = mn.links["h2.r1"]
    link.set_state(False)
    try:
        assert not probes.reachable(mn, "h1", "h2", "r1")
        assert probes.reachable(mn, "h1", "h2", "r0")
        assert probes.reachable(mn, "h1", "h3", "r1")
    finally:
        link.set_state(True)
    deadline = time.monotonic() + 5
    while not probes.reachable(mn, "h1", "h2", "r1") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert probes.reachable(mn, "h1", "h2", "r1")


def test_direct_wiring(no_leftovers):
    topo = spec.loads("hosts: 2\nwiring: direct\nbackend: mininet\n"
                      "rails: [{name: r0, bandwidth: 100mbit}, {name: r1, bandwidth: 100mbit}]\n")
    with MininetFabric(topo) as fab:
        assert len(fab.state.namespaces) == 2
        assert all(probes.reachable(fab, "h1", "h2", r) for r in ("r0", "r1"))
        fab.links["h1.r0"].set_state(False)
        assert not probes.reachable(fab, "h1", "h2", "r0")
        assert probes.reachable(fab, "h1", "h2", "r1")


def test_teardown_leaves_nothing(no_leftovers):
    topo = spec.loads("hosts: 2\nbackend: mininet\nrails: [{name: r0}, {name: r1}]\n")
    fab = MininetFabric(topo)
    fab.build()
    run = fab.state.run_id
    shells = [node.pid for node in fab.nodes.values()]
    state_file = fab.state.path
    assert all(os.path.exists(f"/proc/{p}") for p in shells)
    fab.teardown()
    assert not [n for n in netns.listing() if n.startswith(f"{state.PREFIX}{run}-")]
    assert not state_file.exists()
    deadline = time.monotonic() + 2
    while any(netns._alive(p) for p in shells) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(netns._alive(p) for p in shells), "mininet shells outlived the fabric"
    assert fab.mininet_net() is None


def test_failed_build_is_removed(no_leftovers, monkeypatch):
    """An error half-way through the build removes Mininet's nodes and our namespaces."""
    topo = spec.loads("hosts: 2\nbackend: mininet\nrails: [{name: r0}]\n")
    fab = MininetFabric(topo)

    def boom():
        raise RuntimeError("injected")
    monkeypatch.setattr(fab, "_wait_operational", lambda timeout=5.0: boom())
    with pytest.raises(RuntimeError, match="injected"):
        fab.build()
    assert fab.state is None


def _reduce_alone(address: str, port: int, secret: str) -> list:
    """One rank of a world of one through the switch: its own array comes back."""
    import numpy as np

    from nezha.transport.aggregation import AggregationChannel
    with AggregationChannel(address, port, 0, 1, secret, job="mn") as ch:
        return ch.allreduce(1, np.arange(4096, dtype=np.float32), "sum").tolist()


def test_an_aggregation_rail_serves_from_its_switch_and_goes_with_the_fabric(no_leftovers):
    """The Mininet backend starts an aggregation rail's switch service as the pyroute2 one
    does (measured through it: 3 hosts x 100 Mbit/s, 4 MiB, 1.05x the rail sum)."""
    topo = spec.loads("hosts: 2\nbackend: mininet\nrails: [{name: r0, bandwidth: 100mbit}, "
                      "{name: r1, bandwidth: 100mbit, protocol: aggregation}]\n")
    with MininetFabric(topo) as fab:
        agg = fab.aggregators["r1"]
        assert agg.proc.pid in netns.pids_in(fab.state.ns_name("sw-r1"))
        assert fab.aggregator_health()["r1"]["answers"] is True
        address, port = agg.endpoint.rsplit(":", 1)
        got = netns.call_in(fab.hosts["h1"].ns, _reduce_alone, address, int(port),
                            fab.job_secret)
        assert got == list(range(4096))
        pid = agg.proc.pid
    deadline = time.monotonic() + 2
    while netns._alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not netns._alive(pid), "the switch service outlived the fabric"
