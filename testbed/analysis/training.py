"""The metrics of a ``train`` workload, from the per-step lines every rank wrote.

A rank's line (testbed/run/train.py): step, t_start, t_end (monotonic), loss (the step's global
batch under that rank's weights after the step), samples (its shard), under the phase's system
(the backend). Definitions, for the main backend (nezha when it ran, else the first listed):

* a step is *complete* when every rank of the world wrote it; the step time of a step is the
  slowest rank's t_end - t_start (forward, backward with DDP's gradient allreduce, optimizer).
* ``step_time_ms``: median step time over the complete steps at or after ``warmup`` (all
  rounds of the backend).
* ``samples_per_s``: every rank's samples of those steps / the time from the first rank's start
  of the first one to the last rank's end of the last one, per round, summed over rounds (so
  the stalls a fault causes count, where the median leaves them out).
* ``loss_final``: the loss of the last step of the last round (rank 0's; the note says if the
  ranks disagree).
* ``loss_matches_reference``: 1 when, for every backend and round, every step was written by
  every rank, all ranks wrote the same loss and it equals the reference's loss of that step,
  bit for bit; else 0. Reference: the file of ``reference: PATH``, or the fault-free run of the
  same job made first (``reference: auto`` with faults). None (not measured) without one.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from testbed.model.records import IterationRecord, Metrics, is_num
from testbed.model.scenario import Workload

TRAIN_METRICS = ("step_time_ms", "samples_per_s", "loss_final", "loss_matches_reference")


@dataclass
class Step:
    """One step of one round, over the ranks that wrote it."""

    step: int
    t_start: dict[int, float] = field(default_factory=dict)    # rank -> t
    t_end: dict[int, float] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)
    samples: int = 0

    def complete(self, world: int) -> bool:
        return len(self.t_end) >= world

    @property
    def seconds(self) -> float:
        return max(self.t_end[r] - self.t_start[r] for r in self.t_end)

    @property
    def agreed_loss(self) -> Optional[float]:
        """The loss every rank wrote, or None when they differ."""
        vals = set(self.loss.values())
        return vals.pop() if len(vals) == 1 else None


def rounds_by_backend(iterations: Sequence[IterationRecord]) -> dict[str, list[list[Step]]]:
    """{backend: [steps of each round (phase) in step order]} from the ranks' lines."""
    acc: dict[str, dict[Any, dict[int, Step]]] = {}
    for r in iterations:
        step = r.extra.get("step")
        if not isinstance(step, int) or not r.done or r.rank is None:
            continue
        s = acc.setdefault(str(r.system), {}).setdefault(r.phase, {}).setdefault(step, Step(step))
        s.t_start[r.rank], s.t_end[r.rank] = r.t_start, r.t_end
        if is_num(r.extra.get("loss")):
            s.loss[r.rank] = float(r.extra["loss"])
        if is_num(r.extra.get("samples")):
            s.samples += int(r.extra["samples"])
    order = lambda kv: (not isinstance(kv[0], int), kv[0] if isinstance(kv[0], int)  # noqa
                        else str(kv[0]))
    return {b: [[steps[k] for k in sorted(steps)] for _, steps in sorted(phases.items(), key=order)]
            for b, phases in acc.items()}


def timing(rounds: list[list[Step]], world: int, warmup: int) -> tuple[Optional[float],
                                                                        Optional[float]]:
    """(step_time_ms, samples_per_s) of one backend; None where no step counts."""
    times, samples, span = [], 0, 0.0
    for steps in rounds:
        timed = [s for s in steps if s.step >= warmup and s.complete(world)]
        if not timed:
            continue
        times += [s.seconds for s in timed]
        samples += sum(s.samples for s in timed)
        span += max(max(s.t_end.values()) for s in timed) - \
            min(min(s.t_start.values()) for s in timed)
    ms = statistics.median(times) * 1e3 if times else None
    return ms, (samples / span if span > 0 else None)


def reference_losses(workload: Workload, reference: Sequence[IterationRecord], world: int
                     ) -> tuple[dict[str, list[Optional[float]]], str]:
    """{backend: per-step reference loss (None: not agreed or not complete)} and, when there is
    none, why."""
    if workload.reference_losses:
        return {b: list(v) for b, v in workload.reference_losses}, ""
    if workload.reference == "none":
        return {}, "reference: none"
    if not reference:
        return {}, ("no reference: the run has no faults, so reference: auto runs none (give "
                    "reference: PATH, e.g. the train_losses.json of an earlier run)")
    out = {}
    for b, rounds in rounds_by_backend(reference).items():
        steps = rounds[-1]
        out[b] = [s.agreed_loss if s.complete(world) else None for s in steps]
    return out, ""


def matches(rounds: list[list[Step]], ref: Optional[list[Optional[float]]], world: int,
            steps: int) -> tuple[Optional[bool], str]:
    """Whether every round of a backend matches the reference; (None, why) when the reference
    cannot tell, (False, the first difference) when it does not."""
    if ref is None or len(ref) < steps or any(v is None for v in ref[:steps]):
        return None, "the reference has no agreed loss for every step (incomplete reference run)"
    for i, got in enumerate(rounds):
        if len(got) < steps or not all(s.complete(world) for s in got):
            return False, f"round {i}: not every rank wrote all {steps} steps"
        for s in got:
            if s.agreed_loss is None:
                return False, f"round {i} step {s.step}: the ranks' losses differ {s.loss}"
            if s.agreed_loss != ref[s.step]:
                return False, (f"round {i} step {s.step}: loss {s.agreed_loss!r} != reference "
                               f"{ref[s.step]!r}")
    return True, ""


def _by_backend(by: dict, ref: dict, world: int, w: Workload, t0: float) -> dict:
    """Per backend: the figures, the match, and per round the step series the plot draws."""
    out = {}
    for b, rounds in by.items():
        ms, sps = timing(rounds, world, w.warmup)
        ok, why = matches(rounds, ref.get(b), world, w.steps) if b in ref else (None, "")
        out[b] = {"step_time_ms": ms, "samples_per_s": sps, "matches": ok, "mismatch": why,
                  "reference": ref.get(b),
                  "rounds": [[{"step": s.step, "step_ms": s.seconds * 1e3,
                               "loss": s.agreed_loss if s.agreed_loss is not None
                               else s.loss.get(min(s.loss), None) if s.loss else None,
                               "ranks_agree": s.agreed_loss is not None,
                               "complete": s.complete(world),
                               "t_start_rel": min(s.t_start.values()) - t0,
                               "t_end_rel": max(s.t_end.values()) - t0} for s in steps]
                             for steps in rounds]}
    return out


def train_metrics(m: Metrics, workload: Workload, iterations: Sequence[IterationRecord],
                  reference: Sequence[IterationRecord], world: int, t0: float) -> None:
    """Fill the four train metrics of ``m`` (None with a note when not measured) and
    ``m.detail['train']``."""
    by = rounds_by_backend(iterations)
    ref, why_no_ref = reference_losses(workload, reference, world)
    main = "nezha" if "nezha" in workload.backends else workload.backends[0]
    detail = _by_backend(by, ref, world, workload, t0)
    m.detail["train"] = {"main": main, "warmup": workload.warmup, "steps": workload.steps,
                         "world": world, "backends": detail}
    d = detail.get(main)
    if d is None:
        for k in TRAIN_METRICS:
            m.notes[k] = f"no step of {main} was recorded by any rank"
        return
    for k in ("step_time_ms", "samples_per_s"):
        m.values[k] = d[k]
        if d[k] is None:
            m.notes[k] = f"no step after the {workload.warmup} warm-up step(s) was completed " \
                         "by every rank"
    last = by[main][-1][-1] if by[main] and by[main][-1] else None
    if last is None or last.step != workload.steps - 1 or not last.complete(world):
        m.notes["loss_final"] = f"the last step ({workload.steps - 1}) was not completed by " \
                                "every rank"
    else:
        m.values["loss_final"] = last.loss.get(0, next(iter(last.loss.values()), None))
        if last.agreed_loss is None:
            m.notes["loss_final"] = f"rank 0's; the ranks' losses differ: {last.loss}"
    _match(m, workload, detail, why_no_ref)


def _match(m: Metrics, workload: Workload, detail: dict, why_no_ref: str) -> None:
    """loss_matches_reference over every backend the workload lists."""
    if why_no_ref:
        m.notes["loss_matches_reference"] = why_no_ref
        return
    results = []
    for b in workload.backends:
        d = detail.get(b)
        if d is None:
            results.append((False, f"{b}: no step was recorded"))
        elif d["matches"] is None:
            m.notes["loss_matches_reference"] = f"{b}: {d['mismatch'] or 'no reference'}"
            return
        else:
            results.append((d["matches"], f"{b}: {d['mismatch']}" if d["mismatch"] else ""))
    m.values["loss_matches_reference"] = all(ok for ok, _ in results)
    notes = [n for ok, n in results if not ok and n]
    if notes:
        m.notes["loss_matches_reference"] = "; ".join(notes)
