"""Topology files: every bad input names its field and the accepted forms, and builds nothing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testbed.model import spec
from testbed.kernel.capabilities import Capabilities
from testbed.errors import CapabilityError, SpecError

ROOT = Path(__file__).resolve().parent.parent

GOOD = """
name: dual
hosts: 4
rails:
  - {name: r0, bandwidth: 200mbit}
  - {name: r1, bandwidth: 100mbit, loss: 0.5%, mtu: 9000}
links:
  h2.r1: {bandwidth: 50mbit}
"""


def test_good_file_resolves_addresses_and_overrides():
    t = spec.loads(GOOD)
    assert t.hosts == ("h1", "h2", "h3", "h4")
    assert [r.name for r in t.rails] == ["r0", "r1"]
    assert t.address("h1", "r0") == "198.18.0.1"
    assert t.address("h3", "r1") == "198.18.1.3"
    assert t.link("h2", "r1").shape.rate_bps == 50_000_000
    assert t.link("h2", "r1").shape.loss == pytest.approx(0.005)   # inherited from the rail
    assert t.link("h1", "r1").shape.rate_bps == 100_000_000
    assert t.link("h1", "r1").mtu == 9000


def test_units():
    from testbed.model.units import parse_duration, parse_percent, parse_rate, parse_size
    assert parse_rate("1.5gbit", "f") == 1_500_000_000
    assert parse_rate("500kbit", "f") == 500_000
    assert parse_duration("250us", "f") == pytest.approx(250e-6)
    assert parse_percent("5%", "f") == pytest.approx(0.05)
    assert parse_size("16MiB", "f") == 16 << 20
    assert parse_size(4096, "f") == 4096


BAD = [
    # (yaml, field named in the error, words of the accepted forms)
    ("hosts: 2\nrails: [{name: r0}]\nbogus: 1\n", "bogus", "one of"),
    ("hosts: 2\nrails: [{name: r0, bandwidth: 100mbps}]\n", "rails[0].bandwidth", "kbit, mbit"),
    ("hosts: 2\nrails: [{name: r0, bandwidth: 200}]\n", "rails[0].bandwidth", "mbit"),
    ("hosts: 2\nrails: [{name: r0, bandwidth: 0mbit}]\n", "rails[0].bandwidth", "at least"),
    ("hosts: 2\nrails: [{name: r0, bandwidth: -5mbit}]\n", "rails[0].bandwidth", "mbit"),
    ("hosts: 2\nrails: [{name: r0, loss: 101%}]\n", "rails[0].loss", "0% to 100%"),
    ("hosts: 2\nrails: [{name: r0, delay: 5 parsecs}]\n", "rails[0].delay", "ms"),
    ("hosts: [a, b, a]\nrails: [{name: r0}]\n", "hosts[2]", "unique"),
    ("hosts: 2\nrails: [{name: r0}, {name: r0}]\n", "rails[1].name", "unique"),
    ("hosts: 2\nrails: [{name: r0}]\nlinks: {h3.r0: {bandwidth: 1mbit}}\n", "links.h3.r0", "HOST.RAIL"),
    ("hosts: 2\nrails: [{name: r0}]\nlinks: {h1.r9: {bandwidth: 1mbit}}\n", "links.h1.r9", "HOST.RAIL"),
    ("hosts: 300\nrails: [{name: r0}]\n", "hosts", "rail_prefix"),
    ("hosts: 2\nrails: [{name: r0}]\naddressing: 198.18.0.0/29\nrail_prefix: 30\nlinks: {}\n"
     "wiring: ring\n", "wiring", "switch, direct"),
    ("hosts: 3\nwiring: direct\nrails: [{name: r0}]\n", "wiring", "exactly 2 hosts"),
    ("hosts: 2\nrails: [{name: r0, mtu: 100}]\n", "rails[0].mtu", "576"),
    ("hosts: 2\nrails: [{name: R0}]\n", "rails[0].name", "lowercase"),
    ("hosts: 2\nrails: []\n", "rails", "non-empty"),
    ("hosts: 0\nrails: [{name: r0}]\n", "hosts", "at least 1"),
    ("hosts: 2\nrails: [{name: r0, jitter: 1ms}]\n", "rails[0].jitter", "delay"),
    ("hosts: 2\nrails: [{name: r0}]\naddressing: 10.0.0.300/8\n", "addressing", "CIDR"),
    ("hosts: 2\nrails: [{name: r0}]\nfaults: [{at: 1s, action: explode, target: r0}]\n",
     "faults[0].action", "link-down"),
    ("hosts: 2\nrails: [{name: r0}]\nfaults: [{at: 1s, action: link-down, target: h7.r0}]\n",
     "faults[0].target", "HOST.RAIL"),
    ("hosts: 2\nrails: [{name: r0}]\nfaults: [{at: 1s, action: kill, target: r0}]\n",
     "faults[0].target", "host"),
    ("hosts: 2\nrails: [{name: r0}]\nfaults: [{at: 1s, action: rate, target: r0}]\n",
     "faults[0].value", "20mbit"),
    ("hosts: 2\nrails: [{name: r0}]\nexpect: {speed: 3}\n", "expect.speed", "failover_ms"),
    ("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: allreduce, size: huge}\n",
     "workload.size", "MiB"),
    ("hosts: 2\nrails: [{name: r0}]\ntcp: {congestion_control: 'cubic; rm'}\n",
     "tcp.congestion_control", "cubic, reno, bbr"),
    ("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: allreduce, rounds: 2}\n",
     "workload.rounds", "kind: compare"),
    ("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: allreduce, warmup: -1}\n",
     "workload.warmup", ">= 0"),
    ("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: command, command: 'true', warmup: 2}\n",
     "workload.warmup", "kind: allreduce, sweep or compare"),
    ("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: compare, sizes: [4KiB, 16MiB]}\n"
     "expect: {busbw_vs_single_rail.1MiB: {min: 1.8}}\n",
     "expect.busbw_vs_single_rail.1MiB", "busbw_vs_single_rail.4KiB, busbw_vs_single_rail.16MiB"),
    ("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: allreduce}\n"
     "expect: {busbw_vs_single_rail.16MiB: {min: 1.8}}\n",
     "expect.busbw_vs_single_rail.16MiB", "needs a compare workload"),
    ("hosts: 2\nrails: [{name: r0}\n", "line", "valid YAML"),
    ("", "(file)", "hosts and rails"),
]


@pytest.mark.parametrize("text,field,accepted", BAD, ids=[b[1] + ":" + str(i) for i, b in enumerate(BAD)])
def test_bad_input_names_field_and_accepted_forms(text, field, accepted):
    with pytest.raises(SpecError) as info:
        spec.loads(text)
    msg = str(info.value)
    assert msg.startswith(field), msg
    assert accepted in msg, msg


def test_warmup_defaults_and_sized_ratio_names_are_normalised():
    from testbed.model.scenario import build
    t = spec.loads("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: compare, sizes: [16MiB, 4KiB]}\n"
                   "expect: {busbw_vs_single_rail.16mib: {min: 1.8}}\n")
    sc = build(t)
    assert sc.workload.warmup == 1                 # compare: one untimed iteration per phase
    assert [e.metric for e in sc.expect] == ["busbw_vs_single_rail.16MiB"]
    t = spec.loads("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: allreduce, warmup: 3}\n")
    assert build(t).workload.warmup == 3
    assert build(spec.loads("hosts: 2\nrails: [{name: r0}]\n")).workload is None


def test_iterations_and_duration_together_mean_at_least_both():
    from testbed.model.scenario import build
    from testbed.run.workload import WorkloadRunner, phases
    t = spec.loads("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: compare, sizes: [4KiB, 16MiB], "
                   "systems: [nezha, single], iterations: 5, duration: 2s}\n")
    ph = phases(build(t).workload)
    assert len(ph) == 4 and all(p.iterations == 5 and p.duration == 2.0 for p in ph)
    argv = WorkloadRunner.argv(type("R", (), {"workload": build(t).workload})(), ph[0])
    assert argv[argv.index("--iterations") + 1] == "5" and argv[argv.index("--duration") + 1] == "2.0"
    assert argv[argv.index("--warmup") + 1] == "1"
    t = spec.loads("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: compare, sizes: [4KiB, 16MiB], "
                   "systems: [nezha, single], rounds: 2}\n")
    assert [(p.system, p.size) for p in phases(build(t).workload)] == [
        ("nezha", 4096), ("single", 4096), ("nezha", 4096), ("single", 4096),
        ("nezha", 16 << 20), ("single", 16 << 20), ("nezha", 16 << 20), ("single", 16 << 20)]


def test_congestion_control_must_exist_in_the_kernel():
    t = spec.loads("hosts: 2\nrails: [{name: r0}]\ntcp: {congestion_control: vegas}\n")
    caps = Capabilities(netns=True, veth=True, bridge=True, htb=True, tbf=True, netem=True,
                        nftables=True, mptcp=True, iperf3=True, mnexec=True, details={},
                        congestion_controls=("reno", "cubic"))
    with pytest.raises(CapabilityError) as info:
        spec.check_capabilities(t, caps)
    assert str(info.value).startswith("tcp.congestion_control") and "reno, cubic" in str(info.value)
    assert "modprobe tcp_vegas" in str(info.value)
    # unset: cubic where the kernel has it (results do not depend on the machine's default)
    plain = spec.loads("hosts: 2\nrails: [{name: r0}]\n")
    assert caps.congestion_control(plain) == "cubic"
    assert caps.congestion_control(t) == "vegas"
    bare = Capabilities(congestion_controls=("reno", "bbr"))
    assert bare.congestion_control(plain) is None


def test_delay_refused_without_netem_names_the_kernel_feature():
    t = spec.loads("hosts: 2\nrails: [{name: r0, delay: 1ms}]\n")
    no_netem = Capabilities(netns=True, veth=True, bridge=True, htb=True, tbf=True, netem=False,
                            nftables=True, mptcp=True, iperf3=True, mnexec=True, details={})
    with pytest.raises(CapabilityError) as info:
        spec.check_capabilities(t, no_netem)
    assert "netem" in str(info.value) and "delay" in str(info.value)
    with_netem = Capabilities(netns=True, veth=True, bridge=True, htb=True, tbf=True, netem=True,
                              nftables=True, mptcp=True, iperf3=True, mnexec=True, details={})
    spec.check_capabilities(t, with_netem)


def test_cli_validate_exits_2_and_names_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts: 2\nrails: [{name: r0, bandwidth: 10 furlongs}]\n")
    r = subprocess.run([sys.executable, "-m", "testbed", "validate", str(bad)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert "rails[0].bandwidth" in r.stderr and "mbit" in r.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "topologies").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_topologies_validate(path):
    spec.load(path)
