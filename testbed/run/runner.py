"""`run`: from a topology file to a verdict, and everything torn down afterwards.

    spec -> fabric -> (sampler + workload + fault schedule) -> metrics -> verdict -> report
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from testbed.analysis import sampler as measure
from testbed.analysis import metrics as metrics_mod
from testbed.analysis import report
from testbed.analysis import verdict as verdict_mod
from testbed.kernel.capabilities import probe
from testbed.run.capture import Capture
from testbed.fabric.guard import sigterm_as_interrupt
from testbed.fabric.mininet_backend import fabric_class
from testbed.run.faults import FaultInjector
from testbed.model.scenario import build as build_scenario
from testbed.model.spec import Topology, check_capabilities, load
from testbed.run.workload import WorkloadRunner



@dataclass
class RunOutcome:
    passed: bool
    exit_code: int
    results_dir: Path
    metrics: dict
    verdict: object
    faults: list


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_results_dir(topo: Topology) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("results") / f"{topo.name}-{stamp}"


def run_topology(topo: Topology, results_dir: Optional[Path] = None,
                 say: Callable[[str], None] = _say,
                 show: Optional[Callable[[str], None]] = None) -> RunOutcome:
    """Run one topology end to end. ``say``: progress lines (stderr by default); ``show``: the
    summary table and verdict (stdout by default; silent when ``say`` is silenced)."""
    if show is None:
        show = print if say is _say else say
    scenario = build_scenario(topo)
    caps = probe()
    check_capabilities(topo, caps)
    out = Path(results_dir or default_results_dir(topo))
    out.mkdir(parents=True, exist_ok=True)
    ranks_dir = out / "ranks"
    ranks_dir.mkdir(exist_ok=True)

    say(f"== {topo.name}: {len(topo.hosts)} hosts x {len(topo.rails)} rails "
        f"({', '.join(f'{r.name} {r.shape.describe()}' for r in topo.rails)}); results in {out}")
    fabric = fabric_class(topo)(topo, caps, progress=lambda m: say(f"   build: {m}"))
    capture: Optional[Capture] = None
    guard = sigterm_as_interrupt()
    guard.__enter__()
    injector: Optional[FaultInjector] = None
    sampler = None
    try:
        fabric.build()
        say(f"   fabric up in {fabric.build_seconds * 1000:.0f} ms (run id {fabric.state.run_id})")
        if scenario.capture:
            capture = Capture(fabric, out / "pcap", max_mb=scenario.capture_mb).start()
            say(f"   capturing every rail to {out / 'pcap'} (cap {scenario.capture_mb} MB each)")
        sampler = measure.Sampler(fabric)
        runner = WorkloadRunner(fabric, scenario.workload, ranks_dir, progress=say) \
            if scenario.workload else None
        injector = FaultInjector(fabric, scenario.faults,
                                 kill=runner.kill if runner else None)
        sampler.start()
        t0 = time.monotonic()
        injector.start(t0)
        for f in scenario.faults:
            say(f"   fault scheduled at {f.at:g}s: {f.label}"
                + (f" for {f.duration:g}s" if f.duration else ""))
        phase_results = []
        if runner:
            def on_phase(i, n, phase):
                what = "command" if phase.system == "command" else \
                    f"{phase.system} allreduce {phase.size} B"
                say(f"   workload {i + 1}/{n}: {what} on {len(runner.hosts)} ranks")
            phase_results = runner.run(on_phase)
        else:
            last = max((f.at + (f.duration or 0) for f in scenario.faults), default=0.0)
            time.sleep(max(0.0, t0 + last + 0.5 - time.monotonic()))
        injector.stop()
        samples = sampler.stop()
        sampler = None
        if capture is not None:
            capture.stop()
            capture = None
        t_end = time.monotonic()
        say(f"   workload done in {t_end - t0:.1f} s; computing metrics")

        iterations = [r for p in phase_results for r in p.iterations]
        events = [e for p in phase_results for e in p.events]
        ranks = [dict(r, phase=i) for i, p in enumerate(phase_results) for r in p.ranks]
        extra = {"rank_errors": sum(1 for r in ranks if r["exit_code"] not in (0, None)
                                    and not r["killed"]),
                 "timed_out": any(p.timed_out for p in phase_results),
                 "phases": [{"system": p.phase.system, "size": p.phase.size,
                             "t_start": p.t_start, "t_end": p.t_end} for p in phase_results],
                 "fault_errors": list(injector.errors)}
        m = metrics_mod.compute(topo, scenario, samples, iterations, events, injector.records,
                                t0, extra=extra)
        v = verdict_mod.judge(scenario.expect, m)
        timeline = measure.Timeline.merge(samples=samples, faults=injector.records,
                                          events=events, iterations=iterations, t0=t0)
        report.write(out, topo, scenario, m, v, samples, timeline, injector.records,
                     compare=extra["phases"] if scenario.workload and
                     scenario.workload.kind in ("compare", "sweep") else None)
        (out / "ranks.json").write_text(json.dumps(ranks, indent=1))
        say("")
        show(report.summary_table(m, v))
        for r in ranks:
            if r["error"] and not r["killed"]:
                say(f"   rank {r['rank']} on {r['host']} exited {r['exit_code']}: {r['error']}")
        for e in injector.errors:
            say(f"   {e}")
        passed = v.passed and not injector.errors
        code = 0 if passed else 1
        show(f"verdict: {'PASS' if passed else 'FAIL'} — results in {out}")
        return RunOutcome(passed, code, out, m, v, injector.records)
    finally:
        if injector is not None:
            injector.stop()
        if sampler is not None:
            sampler.stop()
        if capture is not None:
            capture.stop()
        t = fabric.teardown()
        say(f"   fabric torn down in {t * 1000:.0f} ms")
        guard.__exit__(None, None, None)


def run_file(path, results_dir=None, backend: Optional[str] = None,
             capture: bool = False) -> int:
    topo = load(path)
    if backend and backend != topo.backend:
        topo = replace(topo, backend=backend)
    if capture:
        topo = replace(topo, sections={**topo.sections, "capture": True})
    outcome = run_topology(topo, Path(results_dir) if results_dir else None)
    return outcome.exit_code
