"""The workload the testbed launches on every host: repeated verified allreduce.

    python -m nezha.worker --rank 0 --world-size 4 --rails 10.0.0.1,10.1.0.1 \\
        --master 10.0.0.1:29500 --system nezha --size 16777216 --iterations 20 \\
        --dtype float32 --op sum --events ev.jsonl --results res.jsonl

Every flag also comes from the environment (NEZHA_RANK, NEZHA_WORLD_SIZE, NEZHA_RAILS,
NEZHA_MASTER or NEZHA_MASTER_ADDR + NEZHA_MASTER_PORT, NEZHA_SYSTEM, NEZHA_SIZE,
NEZHA_ITERATIONS, NEZHA_WARMUP, NEZHA_DURATION, NEZHA_DTYPE, NEZHA_OP, NEZHA_EVENT_LOG,
NEZHA_RESULTS, NEZHA_TIMEOUT), read once by nezha.config (the table of every variable is there).

Every iteration starts with a barrier (not timed), so its time is the collective's, not the
ranks' skew on entry.

Data: element i of rank r in iteration k is base[i] + c(r, k) (small integers; for prod,
base[i] * s(r, k) with s = +-1), so the exact result is known in closed form and every
element is checked. --results gets one JSON line per iteration::

    {"iter": k, "t_start": mono, "t_end": mono, "seconds": .., "bytes": size, "ok": bool,
     "mismatches": n, "rail_bytes": {"0": bytes sent on rail 0 in this iteration, ...},
     "rank": r, "system": s, "warmup": bool}

--warmup N runs N iterations first (verified like the rest, marked ``"warmup": true`` and left
out of the summary's timings; --iterations and --duration count from after them), as
nccl-tests' -w does: a fresh process's first operation pays for TCP slow start and Nezha's
cold start.

and a last line ``{"summary": true, "iterations", "ok", "failed_iterations", "mismatches",
"mean_s", "algbw_Bps", "busbw_Bps", "rail_bytes", "shares", "state", "exit_code"}``
(and ``"hybrid"``: the split across protocols, with aggregation switches).
In duration mode every rank runs the same number of iterations: after each iteration the
ranks allreduce (max) a stop flag, so they stop together. With both --iterations and
--duration, a rank stops after at least that many iterations and at least that long (small
messages then get many samples, large ones their minimum count).
Exit status: 0 all results exact, 3 a wrong result, 2 bad arguments, 4 communication
error (message on stderr), 1 anything else.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .config import Config, Workload

EXIT_OK, EXIT_OTHER, EXIT_CONFIG, EXIT_WRONG, EXIT_COMM = 0, 1, 2, 3, 4


def parse_size(s) -> int:
    s = str(s).strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def build_parser(cfg: Optional[Config] = None, wl: Optional[Workload] = None):
    """The command line; its defaults come from the environment (``cfg``, ``wl``)."""
    cfg = cfg if cfg is not None else Config.from_env()
    wl = wl if wl is not None else Workload.from_env()
    p = argparse.ArgumentParser(prog="python -m nezha.worker", description=__doc__.split("\n")[0])
    master = wl.master
    if master is None and cfg.master_addr and cfg.master_port is not None:
        master = f"{cfg.master_addr}:{cfg.master_port}"
    p.add_argument("--rank", type=int, default=cfg.rank)
    p.add_argument("--world-size", type=int, default=cfg.world_size)
    p.add_argument("--rails", default=cfg.rails)
    p.add_argument("--master", default=master)
    p.add_argument("--system", default=cfg.system)
    p.add_argument("--size", default=wl.size, help="bytes per allreduce (16M, 4096...)")
    p.add_argument("--iterations", type=int, default=wl.iterations)
    p.add_argument("--duration", type=float, default=wl.duration)
    p.add_argument("--warmup", type=int, default=wl.warmup,
                   help="iterations run first and left out of the timings")
    p.add_argument("--dtype", default=wl.dtype)
    p.add_argument("--op", default=wl.op)
    p.add_argument("--events", default=cfg.event_log)
    p.add_argument("--results", default=wl.results)
    p.add_argument("--timeout", type=float, default=cfg.timeout)
    p.add_argument("--log-ops", action="store_true", help="op_start/op_end events")
    return p


COMBINE = {"sum": sum, "max": max, "min": min}   # the ranks' offsets, as the op combines them


class Pattern:
    """Closed-form per-rank inputs and the exact reduced result. The check reuses two
    arrays of the buffer's size: three new ones every iteration cost more CPU than the
    comparison (2 ranks x 16 MiB: 8 % of both cores in the kernel's page clears, and the
    check half of the main thread's samples in ``py-spy``)."""

    def __init__(self, count, dtype, op, world):
        self.dtype, self.op, self.world = np.dtype(dtype), op, world
        i = np.arange(count, dtype=np.int64)
        if op == "prod":
            self.base = np.array([1, 2, -1])[i % 3].astype(self.dtype)
        else:
            self.base = ((i * 7) % 11 - 5).astype(self.dtype)
        # the part of the expected result that does not change with the iteration
        if op == "sum":
            self.fixed = self.base * world
        elif op == "prod":
            self.fixed = self.base ** world
        else:
            self.fixed = self.base
        self.expected = np.empty_like(self.base)
        self.differs = np.empty(count, dtype=bool)

    def c(self, r, k):
        if self.op == "prod":
            return 1 if (r * 3 + k) % 4 else -1
        return (r * 13 + k * 5) % 7 - 3

    def fill(self, buf, r, k):
        if self.op == "prod":
            np.multiply(self.base, self.c(r, k), out=buf)
        else:
            np.add(self.base, self.c(r, k), out=buf, casting="unsafe")

    def mismatches(self, buf, k) -> int:
        cs = [self.c(r, k) for r in range(self.world)]
        if self.op == "prod":
            np.multiply(self.fixed, int(np.prod(cs)), out=self.expected)
        else:
            np.add(self.fixed, COMBINE[self.op](cs), out=self.expected)
        np.not_equal(buf, self.expected, out=self.differs)
        return int(np.count_nonzero(self.differs))


@dataclass
class Tally:
    """What the iterations so far came to (the summary line is made from it)."""
    k: int = 0                                   # iterations run (warm-up included)
    times: list = field(default_factory=list)    # seconds of each timed iteration
    bad_iters: list = field(default_factory=list)
    mismatches: int = 0
    t_begin: float = 0.0                         # when the timed part began
    rb0: dict = field(default_factory=dict)      # rail bytes then


def _arg_error(a) -> Optional[str]:
    missing = [n for n in ("rank", "world_size", "rails", "master") if getattr(a, n) is None]
    if missing:
        return (f"missing {', '.join('--' + m.replace('_', '-') for m in missing)} "
                f"(or the NEZHA_* environment)")
    if a.warmup < 0:
        return f"--warmup {a.warmup} is negative"
    size, dt = parse_size(a.size), np.dtype(a.dtype)
    if size % dt.itemsize:
        return f"--size {size} is not a multiple of {dt.itemsize} ({dt.name})"
    return None


def run(a, config: Optional[Config] = None) -> int:
    from .baselines import make_context
    err = _arg_error(a)
    if err:
        print(f"nezha.worker: {err}", file=sys.stderr)
        return EXIT_CONFIG
    if a.iterations is None and a.duration is None:
        a.iterations = 10
    size = parse_size(a.size)
    dt = np.dtype(a.dtype)
    out = open(a.results, "a", buffering=1) if a.results else None

    def emit(rec):
        if out:
            out.write(json.dumps(rec) + "\n")

    ctx = make_context(a.system, rank=a.rank, world_size=a.world_size, rails=a.rails,
                       master=a.master, timeout=a.timeout, events=a.events,
                       config=config,
                       **({"log_ops": True} if a.log_ops and a.system != "gloo" else {}))
    # what exists now (modules, the context) never goes through a full collection again: one
    # took every rank ~1 in 10 allreduces, and on 16 ranks x 2 cores those ran 3x (~300 ms
    # against ~90; a collection in one rank stalls the ring)
    gc.freeze()
    tally = Tally(t_begin=time.monotonic(), rb0=dict(ctx.rail_bytes()))
    try:
        _iterate(ctx, a, Pattern(size // dt.itemsize, dt, a.op, ctx.world_size), tally, emit)
    except Exception as e:
        emit({"summary": True, "iterations": tally.k, "ok": False,
              "error": f"{type(e).__name__}: {e}", "rank": ctx.rank, "system": a.system,
              "exit_code": EXIT_COMM})
        raise
    finally:
        stats = ctx.stats()
        ctx.close()
    return _summary(ctx, a, size, tally, stats, emit)


def _iterate(ctx, a, pat: Pattern, tally: Tally, emit) -> None:
    """Verified allreduces until --iterations / --duration say stop (see the docstring)."""
    buf = np.empty(len(pat.base), dtype=pat.dtype)
    while True:
        k = tally.k
        pat.fill(buf, ctx.rank, k)
        # start together: otherwise a rank that finished verifying early times its wait for
        # the others as part of the collective
        ctx.barrier()
        before = ctx.rail_bytes()
        t0 = time.monotonic()
        ctx.allreduce(buf, op=a.op)
        t1 = time.monotonic()
        after = ctx.rail_bytes()
        mis = pat.mismatches(buf, k)
        tally.mismatches += mis
        if mis:
            tally.bad_iters.append(k)
        warm = k < a.warmup
        if not warm:
            tally.times.append(t1 - t0)
        emit({"iter": k, "t_start": t0, "t_end": t1, "seconds": t1 - t0, "bytes": buf.nbytes,
              "ok": mis == 0, "mismatches": mis, "rank": ctx.rank, "system": a.system,
              "warmup": warm, "rail_bytes": {r: after[r] - before.get(r, 0) for r in after}})
        tally.k = k = k + 1
        if warm:
            if k == a.warmup:       # timings, duration and rail bytes start here
                tally.t_begin = time.monotonic()
                tally.rb0 = dict(ctx.rail_bytes())
            continue
        if _should_stop(ctx, a, tally):
            return


def _should_stop(ctx, a, tally: Tally) -> bool:
    enough = a.iterations is None or tally.k >= a.iterations + a.warmup
    if a.duration is None:
        return enough
    # both given: at least that many iterations and at least that long; every rank stops
    # after the same iteration (an allreduce (max) of the flag)
    stop = np.array([1 if enough and time.monotonic() - tally.t_begin >= a.duration
                     else 0], dtype=np.int32)
    ctx.allreduce(stop, op="max")
    return bool(stop[0])


def _hybrid_summary(stats: dict) -> dict:
    """With aggregation switches: the split across protocols and what went where."""
    h = stats.get("hybrid")
    return {"hybrid": {k: h[k] for k in ("shares", "state", "up", "agg_bytes",
                                         "recomputed_bytes")}} if h else {}


def _summary(ctx, a, size: int, tally: Tally, stats: dict, emit) -> int:
    n = ctx.world_size
    mean = float(np.mean(tally.times)) if tally.times else 0.0
    algbw = size / mean if mean > 0 else 0.0
    rb = ({r: v - tally.rb0.get(r, 0) for r, v in ctx.rail_bytes().items()}
          if hasattr(ctx, "events") else {})
    bad = tally.bad_iters
    code = EXIT_WRONG if bad else EXIT_OK
    emit({"summary": True, "iterations": tally.k, "warmup": min(tally.k, a.warmup), "ok": not bad,
          "failed_iterations": bad,
          "mismatches": tally.mismatches, "mean_s": mean, "algbw_Bps": algbw,
          "busbw_Bps": algbw * 2 * (n - 1) / n if n > 1 else algbw, "rail_bytes": rb,
          "shares": stats.get("shares"), "state": stats.get("state"), "rank": ctx.rank,
          "system": a.system, "bytes": size, "exit_code": code,
          **_hybrid_summary(stats)})
    if bad:
        print(f"nezha.worker: rank {ctx.rank}: WRONG RESULTS in iterations {bad[:10]} "
              f"({tally.mismatches} elements)", file=sys.stderr)
    return code


def main(argv=None) -> int:
    from .errors import ConfigError, NezhaError
    try:
        cfg, wl = Config.from_env(), Workload.from_env()
    except ConfigError as e:
        print(f"nezha.worker: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    a = build_parser(cfg, wl).parse_args(argv)
    try:
        return run(a, cfg)
    except ConfigError as e:
        print(f"nezha.worker: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except NezhaError as e:
        print(f"nezha.worker: rank {a.rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_COMM
    except Exception as e:
        print(f"nezha.worker: rank {a.rank}: unexpected {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_OTHER


if __name__ == "__main__":
    sys.exit(main())
