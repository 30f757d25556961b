"""Measure detection / failover / recovery per fault kind (the README's failover table).

    sudo .venv/bin/python scripts/failover_table.py --hosts 3 --rails 2 [--rate 200mbit]
        [--repeat N] [--results DIR] [kinds...]

"hit iteration +ms" is how much longer the iteration in flight at the fault took than the
median iteration (failover.iteration_stall). Each kind is one testbed run of the scenario tests/test_failover.py uses (16 MiB allreduce on
rails of 200 Mbit/s unless --rate says otherwise, fault at 3 s for 3 s); the table prints the median over --repeat runs and
the worst value."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_failover import FAULTS, topology  # noqa: E402

from testbed.model import spec  # noqa: E402
from testbed.run.runner import run_topology  # noqa: E402

COLS = ("detection_ms", "failover_ms", "iteration_stall_ms", "recovery_ms")


def fmt(vals: list) -> str:
    got = [v for v in vals if v is not None]
    if not got:
        return "-"
    med = statistics.median(got)
    return f"{med:.0f}" + (f" (max {max(got):.0f})" if len(got) > 1 else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--rails", type=int, default=2)
    ap.add_argument("--rate", default="200mbit", help="every rail's rate (a topology bandwidth)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write every run's metrics here")
    ap.add_argument("--results", type=Path,
                    help="keep each run's results (event logs, plots) in RESULTS/KIND-N")
    ap.add_argument("kinds", nargs="*", default=list(FAULTS))
    a = ap.parse_args()
    rows, dump = [], {}
    for kind in a.kinds:
        vals: dict[str, list] = {c: [] for c in COLS + ("wrong_results", "iterations_lost")}
        passed = 0
        for i in range(a.repeat):
            topo = spec.loads(topology(kind, a.hosts, a.rails, a.rate))
            if a.results:
                out = run_topology(topo, a.results / f"{kind}-{i + 1}", say=lambda m: None)
            else:
                with tempfile.TemporaryDirectory() as d:
                    out = run_topology(topo, Path(d) / topo.name, say=lambda m: None)
            m = dict(out.metrics)
            stalls = [f.iteration_stall_ms for f in out.metrics.faults
                      if f.iteration_stall_ms is not None]
            m["iteration_stall_ms"] = max(stalls) if stalls else None
            for c in vals:
                vals[c].append(m.get(c))
            passed += out.passed
            dump.setdefault(kind, []).append({c: m.get(c) for c in vals} | {
                "passed": out.passed, "failures": out.verdict.failures,
                "notes": {c: out.metrics.notes[c] for c in COLS if c in out.metrics.notes}})
            print(f"{kind} #{i + 1}: " + ", ".join(f"{c}={m.get(c)}" for c in vals)
                  + ("" if out.passed else f"  FAIL {out.verdict.failures}"), flush=True)
        rows.append((kind, *(fmt(vals[c]) for c in COLS),
                     str(sum(v or 0 for v in vals["wrong_results"])),
                     str(sum(v or 0 for v in vals["iterations_lost"])), f"{passed}/{a.repeat}"))
    head = ("fault", "detection ms", "failover ms", "hit iteration +ms", "recovery ms", "wrong",
            "lost", "passed")
    w = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    print(f"\n{a.hosts} hosts x {a.rails} rails of {a.rate}, 16 MiB allreduce, "
          f"median (max) of {a.repeat}")
    for r in [head] + rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)))
    if a.json:
        a.json.write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
