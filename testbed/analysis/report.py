"""The results folder and the terminal summary.

``write`` produces, in ``results_dir``:
  results.json            metrics (with notes and detail), verdict, fault records, versions, timings
                          (the JSON of the records in testbed.model.records)
  samples.csv             kernel counters per link per sample (t in s since t0)
  timeline.jsonl          every kernel observation, fault, Nezha event and iteration, by time
  topology.resolved.yaml  the topology as resolved (Topology.to_dict())
  throughput.png          goodput per rail over time, faults shaded and labelled; with a traffic
                          fault, each loaded rail's competing flows and its workload apart
  split.png               Nezha's split over time (from its events) against each rail's share of
                          the capacity (from the shape and the fault schedule), when Nezha ran
  latency.png             iteration latency over time, wrong results marked
  busbw.png               bus bandwidth by message size per system (compare/sweep only)
  train.png               train: loss and step time per step, one line per backend, the
                          reference's losses dashed, the steps a fault overlapped shaded
  train_losses.json       train: {backend: [loss of each step]} (last round), usable as
                          another run's ``reference: PATH``
  mptcp_summary.txt       when the mptcp system ran: its subflows and, per fault, what the path
                          manager and counters showed (testbed/analysis/mptcp.py; the events
                          are in mptcp_events.jsonl, given ``t``; results.json ``mptcp``)
"""
from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import yaml

from testbed.analysis.sampler import Samples
from testbed.analysis.timeline import Timeline
from testbed.model.records import (DEGRADING, FaultRecord, FlowRecord, Metrics, Verdict,
                                   format_value, jsonable)
from testbed.model.scenario import METRICS, SHARE_PREFIX, SIZED_PREFIX

# a fault without an end that leaves its mark until the end of the run (a flap always ends)
_UNENDED = ("link-down", "blackhole") + DEGRADING


@dataclass
class RunResults:
    """Everything one run leaves for the results folder. ``phases``: the workload phases
    [{system, size, t_start, t_end}] of a compare or sweep run (shaded on the throughput plot);
    ``timings``: seconds per stage, written as they are."""

    topo: Any
    scenario: Any
    metrics: Metrics
    verdict: Verdict
    faults: list[FaultRecord] = field(default_factory=list)
    samples: Optional[Samples] = None
    timeline: Optional[Timeline] = None
    phases: Optional[list[dict]] = None
    timings: dict = field(default_factory=dict)
    flows: list[FlowRecord] = field(default_factory=list)


def versions() -> dict:
    out = {"python": sys.version.split()[0], "kernel": platform.release(),
           "machine": platform.machine()}
    for mod in ("numpy", "matplotlib", "pyroute2", "yaml"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = None
    try:
        root = Path(__file__).resolve().parents[2]
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                           text=True, timeout=5)
        out["git"] = r.stdout.strip() or None
    except Exception:
        out["git"] = None
    return out


def _t0(run: RunResults) -> float:
    t0 = run.metrics.detail.get("t0")
    if t0 is None and run.timeline is not None:
        t0 = getattr(run.timeline, "t0", None)
    if t0 is None:
        ts = [f.t_applied for f in run.faults if f.t_applied is not None]
        t0 = min(ts) if ts else 0.0
    return float(t0)


def _write_data(out: Path, run: RunResults, t0: float) -> dict[str, Path]:
    """samples.csv, timeline.jsonl, topology.resolved.yaml (empty ones when nothing was
    recorded, so a results folder always has the same files)."""
    p = out / "samples.csv"
    if run.samples is not None:
        run.samples.to_csv(p, t0=t0)
    else:
        p.write_text("t,link,host,rail,tx_bytes,rx_bytes,tx_packets,rx_packets,rx_dropped,"
                     "tx_dropped,up\n")
    written = {"samples": p}
    p = out / "timeline.jsonl"
    if run.timeline is not None:
        run.timeline.write(p)
    else:
        p.write_text("")
    written["timeline"] = p
    p = out / "topology.resolved.yaml"
    p.write_text(yaml.safe_dump(jsonable(run.topo.to_dict()), sort_keys=False))
    written["topology"] = p
    return written


def _write_plots(out: Path, run: RunResults, t0: float) -> dict[str, Path]:
    """throughput.png, latency.png, and busbw.png when there is a size sweep or several
    systems."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    m = run.metrics
    written = {"throughput": plot_throughput(out / "throughput.png", run.topo, m, run.samples,
                                             run.faults, t0, run.phases, run.flows),
               "latency": plot_latency(out / "latency.png", m, run.faults, t0)}
    if (m.detail.get("split") or {}).get("nezha"):
        written["split"] = plot_split(out / "split.png", run.topo, m, run.faults, t0)
    if m.detail.get("train"):
        written["train"] = plot_train(out / "train.png", run.topo, m, run.faults, t0)
    bw = m.detail.get("busbw_by_system") or {}
    if run.phases or len(bw) > 1 or any(len(v) > 1 for v in bw.values()):
        written["busbw"] = plot_busbw(out / "busbw.png", run.topo, m)
    return written


def write(results_dir, run: RunResults) -> dict:
    """Write the whole results folder; returns {kind: path} of what was written."""
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_begin = time.monotonic()
    t0 = _t0(run)
    written = _write_data(out, run, t0)
    written.update(_write_plots(out, run, t0))
    m = run.metrics
    from testbed.analysis import mptcp as mptcp_evidence
    mptcp = mptcp_evidence.report(out, t0, run.faults)   # the mptcp system ran: its events
    if mptcp is not None:
        written["mptcp_events"] = out / "mptcp_events.jsonl"
        written["mptcp_summary"] = out / "mptcp_summary.txt"
    if m.detail.get("train"):
        written["train_losses"] = write_train_losses(out / "train_losses.json", m)
    p = out / "results.json"
    doc = {"topology": run.topo.name, "t0": t0, "metrics": dict(m.values), "notes": m.notes,
           "verdict": run.verdict.to_dict(),
           "faults": [dict(f.to_dict(), t_applied_rel=(f.t_applied - t0)
                           if f.t_applied is not None else None) for f in run.faults],
           "detail": m.detail_dict(), "phases": run.phases,
           "sampler": m.detail.get("sampler"),
           "versions": versions(),
           "timings": dict(run.timings, report_s=time.monotonic() - t_begin),
           "files": {k: v.name for k, v in written.items()}}
    if mptcp is not None:       # only a run of the mptcp system has one
        doc["mptcp"] = mptcp
    p.write_text(json.dumps(jsonable(doc), indent=1))
    written["results"] = p
    return written


# ----------------------------------------------------------------------------------- plots
def _fault_spans(ax, faults: Sequence[FaultRecord], t0: float, t_max: float) -> None:
    colours = ["tab:red", "tab:purple", "tab:brown", "tab:olive", "tab:pink"]
    for i, f in enumerate(sorted((f for f in faults if f.t_applied is not None),
                                 key=lambda f: f.t_applied)):
        c = colours[i % len(colours)]
        a = f.t_applied - t0
        label = f.label or f.action or "fault"
        if f.t_end is not None:
            ax.axvspan(a, f.t_end - t0, color=c, alpha=0.12, lw=0)
            ax.axvline(f.t_end - t0, color=c, ls=":", lw=1)
        elif f.action in _UNENDED:
            ax.axvspan(a, t_max, color=c, alpha=0.08, lw=0)
        ax.axvline(a, color=c, ls="--", lw=1.2)
        for tog in f.toggles:
            if tog.t is not None:
                ax.axvline(tog.t - t0, color=c, ls=":", lw=0.8,
                           alpha=0.9 if tog.state == "down" else 0.5)
        ax.annotate(f"{label} @ {a:.2f}s", xy=(a, 1.0), xycoords=ax.get_xaxis_transform(),
                    xytext=(3, -3 - 11 * (i % 4)), textcoords="offset points", fontsize=8,
                    color=c, va="top")


def plot_throughput(path: Path, topo, metrics: Metrics, samples: Optional[Samples],
                    faults: Sequence[FaultRecord], t0: float, phases=None,
                    flows: Sequence[FlowRecord] = ()) -> Path:
    import matplotlib.pyplot as plt
    from testbed.analysis.competing import competing_bps, workload_bps
    from testbed.analysis.metrics import BIN_S
    fig, ax = plt.subplots(figsize=(11, 4.8), dpi=110)
    t_max = 1.0
    if samples:
        rates = samples.rates(BIN_S, start=t0 + math.ceil((samples.span[0] - t0) / BIN_S)
                              * BIN_S)
        x = rates.centers - t0
        t_max = float(x[-1]) if len(x) else 1.0
        comp = competing_bps(rates, flows) if flows else {}
        work = workload_bps(rates, comp)
        for i, r in enumerate([rl.name for rl in topo.rails]):
            if r not in rates.rail_bps:
                continue
            c = f"C{i}"
            if r in comp:    # the workload's part (rail minus flows), the flows, and the rail
                ax.plot(x, work[r] / 1e6, lw=1, color=c, label=f"rail {r}: workload")
                ax.plot(x, comp[r] / 1e6, lw=1.2, ls="--", color=c,
                        label=f"rail {r}: competing flows (their receivers' count)")
                ax.plot(x, rates.rail_bps[r] / 1e6, lw=0.6, color=c, alpha=0.35,
                        label=f"rail {r}: all (kernel)")
            else:
                ax.plot(x, rates.rail_bps[r] / 1e6, lw=1, color=c, label=f"rail {r}")
        if len(rates.rail_bps) > 1:
            ax.plot(x, rates.total_bps / 1e6, lw=1, color="0.3", alpha=0.6, label="total")
    else:
        ax.text(0.5, 0.5, "no kernel samples", transform=ax.transAxes, ha="center")
    ax.set_ylim(bottom=0)
    if ax.get_ylim()[1] <= 0:
        ax.set_ylim(0, 1)
    for p in phases or ():
        if p.get("t_start") is not None and p.get("t_end") is not None:
            ax.axvspan(p["t_start"] - t0, p["t_end"] - t0, color="0.9", alpha=0.3, lw=0)
            ax.text(p["t_start"] - t0, 0, f" {p.get('system')} {p.get('size')}", fontsize=7,
                    rotation=90, va="bottom", color="0.4")
    _fault_spans(ax, faults, t0, t_max)
    ax.set_xlabel("time since start of run (s)")
    ax.set_ylabel("goodput, bytes delivered to hosts (Mbit/s)")
    ax.set_title(f"{topo.name}: goodput per rail ({BIN_S * 1e3:.0f} ms bins, kernel counters);"
                 " dashed = fault applied, dotted = fault end")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _steps(series: Sequence[dict], t_max: float) -> tuple[list[float], list[list[float]]]:
    """x and per-rail y of a step line from [{t_rel, shares}], held to t_max."""
    xs = [s["t_rel"] for s in series] + [max(t_max, series[-1]["t_rel"])]
    ys = [[s["shares"][i] for s in series] + [series[-1]["shares"][i]]
          for i in range(len(series[0]["shares"]))]
    return xs, ys


def plot_split(path: Path, topo, metrics: Metrics, faults: Sequence[FaultRecord],
               t0: float) -> Path:
    """Nezha's split (solid steps, from its events) against each rail's share of the capacity
    (dashed steps, the optimum split under the faults active), the 10 % band around it, and
    the workload's measured share per 200 ms (dots, kernel counters minus competing flows)."""
    import matplotlib.pyplot as plt
    sp = metrics.detail.get("split") or {}
    nez, cap = sp.get("nezha") or [], sp.get("capacity") or []
    good = metrics.detail.get("goodput") or {}
    t_rel = good.get("t_rel") or []
    t_max = max([t_rel[-1] if t_rel else 0.0] + [s["t_rel"] for s in nez + cap])
    fig, ax = plt.subplots(figsize=(11, 4.8), dpi=110)
    rails = [r.name for r in topo.rails]
    if cap:
        xs, ys = _steps(cap, t_max)
        for i, y in enumerate(ys):
            ax.step(xs, y, where="post", ls="--", lw=1.4, color=f"C{i}",
                    label=f"{rails[i]}: capacity share (optimum)")
            ax.fill_between(xs, [v - 0.1 for v in y], [v + 0.1 for v in y], step="post",
                            color=f"C{i}", alpha=0.08, lw=0)
    xs, ys = _steps(nez, t_max)
    for i, y in enumerate(ys):
        ax.step(xs, y, where="post", lw=2, color=f"C{i}", label=f"{rails[i]}: Nezha's split")
    work = good.get("workload_mbps") or good.get("rails_mbps") or {}
    if t_rel and all(r in work for r in rails):
        k = 10      # 10 bins of 20 ms
        n = len(t_rel) // k
        arr = np.array([work[r][:n * k] for r in rails], dtype=float).reshape(len(rails), n, k)
        tot = np.nansum(arr, axis=(0, 2))
        ok = tot > 0.05 * np.nanmax(tot) if n and np.nanmax(tot) > 0 else np.zeros(n, bool)
        xm = np.array(t_rel[:n * k]).reshape(n, k).mean(axis=1)
        for i in range(len(rails)):
            share = np.nansum(arr[i], axis=1) / np.where(tot > 0, tot, 1)
            ax.plot(xm[ok], share[ok], ".", ms=3, color=f"C{i}", alpha=0.5,
                    label=f"{rails[i]}: measured share (200 ms)")
    _fault_spans(ax, faults, t0, t_max)
    for c in sp.get("changes") or []:
        if c.get("adaptation_ms") is not None:
            ax.annotate(f"{c['adaptation_ms']:.0f} ms", xy=(c["t_rel"], 0.02), fontsize=8,
                        color="0.2")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("time since start of run (s)")
    ax.set_ylabel("share of the allreduce's bytes")
    ax.set_title(f"{topo.name}: Nezha's split (its weights events, rank {sp.get('rank')}) vs the "
                 f"rails' capacity share; band = +-10 %")
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_train_losses(path: Path, metrics: Metrics) -> Path:
    """{backend: [loss per step]} of each backend's last round (None: ranks disagreed)."""
    by = metrics.detail["train"]["backends"]
    doc = {b: [s["loss"] if s["ranks_agree"] else None for s in d["rounds"][-1]]
           for b, d in by.items() if d["rounds"]}
    path.write_text(json.dumps(doc, indent=1))
    return path


def _fault_steps(ax, faults: Sequence[FaultRecord], rounds: list[list[dict]], t0: float,
                 t_max: float) -> None:
    """Shade the steps (x = step) whose time overlapped a fault, in the fault's colour."""
    colours = ["tab:red", "tab:purple", "tab:brown", "tab:olive", "tab:pink"]
    for i, f in enumerate(sorted((f for f in faults if f.t_applied is not None),
                                 key=lambda f: f.t_applied)):
        a = f.t_applied - t0
        b = (f.t_end - t0) if f.t_end is not None else t_max
        label = f"{f.label or f.action} @ {a:.2f}s"
        for steps in rounds:
            hit = [s["step"] for s in steps if s["t_end_rel"] >= a and s["t_start_rel"] <= b]
            if hit:
                ax.axvspan(min(hit) - 0.5, max(hit) + 0.5, color=colours[i % len(colours)],
                           alpha=0.15, lw=0, label=label)
                label = None


def plot_train(path: Path, topo, metrics: Metrics, faults: Sequence[FaultRecord],
               t0: float) -> Path:
    """Loss (top) and the slowest rank's step time (bottom) per step, one line per backend
    (each round), the reference's losses dashed; steps during a fault shaded."""
    import matplotlib.pyplot as plt
    tr = metrics.detail["train"]
    fig, (ax_l, ax_t) = plt.subplots(2, 1, figsize=(11, 6.4), dpi=110, sharex=True)
    t_max = max([s["t_end_rel"] for d in tr["backends"].values() for r in d["rounds"]
                 for s in r] or [1.0])
    for i, (b, d) in enumerate(sorted(tr["backends"].items())):
        c = f"C{i}"
        for k, steps in enumerate(d["rounds"]):
            lab = b if k == 0 else None
            ax_l.plot([s["step"] for s in steps], [s["loss"] for s in steps], ".-", color=c,
                      lw=1, ms=3, label=lab)
            ax_t.plot([s["step"] for s in steps], [s["step_ms"] for s in steps], ".-", color=c,
                      lw=1, ms=3, label=f"{b}: median {d['step_time_ms']:.0f} ms"
                      if lab and d["step_time_ms"] is not None else lab)
        if d.get("reference"):
            ax_l.plot(range(len(d["reference"])), d["reference"], "--", color=c, lw=1.5,
                      alpha=0.5, label=f"{b}: reference")
    rounds = [r for d in tr["backends"].values() for r in d["rounds"]]
    for ax in (ax_l, ax_t):
        _fault_steps(ax, faults, rounds, t0, t_max)
    if tr.get("warmup"):
        ax_t.axvspan(-0.5, tr["warmup"] - 0.5, color="0.85", alpha=0.5, lw=0,
                     label="warm-up (not in the median)")
    ax_l.set_ylabel("loss (global batch)")
    ax_t.set_ylabel("step time, slowest rank (ms)")
    ax_t.set_xlabel("step")
    ax_t.set_ylim(bottom=0)
    ax_l.set_title(f"{topo.name}: DDP training, {tr['world']} ranks"
                   + (" (shaded: steps during a fault)" if faults else ""))
    for ax in (ax_l, ax_t):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_latency(path: Path, metrics: Metrics, faults: Sequence[FaultRecord], t0: float) -> Path:
    import matplotlib.pyplot as plt
    its = [r for r in metrics.detail.get("iterations", [])
           if r.get("t_rel") is not None and r.get("latency_ms") is not None]
    fig, ax = plt.subplots(figsize=(11, 4.2), dpi=110)
    if its:
        groups: dict[str, list[dict]] = {}
        for r in its:
            groups.setdefault(f"{r['system']} {r['bytes']} B", []).append(r)
        for name, rs in groups.items():
            ax.plot([r["t_rel"] for r in rs], [r["latency_ms"] for r in rs], ".-", lw=0.8,
                    ms=3, label=name)
        bad = [r for r in its if not r["ok"]]
        if bad:
            ax.scatter([r["t_rel"] for r in bad], [r["latency_ms"] for r in bad], marker="x",
                       s=60, color="red", zorder=5, label=f"wrong result ({len(bad)})")
        inc = [r for r in its if not r["complete"]]
        if inc:
            ax.scatter([r["t_rel"] for r in inc], [r["latency_ms"] for r in inc], marker="o",
                       facecolors="none", edgecolors="orange", s=50, zorder=5,
                       label=f"not completed by every rank ({len(inc)})")
        lat = [r["latency_ms"] for r in its if r["latency_ms"] > 0]
        if lat and max(lat) / min(lat) > 20:
            ax.set_yscale("log")
        else:
            ax.set_ylim(0, max(lat or [1]) * 1.15)
        t_max = max(r["t_rel"] for r in its)
    else:
        ax.text(0.5, 0.5, "no iteration records", transform=ax.transAxes, ha="center")
        t_max = 1.0
    _fault_spans(ax, faults, t0, t_max)
    ax.set_xlabel("iteration start, time since start of run (s)")
    ax.set_ylabel("iteration latency, slowest rank (ms)")
    ax.set_title("allreduce iteration latency (x = wrong result)")
    ax.grid(alpha=0.3, which="both")
    if its:
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_busbw(path: Path, topo, metrics: Metrics) -> Path:
    import matplotlib.pyplot as plt
    detail = metrics.detail
    bw = detail.get("busbw_by_system") or {}
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for system, sizes in sorted(bw.items()):
        xs = sorted(int(s) for s in sizes)
        ys = [sizes[s]["median_mbps"] if s in sizes else sizes[str(s)]["median_mbps"]
              for s in xs]
        ax.plot(xs, ys, "o-", label=system)
    nominal = detail.get("nominal_mbps") or {}
    if nominal and all(nominal.values()):
        ax.axhline(sum(nominal.values()), color="0.4", ls="--", lw=1, label="sum of rail rates")
        ax.axhline(max(nominal.values()), color="0.6", ls=":", lw=1, label="fastest rail")
    if not bw:
        ax.text(0.5, 0.5, "no complete iterations", transform=ax.transAxes, ha="center")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth, median (Mbit/s)")
    ax.set_title(f"{topo.name}: allreduce bus bandwidth by message size")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------- terminal
def summary_table(metrics: Metrics, verdict: Verdict) -> str:
    """Aligned columns: metric, expected, measured, result; every expectation first, then the
    other measured metrics for context; notes of failed rows below."""
    rows = [(r.metric, r.expected, format_value(r.metric, r.measured), r.status)
            for r in verdict.rows]
    judged = {r.metric for r in verdict.rows}
    for m in list(METRICS) + sorted(k for k in metrics if k.startswith(SHARE_PREFIX)) + [
            k for k in metrics if k.startswith(SIZED_PREFIX)]:
        if m not in judged and metrics.get(m) is not None:
            rows.append((m, "-", format_value(m, metrics[m]), ""))
    head = ("metric", "expected", "measured", "result")
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) if rows else len(head[i])
              for i in range(4)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    out = [line(head), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in rows]
    notes = [f"  {r.metric}: {r.note}" for r in verdict.rows if r.note and not r.ok]
    if notes:
        out.append("")
        out += notes
    n_fail = sum(1 for r in verdict.rows if not r.ok)
    out.append("")
    out.append(f"expectations: {len(verdict.rows) - n_fail}/{len(verdict.rows)} hold"
               + ("" if verdict.passed else " — FAIL"))
    return "\n".join(out)
