"""Nezha's fault tolerance, measured by the testbed: for every fault kind on 2 and 4 hosts with 2
and 3 rails, every result stays exact, no iteration is lost, detection and failover times are
reported, failover stays under 200 ms for link-down and black hole, and a healed rail carries
its share again within 2 s (the topology's verdict holds those bounds; this suite fails beyond
twice them, TIME_MARGIN, in timing tests apart from the exact results) and, after a loss
burst, keeps it to the end (HEALED_SHARE). A loaded but healthy rail (slowed to 10 %) is never
declared dead."""
from __future__ import annotations

import pytest

from testbed.model import spec
from testbed.run.runner import run_topology

pytestmark = [pytest.mark.netns, pytest.mark.slow]

FAULTS = {
    # kind: (fault yaml, must fail over within 200 ms, must be detected)
    "link-down-one-end": ("{at: 3s, action: link-down, target: h2.r1, end: host, for: 3s}", True, True),
    "link-down-whole-rail": ("{at: 3s, action: link-down, target: r1, for: 3s}", True, True),
    "blackhole": ("{at: 3s, action: blackhole, target: h2.r1, for: 3s}", True, True),
    "loss-burst-30": ("{at: 3s, action: loss, target: h2.r1, value: 30%, for: 2s}", False, False),
    "flapping-500ms": ("{at: 3s, action: flap, target: h2.r1, period: 500ms, for: 3s}", False, True),
    "rate-collapse-1pct": ("{at: 3s, action: rate, target: r1, value: 2mbit, for: 3s}", False, False),
}
SHAPES = {"2x2": (2, 2), "2x3": (2, 3), "4x2": (4, 2), "4x3": (4, 3)}
# The times this suite asserts, and the margin it allows over the topology's bound: on a
# 2-core machine running 4 hosts a black hole once measured 279 ms against its 200 ms bound;
# twice the bound still fails a real regression (a detector falling back to the 1.5 s
# heartbeat, or to a 200 ms minimum RTO). They are asserted apart from the exact results, by a
# timing test that may rerun once (with a run of its own); the exact test never reruns.
TIME_BOUNDS = {"failover_ms": 200, "detection_ms": 200, "recovery_ms": 2000}
TIME_MARGIN = 2.0
# After a loss burst the rail carries at least this part of an equal share outside the burst
# (rail_share over the steady state). recovery_ms alone asks for half its pre-fault share in
# two windows, which a rail that kept 0.2-0.3 of the split after the burst (where 0.5 was
# right, busbw 0.50-0.75 of the rail sum) met by chance in the 7 runs traced on 4 x 2, and
# missed in one CI run (5258 ms).
HEALED_SHARE = 0.7


def topology(kind: str, hosts: int, rails: int, rate: str = "200mbit") -> str:
    fault, fast, detected = FAULTS[kind]
    rail_lines = "".join(f"  - {{name: r{k}, bandwidth: {rate}}}\n" for k in range(rails))
    expect = ["wrong_results: 0", "iterations_lost: 0"]
    if fast:
        expect += ["failover_ms: {max: 200}", "detection_ms: {max: 200}"]
    if kind != "rate-collapse-1pct":
        expect.append("recovery_ms: {max: 2000}")
    return (f"name: ft-{kind}-{hosts}x{rails}\nhosts: {hosts}\nrails:\n{rail_lines}"
            f"tcp: {{rto_min: 5ms}}\n"
            f"workload: {{kind: allreduce, size: 16MiB, duration: 10s}}\n"
            f"faults: [{fault}]\n"
            f"expect: {{{', '.join(expect)}}}\n")


def _run(kind: str, shape: str, tmp_path):
    """A callable that runs the fault on the shape (for the shared_run fixture)."""
    topo = spec.loads(topology(kind, *SHAPES[shape]))
    return lambda: run_topology(topo, tmp_path / topo.name, say=lambda m: None)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", FAULTS)
def test_fault_is_survived_exactly(kind, shape, tmp_path, shared_run, no_leftovers):
    """Every result exact, no iteration lost, no rank error, the fault detected where it
    must be, and every expectation of the topology but its time bounds met (the timing test
    below holds those). Never rerun: a wrong result once in three runs is a bug."""
    out = shared_run((kind, shape), _run(kind, shape, tmp_path))
    m = out.metrics
    assert m["wrong_results"] == 0 and m["iterations_lost"] == 0, m.notes
    assert m["rank_errors"] == 0
    if FAULTS[kind][2]:
        assert m["detection_ms"] is not None, m.notes.get("detection_ms")
    assert m["failover_ms"] is not None or not FAULTS[kind][1], m.notes.get("failover_ms")
    others = [f for f in out.verdict.failures if not f.startswith(tuple(TIME_BOUNDS))]
    assert not others, "; ".join(others)
    if kind == "loss-burst-30":
        share, rails = m["rail_share.r1"], SHAPES[shape][1]
        assert share is not None and share >= HEALED_SHARE / rails, \
            f"r1 carried {share} of the bytes outside the burst ({rails} equal rails)"


@pytest.mark.timing
@pytest.mark.flaky(reruns=1, reruns_delay=2)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", [k for k in FAULTS if any(
    m in spec.loads(topology(k, 2, 2)).sections["expect"] for m in TIME_BOUNDS)])
def test_fault_is_survived_in_time(kind, shape, tmp_path, shared_run, request, no_leftovers):
    """Detection, failover and recovery within TIME_MARGIN x the topology's bounds, on the
    run the exact test above made (a rerun makes its own)."""
    out = shared_run((kind, shape), _run(kind, shape, tmp_path), request)
    m = out.metrics
    for metric in {r.metric for r in out.verdict.rows} & TIME_BOUNDS.keys():
        assert m[metric] is not None, m.notes.get(metric)
        assert m[metric] <= TIME_MARGIN * TIME_BOUNDS[metric], f"{metric}: {m[metric]:.0f} ms"


def test_a_slow_but_healthy_rail_stays_in_use(tmp_path, no_leftovers):
    """No false alarm: r1 slowed to 10 % of nominal for 4 s is never declared down, and it keeps
    carrying (a smaller share of) the traffic."""
    topo = spec.loads("""
name: slow-not-dead
hosts: 3
rails: [{name: r0, bandwidth: 200mbit}, {name: r1, bandwidth: 200mbit}]
tcp: {rto_min: 5ms}
workload: {kind: allreduce, size: 16MiB, duration: 10s}
faults: [{at: 3s, action: rate, target: r1, value: 20mbit, for: 4s}]
expect: {wrong_results: 0, iterations_lost: 0}
""")
    out = run_topology(topo, tmp_path / "slow", say=lambda m: None)
    assert out.passed, out.verdict.failures
    from testbed.analysis.timeline import load_events
    events = load_events(sorted((tmp_path / "slow" / "ranks").glob("*.events.jsonl")))
    downs = [e for e in events if e.get("event") in ("rail_down", "rail_suspected")]
    assert not downs, f"a healthy (slow) rail was declared dead: {downs[:3]}"
    fault = out.faults[0]
    t0 = fault.t_applied - fault.at
    good = out.metrics.detail["goodput"]
    during = [v for t, v in zip(good["t_rel"], good["rails_mbps"]["r1"])
              if fault.t_applied - t0 + 0.5 < t < fault.t_end - t0]
    assert during and sum(during) / len(during) > 1.0, "r1 stopped carrying traffic while slow"


@pytest.mark.parametrize("outage", ["1500ms", "5s"])
def test_every_rail_of_a_host_down_is_ridden_through(outage, tmp_path, no_leftovers):
    """Every rail of h2 down at once for less than the collective's timeout (a switch reboot,
    a NIC reset): no rank fails, no iteration is lost, every result is exact, and within 2 s
    of the rails' return the allreduce runs as fast as before (engine/failover.py)."""
    topo = spec.loads(f"""
name: host-outage-{outage}
hosts: 3
rails: [{{name: r0, bandwidth: 200mbit}}, {{name: r1, bandwidth: 200mbit}}]
tcp: {{rto_min: 5ms}}
workload: {{kind: allreduce, size: 8MiB, duration: 14s}}
faults:
  - {{at: 4s, action: link-down, target: h2.r0, for: {outage}}}
  - {{at: 4s, action: link-down, target: h2.r1, for: {outage}}}
""")
    out = run_topology(topo, tmp_path / topo.name, say=lambda m: None)
    m = out.metrics
    assert m["rank_errors"] == 0, m.notes
    assert m["wrong_results"] == 0 and m["iterations_lost"] == 0, m.notes
    # on the run's clock (seconds after t0): the faults' scheduled window, the iterations'
    # starts (t_rel) and durations (latency_ms, slowest rank)
    start = min(f.at for f in out.faults)
    back = max(f.at + f.duration for f in out.faults)
    its = [(r["t_rel"], r["latency_ms"]) for r in m.detail["iterations"]
           if r.get("complete") and r["iter"] > 0]
    before = sorted(ms for t, ms in its if t + ms / 1e3 < start)
    after = sorted(ms for t, ms in its if t >= back + 2.0)
    assert len(before) >= 3 and len(after) >= 3, (len(before), len(after))
    # back to full speed within 2 s of the return: the later iterations take what the
    # earlier ones took (the median, so one slow iteration on 2 cores is not the verdict)
    assert after[len(after) // 2] <= 1.3 * before[len(before) // 2], (before, after)
    # the outage stopped the job (no iteration ran inside it: h2 had no rail) and the job
    # came through it: the first iteration after it ended within 2 s of the rails' return
    # (an iteration in flight, or the untimed barrier between two, waited it out)
    assert not any(start < t and t + ms / 1e3 < back for t, ms in its), its
    assert any(t + ms / 1e3 > back for t, ms in its if t + ms / 1e3 < back + 2.0), its
    # every connection the outage broke is back within 1 s of the links' return (0.1 s in
    # runs). h2 dropped its ends; h1 and h3 kept theirs, and learn they are stale from h2's
    # answers (health.Health._stale), not from their TCP's back-off: that took 0.5-2.6 s
    # after a 5 s outage and held the whole job meanwhile
    from testbed.analysis.timeline import load_events
    events = load_events(sorted((tmp_path / topo.name / "ranks").glob("*.events.jsonl")))
    t_back = max(f.t_end for f in out.faults)
    last: dict = {}
    for e in events:
        if e["event"] in ("rail_down", "rail_up") and e["t"] <= t_back + 1.0:
            last[(e["rank"], e["peer"], e["rail"])] = e["event"]
    assert last and all(v == "rail_up" for v in last.values()), last
    late = [e for e in events if e["event"] == "rail_down" and e["t"] > t_back + 1.0]
    assert not late, late


@pytest.mark.timing
@pytest.mark.flaky(reruns=1, reruns_delay=2)
@pytest.mark.parametrize("fault,within,pairs", [
    # h2's end of r1: h2 redials its lower rank (h1) itself and asks its higher rank (h3,
    # which dials it) to redial at once over r0 (they waited for the back-off's next step
    # before: 0.40-0.53 s after a 3 s outage; this one would wait 0.5-1.0 s)
    ("{at: 3s, action: link-down, target: h2.r1, end: host, for: 2s}", 0.25,
     [(0, 1), (1, 0), (1, 2), (2, 1)]),
    # the whole rail: the first ARP requests of a link's return can be lost, and the kernel
    # asks again only after 1 s; a dial that timed out renews its neighbour entry (it took
    # 0.8-1.0 s before)
    ("{at: 3s, action: link-down, target: r1, for: 2s}", 0.4,
     [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]),
], ids=["one-end", "whole-rail"])
def test_a_link_that_comes_back_is_redialled_at_once(tmp_path, no_leftovers, fault, within,
                                                     pairs):
    """A rail down for 2 s: every connection on it is back within ``within`` of the link."""
    topo = spec.loads(f"""
name: redial
hosts: 3
rails: [{{name: r0, bandwidth: 200mbit}}, {{name: r1, bandwidth: 200mbit}}]
tcp: {{rto_min: 5ms}}
workload: {{kind: allreduce, size: 8MiB, duration: 7s}}
faults: [{fault}]
""")
    # timing only (it may rerun): exact results through a link-down are
    # test_fault_is_survived_exactly's
    out = run_topology(topo, tmp_path / topo.name, say=lambda m: None)
    from testbed.analysis.timeline import load_events
    events = load_events(sorted((tmp_path / topo.name / "ranks").glob("*.events.jsonl")))
    end = out.faults[0].t_end
    ups = sorted((e["rank"], e["peer"]) for e in events
                 if e.get("event") == "rail_up" and e["rail"] == 1 and end <= e["t"] < end + within)
    assert ups == pairs, ups
