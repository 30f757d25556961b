"""The MPTCP baseline as an MPTCP user would configure it (nezha/transport/mptcp.py), and the
evidence a run keeps of what the kernel did (testbed/run/mptcp_monitor.py,
testbed/analysis/mptcp.py).

The netns test takes down the whole rail of the connections' initial subflows (r0) in the
middle of an MPTCP allreduce: the connections must survive it (no rank error, no connection
made again, no subflow closed), the job must keep iterating over r1 while r0 is down, and the
monitor must have recorded one subflow per rail on every connection.
"""
from __future__ import annotations

import json

import pytest

from nezha.transport.mptcp import configure_mptcp_endpoints
from testbed.analysis import mptcp as evidence
from testbed.run.mptcp_monitor import parse


# ------------------------------------------------------------------ no namespaces needed
def test_the_expert_configuration_is_what_the_docstring_says():
    ran = []

    class Done:
        returncode, stderr = 0, ""

    def run(cmd, **kw):
        ran.append(cmd)
        return Done()
    configure_mptcp_endpoints([("198.18.0.1", "r0"), ("198.18.1.1", "r1"), ("198.18.2.1", "r2")],
                              netns="ns1", run=run)
    text = [" ".join(c) for c in ran]
    assert all(t.startswith("ip netns exec ns1 ") for t in text)
    assert "ip netns exec ns1 sysctl -q -w net.mptcp.pm_type=0" in text
    assert any("net.mptcp.stale_loss_cnt=" in t for t in text)
    assert "ip netns exec ns1 ip mptcp limits set subflows 2 add_addr_accepted 2" in text
    # the first rail is the initial subflow's; every other rail is announced, on its device
    endpoints = [t for t in text if " endpoint add " in t]
    assert endpoints == ["ip netns exec ns1 ip mptcp endpoint add 198.18.1.1 dev r1 signal",
                         "ip netns exec ns1 ip mptcp endpoint add 198.18.2.1 dev r2 signal"]


def test_monitor_lines_are_parsed_with_their_fields():
    ev = parse("[     SF_CLOSED] token=add32457 remid=1 locid=1 saddr4=198.18.1.3 "
               "daddr4=198.18.1.1 sport=53877 dport=33555 backup=0 error=111")
    assert ev == {"event": "SF_CLOSED", "token": "add32457", "remid": 1, "locid": 1,
                  "saddr": "198.18.1.3", "daddr": "198.18.1.1", "sport": 53877,
                  "dport": 33555, "backup": 0, "error": 111}
    assert parse("[UNKNOWN 15]") == {"event": "LISTENER_CREATED"}
    assert parse("not an event") is None


def test_the_summary_counts_subflows_and_what_happened_around_a_fault():
    sf = {"saddr": "198.18.1.1", "daddr": "198.18.1.2"}
    events = [
        {"t": 1.0, "host": "h1", "event": "CREATED", "token": "a"},
        {"t": 1.1, "host": "h1", "event": "SF_ESTABLISHED", "token": "a", **sf},
        {"t": 1.2, "host": "h1", "event": "SF_CLOSED", "token": "a", "error": 111,
         "saddr": "198.18.1.1", "daddr": "198.18.0.2"},
        {"t": 5.2, "host": "h1", "event": "MIB", "delta": {"SubflowStale": 1, "MPTCPRetrans": 3}},
        {"t": 6.0, "host": "h1", "event": "MIB", "delta": {"SubflowRecover": 1}},
        {"t": 20.0, "host": "h1", "event": "MIB", "delta": {"MPTCPRetrans": 9}},   # outside
    ]
    s = evidence.summarise(events, [{"label": "link-down r1", "t_start_rel": 5.0,
                                     "t_end_rel": 8.0}])
    assert s["connections"] == 1 and s["subflows_per_connection"] == {2: 1}
    assert s["failed_subflow_errors"] == {"111": 1} and s["cross_rail_subflows"] == 0
    f = s["faults"][0]
    assert f["counters"] == {"SubflowStale": 1, "SubflowRecover": 1, "MPTCPRetrans": 3}
    assert f["first_stale_s"] == 5.2
    assert "first SubflowStale 0.20 s after its start" in evidence.describe(s)


# ------------------------------------------------------------------ in namespaces
OUTAGE_S = 3.0
# the job goes on over r1 while r0 is down: the longest gap between two iterations is shorter
# than the outage. Measured: 1.0-1.3 s here (3 hosts), 1.8 and 2.5 s on 4 hosts x 2 rails
# (README, "What MPTCP does on each fault kind"); with the set-up before issue 13, whose
# connections Nezha's link events tore down and re-dialled after r0 came back, 3.5-3.6 s
STALL_BOUND_S = OUTAGE_S

R0_DOWN = f"""
name: mptcp-r0-down
hosts: 3
rails:
  - {{name: r0, bandwidth: 150mbit}}
  - {{name: r1, bandwidth: 150mbit}}
tcp: {{rto_min: 5ms}}
workload: {{kind: allreduce, system: mptcp, size: 8MiB, duration: 14s, warmup: 1}}
faults:
  - {{at: 10s, action: link-down, target: r0, for: {OUTAGE_S:g}s}}
"""


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timing            # a stall bound measured on a shared 2-core machine
@pytest.mark.flaky(reruns=1, reruns_delay=2)
def test_mptcp_survives_the_initial_subflows_rail_going_down(tmp_path, no_leftovers):
    from testbed.kernel.capabilities import probe
    from testbed.model import spec
    from testbed.run.runner import run_topology
    if not probe().mptcp:
        pytest.skip("no kernel MPTCP here")
    out = run_topology(spec.loads(R0_DOWN), tmp_path / "r", say=lambda m: None)
    m = out.metrics
    assert m["rank_errors"] == 0 and m["wrong_results"] == 0, out.verdict.failures
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    t0 = res["t0"]
    fault = res["faults"][0]
    down, up = fault["t_applied"] - t0, fault["t_end"] - t0
    timeline = [json.loads(line) for line in open(tmp_path / "r" / "timeline.jsonl")]
    ends = sorted(e["t_rel"] for e in timeline
                  if e.get("kind") == "iteration_end" and e.get("rank") == 0)
    assert ends and ends[0] < down, f"the job only began iterating at {ends[:1]} s, after " \
                                    f"the fault at {down:.1f} s: the test proves nothing"
    assert any(t > up for t in ends), "no iteration after the rail came back"
    gap = max(b - a for a, b in zip(ends, ends[1:]))
    print(f"r0 down {down:.2f}-{up:.2f} s: longest gap between iterations {gap:.2f} s")
    assert any(down < t < up for t in ends), f"no iteration ended while r0 was down: {ends}"
    assert gap < STALL_BOUND_S, f"longest gap between iterations {gap:.2f} s"

    events = [json.loads(line) for line in open(tmp_path / "r" / "mptcp_events.jsonl")]
    assert all("t" in e for e in events)
    # every connection (3 hosts: 6 ends) has its subflow on r1, both ends on r1
    sfs = [e for e in events if e["event"] == "SF_ESTABLISHED"]
    assert len(sfs) == 6, sfs
    assert all(e["saddr"].split(".")[2] == e["daddr"].split(".")[2] == "1" for e in sfs)
    # the connections survived: none made again after the fault began, no subflow closed
    assert not [e for e in events if e["event"] == "CREATED" and e["t"] > down]
    assert not [e for e in events if e["event"] in ("SF_CLOSED", "CLOSED") and e["t"] < up]
    summary = res["mptcp"]
    assert summary["connections"] == 6 and summary["subflows_per_connection"] == {"2": 6}
    assert (tmp_path / "r" / "mptcp_summary.txt").read_text().startswith("MPTCP: 6 connection")


# ------------------------------------------------------------------ the monitor's life
class _FakeHost:
    """Runs what would be ``ip mptcp monitor`` as a script printing one event, then waiting."""
    ns = None

    def __init__(self):
        self.processes = []

    def popen(self, argv, **kw):
        import subprocess
        import sys
        line = ("[SF_ESTABLISHED] token=ab remid=1 locid=0 saddr4=198.18.1.1 daddr4=198.18.1.2 "
                "sport=1 dport=2 backup=0")
        p = subprocess.Popen([sys.executable, "-c", f"print({line!r}, flush=True); "
                              "import time; time.sleep(60)"], **kw)
        self.processes.append(p)
        return p


class _FakeFabric:
    state = None

    def __init__(self, n=2):
        self.hosts = {f"h{i}": _FakeHost() for i in range(1, n + 1)}


def _wait_for(pred, timeout=5.0):
    import time
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.02)
    return pred()


def test_the_monitor_records_stamped_events_and_ends_its_processes(tmp_path):
    from testbed.run.mptcp_monitor import MptcpMonitor
    fab = _FakeFabric()
    path = tmp_path / "mptcp_events.jsonl"
    mon = MptcpMonitor(fab, list(fab.hosts), path).start(settle=0)
    try:
        assert _wait_for(lambda: path.read_text().count('"event": "SF_ESTABLISHED"') == 2)
    finally:
        mon.stop()
    procs = [p for h in fab.hosts.values() for p in h.processes]
    assert all(p.poll() is not None for p in procs) and not mon.running
    events = [json.loads(line) for line in path.read_text().splitlines()]
    sf = [e for e in events if e["event"] == "SF_ESTABLISHED"]
    assert {e["host"] for e in sf} == {"h1", "h2"} and all(e["mono"] > 0 for e in sf)


def test_an_interrupted_workload_stops_the_monitor(tmp_path, monkeypatch):
    """Ctrl-C in the middle of an mptcp phase: ``run`` stops the monitor on its way out."""
    from testbed.model.scenario import Workload
    from testbed.run import workload as wl
    import nezha.transport.mptcp as mp
    monkeypatch.setattr(mp, "configure_mptcp_endpoints", lambda rails, netns=None: [])
    fab = _FakeFabric()
    fab.topo = type("T", (), {"hosts": ("h1", "h2"), "rails": (), "address": None})()
    fab.caps = type("C", (), {"congestion_control": lambda self, topo: None})()
    runner = wl.WorkloadRunner(fab, Workload(kind="allreduce", system="mptcp"),
                               tmp_path / "ranks")

    def interrupted(phase, index):
        runner._prepare_mptcp()
        assert runner.mptcp_monitor is not None and runner.mptcp_monitor.running
        raise KeyboardInterrupt
    monkeypatch.setattr(runner, "run_phase", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run()
    assert runner.mptcp_monitor is None
    procs = [p for h in fab.hosts.values() for p in h.processes]
    assert procs and all(p.poll() is not None for p in procs)
    assert (tmp_path / "mptcp_events.jsonl").exists()
