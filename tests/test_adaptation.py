"""adaptation_ms on synthetic fault records and Nezha events where the answer is known: a split
that follows a slowed rail, one that never does (None with a note, never a pass), a rail's
return after a link-down, competing traffic (TCP fair share, UDP measured), and the metric as
an expectation of a topology file."""
from __future__ import annotations

import pytest

from testbed.analysis import adaptation as ad
from testbed.analysis import metrics, verdict
from testbed.model import spec
from testbed.model.records import FaultRecord, FlowRecord
from testbed.model.scenario import build as build_scenario

T0 = 1000.0

TOPO = spec.loads("""
name: adapt
hosts: 3
rails:
  - {name: r0, bandwidth: 200mbit}
  - {name: r1, bandwidth: 200mbit}
workload: {kind: allreduce, size: 8MiB, duration: 14s}
faults:
  - {at: 4s, action: rate, target: r1, value: 50mbit, for: 5s}
expect:
  adaptation_ms: {max: 1500}
""")
SCEN = build_scenario(TOPO)
SPECS = {f.index: f for f in SCEN.faults}
RAILS = ["r0", "r1"]


def rate_fault(at=4.0, dur=5.0) -> FaultRecord:
    return FaultRecord(index=0, action="rate", target="r1", target_kind="rail",
                       label="rate r1 50mbit", at=at, duration=dur, t_issued=T0 + at,
                       t_applied=T0 + at + 0.01, t_end=T0 + at + dur, rails=["r1"],
                       links=["h1.r1", "h2.r1", "h3.r1"])


def weights(t: float, r0: float, rank: int = 0) -> dict:
    return {"t": T0 + t, "event": "weights", "rank": rank, "shares": [r0, 1 - r0],
            "state": "hot"}


def start_events() -> list[dict]:
    return [{"t": T0 + 1.0, "event": "state", "rank": 0, "state": "cold", "reason": "start",
             "live": [0, 1]},
            {"t": T0 + 1.8, "event": "state", "rank": 0, "state": "hot", "reason": "x"},
            weights(1.8, 0.5)]


def run(faults, events, flows=(), specs=SPECS, topo=TOPO) -> ad.Adaptation:
    return ad.adaptation(topo, faults, specs, events, flows, topo.hosts, T0, T0 + 14)


def test_a_split_that_follows_the_slowed_rail_and_its_return():
    events = start_events() + [weights(4.9, 0.65), weights(5.5, 0.75),   # 0.75: within 0.05
                               weights(9.3, 0.6), weights(9.8, 0.52)]
    out = run([rate_fault()], events)
    start, end = out.changes
    assert start.target == pytest.approx([0.8, 0.2])            # 200 vs 50 Mbit/s
    assert start.adaptation_ms == pytest.approx(1500, abs=1)    # 4.0 -> 5.5 s
    assert end.target == pytest.approx([0.5, 0.5])
    assert end.adaptation_ms == pytest.approx(300, abs=1)       # 9.0 -> 9.3 s (0.6: 0.1 off)
    assert out.value_ms == pytest.approx(1500, abs=1)
    caps = [(round(s.t - T0, 3), [round(x, 3) for x in s.shares]) for s in out.capacity]
    assert caps == [(0.0, [0.5, 0.5]), (4.0, [0.8, 0.2]), (9.0, [0.5, 0.5])]


def test_a_split_that_never_adapts_is_none_with_a_note():
    events = start_events() + [weights(6.0, 0.6), weights(8.0, 0.62)]   # never near 0.8
    out = run([rate_fault()], events)
    assert out.changes[0].adaptation_ms is None
    assert out.changes[0].closest == pytest.approx(0.18)
    assert out.value_ms is None
    assert "never came within 10%" in out.why_none() and "fault 0 start" in out.why_none()


def test_already_right_is_zero_and_a_split_after_the_next_change_does_not_count():
    # the end of the fault (9 s) comes before the split reaches 0.8 (at 9.5 s)
    events = start_events() + [weights(9.5, 0.8)]
    out = run([rate_fault()], events)
    assert out.changes[0].adaptation_ms is None                 # cut at the next change
    assert out.changes[1].adaptation_ms == 0.0                  # 0.5 was already right at 9 s


def test_no_nezha_events_and_no_change_are_not_measured():
    assert run([rate_fault()], []).value_ms is None
    assert "no split" in run([rate_fault()], []).why_none()
    out = run([], start_events())
    assert out.value_ms is None and "no rate or traffic fault" in out.why_none()


def test_a_rail_returning_after_a_link_down_is_followed_from_equal_shares():
    down = FaultRecord(index=0, action="link-down", target="h2.r1", target_kind="link",
                       label="link-down h2.r1", at=4.0, duration=4.0, t_issued=T0 + 4,
                       t_applied=T0 + 4, t_end=T0 + 8, rails=["r1"], links=["h2.r1"])
    events = start_events() + [
        {"t": T0 + 4.02, "event": "rail_agreed", "rank": 0, "rail": 1, "state": "down"},
        {"t": T0 + 4.1, "event": "state", "rank": 0, "state": "cold", "reason": "rail set"},
        {"t": T0 + 8.7, "event": "rail_agreed", "rank": 0, "rail": 1, "state": "up"}]
    out = run([down], events, specs={})
    assert [c.edge for c in out.changes] == ["end"]             # only the return is a change
    assert out.split[-1].shares == [0.5, 0.5]
    assert out.changes[0].split_before == [1.0, 0.0]
    assert out.value_ms == pytest.approx(700, abs=1)


def _traffic_topo(proto: str):
    topo = spec.loads(f"""
name: adapt-traffic
hosts: 3
rails: [{{name: r0, bandwidth: 200mbit}}, {{name: r1, bandwidth: 200mbit}}]
workload: {{kind: allreduce, size: 8MiB, duration: 14s}}
faults: [{{at: 4s, action: traffic, target: r1, value: 150mbit, for: 5s, proto: {proto}}}]
""")
    rec = FaultRecord(index=0, action="traffic", target="r1", target_kind="rail",
                      label="traffic", at=4.0, duration=5.0, t_issued=T0 + 4, t_applied=T0 + 4,
                      t_end=T0 + 9, rails=["r1"], links=["h1.r1", "h2.r1", "h3.r1"])
    return topo, {f.index: f for f in build_scenario(topo).faults}, rec


def test_tcp_competition_leaves_a_fair_share():
    topo, specs, rec = _traffic_topo("tcp")
    out = run([rec], start_events(), specs=specs, topo=topo)
    # a 150 Mbit/s TCP flow on each hop shares it fairly: r1 keeps 100 of 200 Mbit/s
    assert out.changes[0].target == pytest.approx([2 / 3, 1 / 3])


def test_udp_competition_leaves_what_its_flows_did_not_deliver():
    topo, specs, rec = _traffic_topo("udp")
    assert run([rec], start_events(), specs=specs, topo=topo).changes[0].target == \
        pytest.approx([200 / 250, 50 / 250])                  # offered 150: 50 left
    factor = 0.97
    flows = [FlowRecord(0, "udp", "r1", a, b, 150e6, factor, T0 + 4, T0 + 9,
                        sent=[(T0 + 4, 0), (T0 + 9, int(100e6 / 8 * 5 * factor))],
                        received=[(T0 + 4, 0), (T0 + 9, int(100e6 / 8 * 5 * factor))])
             for a, b in (("h1", "h2"), ("h2", "h3"), ("h3", "h1"))]
    out = run([rec], start_events(), flows=flows, specs=specs, topo=topo)
    assert out.changes[0].target == pytest.approx([200 / 300, 100 / 300], abs=1e-3)


def test_metric_as_an_expectation_and_in_the_fault_rows():
    events = start_events() + [weights(5.2, 0.78), weights(9.4, 0.5)]
    m = metrics.compute(TOPO, SCEN, None, [], events, [rate_fault()], T0,
                        extra={"phases": [{"system": "nezha", "t_start": T0,
                                           "t_end": T0 + 14}]})
    assert m["adaptation_ms"] == pytest.approx(1200, abs=1)
    assert m.detail["split"]["changes"][1]["adaptation_ms"] == pytest.approx(400, abs=1)
    row = m.faults[0].to_dict()
    assert [c["edge"] for c in row["adaptation"]] == ["start", "end"]
    v = verdict.judge(SCEN.expect, m)
    assert v.passed, v.failures
    slow = metrics.compute(TOPO, SCEN, None, [], start_events() + [weights(8.0, 0.7)],
                           [rate_fault()], T0)
    assert slow["adaptation_ms"] is None and "adaptation_ms" in slow.notes
    assert not verdict.judge(SCEN.expect, slow).passed          # not measured never passes
