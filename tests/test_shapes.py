"""`shapes`: the draw is deterministic and keeps every bound, the YAML it emits loads, the
optimum is the bottleneck-aware one, the judging reads the iteration table as documented; and
one small shape runs end to end on real namespaces."""
from __future__ import annotations

import json
import math

import pytest

from testbed import cli
from testbed.errors import SpecError
from testbed.model import scenario, spec
from testbed.shapes import (
    MIB,
    RATE_MAX_MBIT,
    RATE_MIN_MBIT,
    DrawOptions,
    RunOptions,
    ShapeRow,
    check_options,
    draw,
    expand_command,
    _pinned_env,
    format_row,
    format_summary,
    header,
    options_from,
    goodput_factor,
    ops_to_balance,
    optimum,
    parse_range,
    parse_seeds,
    parse_sizes,
    plot,
    steady_busbw,
    summarize,
    write_json,
)

F1500 = 1448 / 1514
F9000 = 8948 / 9014
SEEDS = range(300)


# ------------------------------------------------------------------------------------ the draw
def test_the_draw_is_deterministic_for_a_seed():
    for seed in range(50):
        a, b = draw(seed), draw(seed)
        assert a == b and a.to_yaml() == b.to_yaml()
    assert len({draw(s).to_yaml() for s in range(50)}) == 50


def _check_bounds(shape, opts: DrawOptions) -> None:
    assert opts.hosts[0] <= shape.hosts <= opts.hosts[1]
    assert opts.rails[0] <= len(shape.rails) <= opts.rails[1]
    assert [r.name for r in shape.rails] == [f"r{i}" for i in range(len(shape.rails))]
    for r in shape.rails:
        assert RATE_MIN_MBIT <= r.mbit <= RATE_MAX_MBIT
        assert r.mtu in ((1500, 9000) if opts.jumbo else (1500,))
        assert r.loss_pct == 0 or 0.5 <= r.loss_pct <= 2.0
    assert shape.hosts * sum(r.mbit for r in shape.rails) <= opts.cpu_budget_mbit
    lossy = [r for r in shape.rails if r.loss_pct]
    assert len(lossy) <= (1 if opts.loss else 0)
    assert not shape.rails[0].loss_pct            # the single-rail ring's rail is clean
    if shape.override:
        host, rail, mbit = shape.override
        assert opts.overrides
        assert host in shape.host_names
        rate = next(r.mbit for r in shape.rails if r.name == rail)
        assert rate / 10 - 1 <= mbit <= rate / 2 and mbit >= RATE_MIN_MBIT
    # best rail first: the clean ring bounds never increase
    bounds = [shape.bound_mbit(r) for r in shape.rails]
    assert bounds == sorted(bounds, reverse=True)
    assert shape.size in [m * MIB for m in opts.sizes_mib]
    t = shape.iteration_s(shape.optimum_mbit)
    in_range = [m for m in opts.sizes_mib if 0.1 <= shape.iteration_s(shape.optimum_mbit,
                                                                       m * MIB) <= 2.0]
    if in_range:
        assert 0.1 <= t <= 2.0


def test_every_drawn_shape_respects_every_bound_and_the_cpu_budget():
    opts = DrawOptions()
    shapes = [draw(s, opts) for s in SEEDS]
    for shape in shapes:
        _check_bounds(shape, opts)
    labels = " ".join(s.label for s in shapes)
    for feature in ("eq", "ovr", "loss", "mtu9k"):     # each feature is drawn, none always
        assert 0.1 < labels.split().count(feature) / len(shapes) < 0.6, feature
    assert {s.hosts for s in shapes} == set(range(2, 7))
    assert min(len(s.rails) for s in shapes) == 2 and max(len(s.rails) for s in shapes) == 16


@pytest.mark.parametrize("opts", [
    DrawOptions(hosts=(2, 4), rails=(8, 16)),
    DrawOptions(hosts=(6, 6), rails=(16, 16), cpu_budget_mbit=1000),
    DrawOptions(sizes_mib=(1, 4), loss=False, overrides=False, equal=False, jumbo=False),
    DrawOptions(hosts=(2, 2), rails=(2, 2), sizes_mib=(1,)),
])
def test_restricted_draws_stay_inside_their_restrictions(opts):
    for seed in range(100):
        _check_bounds(draw(seed, opts), opts)


def test_rates_are_scaled_down_not_clipped_to_fit_the_budget():
    opts = DrawOptions(hosts=(6, 6), rails=(16, 16))
    for seed in range(20):
        shape = draw(seed, opts)
        assert 6 * sum(r.mbit for r in shape.rails) <= 2400
        assert max(r.mbit for r in shape.rails) < 400       # 16 rails of up to 1000 scaled
    # a budget nothing exceeds leaves the drawn rates alone (the same draws, unscaled)
    wide = DrawOptions(hosts=(2, 2), rails=(2, 2), cpu_budget_mbit=1e6)
    assert any(r.mbit > 600 for s in range(50) for r in draw(s, wide).rails)


def test_impossible_options_are_input_errors():
    with pytest.raises(SpecError, match="--cpu-budget"):
        check_options(DrawOptions(hosts=(6, 6), rails=(16, 16), cpu_budget_mbit=500))
    with pytest.raises(SpecError, match="--hosts"):
        check_options(DrawOptions(hosts=(1, 3)))
    with pytest.raises(SpecError, match="--sizes"):
        check_options(DrawOptions(sizes_mib=()))


def test_the_emitted_yaml_loads_with_the_spec_loader_and_says_what_was_drawn():
    for seed in range(60):
        shape = draw(seed)
        text = shape.to_yaml(RunOptions(iterations=7, warmup=2))
        topo = spec.loads(text)
        sc = scenario.build(topo)
        assert len(topo.hosts) == shape.hosts
        for drawn, rail in zip(shape.rails, topo.rails):
            assert rail.name == drawn.name and rail.mtu == drawn.mtu
            assert rail.shape.rate_bps == drawn.mbit * 1_000_000
            assert rail.shape.loss == pytest.approx(drawn.loss_pct / 100)
        if shape.override:
            host, rail, mbit = shape.override
            assert topo.link(host, rail).shape.rate_bps == mbit * 1_000_000
        w = sc.workload
        assert (w.kind, w.sizes, w.systems) == ("compare", (shape.size,), ("nezha", "single",
                                                                           "mptcp"))
        assert (w.iterations, w.warmup, w.rounds) == (7, 2, 1)
        # the clean optimum the draw sized the message by is the one optimum() computes
        assert optimum(topo).sum_bps == pytest.approx(shape.optimum_mbit * 1e6)


def test_emit_on_the_command_line_prints_the_shape(capsys):
    assert cli.main(["shapes", "--emit", "5", "--hosts", "2-3", "--no-loss"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# drawn by: python -m testbed shapes --emit 5 --hosts 2-3 --no-loss")
    assert text == draw(5, DrawOptions(hosts=(2, 3), loss=False)).to_yaml()
    spec.loads(text)


# ------------------------------------------------------------------------------------ optimum
def test_the_optimum_runs_each_rail_at_its_slowest_hop():
    topo = spec.loads("""
hosts: 4
rails: [{name: r0, bandwidth: 200mbit}, {name: r1, bandwidth: 100mbit}]
links: {h3.r0: {bandwidth: 40mbit}}
""")
    opt = optimum(topo)
    r0, r1 = opt.rail("r0"), opt.rail("r1")
    assert r0.wire_bps == 40e6 and r1.wire_bps == 100e6
    assert r0.bottleneck in ("h2->h3", "h3->h4")        # both hops through h3 run at 40
    assert opt.wire_sum_bps == 140e6                     # before the goodput factor
    assert opt.sum_bps == pytest.approx(140e6 * F1500)
    assert opt.sum_bps / 1e6 == pytest.approx(133.9, abs=0.05)


def test_an_override_shapes_only_its_host_and_a_faster_one_does_not_help():
    topo = spec.loads("""
hosts: 4
rails: [{name: r0, bandwidth: 100mbit}, {name: r1, bandwidth: 100mbit}]
links: {h4.r0: {bandwidth: 30mbit}, h1.r1: {bandwidth: 300mbit}}
""")
    opt = optimum(topo)
    # the slow attachment is the last host: the wrap-around hop h4 -> h1 is slow too
    assert opt.rail("r0").wire_bps == 30e6
    assert opt.rail("r0").bottleneck in ("h3->h4", "h4->h1")
    # one fast attachment: every other hop still runs at the rail's rate
    assert opt.rail("r1").wire_bps == 100e6
    # a ring over a subset of the hosts does not cross h4
    assert optimum(topo, hosts=["h1", "h2", "h3"]).rail("r0").wire_bps == 100e6


def test_direct_wiring_override_shapes_the_whole_cable():
    topo = spec.loads("""
hosts: 2
wiring: direct
rails: [{name: r0, bandwidth: 100mbit}]
links: {h2.r0: {bandwidth: 25mbit}}
""")
    assert optimum(topo).rail("r0").wire_bps == 25e6


def test_mtu_9000_gets_the_jumbo_goodput_factor():
    topo = spec.loads("""
hosts: 3
rails: [{name: r0, bandwidth: 100mbit, mtu: 9000}, {name: r1, bandwidth: 100mbit}]
""")
    opt = optimum(topo)
    assert goodput_factor(9000) == pytest.approx(F9000)
    assert opt.rail("r0").goodput_bps == pytest.approx(100e6 * F9000)
    assert opt.rail("r1").goodput_bps == pytest.approx(100e6 * F1500)
    assert opt.sum_bps == pytest.approx(100e6 * (F9000 + F1500))


def test_a_lossy_rail_counts_what_its_own_ring_measured_if_lower():
    topo = spec.loads("""
hosts: 3
rails: [{name: r0, bandwidth: 100mbit}, {name: r1, bandwidth: 100mbit, loss: 1%}]
""")
    assert not optimum(topo).rail("r0").lossy and optimum(topo).rail("r1").lossy
    low = optimum(topo, measured={"r1": 50e6})
    assert low.rail("r1").achievable_bps == 50e6
    assert low.sum_bps == pytest.approx(100e6 * F1500 + 50e6)
    high = optimum(topo, measured={"r1": 500e6})       # never above the clean bound
    assert high.sum_bps == pytest.approx(200e6 * F1500)


def test_an_unshaped_rail_has_no_optimum():
    topo = spec.loads("hosts: 2\nrails: [{name: r0, bandwidth: 100mbit}, {name: r1}]\n")
    opt = optimum(topo)
    assert opt.rail("r1").wire_bps is None and opt.sum_bps is None


# ------------------------------------------------------------------------------------ judging
def _its(system: str, latencies_ms: list[float], nbytes: int = 8 * MIB, ranks: int = 2) -> list:
    out = []
    for k, lat in enumerate(latencies_ms):
        bw = nbytes * 2 * (ranks - 1) / ranks * 8 / (lat / 1e3) / 1e6
        out.append({"phase": 0, "system": system, "bytes": nbytes, "iter": k,
                    "latency_ms": lat, "busbw_mbps": bw, "complete": True, "ok": True})
    return out


def test_steady_busbw_is_the_median_from_the_steady_index_on():
    its = _its("nezha", [900, 800, 700] + [100] * 7 + [100, 110, 90, 100]) + _its("single",
                                                                                 [200] * 14)
    bw, n = steady_busbw(its, "nezha", 10)
    assert n == 4 and bw == pytest.approx(8 * MIB * 8 / 0.1 / 1e6)
    assert steady_busbw(its, "single", 10)[0] == pytest.approx(8 * MIB * 8 / 0.2 / 1e6)
    assert steady_busbw(its, "mptcp", 10) == (None, 0)
    assert steady_busbw(its, None, 0)[1] == len(its)            # a command: every row
    its[12]["complete"] = False
    assert steady_busbw(its, "nezha", 10)[1] == 3


def test_ops_to_balance_is_where_every_later_iteration_is_within_10_percent():
    its = _its("nezha", [900, 500, 300, 105, 120, 100, 98, 102, 100, 95, 100, 101, 99, 100])
    assert ops_to_balance(its, "nezha", 10) == 5     # 120 at index 4 is 20 % off
    assert ops_to_balance(_its("nezha", [100] * 12), "nezha", 10) == 0
    assert ops_to_balance(_its("nezha", [100] * 11 + [300]), "nezha", 10) is None
    assert ops_to_balance([], "nezha", 10) is None


def test_the_steady_table_script_judges_a_compare_run_by_these_rules(tmp_path, capsys,
                                                                     monkeypatch):
    """scripts/steady_table.py (the README's held-out table): per topology file, all and
    steady busbw per system, Nezha over the optimum, single and MPTCP, ops per round."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import steady_table
    topo = tmp_path / "two.yaml"
    topo.write_text("name: two\nhosts: 2\nrails:\n  - {name: r0, bandwidth: 100mbit}\n"
                    "  - {name: r1, bandwidth: 100mbit}\n")
    round2 = [dict(r, phase=1) for r in _its("nezha", [100] * 10 + [200])]
    its = (_its("nezha", [400, 300] + [100] * 9) + round2 + _its("single", [200] * 11)
           + _its("mptcp", [125] * 11))
    (tmp_path / "res" / "two").mkdir(parents=True)
    (tmp_path / "res" / "two" / "results.json").write_text(
        json.dumps({"detail": {"iterations": its}}))
    monkeypatch.setattr("sys.argv", ["steady_table.py", str(topo), "--results",
                                     str(tmp_path / "res")])
    assert steady_table.main() == 0
    cells = [c.strip() for c in capsys.readouterr().out.splitlines()[-1].strip("|").split("|")]
    opt = 2 * 100 * F1500                                       # two rails' goodput, Mbit/s
    steady = 8 * MIB * 8 / 0.1 / 1e6
    assert cells[0] == "two"
    assert cells[1] == f"{steady:.0f} / {steady:.0f}"           # iteration 0 is not timed
    assert cells[4] == f"{steady / opt:.2f}"
    assert cells[5:7] == ["2.00", "1.25"]
    assert cells[7] == "2, -"                                  # round 2 ends off its median


def _row(seed, nezha, single, mptcp, opt=100.0, **kw) -> ShapeRow:
    return ShapeRow(seed, 3, 4, "4r 10-100M", 4 * MIB, optimum_mbps=opt,
                    busbw_mbps={"nezha": nezha, "single": single, "mptcp": mptcp}, **kw)


def test_rows_summary_json_and_plot(tmp_path):
    rows = [_row(0, 90, 50, 80, ops_to_balance=3), _row(1, 40, 60, 70, ops_to_balance=None),
            _row(2, 95, 45, 90, ops_to_balance=5), _row(3, None, None, None, opt=None,
                                                         error="FabricError: boom")]
    assert rows[0].ratios["nezha/optimum"] == pytest.approx(0.9)
    assert rows[0].ratios["nezha/single"] == pytest.approx(1.8)
    assert rows[3].ratios["nezha/optimum"] is None
    s = summarize(rows)
    assert s["measured"] == 3 and s["failed_seeds"] == [3]
    assert s["nezha/optimum"]["median"] == pytest.approx(0.9)
    assert s["nezha/optimum"]["worst"] == pytest.approx(0.4)
    assert s["nezha_below_single"] == [1] and s["never_balanced_seeds"] == [1]
    assert [w["seed"] for w in s["worst_seeds"]][:1] == [1]
    text = format_summary(s)
    assert "median 0.900" in text and "worst 0.400" in text and "nezha < single in 1" in text
    assert "FAILED: FabricError: boom" in format_row(rows[3])
    line = format_row(rows[0])
    assert "0.900" in line and "1.80" in line and "4MiB" in line
    path = tmp_path / "shapes.json"
    write_json(path, rows, DrawOptions(hosts=(2, 4)), RunOptions(), interrupted=True)
    doc = json.loads(path.read_text())
    assert doc["summary"]["interrupted"] is True and len(doc["rows"]) == 4
    assert doc["rerun"] == "python -m testbed shapes --emit SEED --hosts 2-4"
    assert doc["rows"][0]["ratios"]["nezha/optimum"] == pytest.approx(0.9)
    assert plot(tmp_path / "shapes.png", rows).stat().st_size > 0


def test_pinned_runs_stripe_at_the_optimums_proportions():
    topo = spec.loads("""
hosts: 3
rails: [{name: r0, bandwidth: 300mbit}, {name: r1, bandwidth: 100mbit}]
""")
    run = options_from(cli.build_parser().parse_args(["shapes", "--pinned"]))[1]
    assert "stripe" in run.systems
    env = _pinned_env(optimum(topo), run)
    shares = [float(x) for x in env["NEZHA_SHARES"].split(",")]
    assert shares[0] / shares[1] == pytest.approx(3.0, rel=1e-4)
    assert _pinned_env(optimum(topo), RunOptions()) == {}
    row = _row(0, 90, 50, 80)
    row.busbw_mbps["stripe"] = 100.0
    assert row.ratios["nezha/stripe"] == pytest.approx(0.9)
    assert "pinned" in header(pinned=True) and "0.900" in format_row(row, pinned=True)
    assert "nezha/pinned median 0.900" in format_summary(summarize([row]))


def test_seed_size_and_range_options():
    assert parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert parse_seeds("3,7,12") == [3, 7, 12]
    assert parse_seeds("0-2,9,1") == [0, 1, 2, 9]
    assert parse_range("2-4", "--hosts") == (2, 4) and parse_range("3", "--hosts") == (3, 3)
    assert parse_sizes("1,4MiB,16") == (1, 4, 16)
    for bad in ("x", "5-2", ""):
        with pytest.raises(SpecError):
            parse_seeds(bad)


def test_the_users_command_gets_the_shapes_size():
    shape = draw(1)
    cmd = expand_command("prog --bytes {bytes} -n {iterations} -w {warmup}", shape,
                         RunOptions(iterations=9, warmup=2))
    assert cmd == f"prog --bytes {shape.size} -n 9 -w 2"
    topo = spec.loads(shape.to_yaml(command=cmd))
    w = scenario.build(topo).workload
    assert w.kind == "command" and w.command == ("sh", "-c", cmd)


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.netns
@pytest.mark.slow
def test_one_small_shape_end_to_end(tmp_path, capsys, no_leftovers):
    out = tmp_path / "shapes"
    rc = cli.main(["shapes", "--seeds", "0", "--hosts", "2", "--rails", "2", "--sizes", "1",
                   "--no-loss", "--iterations", "4", "--steady-from", "2",
                   "--results", str(out)])
    printed = capsys.readouterr().out
    doc = json.loads((out / "shapes.json").read_text())
    assert rc == 0, printed
    [row] = doc["rows"]
    assert row["seed"] == 0 and row["hosts"] == 2 and row["rails"] == 2
    assert row["size"] == MIB and row["error"] is None
    for key in ("nezha/optimum", "nezha/single", "single/optimum"):
        assert row["ratios"][key] is not None and math.isfinite(row["ratios"][key]), key
    # the single-rail ring on the best rail reaches its clean bound, and at most what htb's
    # full buckets add to a message this short (1 MiB on 2 hosts: up to 25 % at once)
    r0 = row["rail_bounds"][0]
    volume = MIB * 8
    with_burst = volume / ((volume - r0["burst_kbit"] * 1e3) / (r0["achievable_mbps"] * 1e6))
    assert 0.9 * r0["achievable_mbps"] <= row["busbw_mbps"]["single"] <= 1.1 * with_burst / 1e6
    assert row["optimum_burst_mbps"] > row["optimum_mbps"]
    assert "== 1 of 1 shapes measured" in printed
    assert (out / "shapes.png").stat().st_size > 0
    assert spec.loads((out / "seed-0" / "shape.yaml").read_text()).name == "shape-0"
