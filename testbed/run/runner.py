"""`run`: from a topology file to a verdict, and everything torn down afterwards.

    spec -> fabric -> (sampler + workload + fault schedule) -> metrics -> verdict -> report

Each stage is a short function; what a stage builds is entered on an ``ExitStack`` as soon as it
exists, so on any exit (an error, Ctrl-C, SIGTERM turned into KeyboardInterrupt) it is undone
in reverse order: fault injector, sampler, capture, fabric, signal guard.
"""
from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from testbed.analysis import metrics as metrics_mod
from testbed.analysis import report
from testbed.analysis import verdict as verdict_mod
from testbed.analysis.sampler import Sampler, Samples
from testbed.analysis.timeline import Timeline
from testbed.fabric.guard import sigterm_as_interrupt
from testbed.fabric.mininet_backend import fabric_class
from testbed.kernel.capabilities import probe
from testbed.model.records import FaultRecord, FlowRecord, IterationRecord, Metrics, Verdict
from testbed.model.scenario import Scenario
from testbed.model.scenario import build as build_scenario
from testbed.model.spec import Topology, check_capabilities, load
from testbed.run.capture import Capture
from testbed.run.faults import FaultInjector
from testbed.run.traffic import TrafficFlows
from testbed.run.workload import PhaseResult, WorkloadRunner, reference_phases

Say = Callable[[str], None]


@dataclass
class RunOutcome:
    """What a run returns: ``metrics["failover_ms"]``, ``verdict.failures``, ``passed``."""

    passed: bool
    exit_code: int
    results_dir: Path
    metrics: Metrics
    verdict: Verdict
    faults: list[FaultRecord]


@dataclass
class Observed:
    """What the run observed between the start of the sampler and the end of the workload."""

    t0: float
    samples: Samples
    phases: list[PhaseResult]
    faults: list[FaultRecord]
    fault_errors: list[str]
    flows: list[FlowRecord] = field(default_factory=list)   # traffic faults' competing flows
    reference: list[PhaseResult] = field(default_factory=list)   # train: the fault-free run

    @property
    def iterations(self) -> list[IterationRecord]:
        return [r for p in self.phases for r in p.iterations]

    @property
    def events(self) -> list[dict]:
        return [e for p in self.phases for e in p.events]

    @property
    def ranks(self) -> list[dict]:
        """Every rank of every phase, the reference run's (phase "ref-I") first."""
        return [dict(r, phase=f"ref-{i}") for i, p in enumerate(self.reference)
                for r in p.ranks] + \
            [dict(r, phase=i) for i, p in enumerate(self.phases) for r in p.ranks]


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_results_dir(topo: Topology) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("results") / f"{topo.name}-{stamp}"


def _results_dir(topo: Topology, results_dir: Optional[Path]) -> Path:
    out = Path(results_dir or default_results_dir(topo))
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranks").mkdir(exist_ok=True)
    return out


# ----------------------------------------------------------------------------- stages
def _build_fabric(stack: ExitStack, topo: Topology, caps, say: Say):
    """The fabric, built; its teardown is on the stack before the build starts, so a build
    that fails half-way is removed too."""
    fabric = fabric_class(topo)(topo, caps, progress=lambda m: say(f"   build: {m}"))

    def teardown() -> None:
        t = fabric.teardown()
        say(f"   fabric torn down in {t * 1000:.0f} ms")
    stack.callback(teardown)
    fabric.build()
    say(f"   fabric up in {fabric.build_seconds * 1000:.0f} ms (run id {fabric.state.run_id})")
    return fabric


def _run_workload(runner: Optional[WorkloadRunner], scenario: Scenario, t0: float,
                  say: Say) -> list[PhaseResult]:
    """Every phase of the workload; without one, wait until the last fault has ended."""
    if runner is None:
        last = max((f.at + (f.duration or 0) for f in scenario.faults), default=0.0)
        time.sleep(max(0.0, t0 + last + 0.5 - time.monotonic()))
        return []

    def on_phase(i, n, phase):
        what = "command" if phase.system == "command" else \
            f"{phase.system} training" if scenario.workload.kind == "train" else \
            f"{phase.system} allreduce {phase.size} B"
        say(f"   workload {i + 1}/{n}: {what} on {len(runner.hosts)} ranks")
    return runner.run(on_phase)


def _run_reference(runner: Optional[WorkloadRunner], scenario: Scenario,
                   say: Say) -> list[PhaseResult]:
    """train with faults and ``reference: auto``: the same job without faults, first, on the
    same fabric; before the fault schedule's t0, so no fault can reach it."""
    plan = reference_phases(scenario.workload, scenario.faults) if runner else []
    if not plan:
        return []

    def on_phase(i, n, phase):
        say(f"   reference {i + 1}/{n}: {phase.system} training, no faults, on "
            f"{len(runner.hosts)} ranks")
    return runner.run(on_phase, plan)


def _observe(fabric, scenario: Scenario, out: Path, say: Say) -> Observed:
    """Capture, sampler and fault schedule around the workload. Their own stack closes when
    the workload ends (faults undone, last sample taken, pcap files complete) or on any
    error, before the fabric's teardown."""
    with ExitStack() as stack:
        if scenario.capture:
            capture = Capture(fabric, out / "pcap", max_mb=scenario.capture_mb).start()
            stack.callback(capture.stop)
            say(f"   capturing every rail to {out / 'pcap'} (cap {scenario.capture_mb} MB each)")
        sampler = Sampler(fabric)
        stack.callback(sampler.stop)
        runner = WorkloadRunner(fabric, scenario.workload, out / "ranks", progress=say) \
            if scenario.workload else None
        traffic = TrafficFlows(fabric, out / "traffic", fabric.caps.congestion_control(
            fabric.topo)) if any(f.action == "traffic" for f in scenario.faults) else None
        injector = FaultInjector(fabric, scenario.faults, kill=runner.kill if runner else None,
                                 traffic=traffic)
        stack.callback(injector.stop)
        reference = _run_reference(runner, scenario, say)
        sampler.start()
        t0 = time.monotonic()
        injector.start(t0)
        for f in scenario.faults:
            say(f"   fault scheduled at {f.at:g}s: {f.label}"
                + (f" for {f.duration:g}s" if f.duration else ""))
        phases = _run_workload(runner, scenario, t0, say)
    say(f"   workload done in {time.monotonic() - t0:.1f} s; computing metrics")
    if injector.timing():
        say(f"   {injector.timing()}")
    return Observed(t0, sampler.stop(), phases, injector.records, list(injector.errors),
                    injector.flow_records, reference)


def _analyse(topo: Topology, scenario: Scenario, obs: Observed) -> report.RunResults:
    """Metrics, verdict, and what the results folder is written from."""
    ranks = obs.ranks
    phases = [{"system": p.phase.system, "size": p.phase.size, "t_start": p.t_start,
               "t_end": p.t_end} for p in obs.phases]
    extra = {"rank_errors": sum(1 for r in ranks if r["exit_code"] not in (0, None)
                                and not r["killed"]),
             "timed_out": any(p.timed_out for p in obs.phases),
             "phases": phases, "fault_errors": obs.fault_errors,
             "train_reference": [r for p in obs.reference for r in p.iterations]}
    iterations, events = obs.iterations, obs.events
    m = metrics_mod.compute(topo, scenario, obs.samples, iterations, events, obs.faults,
                            obs.t0, extra=extra, flows=obs.flows)
    v = verdict_mod.judge(scenario.expect, m)
    timeline = Timeline.merge(samples=obs.samples, faults=obs.faults, events=events,
                              iterations=iterations, t0=obs.t0, flows=obs.flows,
                              rails=topo.rail_order)
    compare = scenario.workload and scenario.workload.kind in ("compare", "sweep")
    results = report.RunResults(topo, scenario, m, v, obs.faults, obs.samples, timeline,
                                phases=phases if compare else None, flows=obs.flows)
    return results


def _conclude(out: Path, obs: Observed, results: report.RunResults, say: Say,
              show: Say) -> RunOutcome:
    """Write the results folder, show the table and the verdict."""
    report.write(out, results)
    ranks = obs.ranks
    (out / "ranks.json").write_text(json.dumps(ranks, indent=1))
    say("")
    show(report.summary_table(results.metrics, results.verdict))
    for r in ranks:
        if r["error"] and not r["killed"]:
            say(f"   rank {r['rank']} on {r['host']} exited {r['exit_code']}: {r['error']}")
    for e in obs.fault_errors:
        say(f"   {e}")
    timed_out = [p for p in obs.phases if p.timed_out]
    for p in timed_out:
        say(f"   {p.phase.system} did not finish within workload.timeout "
            f"({p.t_end - p.t_start:.0f} s): its ranks still running were killed; raise "
            f"workload.timeout (or lower iterations / size) for a run this long")
    # a workload cut short proves nothing, whatever the expectations say
    passed = results.verdict.passed and not obs.fault_errors and not timed_out
    show(f"verdict: {'PASS' if passed else 'FAIL'} — results in {out}")
    return RunOutcome(passed, 0 if passed else 1, out, results.metrics, results.verdict,
                      obs.faults)


def run_topology(topo: Topology, results_dir: Optional[Path] = None, say: Say = _say,
                 show: Optional[Say] = None) -> RunOutcome:
    """Run one topology end to end. ``say``: progress lines (stderr by default); ``show``: the
    summary table and verdict (stdout by default; silent when ``say`` is silenced)."""
    if show is None:
        show = print if say is _say else say
    scenario = build_scenario(topo)
    caps = probe()
    check_capabilities(topo, caps)
    out = _results_dir(topo, results_dir)
    say(f"== {topo.name}: {len(topo.hosts)} hosts x {len(topo.rails)} rails "
        f"({', '.join(f'{r.name} {r.shape.describe()}' for r in topo.rails)}); results in {out}")
    with ExitStack() as stack:
        stack.enter_context(sigterm_as_interrupt())
        fabric = _build_fabric(stack, topo, caps, say)
        obs = _observe(fabric, scenario, out, say)
        return _conclude(out, obs, _analyse(topo, scenario, obs), say, show)


def run_file(path, results_dir=None, backend: Optional[str] = None,
             capture: bool = False) -> int:
    topo = load(path)
    if backend and backend != topo.backend:
        topo = replace(topo, backend=backend)
    if capture:
        topo = replace(topo, sections={**topo.sections, "capture": True})
    outcome = run_topology(topo, Path(results_dir) if results_dir else None)
    return outcome.exit_code
