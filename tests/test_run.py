"""`run` end to end on real namespaces, on both backends: verdicts, metrics, results folder.
A run whose expectation cannot hold must exit 1 and say which one, with the measured value."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.model import spec
from testbed.run.runner import run_topology

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ["pyroute2", "mininet"]

EQUAL = """
name: e2e-equal
backend: {backend}
hosts: 3
rails:
  - {{name: r0, bandwidth: 200mbit}}
  - {{name: r1, bandwidth: 200mbit}}
workload: {{kind: allreduce, size: 8MiB, iterations: 5}}
expect:
  wrong_results: 0
  iterations_lost: 0
  iterations: 5
  rail_share.r0: {{min: 0.35, max: 0.65}}
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_equal_rails_pass_with_exact_results_and_both_rails_used(backend, tmp_path, no_leftovers):
    out = run_topology(spec.loads(EQUAL.format(backend=backend)), tmp_path / "r", say=lambda m: None)
    assert out.passed, out.verdict.failures
    m = out.metrics
    assert m["wrong_results"] == 0 and m["iterations"] == 5
    assert 0.35 <= m["rail_share.r0"] <= 0.65 and 0.35 <= m["rail_share.r1"] <= 0.65
    # both rails carry work, and together more than one rail could
    assert m["busbw_mbps"] > 200 * 0.956
    for name in ("results.json", "samples.csv", "timeline.jsonl", "throughput.png",
                 "latency.png", "topology.resolved.yaml"):
        assert (tmp_path / "r" / name).stat().st_size > 0, name
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert results["verdict"]["passed"] is True


def test_failing_expectation_exits_1_and_names_it(tmp_path, no_leftovers):
    topo = tmp_path / "impossible.yaml"
    topo.write_text("""
name: impossible
hosts: 2
rails: [{name: r0, bandwidth: 50mbit}, {name: r1, bandwidth: 50mbit}]
workload: {kind: allreduce, size: 1MiB, iterations: 3}
expect:
  wrong_results: 0
  busbw_mbps: {min: 5000}
""")
    r = subprocess.run([sys.executable, "-m", "testbed", "run", str(topo), "--results",
                        str(tmp_path / "res")], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    line = [l for l in r.stdout.splitlines() if l.startswith("busbw_mbps")][0]
    assert "FAIL" in line and ">= 5000" in line and "Mbit/s" in line
    assert "verdict: FAIL" in r.stdout
    assert [l for l in r.stdout.splitlines() if l.startswith("wrong_results")][0].endswith("PASS")


def test_a_workload_cut_short_by_its_timeout_fails_even_without_expectations(tmp_path,
                                                                             no_leftovers):
    """Ranks killed at workload.timeout prove nothing: the run says so and fails, also when
    the file expects nothing (it used to print PASS over 32 killed ranks)."""
    topo = tmp_path / "slow.yaml"
    topo.write_text("""
name: slow
hosts: 2
rails: [{name: r0}, {name: r1}]
workload: {kind: command, command: 'echo started; sleep 60', timeout: 2s}
""")
    r = subprocess.run([sys.executable, "-m", "testbed", "run", str(topo), "--results",
                        str(tmp_path / "res")], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "did not finish within workload.timeout" in out and "verdict: FAIL" in out
    ranks = json.loads((tmp_path / "res" / "ranks.json").read_text())
    assert [x["exit_code"] for x in ranks] == [-9, -9]


def test_a_degraded_rail_is_reported_as_such(tmp_path, no_leftovers):
    """Both rails collapsed to 10 % of their rate for the whole run: the bus bandwidth the run
    reports falls accordingly, and an expectation written for healthy rails fails."""
    healthy = """
name: healthy
hosts: 2
rails: [{name: r0, bandwidth: 100mbit}, {name: r1, bandwidth: 100mbit}]
workload: {kind: allreduce, size: 1MiB, duration: 5s}
expect: {wrong_results: 0, busbw_vs_rail_sum: {min: 0.6}}
"""
    degraded = healthy.replace("name: healthy", "name: degraded") + \
        "faults: [{at: 0s, action: rate, target: r1, value: 10mbit, for: 20s},\n" \
        "         {at: 0s, action: rate, target: r0, value: 10mbit, for: 20s}]\n"
    ok = run_topology(spec.loads(healthy), tmp_path / "ok", say=lambda m: None)
    bad = run_topology(spec.loads(degraded), tmp_path / "bad", say=lambda m: None)
    assert ok.passed, ok.verdict.failures
    assert not bad.passed
    assert any("busbw_vs_rail_sum" in f for f in bad.verdict.failures)
    assert bad.metrics["busbw_mbps"] < ok.metrics["busbw_mbps"] / 5
    assert bad.metrics["wrong_results"] == 0


def test_killed_rank_fails_the_others_cleanly(tmp_path, no_leftovers):
    topo = spec.loads("""
name: kill
hosts: 3
rails: [{name: r0, bandwidth: 100mbit}, {name: r1, bandwidth: 100mbit}]
workload: {kind: allreduce, size: 1MiB, duration: 30s, timeout: 40s}
faults: [{at: 2s, action: kill, target: h3}]
expect: {wrong_results: 0}
""")
    out = run_topology(topo, tmp_path / "k", say=lambda m: None)
    ranks = json.loads((tmp_path / "k" / "ranks.json").read_text())
    killed = [r for r in ranks if r["killed"]]
    others = [r for r in ranks if not r["killed"]]
    assert [r["host"] for r in killed] == ["h3"]
    # every surviving rank noticed and exited with a communication error (the worker's
    # EXIT_COMM, 4; a wrong result would be 3), long before 30 s
    from nezha.worker import EXIT_COMM
    assert [r["exit_code"] for r in others] == [EXIT_COMM, EXIT_COMM], others
    assert out.metrics["rank_errors"] == 2
    assert out.metrics["wrong_results"] == 0
    # the allreduce ran before the kill at 2 s (16-17 iterations in 3 runs here), and exactly
    # one iteration, the one in flight when h3 died, is lost: no more, and not none
    assert out.metrics["iterations"] >= 1, out.metrics.notes
    assert out.metrics["iterations_lost"] == 1, out.metrics.notes


def test_command_workload_gets_rails_and_rendezvous(tmp_path, no_leftovers):
    topo = spec.loads("""
name: cmd
hosts: 2
rails: [{name: r0}, {name: r1}]
workload:
  kind: command
  command: 'test "$NEZHA_WORLD_SIZE" = 2 && test -n "$NEZHA_RAILS" && ping -c1 -W2 -I r1 198.18.1.$((2 - NEZHA_RANK)) >/dev/null && echo "ok $NEZHA_RANK $NEZHA_RAILS"'
expect: {rank_errors: 0}
""")
    out = run_topology(topo, tmp_path / "c", say=lambda m: None)
    assert out.passed, out.verdict.failures
    logs = sorted((tmp_path / "c" / "ranks").glob("*.log"))
    texts = [p.read_text() for p in logs]
    assert "ok 0 198.18.0.1,198.18.1.1" in texts[0] and "ok 1 198.18.0.2,198.18.1.2" in texts[1]


USER_PROGRAM = r"""
# A user's own training-style program, as the README's `command` workload runs it: Nezha from
# the environment the testbed sets, every collective once, every result checked.
import sys

import numpy as np
import nezha

ctx = nezha.Context.from_env()
r, n = ctx.rank, ctx.world_size
m = 1 << 16
wrong = []


def check(name, got, want):
    if not np.array_equal(got, want):
        wrong.append(name)


try:
    x = np.arange(4 * m, dtype=np.float32) + r                       # 1 MiB
    ctx.allreduce(x)
    check("allreduce", x, n * np.arange(4 * m, dtype=np.float32) + n * (n - 1) // 2)
    y = np.full(m, r, dtype=np.int64)
    ctx.allreduce(y, op="max")
    check("allreduce max", y, np.full(m, n - 1, dtype=np.int64))
    b = np.arange(m, dtype=np.float64) * 7 if r == 1 else np.zeros(m, dtype=np.float64)
    ctx.broadcast(b, root=1)
    check("broadcast", b, np.arange(m, dtype=np.float64) * 7)
    gathered = np.empty(n * m, dtype=np.int32)
    ctx.allgather(np.full(m, 10 + r, dtype=np.int32), gathered)
    check("allgather", gathered, np.repeat(np.arange(n, dtype=np.int32) + 10, m))
    part = np.empty(m, dtype=np.float64)
    ctx.reduce_scatter(np.arange(n * m, dtype=np.float64) * (r + 1), part)
    check("reduce_scatter", part, np.arange(r * m, (r + 1) * m, dtype=np.float64) * n * (n + 1) // 2)
    ctx.barrier()
    rails = len(ctx.rail_addrs)
finally:
    ctx.close()
print(f"rank {r} of {n}: system {ctx.system}, {rails} rails, wrong: {wrong or 'none'}")
sys.exit(1 if wrong else 0)
"""


def test_a_users_nezha_program_runs_as_a_command_workload(tmp_path, no_leftovers):
    """The README's path for your own program: `command: "python my_train.py"` on every host,
    where `nezha.Context.from_env()` joins the ranks over the rails and every collective gives
    the right answer (a wrong one exits 1, and counts as a rank error)."""
    program = tmp_path / "my_train.py"
    program.write_text(USER_PROGRAM)
    topo = spec.loads(f"""
name: user-program
hosts: 3
rails: [{{name: r0, bandwidth: 200mbit}}, {{name: r1, bandwidth: 200mbit}}]
workload: {{kind: command, command: "python {program}", timeout: 60s}}
expect: {{rank_errors: 0}}
""")
    out = run_topology(topo, tmp_path / "u", say=lambda m: None)
    ranks = json.loads((tmp_path / "u" / "ranks.json").read_text())
    logs = {r["host"]: Path(r["log"]).read_text(errors="replace") for r in ranks}
    assert [(r["host"], r["exit_code"]) for r in ranks] == \
        [("h1", 0), ("h2", 0), ("h3", 0)], logs
    for r in ranks:
        assert f"rank {r['rank']} of 3: system nezha, 2 rails, wrong: none" in logs[r["host"]]
    assert out.passed, out.verdict.failures
    assert out.metrics["rank_errors"] == 0


def test_compare_runs_every_system_on_the_same_fabric(tmp_path, no_leftovers):
    topo = spec.loads("""
name: cmp
hosts: 2
rails: [{name: r0, bandwidth: 100mbit}, {name: r1, bandwidth: 100mbit}]
workload: {kind: compare, sizes: [64KiB, 2MiB], systems: [nezha, single], iterations: 3}
expect: {wrong_results: 0}
""")
    out = run_topology(topo, tmp_path / "cmp", say=lambda m: None)
    assert out.passed, out.verdict.failures
    by = out.metrics.detail["busbw_by_system"]
    assert set(by) == {"nezha", "single"}
    assert (tmp_path / "cmp" / "busbw.png").stat().st_size > 5000
    assert out.metrics["busbw_vs_single_rail"] is not None


def test_an_interrupted_run_tears_down_in_reverse_order(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) during the workload: fault injector, sampler, capture, fabric are
    undone in reverse order of being set up, each exactly once. Fakes, no namespaces."""
    from testbed.run import runner as runner_mod
    calls: list[str] = []

    class Fake:
        def __init__(self, name, *a, **kw):
            self.name, self.hosts = name, ["h1", "h2"]

        def __getattr__(self, step):
            def call(*a, **kw):
                calls.append(f"{self.name}.{step}")
                if step == "run":
                    raise KeyboardInterrupt
                return 0.0 if step == "teardown" else self
            return call

    class FakeFabric(Fake):
        build_seconds, state = 0.0, type("S", (), {"run_id": 1})

        def __init__(self, *a, **kw):
            super().__init__("fabric")

    monkeypatch.setattr(runner_mod, "probe", lambda: None)
    monkeypatch.setattr(runner_mod, "check_capabilities", lambda topo, caps: None)
    monkeypatch.setattr(runner_mod, "fabric_class", lambda topo: FakeFabric)
    for cls, name in (("Capture", "capture"), ("Sampler", "sampler"),
                      ("FaultInjector", "injector"), ("WorkloadRunner", "runner")):
        monkeypatch.setattr(runner_mod, cls, lambda *a, _n=name, **kw: Fake(_n))
    topo = spec.loads("name: stop\nhosts: 2\nrails: [{name: r0, bandwidth: 100mbit}]\n"
                      "capture: true\nworkload: {kind: allreduce, size: 1MiB, iterations: 3}\n"
                      "faults: [{at: 1s, action: link-down, target: h2.r0, for: 1s}]\n")
    with pytest.raises(KeyboardInterrupt):
        run_topology(topo, tmp_path / "r", say=lambda m: None)
    assert calls == ["fabric.build", "capture.start", "sampler.start", "injector.start",
                     "runner.run", "injector.stop", "sampler.stop", "capture.stop",
                     "fabric.teardown"]
