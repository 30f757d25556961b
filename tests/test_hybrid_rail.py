"""Nezha's allreduce split across a TCP rail and an aggregation rail, in namespaces: the
shipped failover topology (the switch SIGKILLed mid-run and restarted, then its rail
black-holed) keeps every result exact, loses no iteration, and the switch takes its share
again after each return; a kill fault on a rail is validated like every other field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.errors import SpecError
from testbed.model import scenario, spec
from testbed.run.runner import run_topology

REPO = Path(__file__).resolve().parents[1]
RAILS = """
hosts: 2
rails:
  - {name: r0, bandwidth: 150mbit}
  - {name: r1, bandwidth: 150mbit, protocol: aggregation}
workload: {kind: allreduce, size: 1MiB, iterations: 2}
"""
REJOIN_BOUND_MS = 2000
TIME_MARGIN = 2.0          # as tests/test_failover.py: a loaded 2-core machine, never rerun


@pytest.mark.parametrize("fault,field,accepted", [
    ("{at: 1s, action: kill, target: r0}", "faults[0].target", "protocol: aggregation"),
    ("{at: 1s, action: kill, target: h1, for: 1s}", "faults[0].for", "rail kill"),
    ("{at: 1s, action: kill, target: h1.r1}", "faults[0].target", "a host or rail"),
])
def test_a_kill_fault_names_what_it_cannot_kill(fault, field, accepted):
    with pytest.raises(SpecError) as e:
        spec.loads(RAILS + f"faults: [{fault}]\n")
    assert e.value.field == field and accepted in str(e.value), str(e.value)


def test_a_rail_kill_with_for_is_accepted():
    topo = spec.loads(RAILS + "faults: [{at: 1s, action: kill, target: r1, for: 2s, "
                              "signal: STOP}]\n")
    (f,) = scenario.build(topo).faults
    assert (f.target_kind, f.duration, f.signal) == ("rail", 2.0, "STOP")


@pytest.mark.netns
@pytest.mark.slow
def test_the_aggregator_fails_and_rejoins_with_exact_results(tmp_path, no_leftovers):
    topo = spec.load(REPO / "topologies" / "aggregation-failover.yaml")
    out = run_topology(topo, tmp_path / topo.name, say=lambda m: None)
    m = out.metrics
    assert m["wrong_results"] == 0 and m["iterations_lost"] == 0, m.notes
    assert m["rank_errors"] == 0 and m["iterations"] >= 10
    assert m["aggregation_rejoin_ms"] is not None, m.notes.get("aggregation_rejoin_ms")
    events = [json.loads(line) for p in (tmp_path / topo.name / "ranks").glob("*h1.events.jsonl")
              for line in p.read_text().splitlines() if line.strip()]
    names = [e["event"] for e in events]
    assert names.count("agg_down") >= 2 and names.count("agg_back") >= 2, names
    # each time, the failed range was recomputed on the ring (a kill mid-operation at least)
    downs = [e for e in events if e["event"] == "agg_down"]
    assert any(e["recomputed_bytes"] > 0 for e in downs), downs


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timing           # a rejoin measured on a shared 2-core machine (1157-1452 ms)
@pytest.mark.flaky(reruns=1, reruns_delay=2)
def test_the_aggregator_rejoins_within_its_bound(tmp_path, no_leftovers):
    """The rejoin's bound, apart from the exact results above: a rejoin late under load
    (2010 ms once) is a timing miss, which may run again; a wrong result never."""
    topo = spec.load(REPO / "topologies" / "aggregation-failover.yaml")
    m = run_topology(topo, tmp_path / topo.name, say=lambda m: None).metrics
    assert m["aggregation_rejoin_ms"] is not None, m.notes.get("aggregation_rejoin_ms")
    assert m["aggregation_rejoin_ms"] <= REJOIN_BOUND_MS * TIME_MARGIN


def _fault(index, action, at, end, target="r1"):
    from testbed.model.records import FaultRecord
    return FaultRecord(index=index, action=action, target=target, target_kind="rail",
                       label=f"{action} {target}", at=at, duration=1.0, rails=[target],
                       links=[], t_issued=at, t_applied=at, t_end=end)


def test_rejoin_counts_from_the_later_of_the_return_and_the_agreed_down():
    from testbed.analysis.aggregation import rejoin_ms
    topo = spec.loads(RAILS)
    kill, hole = _fault(0, "kill", 10.0, 13.0), _fault(1, "blackhole", 20.0, 22.0)
    events = [{"t": 10.1, "event": "agg_down"}, {"t": 13.5, "event": "agg_back"},
              {"t": 23.0, "event": "agg_down"},          # seen after the hole had closed
              {"t": 24.2, "event": "agg_back"}]
    value, note = rejoin_ms(topo, [kill, hole], events)
    assert value == pytest.approx(1200.0) and note == ""
    value, note = rejoin_ms(topo, [kill], events[:1])
    assert value is None and "never rejoined" in note
    assert rejoin_ms(topo, [_fault(0, "kill", 1.0, 2.0, target="r0")], events)[0] is None
