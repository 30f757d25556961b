"""The ``traffic`` fault: validation (pure), the flows' ring, and on a real fabric: competing
flows deliver about what they were offered on an idle rail, are measured apart from the
workload, and leave no process and no namespace behind (after a run, and after a crash when
``clean`` removes what the dead run left)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from testbed.errors import SpecError
from testbed.fabric import state
from testbed.kernel import netns
from testbed.model import spec
from testbed.model.scenario import build as build_scenario
from testbed.run.runner import run_topology
from testbed.run.traffic import payload_factor, ring

BASE = """
name: traffic-check
hosts: 3
rails: [{{name: r0, bandwidth: 100mbit}}, {{name: r1, bandwidth: 100mbit}}]
workload: {{kind: none}}
faults: [{fault}]
"""
REPO = Path(__file__).resolve().parents[1]


def scenario(fault: str):
    return build_scenario(spec.loads(BASE.format(fault=fault)))


def refused(fault: str) -> SpecError:
    with pytest.raises(SpecError) as e:
        scenario(fault)
    return e.value


# ------------------------------------------------------------------------------ validation
def test_a_traffic_fault_parses_with_its_defaults():
    f = scenario("{at: 4s, action: traffic, target: r1, value: 150mbit, for: 5s}").faults[0]
    assert (f.value, f.duration, f.proto, f.between) == (150_000_000, 5.0, "tcp", ())
    assert f.label == "traffic r1 150mbit tcp"
    g = scenario("{at: 1s, action: traffic, target: r0, value: 20mbit, proto: udp, "
                 "between: [h3, h1]}").faults[0]
    assert (g.proto, g.between, g.label) == ("udp", ("h3", "h1"),
                                             "traffic r0 20mbit udp between h3,h1")


@pytest.mark.parametrize("fault, field_, words", [
    ("{at: 1s, action: traffic, target: r1, value: 10mbit, rate: 5mbit}",
     "faults[0].rate", "unknown key"),
    ("{at: 1s, action: traffic, target: r1, value: 150mbps}", "faults[0].value", "not a rate"),
    ("{at: 1s, action: traffic, target: r1, value: 150}", "faults[0].value", "not a rate"),
    ("{at: 1s, action: traffic, target: r1, value: 1bit}", "faults[0].value", "too small"),
    ("{at: 1s, action: traffic, target: r1}", "faults[0].value", "missing"),
    ("{at: 1s, action: traffic, target: h2.r1, value: 10mbit}", "faults[0].target",
     "cannot act on a link"),
    ("{at: 1s, action: traffic, target: h2, value: 10mbit}", "faults[0].target",
     "cannot act on a host"),
    ("{at: 1s, action: traffic, target: r7, value: 10mbit}", "faults[0].target",
     "names nothing"),
    ("{at: 1s, action: traffic, target: r1, value: 10mbit, proto: sctp}", "faults[0].proto",
     "not accepted"),
    ("{at: 1s, action: traffic, target: r1, value: 10mbit, between: [h1, h9]}",
     "faults[0].between[1]", "not a host on rail r1"),
    ("{at: 1s, action: traffic, target: r1, value: 10mbit, between: [h1]}",
     "faults[0].between", "at least two"),
    ("{at: 1s, action: traffic, target: r1, value: 10mbit, between: h1}",
     "faults[0].between", "at least two"),
    ("{at: 1s, action: traffic, target: r1, value: 10mbit, between: [h1, h2, h1]}",
     "faults[0].between[2]", "listed twice"),
    ("{at: 1s, action: rate, target: r1, value: 10mbit, proto: udp}", "faults[0].proto",
     "unknown key"),
])
def test_a_bad_traffic_fault_is_refused_naming_the_field(fault, field_, words):
    e = refused(fault)
    assert e.field == field_ and words in str(e), str(e)
    assert e.exit_code == 2


def test_validate_exits_2_and_builds_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE.format(fault="{at: 1s, action: traffic, target: r1, value: 10mbit, "
                                     "between: [h1, h4]}"))
    r = subprocess.run([sys.executable, "-m", "testbed", "run", str(bad), "--results",
                        str(tmp_path / "res")], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stderr
    assert "faults[0].between[1]" in r.stderr
    assert not (tmp_path / "res").exists()     # refused before the results folder exists


def test_the_flows_form_a_ring_that_loads_every_link_once_each_way():
    assert ring(("h1", "h2")) == [("h1", "h2"), ("h2", "h1")]
    pairs = ring(("h1", "h2", "h3"))
    assert pairs == [("h1", "h2"), ("h2", "h3"), ("h3", "h1")]
    assert sorted(a for a, _ in pairs) == sorted(b for _, b in pairs) == ["h1", "h2", "h3"]
    assert payload_factor("tcp", 1500) == pytest.approx(1448 / 1514)
    assert payload_factor("udp", 1500) == pytest.approx(1472 / 1514)


# ------------------------------------------------------------------------------ on a fabric
IDLE = """
name: traffic-idle
hosts: 2
rails: [{name: r0, bandwidth: 100mbit}, {name: r1, bandwidth: 100mbit}]
faults:
  - {at: 0.5s, action: traffic, target: r1, value: 40mbit, proto: udp, for: 2s}
  - {at: 0.5s, action: traffic, target: r0, value: 60mbit, for: 2s}
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.netns
def test_flows_deliver_their_offered_rate_apart_from_the_workload_and_leave_nothing(
        tmp_path, no_leftovers):
    out = run_topology(spec.loads(IDLE), tmp_path / "r", say=lambda m: None)
    assert not out.verdict.rows and out.exit_code == 0
    doc = json.loads((out.results_dir / "results.json").read_text())
    flows = doc["detail"]["flows"]
    assert sorted((f["rail"], f["src"], f["dst"], f["proto"]) for f in flows) == [
        ("r0", "h1", "h2", "tcp"), ("r0", "h2", "h1", "tcp"),
        ("r1", "h1", "h2", "udp"), ("r1", "h2", "h1", "udp")]
    for f in flows:        # an idle 100 Mbit/s rail: every flow gets what it offers (as frames)
        assert f["received_l2_mbps"] == pytest.approx(f["offered_mbps"], rel=0.12), f
        assert f["t_end_rel"] - f["t_start_rel"] == pytest.approx(2.0, abs=0.15)
    assert {r["t_applied_rel"] > 0.45 for r in doc["faults"]} == {True}
    good = doc["detail"]["goodput"]
    t = good["t_rel"]
    inside = [i for i, x in enumerate(t) if 1.0 <= x <= 2.3]
    for rail, offered in (("r0", 60), ("r1", 40)):
        comp = [good["competing_mbps"][rail][i] for i in inside]
        kern = [good["rails_mbps"][rail][i] for i in inside]
        work = [good["workload_mbps"][rail][i] for i in inside]
        # 2 hosts each receive one flow: the rail delivers 2 x offered, all of it the flows'
        assert sum(comp) / len(comp) == pytest.approx(2 * offered, rel=0.12)
        assert sum(kern) / len(kern) == pytest.approx(2 * offered, rel=0.12)
        assert sum(work) / len(work) < 0.1 * offered        # no workload: ACKs at most
    pids = [p for f in flows for p in f["pids"]]
    assert len(pids) == 8 and not any(_alive(p) for p in pids)   # every flow process ended
    for rec in out.faults:
        assert rec.t_end is not None
    files = sorted(p.name for p in (out.results_dir / "traffic").glob("*.jsonl"))
    assert len(files) == 8
    for p in (out.results_dir / "traffic").glob("*.send.jsonl"):
        lines = [json.loads(l) for l in p.read_text().splitlines()]
        assert lines[-1].get("final")
    assert "split" not in {p.stem for p in out.results_dir.iterdir()}   # no Nezha, no split
    kinds = [json.loads(l)["kind"] for l in
             (out.results_dir / "timeline.jsonl").read_text().splitlines()]
    assert kinds.count("flow_start") == kinds.count("flow_end") == 4


CRASH = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from testbed.model import spec
    from testbed.fabric import Fabric
    from testbed.model.scenario import build
    from testbed.run.traffic import TrafficFlows
    topo = spec.loads(sys.argv[1])
    fab = Fabric(topo).build()
    flows = TrafficFlows(fab, Path(sys.argv[2]))
    launched = flows.launch(build(topo).faults[0], time.monotonic())
    print(json.dumps({"run_id": fab.state.run_id,
                      "pids": [p.pid for f in launched for p in (f.send_proc, f.recv_proc)]}),
          flush=True)
    time.sleep(0.5)
    os._exit(0)          # a crash: no teardown
""")


@pytest.mark.netns
def test_clean_ends_the_flows_of_a_run_that_died(tmp_path, no_leftovers):
    topo = IDLE.replace("at: 0.5s", "at: 0.2s").replace("for: 2s", "for: 60s")
    r = subprocess.run([sys.executable, "-c", CRASH, topo, str(tmp_path / "t")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    pids = info["pids"]
    try:
        assert all(_alive(p) for p in pids), "the flows should outlive their dead launcher"
        st = json.loads((state.STATE_DIR / f"{info['run_id']}.json").read_text())
        recorded = {o["pid"] for o in st["objects"] if o.get("kind") == "flow"}
        assert recorded == set(pids)            # every flow process is in the run's state
        time.sleep(0.3)
        assert any(json.loads(l)["bytes"] > 0 for p in (tmp_path / "t").glob("*.recv.jsonl")
                   for l in p.read_text().splitlines()), "the flows were running"
        out = state.clean()
        assert info["run_id"] in out["runs"]
        deadline = time.monotonic() + 3
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
        assert not [n for n in netns.listing() if n.startswith(f"nzt-{info['run_id']}-")]
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, 9)
