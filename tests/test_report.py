"""Verdicts name what failed with the measured value; the results folder holds every file, and the
plots are real PNG images."""
from __future__ import annotations

import json

import pytest
import yaml

from testbed.analysis import sampler as measure
from testbed.analysis import metrics
from testbed.analysis import report
from testbed.analysis.timeline import Timeline
from testbed.model import spec
from testbed.analysis import verdict
from testbed.model.records import Metrics, jsonable
from testbed.model.scenario import Expectation, build as build_scenario

try:
    from tests.test_metrics import (TOPO, SCEN, failover_world, fault_record, iteration_records,
                                    span_records, synth_samples, world_spans)
except ImportError:  # rootdir not importable as a package (pytest importmode)
    from test_metrics import (TOPO, SCEN, failover_world, fault_record, iteration_records,
                              span_records, synth_samples, world_spans)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------- verdict
def test_failing_bound_is_named_with_the_measured_value():
    m = Metrics({"failover_ms": 350.0, "wrong_results": 0})
    v = verdict.judge([Expectation("failover_ms", max=200.0),
                       Expectation("wrong_results", 0.0, 0.0)], m)
    assert not v.passed
    assert [r.status for r in v.rows] == ["FAIL", "PASS"]
    assert len(v.failures) == 1
    assert "failover_ms" in v.failures[0] and "350.0 ms" in v.failures[0] \
        and "<= 200" in v.failures[0]


def test_none_metric_fails_as_not_measured_with_the_reason():
    m = Metrics({"detection_ms": None},
                notes={"detection_ms": "fault 0: Nezha logged no rail_down"})
    v = verdict.judge([Expectation("detection_ms", max=100.0)], m)
    assert not v.passed
    assert v.rows[0].note == "not measured: fault 0: Nezha logged no rail_down"
    assert "not measured" in v.failures[0]


def test_share_bounds_and_no_expectations():
    m = Metrics({"rail_share.r0": 0.61})
    v = verdict.judge([Expectation("rail_share.r0", 0.4, 0.6)], m)
    assert not v.passed and "0.610" in v.failures[0]
    assert verdict.judge([], m).passed


# ------------------------------------------------------------------------------- report
@pytest.fixture
def run_data():
    active, _ = failover_world()
    samples = synth_samples(active)
    faults = [fault_record(3.0, 5.0)]
    its = span_records(world_spans())
    its[3]["ok"] = False
    events = [{"t": 3.08, "event": "rail_down", "rank": 1, "rail": 1, "peer": 0}]
    m = metrics.compute(TOPO, SCEN, samples, its, events, faults, t0=0.0,
                        extra={"rank_errors": 0})
    v = verdict.judge(SCEN.expect, m)
    tl = Timeline.merge(samples=samples, faults=faults, events=events, iterations=its,
                        t0=0.0)
    return samples, faults, m, v, tl


def _png(path):
    data = path.read_bytes()
    assert len(data) > 5000, f"{path.name} is {len(data)} bytes"
    assert data[:8] == PNG_MAGIC
    import matplotlib.image
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 400
    return img


def test_report_writes_every_file(tmp_path, run_data):
    samples, faults, m, v, tl = run_data
    out = tmp_path / "res"
    written = report.write(out, report.RunResults(TOPO, SCEN, m, v, faults, samples, tl,
                                                  timings={"build_s": 0.1}))
    for name in ("results.json", "samples.csv", "timeline.jsonl", "topology.resolved.yaml",
                 "throughput.png", "latency.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for name in ("throughput.png", "latency.png"):
        _png(out / name)
    doc = json.loads((out / "results.json").read_text())
    assert doc["metrics"]["failover_ms"] == pytest.approx(350, abs=20)
    assert doc["verdict"]["passed"] is False                       # failover 350 > 200
    assert any("failover_ms" in f for f in doc["verdict"]["failures"])
    assert doc["versions"]["python"] and doc["timings"]["build_s"] == 0.1
    assert yaml.safe_load((out / "topology.resolved.yaml").read_text())["name"] == "synth"
    header = (out / "samples.csv").read_text().splitlines()[0].split(",")
    assert header[:9] == ["t", "link", "host", "rail", "tx_bytes", "rx_bytes", "tx_packets",
                          "rx_packets", "rx_dropped"]
    back = measure.Samples.read_csv(out / "samples.csv")
    assert set(back.links) == set(samples.links)
    lines = [json.loads(x) for x in (out / "timeline.jsonl").read_text().splitlines()]
    assert {x["source"] for x in lines} == {"kernel", "fault", "nezha", "iteration"}
    assert "busbw" not in written
    # results.json holds exactly what the records hold
    def as_json(x):
        return json.loads(json.dumps(jsonable(x)))
    assert doc["metrics"] == as_json(m.values) and doc["notes"] == as_json(m.notes)
    assert doc["detail"] == as_json(m.detail_dict())
    assert doc["verdict"] == as_json(v.to_dict())
    assert [{k: x for k, x in f.items() if k != "t_applied_rel"} for f in doc["faults"]] \
        == [as_json(f.to_dict()) for f in faults]
    assert set(doc) == {"topology", "t0", "metrics", "notes", "verdict", "faults", "detail",
                        "phases", "sampler", "versions", "timings", "files"}
    assert set(doc["faults"][0]) == {"index", "action", "target", "target_kind", "label", "at",
                                     "for", "t_issued", "t_applied", "t_end", "rails", "links",
                                     "toggles", "t_applied_rel"}


def test_compare_writes_busbw_plot(tmp_path):
    recs = []
    for i, (system, dur) in enumerate([("nezha", 0.1), ("single", 0.2), ("stripe", 0.12)]):
        for j, size in enumerate((1 << 16, 1 << 20, 16 << 20)):
            d = dur * size / (16 << 20) + 0.002
            recs += [dict(r, system=system, phase=3 * i + j, bytes=size)
                     for r in iteration_records(n=5, dur=d, t=10 * i + 3 * j)]
    topo = spec.loads("hosts: 2\nrails: [{name: r0, bandwidth: 100mbit}, "
                      "{name: r1, bandwidth: 100mbit}]\n"
                      "workload: {kind: compare, sizes: [64KiB, 1MiB, 16MiB], "
                      "systems: [nezha, single, stripe]}\n")
    sc = build_scenario(topo)
    m = metrics.compute(topo, sc, None, recs, [], [], t0=0.0, extra={"rank_errors": 0})
    assert m["busbw_vs_single_rail"] == pytest.approx(2.0, rel=0.05)
    v = verdict.judge(sc.expect, m)
    phases = [{"system": "nezha", "size": 1 << 16, "t_start": 0.0, "t_end": 1.0}]
    report.write(tmp_path, report.RunResults(topo, sc, m, v, phases=phases))
    _png(tmp_path / "busbw.png")
    _png(tmp_path / "throughput.png")     # without samples: still a valid, labelled image
    assert (tmp_path / "samples.csv").read_text().startswith("t,link,host,rail")


def test_summary_table_is_aligned(run_data):
    _, _, m, v, _ = run_data
    text = report.summary_table(m, v)
    lines = text.splitlines()
    assert lines[0].split() == ["metric", "expected", "measured", "result"]
    rows = {l.split()[0]: l for l in lines[2:2 + len(v.rows)]}
    assert rows["failover_ms"].rstrip().endswith("FAIL") and "<= 200" in rows["failover_ms"]
    assert rows["detection_ms"].rstrip().endswith("PASS") and "80.0 ms" in rows["detection_ms"]
    assert rows["wrong_results"].rstrip().endswith("FAIL")
    col = lines[0].index("measured")
    assert all(l[col - 2:col] == "  " for l in lines[2:2 + len(v.rows)])
    assert "expectations: 1/3 hold" in text
