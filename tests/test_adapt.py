"""`adapt`: the figures come out of a results folder as documented (synthetic folders with
known iteration times, for each kind of change), bad arguments are input errors naming their
flag, the tables, summary, JSON and plot are written; and the smallest matrix runs end to end
on real namespaces."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from testbed import cli
from testbed.adapt import (
    KINDS,
    Cell,
    Figures,
    Options,
    Row,
    aggregate,
    capacities,
    figures,
    format_summary,
    format_table,
    ideal_ms,
    kind_of,
    plot,
    summarize,
    topology_doc,
    write_json,
)
from testbed import errors
from testbed.model import scenario, spec

MIB = 1 << 20
SIZE = 8 * MIB
T_FS, T_FE = 104.0, 109.0          # the fault's first change and its end (monotonic s)


# ------------------------------------------------------------------------ a fake results folder
def _seg(t: float, n: int, dur: float, **extra) -> list[dict]:
    """n iterations back to back from t, each dur seconds."""
    return [{"t_start": t + i * dur, "t_end": t + (i + 1) * dur, "seconds": dur, "bytes": SIZE,
             "ok": True, "warmup": False, **extra} for i in range(n)]


def timeline_rows(post: float = 0.22, recover: float = 0.21) -> list[dict]:
    """Warm-up 0.5 s; pre 11 x 0.2 s; iterations across the change and the first second of it
    (left out); during 13 x 0.3 s from 105.05 to 108.95; after the end 0.45 (across it), 0.3,
    then ``recover`` ending at 110.01; from 110.05 (>= end + 1 s) 10 x ``post``."""
    rows = (_seg(101.0, 1, 0.5, warmup=True) + _seg(101.55, 11, 0.2) + _seg(103.8, 1, 0.5)
            + _seg(104.35, 2, 0.3) + _seg(105.05, 13, 0.3) + _seg(108.97, 1, 0.45)
            + _seg(109.45, 1, 0.3) + _seg(109.8, 1, recover) + _seg(110.05, 10, post))
    return [dict(r, iter=i, rank=0) for i, r in enumerate(rows)]


def fake_results(d: Path, fault: dict, hosts: int = 2, rails: int = 2, system: str = "nezha",
                 rows: list[dict] | None = None, metrics: dict | None = None,
                 link_rates: dict[str, int] | None = None,
                 flows: list[dict] | None = None) -> Path:
    """A results folder as the runner writes it, with only what `figures` reads."""
    names = [f"h{i + 1}" for i in range(hosts)]
    topo = {"name": "fake", "hosts": names,
            "rails": [{"name": f"r{i}", "rate_bps": 200_000_000} for i in range(rails)],
            "links": {f"{h}.r{i}": {"rate_bps": (link_rates or {}).get(f"{h}.r{i}",
                                                                       200_000_000)}
                      for h in names for i in range(rails)},
            "workload": {"kind": "allreduce", "size": "8MiB", "system": system},
            "faults": [fault]}
    (d / "ranks").mkdir(parents=True)
    (d / "topology.resolved.yaml").write_text(yaml.safe_dump(topo))
    base = {"source": "fault", "index": 0, "action": fault["action"], "target": fault["target"]}
    tl = [{"t": 100.0, "source": "kernel", "kind": "goodput"},
          {**base, "t": T_FS, "kind": "fault_start"}, {**base, "t": T_FE, "kind": "fault_end"}]
    (d / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in tl))
    its = [dict(r, system=system) for r in (timeline_rows() if rows is None else rows)]
    summary = {"summary": True, "iterations": len(its), "rank": 0, "system": system}
    for h in names:
        (d / "ranks" / f"00-{system}-{h}.results.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in its + [summary]) + "{garbled\n")
    m = {"wrong_results": 0, "iterations_lost": 0, "rank_errors": 0, "adaptation_ms": 654.0}
    (d / "results.json").write_text(json.dumps({"metrics": {**m, **(metrics or {})},
                                                "detail": {"flows": flows or []}}))
    return d


FAULTS = {"rate": {"at": "4s", "action": "rate", "target": "r1", "value": "50mbit",
                   "for": "5s"},
          "traffic": {"at": "4s", "action": "traffic", "target": "r1", "value": "150mbit",
                      "for": "5s"},
          "down": {"at": "4s", "action": "link-down", "target": "r1", "for": "3s"}}


def ideal(hosts: int, capacity_mbit: float) -> float:
    return 2 * (hosts - 1) / hosts * SIZE * 8 / (capacity_mbit * 1e6) * 1e3


# ------------------------------------------------------------------------------------ figures
@pytest.mark.parametrize("kind, during_mbit", [("rate", 250), ("traffic", 300), ("down", 200)])
def test_each_kinds_figures_from_a_results_folder(tmp_path, kind, during_mbit):
    # rate: r1 at 50 -> 200 + 50; traffic 150 of 200: r1 keeps max(50, 100); down: r1 gone
    f = figures(fake_results(tmp_path / kind, FAULTS[kind]))
    assert (f.kind, f.system, f.hosts, f.rails) == (kind, "nezha", 2, 2)
    assert f.ideal_pre_ms == pytest.approx(ideal(2, 400))
    assert f.ideal_during_ms == pytest.approx(ideal(2, during_mbit))
    assert f.pre_ms == pytest.approx(200.0)            # median of pre, warm-up left out
    assert f.during_ms == pytest.approx(300.0)         # 105.05..108.95 only
    assert f.during_x == pytest.approx(300.0 / ideal(2, during_mbit))
    assert f.recovery_ms == pytest.approx(1010.0)      # 0.21 <= 1.1 x 0.2 ends at 110.01
    assert f.post_x == pytest.approx(1.1)              # 0.22 / 0.2
    assert f.counts == {"pre": 11, "during": 13, "during_whole": 13, "post": 10}
    assert (f.wrong_results, f.iterations_lost, f.adaptation_ms) == (0, 0, 654.0)
    assert f.notes == []


def test_left_x_is_during_over_the_ideal_at_what_the_busiest_competing_flow_left(tmp_path):
    # the flows on r1 took 120 and 110 Mbit/s of frames (not the fair 100): r1 left 80 on
    # its busiest hop; a flow of another rail or fault does not count
    flows = [{"fault": 0, "rail": "r1", "received_l2_mbps": 120.0},
             {"fault": 0, "rail": "r1", "received_l2_mbps": 110.0},
             {"fault": 0, "rail": "r0", "received_l2_mbps": 190.0},
             {"fault": 1, "rail": "r1", "received_l2_mbps": 190.0}]
    f = figures(fake_results(tmp_path / "t", FAULTS["traffic"], flows=flows))
    assert f.ideal_during_ms == pytest.approx(ideal(2, 300))
    assert f.ideal_left_ms == pytest.approx(ideal(2, 280))
    assert f.left_x == pytest.approx(300.0 / ideal(2, 280))
    assert figures(fake_results(tmp_path / "none", FAULTS["traffic"])).left_x is None
    assert figures(fake_results(tmp_path / "rate", FAULTS["rate"], flows=flows)).left_x is None
    cells = aggregate([_row(Cell(2, 2, "traffic", "nezha"), left_x=1.07)])
    assert "1.07/-" in format_table("traffic", cells, Options(hosts=(2,), rails=(2,)))
    assert "left (measured) (worst 1.07: traffic 2x2): not a target" in format_summary(summarize(
        cells, Options(hosts=(2,), rails=(2,))))


def test_ideal_counts_2_n_minus_1_over_n_and_the_slowest_link_of_a_rail(tmp_path):
    assert ideal_ms(4, SIZE, 600e6) == pytest.approx(1.5 * SIZE * 8 / 600e6 * 1e3)
    assert ideal_ms(2, SIZE, 0.0) is None
    # a per-link override on r0 slows r0's whole ring
    f = figures(fake_results(tmp_path / "x", FAULTS["rate"], hosts=3, rails=3,
                             link_rates={"h2.r0": 100_000_000}))
    assert f.ideal_pre_ms == pytest.approx(ideal(3, 100 + 200 + 200))
    assert f.ideal_during_ms == pytest.approx(ideal(3, 100 + 50 + 200))


def test_capacity_rules():
    topo = {"rails": [{"name": "r0", "rate_bps": 200e6}, {"name": "r1", "rate_bps": 200e6}]}
    cap = (lambda fault: capacities(topo, fault))
    assert cap({"action": "rate", "target": "r1", "value": "50mbit"}) == (400e6, 250e6)
    assert cap({"action": "rate", "target": "h2.r1", "value": "1gbit"}) == (400e6, 400e6)
    assert cap({"action": "traffic", "target": "r1", "value": "50mbit"}) == (400e6, 350e6)
    assert cap({"action": "traffic", "target": "r1", "value": "190mbit"}) == (400e6, 300e6)
    for action in ("link-down", "blackhole", "flap"):
        assert cap({"action": action, "target": "r1"}) == (400e6, 200e6)
        assert kind_of(action) == "down"
    with pytest.raises(errors.TestbedError, match="loss"):
        cap({"action": "loss", "target": "r1", "value": "5%"})
    with pytest.raises(errors.TestbedError, match="no rail"):
        cap({"action": "rate", "target": "r7", "value": "5mbit"})


def test_never_recovered_and_missing_windows_are_none_with_a_reason(tmp_path):
    rows = [r for r in timeline_rows(post=0.3, recover=0.3)]
    f = figures(fake_results(tmp_path / "slow", FAULTS["rate"], rows=rows))
    assert f.recovery_ms is None and f.post_x == pytest.approx(1.5)
    assert any("within 1.1x" in n for n in f.notes)
    early = [r for r in timeline_rows() if r["t_end"] < T_FS]       # the run stopped at 4 s
    f = figures(fake_results(tmp_path / "short", FAULTS["rate"], rows=early))
    assert f.pre_ms == pytest.approx(200.0)
    assert f.during_x is None and f.recovery_ms is None and f.post_x is None
    assert len(f.notes) == 3


def test_an_iteration_stalled_across_the_during_window_is_not_left_out(tmp_path):
    # MPTCP on a link-down: one iteration from 103.8 to 107.6, then back to 0.3 s ones
    rows = [r for r in timeline_rows() if r["t_end"] < T_FS] + _seg(103.8, 1, 3.8) \
        + _seg(107.65, 4, 0.3) + _seg(109.0, 15, 0.2)
    f = figures(fake_results(tmp_path / "stall", FAULTS["down"], rows=rows))
    assert f.counts["during_whole"] == 4 and f.during_ms == pytest.approx(300.0)
    rows = [r for r in rows if not 107.0 < r["t_start"] < 109.0]
    f = figures(fake_results(tmp_path / "stall2", FAULTS["down"], rows=rows))
    assert f.counts["during_whole"] == 0 and f.counts["during"] == 1
    assert f.during_ms == pytest.approx(3800.0)
    assert f.during_x == pytest.approx(3800.0 / ideal(2, 200))
    assert any("overlapping" in n for n in f.notes)


def test_exactness_and_adaptation_come_from_results_json(tmp_path):
    f = figures(fake_results(tmp_path / "m", FAULTS["traffic"], system="mptcp",
                             metrics={"wrong_results": 2, "iterations_lost": 1}))
    assert f.system == "mptcp" and f.adaptation_ms is None     # Nezha's metric only
    assert (f.wrong_results, f.iterations_lost) == (2, 1)
    assert any("2 wrong results" in n for n in f.notes)


def test_no_fault_in_the_timeline_is_an_error(tmp_path):
    d = fake_results(tmp_path / "nf", FAULTS["rate"])
    (d / "timeline.jsonl").write_text('{"t": 1.0, "kind": "goodput"}\n')
    with pytest.raises(errors.TestbedError, match="fault_start"):
        figures(d)


# ------------------------------------------------------------------------------------ topology
def test_every_default_cell_is_a_valid_topology_with_the_issues_fault():
    opts = Options()
    cells = opts.cells()
    assert len(cells) == 36 and len(opts.runs()) == 36
    for cell in cells:
        topo = spec.parse(topology_doc(cell, opts))
        sc = scenario.build(topo)
        assert len(topo.hosts) == cell.hosts and len(topo.rails) == cell.rails
        assert sc.workload.system == cell.system and sc.workload.warmup == 1
        [fault] = sc.faults
        assert (fault.at, fault.target) == (4.0, "r1")
        assert fault.duration == (3.0 if cell.kind == "down" else 5.0)
    docs = {k: topology_doc(Cell(2, 2, k, "nezha"), opts)["faults"][0] for k in KINDS}
    assert docs["rate"]["value"] == "50mbit" and docs["traffic"]["value"] == "150mbit"
    assert docs["down"]["action"] == "link-down"


# ------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("argv, flag, accepted", [
    (["--kinds", "rate,slow"], "--kinds", "rate, traffic, down"),
    (["--systems", "single"], "--systems", "nezha, mptcp"),
    (["--hosts", "1"], "--hosts", "from 2 to 8"),
    (["--hosts", "2,x"], "--hosts", "whole numbers"),
    (["--rails", "9"], "--rails", "from 2 to 8"),
    (["--rate", "200"], "--rate", "mbit"),
    (["--rate", "2mbit"], "--rate", "at least 4mbit"),
    (["--size", "0B"], "--size", "8MiB"),
    (["--duration", "10s"], "--duration", "at least 11s"),
    (["--at", "1s"], "--at", "at least 2s"),
    (["--for", "1s"], "--for", "more than 1s"),
    (["--down-for", "500ms"], "--down-for", "more than 1s"),
    (["--repeat", "0"], "--repeat", "from 1 to 100"),
    (["--target", "r3"], "--target", "a rail r0..r1 (the smallest --rails is 2)"),
    (["--target", "eth0"], "--target", "a rail such as r1, or one host's link"),
    (["--target", "h4.r0", "--hosts", "2,4"], "--target", "a host h1..h1"),
    (["--target", "h4.r0", "--kinds", "rate", "--hosts", "3"], "--target", "a host h1..h3 ("),
])
def test_bad_arguments_name_the_flag_and_what_is_valid(capsys, argv, flag, accepted):
    assert cli.main(["adapt", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: ") and accepted in err, err


def test_timing_options_scale_the_fault():
    from testbed.adapt import options_from
    args = cli.build_parser().parse_args(["adapt", "--duration", "8s", "--at", "3s", "--for",
                                          "3s", "--kinds", "rate", "--hosts", "2",
                                          "--rails", "2", "--systems", "nezha"])
    opts = options_from(args)
    assert (opts.duration_s, opts.at_s, opts.for_s, len(opts.runs())) == (8.0, 3.0, 3.0, 1)
    fault = topology_doc(opts.cells()[0], opts)["faults"][0]
    assert (fault["at"], fault["for"], fault["value"]) == ("3s", "3s", "50mbit")


def test_another_target_is_the_changed_rail_or_link_and_the_ideal_follows_it(tmp_path):
    from testbed.adapt import options_from
    args = cli.build_parser().parse_args(["adapt", "--target", "h2.r0", "--hosts", "3",
                                          "--rails", "2"])
    opts = options_from(args)
    docs = {k: topology_doc(Cell(3, 2, k, "nezha"), opts) for k in KINDS}
    for kind, doc in docs.items():
        [fault] = scenario.build(spec.parse(doc)).faults
        if kind == "traffic":      # a rail's load: r0 between h2 and the next host
            assert (fault.target, fault.between) == ("r0", ("h2", "h3"))
        else:
            assert fault.target == "h2.r0"
    # one link of r0 at a quarter slows r0's whole ring
    f = figures(fake_results(tmp_path / "l", docs["rate"]["faults"][0], hosts=3))
    assert f.ideal_during_ms == pytest.approx(ideal(3, 50 + 200))
    assert "h2.r0 200mbit -> 50mbit" in format_table("rate", {}, opts)
    assert "on r0 between h2 and h3" in format_table("traffic", {}, opts)


# ------------------------------------------------------------------------------------ output
def _row(cell: Cell, repeat: int = 0, **figs) -> Row:
    base = dict(pre_ms=200.0, ideal_pre_ms=168.0, ideal_during_ms=268.0, during_ms=300.0,
                during_x=1.12, recovery_ms=400.0, post_x=1.01, wrong_results=0,
                iterations_lost=0, adaptation_ms=700.0 if cell.system == "nezha" else None)
    return Row(cell, repeat, Figures(kind=cell.kind, system=cell.system, hosts=cell.hosts,
                                     rails=cell.rails, **{**base, **figs}))


def test_repeats_median_tables_summary_json_and_plot(tmp_path):
    opts = Options(hosts=(2, 3), rails=(2,), kinds=("rate", "down"), repeat=3)
    rows = [_row(Cell(h, 2, k, s), i) for k in opts.kinds for h in opts.hosts
            for s in opts.systems for i in range(3)]
    mptcp = Cell(2, 2, "rate", "mptcp")
    rows = [_row(r.cell, r.repeat, during_ms=600.0, during_x=2.2) if r.cell == mptcp else r
            for r in rows]
    nez = Cell(3, 2, "down", "nezha")       # one repeat never recovers: the median is 400
    rows[[i for i, r in enumerate(rows) if r.cell == nez][0]] = _row(nez, 0, recovery_ms=None)
    cells = aggregate(rows)
    assert cells[nez]["recovery_ms"] == 400.0 and cells[nez]["runs"] == 3
    assert cells[mptcp]["during_x"] == 2.2
    table = format_table("rate", cells, opts)
    assert "2x2" in table and "3x2" in table and "1.12/2.20" in table and " 0.50" in table
    s = summarize(cells, opts)
    assert (s["shapes"], s["during_x_met"], s["nezha_le_mptcp"], s["recovery_met"]) == \
        (4, 4, 4, 4)
    assert "MISSED" not in format_summary(s)
    rows.append(_row(Cell(2, 2, "down", "nezha"), 3, recovery_ms=None, during_x=1.4,
                     wrong_results=1))
    s = summarize(aggregate(rows), opts)
    assert s["wrong_results"] == 1 and "MISSED" in format_summary(s)
    write_json(tmp_path / "adapt.json", rows, opts)
    doc = json.loads((tmp_path / "adapt.json").read_text())
    assert len(doc["rows"]) == len(rows) and len(doc["cells"]) == 8
    assert plot(tmp_path / "adapt.png", aggregate(rows), opts).stat().st_size > 0


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.netns
@pytest.mark.slow
def test_the_smallest_matrix_end_to_end(tmp_path, capsys, no_leftovers):
    out = tmp_path / "adapt"
    rc = cli.main(["adapt", "--hosts", "2", "--rails", "2", "--kinds", "rate", "--systems",
                   "nezha", "--duration", "8s", "--at", "3s", "--for", "3s",
                   "--out", str(out)])
    printed = capsys.readouterr().out
    doc = json.loads((out / "adapt.json").read_text())
    assert rc == 0, printed
    [row] = doc["rows"]
    assert (row["hosts"], row["rails"], row["kind"], row["system"]) == (2, 2, "rate", "nezha")
    assert row["error"] is None, row
    for key in ("pre_ms", "ideal_pre_ms", "ideal_during_ms", "during_x", "recovery_ms",
                "post_x"):
        assert row[key] is not None and math.isfinite(row[key]) and row[key] > 0, (key, row)
    assert row["wrong_results"] == 0 and row["iterations_lost"] == 0
    assert "== rate: r1 200mbit -> 50mbit at 3 s for 3 s" in printed and "2x2" in printed
    assert (out / "adapt.png").stat().st_size > 0
