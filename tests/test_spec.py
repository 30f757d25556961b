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


# ---- every input bounded (README: Topology files, Limits) ------------------------------------
def _refused(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        spec.loads(text)
    assert len(str(info.value)) < 600, str(info.value)[:600]
    return info.value


def _bomb(levels: int = 7) -> str:
    """A 'billion laughs' document: each level is nine aliases of the one before."""
    anchors = ["&a0 lollollollollollollollollollollol"]
    for i in range(1, levels):
        anchors.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return f"name: [{', '.join(anchors)}]\nhosts: 2\nrails: [{{name: r0}}]\n"


def test_host_count_is_bounded_by_the_bridge_port_limit():
    e = _refused("hosts: 1024\nrail_prefix: 20\nrails: [{name: r0}]\n")
    assert e.field == "hosts" and "1023" in str(e) and "1024 port" in str(e)
    e = _refused("hosts: [" + ", ".join(f"x{i}" for i in range(1024)) + "]\nrail_prefix: 20\n"
                 "rails: [{name: r0}]\n")
    assert e.field == "hosts" and "1023" in str(e)
    assert len(spec.loads("hosts: 1023\nrail_prefix: 20\nrails: [{name: r0}]\n").hosts) == 1023


def test_a_billion_hosts_exit_2_within_5_seconds(tmp_path):
    """Checked before a single name is made (it used to build 1e9 names: MemoryError)."""
    f = tmp_path / "huge.yaml"
    f.write_text("hosts: 1000000000\nrails: [{name: r0}]\n")
    r = subprocess.run([sys.executable, "-m", "testbed", "validate", "--no-kernel", str(f)],
                       capture_output=True, text=True, cwd=ROOT, timeout=5)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: hosts:") and "1024" in r.stderr


def test_alias_bomb_is_refused_and_error_messages_quote_at_most_80_characters():
    text = _bomb()
    assert len(text) < 500
    e = _refused(text)                                     # used to be a 44 MB message
    assert e.field.startswith("line 1") and "alias" in str(e)
    # a bounded number of aliases is fine, and a long bad value is quoted in 80 characters
    t = spec.loads("hosts: 2\nrails: [&r {name: r0, bandwidth: 100mbit}, {<<: *r, name: r1}]\n")
    assert t.rail("r1").shape.rate_bps == 100_000_000
    e = _refused("name: " + "x" * 5000 + "\nhosts: 2\nrails: [{name: r0}]\n")
    assert e.field == "name" and "..." in e.problem and len(e.problem) < 120
    e = _refused("name: " + _bomb(4).split("name: ", 1)[1])       # 729 values: under the limit
    assert e.field == "name" and len(e.problem) < 120
    e = _refused("hosts: 2\nrails: &x [{name: r0}, *x]\n")
    assert "refers to the value containing it" in str(e)
    e = _refused("hosts: 2\nrails: [{name: r0}]\ndescription: " + "[" * 40 + "]" * 40 + "\n")
    assert "nested more than" in str(e)
    _refused("hosts: 2\nrails: [{name: r0}]\ndescription: " + "[" * 5000 + "]" * 5000 + "\n")


def test_duplicate_keys_are_refused_with_key_and_line():
    e = _refused("hosts: 2\nrails: [{name: r0, bandwidth: 100mbit}]\nhosts: 3\n")
    assert e.field == "line 3, column 1", str(e)
    assert "duplicate key 'hosts'" in str(e) and "first on line 1" in str(e)
    e = _refused("hosts: 2\nrails:\n  - {name: r0, bandwidth: 1mbit, bandwidth: 2mbit}\n")
    assert e.field.startswith("line 3") and "'bandwidth'" in str(e)


BOUNDS = [
    # (yaml, field named in the error, words of the accepted forms); each was accepted or
    # crashed (OverflowError) before the limits
    ("hosts: 2\nrails: [{name: r0, bandwidth: " + "9" * 400 + "mbit}]\n",
     "rails[0].bandwidth", "at most 1000gbit"),
    ("hosts: 2\nrails: [{name: r0, bandwidth: 1001gbit}]\n", "rails[0].bandwidth", "1000gbit"),
    ("hosts: 2\nrails: [{name: r0, delay: 1" + "0" * 400 + "s}]\n", "rails[0].delay", "60s"),
    ("hosts: 2\nrails: [{name: r0, delay: 61s}]\n", "rails[0].delay", "at most 60s"),
    ("hosts: 2\nrails: [{name: r0}]\nfaults: [{at: 1000000000000s, action: link-down, "
     "target: h1.r0}]\n", "faults[0].at", "at most 86400s"),
    ("hosts: 2\nrails: [{name: r0}]\nfaults: [{at: 1s, action: loss, target: r0, value: 5%, "
     "for: 1" + "0" * 400 + "s}]\n", "faults[0].for", "86400s"),
    ("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: allreduce, duration: 86401s}\n",
     "workload.duration", "86400s"),
    ("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: allreduce, size: 65GiB}\n",
     "workload.size", "at most 64GiB"),
    ("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: allreduce, size: " + "9" * 30 + "}\n",
     "workload.size", "64GiB"),
    ("hosts: 2\nrails: [{name: r0}]\nworkload: {kind: compare, rounds: 1000000000}\n",
     "workload.rounds", "<= 1000"),
    ("hosts: 2\nrails: [{name: r0}]\nexpect: {failover_ms: {max: .inf}}\n",
     "expect.failover_ms.max", "finite"),
    ("hosts: 2\nrails: [" + ", ".join(f"{{name: r{i}}}" for i in range(33)) + "]\n",
     "rails", "at most 32"),
]


@pytest.mark.parametrize("text,field,accepted", BOUNDS,
                         ids=[b[1] + ":" + str(i) for i, b in enumerate(BOUNDS)])
def test_numbers_are_finite_and_within_the_limits(text, field, accepted):
    e = _refused(text)
    assert e.field == field, str(e)
    assert accepted in str(e), str(e)


def test_the_limits_themselves_are_accepted():
    t = spec.loads("hosts: 2\nrails: [{name: r0, bandwidth: 1000gbit, delay: 60s}]\n"
                   "workload: {kind: allreduce, size: 64GiB, duration: 86400s}\n"
                   "faults: [{at: 86400s, action: link-down, target: h1.r0, for: 86400s}]\n")
    assert t.rail("r0").shape.rate_bps == 10 ** 12


def test_flap_steps_and_period_are_bounded():
    flap = "hosts: 2\nrails: [{name: r0}]\nfaults: [{at: 1s, action: flap, target: h1.r0, %s}]\n"
    e = _refused(flap % "period: 1us, for: 2s")         # used to expand to 4 million steps
    assert e.field == "faults[0].period" and "at least 10ms" in str(e)
    e = _refused(flap % "period: 10ms, for: 1001s")      # 200 toggles a second
    assert e.field == "faults[0].for" and "100000 toggles" in str(e)
    two = ("hosts: 2\nrails: [{name: r0}]\nfaults: [{at: 1s, action: flap, target: h1.r0, "
           "period: 20ms, for: 600s}, {at: 1s, action: flap, target: h2.r0, period: 20ms, "
           "for: 600s}]\n")                              # 60000 toggles each: too many together
    assert _refused(two).field == "faults[1].for"
    # the count the limit uses is the schedule's own expansion
    from testbed.model.scenario import build, flap_steps
    from testbed.run.faults import FaultInjector
    for period, duration in (("500ms", "3s"), ("10ms", "1s"), ("300ms", "1s"), ("1s", "500ms")):
        t = spec.loads(flap % f"period: {period}, for: {duration}")
        inj = FaultInjector.__new__(FaultInjector)
        inj.faults = build(t).faults
        f = inj.faults[0]
        assert len(inj._plan()) == 2 + flap_steps(f.period, f.duration), (period, duration)


def test_workload_hosts_are_distinct():
    e = _refused("hosts: 3\nrails: [{name: r0}]\n"
                 "workload: {kind: allreduce, hosts: [h1, h2, h1]}\n")
    assert e.field == "workload.hosts[2]" and "twice" in str(e) and "workload.hosts[0]" in str(e)


@pytest.mark.parametrize("text,field", [
    ("hosts: [br0, h2]\nrails: [{name: r0}]\n", "hosts[0]"),        # the rail switch's bridge
    ("hosts: [h1, lo]\nrails: [{name: r0}]\n", "hosts[1]"),
    ("hosts: 2\nrails: [{name: all}]\n", "rails[0].name"),          # the kernel refuses it
    ("hosts: 2\nrails: [{name: r0}, {name: sit0}]\n", "rails[1].name"),  # a tunnel's fallback
    ("hosts: 2\nrails: [{name: abcdefghijklmnop}]\n", "rails[0].name"),  # 16 > IFNAMSIZ - 1
])
def test_names_that_collide_with_internal_interfaces_are_refused(text, field):
    from testbed.fabric.fabric import BRIDGE
    assert BRIDGE in spec.RESERVED_NAMES and "lo" in spec.RESERVED_NAMES
    e = _refused(text)
    assert e.field == field, str(e)


BOUNDED_FILES = {
    "hosts": "hosts: 1000000000\nrails: [{name: r0}]\n",
    "bomb": _bomb(),
    "duplicate": "hosts: 2\nrails: [{name: r0}]\nhosts: 3\n",
    "bandwidth": "hosts: 2\nrails: [{name: r0, bandwidth: " + "9" * 400 + "mbit}]\n",
    "at": "hosts: 2\nrails: [{name: r0}]\nworkload: {kind: none}\n"
          "faults: [{at: 1000000000000s, action: link-down, target: h1.r0}]\n",
    "flap": "hosts: 2\nrails: [{name: r0}]\nworkload: {kind: none}\n"
            "faults: [{at: 1s, action: flap, target: h1.r0, period: 1us, for: 2s}]\n",
    "ranks": "hosts: 2\nrails: [{name: r0}]\nworkload: {kind: allreduce, hosts: [h1, h1]}\n",
    "br0": "hosts: [br0, h2]\nrails: [{name: r0}]\nworkload: {kind: none}\n",
}


@pytest.mark.netns
@pytest.mark.parametrize("name", sorted(BOUNDED_FILES))
def test_run_of_an_unbounded_file_exits_2_and_builds_nothing(name, tmp_path):
    from testbed.fabric import state
    from testbed.kernel import netns
    f = tmp_path / f"{name}.yaml"
    f.write_text(BOUNDED_FILES[name])
    before_ns = set(netns.listing())
    before_state = set(state.STATE_DIR.glob("*.json")) if state.STATE_DIR.is_dir() else set()
    r = subprocess.run([sys.executable, "-m", "testbed", "run", str(f)],
                       capture_output=True, text=True, cwd=ROOT, timeout=5)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error: ") and len(r.stderr) < 600, r.stderr[:600]
    assert not [n for n in set(netns.listing()) - before_ns if n.startswith(state.PREFIX)]
    after_state = set(state.STATE_DIR.glob("*.json")) if state.STATE_DIR.is_dir() else set()
    assert not after_state - before_state


def test_readme_limits_table_states_the_limits_in_units():
    from testbed.model import units
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("**Limits.**"):readme.index("Shipped topologies")]
    for text in (f"1-{units.MAX_HOSTS}", f"1-{units.MAX_RAILS}", "1000 gbit", "86400 s",
                 f"{units.MAX_DELAY_S:g} s", f"{units.MAX_SIZE_BYTES >> 30} GiB",
                 f"{units.MAX_ROUNDS}", f"{units.MAX_PHASES}", f"{units.MAX_CAPTURE_MB}",
                 f"{units.MIN_FLAP_PERIOD_S * 1000:g} ms", f"{units.MAX_FLAP_STEPS}",
                 f"{units.MAX_FILE_BYTES >> 10} KiB", f"{units.MAX_YAML_DEPTH} levels",
                 f"{units.MAX_YAML_NODES} values", "80 characters"):
        assert text in table, text
    assert units.MAX_RATE_BPS == 10 ** 12 and units.MAX_DURATION_S == 86400
    for name in spec.RESERVED_NAMES:
        assert f"`{name}`" in table, name


def test_scheduled_rates_are_each_rails_lowest_rate_fault():
    """What the fabric sizes a rail's skbs for: the lowest rate a fault gives any of its
    links, whether the fault names the link, the rail or a host; other faults count nothing."""
    from testbed.model.scenario import scheduled_rates
    topo = spec.loads("hosts: 3\nrails:\n  - {name: r0, bandwidth: 200mbit}\n"
                      "  - {name: r1, bandwidth: 200mbit}\n  - {name: r2, bandwidth: 1gbit}\n"
                      "faults:\n"
                      "  - {at: 1s, action: rate, target: r1, value: 100mbit, for: 1s}\n"
                      "  - {at: 3s, action: rate, target: h2.r1, value: 20mbit}\n"
                      "  - {at: 4s, action: rate, target: h3, value: 150mbit, for: 1s}\n"
                      "  - {at: 5s, action: traffic, target: r2, value: 900mbit, for: 1s}\n"
                      "  - {at: 6s, action: link-down, target: r2, for: 1s}\n")
    assert scheduled_rates(topo) == {"r0": 150_000_000, "r1": 20_000_000, "r2": 150_000_000}
    assert scheduled_rates(spec.loads("hosts: 2\nrails: [{name: r0}]\n")) == {}
