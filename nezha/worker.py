"""The workload the testbed launches on every host: repeated verified allreduce.

    python -m nezha.worker --rank 0 --world-size 4 --rails 10.0.0.1,10.1.0.1 \\
        --master 10.0.0.1:29500 --system nezha --size 16777216 --iterations 20 \\
        --dtype float32 --op sum --events ev.jsonl --results res.jsonl

Every flag also comes from the environment (NEZHA_RANK, NEZHA_WORLD_SIZE, NEZHA_RAILS,
NEZHA_MASTER or NEZHA_MASTER_ADDR + NEZHA_MASTER_PORT, NEZHA_SYSTEM, NEZHA_SIZE,
NEZHA_ITERATIONS, NEZHA_WARMUP, NEZHA_DURATION, NEZHA_DTYPE, NEZHA_OP, NEZHA_EVENT_LOG, NEZHA_RESULTS,
NEZHA_TIMEOUT).

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
"mean_s", "algbw_Bps", "busbw_Bps", "rail_bytes", "shares", "state", "exit_code"}``.
In duration mode every rank runs the same number of iterations: after each iteration the
ranks allreduce (max) a stop flag, so they stop together. With both --iterations and
--duration, a rank stops after at least that many iterations and at least that long (small
messages then get many samples, large ones their minimum count).
Exit status: 0 all results exact, 3 a wrong result, 2 bad arguments, 4 communication
error (message on stderr), 1 anything else.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

EXIT_OK, EXIT_OTHER, EXIT_CONFIG, EXIT_WRONG, EXIT_COMM = 0, 1, 2, 3, 4


def env(name, default=None):
    v = os.environ.get(name)
    return v if v not in (None, "") else default


def parse_size(s) -> int:
    s = str(s).strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m nezha.worker", description=__doc__.split("\n")[0])
    master = env("NEZHA_MASTER")
    if master is None and env("NEZHA_MASTER_ADDR") and env("NEZHA_MASTER_PORT"):
        master = f"{env('NEZHA_MASTER_ADDR')}:{env('NEZHA_MASTER_PORT')}"
    p.add_argument("--rank", type=int, default=env("NEZHA_RANK"))
    p.add_argument("--world-size", type=int, default=env("NEZHA_WORLD_SIZE"))
    p.add_argument("--rails", default=env("NEZHA_RAILS"))
    p.add_argument("--master", default=master)
    p.add_argument("--system", default=env("NEZHA_SYSTEM", "nezha"))
    p.add_argument("--size", default=env("NEZHA_SIZE", "16M"), help="bytes per allreduce (16M, 4096...)")
    p.add_argument("--iterations", type=int, default=env("NEZHA_ITERATIONS"))
    p.add_argument("--duration", type=float, default=env("NEZHA_DURATION"))
    p.add_argument("--warmup", type=int, default=int(env("NEZHA_WARMUP", 0)),
                   help="iterations run first and left out of the timings")
    p.add_argument("--dtype", default=env("NEZHA_DTYPE", "float32"))
    p.add_argument("--op", default=env("NEZHA_OP", "sum"))
    p.add_argument("--events", default=env("NEZHA_EVENT_LOG"))
    p.add_argument("--results", default=env("NEZHA_RESULTS"))
    p.add_argument("--timeout", type=float, default=float(env("NEZHA_TIMEOUT", 30.0)))
    p.add_argument("--log-ops", action="store_true", help="op_start/op_end events")
    return p


class Pattern:
    """Closed-form per-rank inputs and the exact reduced result."""

    def __init__(self, count, dtype, op, world):
        self.dtype, self.op, self.world = np.dtype(dtype), op, world
        i = np.arange(count, dtype=np.int64)
        if op == "prod":
            self.base = np.array([1, 2, -1])[i % 3].astype(self.dtype)
        else:
            self.base = ((i * 7) % 11 - 5).astype(self.dtype)

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
        if self.op == "sum":
            exp = self.base * self.world + sum(cs)
        elif self.op == "max":
            exp = self.base + max(cs)
        elif self.op == "min":
            exp = self.base + min(cs)
        else:
            exp = self.base ** self.world * int(np.prod(cs))
        return int(np.count_nonzero(buf != exp.astype(self.dtype)))


def run(a) -> int:
    from .baselines import make_context
    missing = [n for n in ("rank", "world_size", "rails", "master") if getattr(a, n) is None]
    if missing:
        print(f"nezha.worker: missing {', '.join('--' + m.replace('_', '-') for m in missing)} "
              f"(or the NEZHA_* environment)", file=sys.stderr)
        return EXIT_CONFIG
    if a.iterations is None and a.duration is None:
        a.iterations = 10
    if a.warmup < 0:
        print(f"nezha.worker: --warmup {a.warmup} is negative", file=sys.stderr)
        return EXIT_CONFIG
    size = parse_size(a.size)
    dt = np.dtype(a.dtype)
    if size % dt.itemsize:
        print(f"nezha.worker: --size {size} is not a multiple of {dt.itemsize} ({dt.name})", file=sys.stderr)
        return EXIT_CONFIG
    count = size // dt.itemsize
    out = open(a.results, "a", buffering=1) if a.results else None

    def emit(rec):
        if out:
            out.write(json.dumps(rec) + "\n")

    ctx = make_context(a.system, rank=a.rank, world_size=a.world_size, rails=a.rails,
                       master=a.master, timeout=a.timeout, events=a.events,
                       **({"log_ops": True} if a.log_ops and a.system != "gloo" else {}))
    pat = Pattern(count, dt, a.op, ctx.world_size)
    buf = np.empty(count, dtype=dt)
    n = ctx.world_size
    times, bad_iters, total_mis = [], [], 0
    t_begin = time.monotonic()
    rb0 = dict(ctx.rail_bytes())
    k = 0
    try:
        while True:
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
            total_mis += mis
            if mis:
                bad_iters.append(k)
            warm = k < a.warmup
            if not warm:
                times.append(t1 - t0)
            emit({"iter": k, "t_start": t0, "t_end": t1, "seconds": t1 - t0, "bytes": size,
                  "ok": mis == 0, "mismatches": mis, "rank": ctx.rank, "system": a.system,
                  "warmup": warm, "rail_bytes": {r: after[r] - before.get(r, 0) for r in after}})
            k += 1
            if warm:
                if k == a.warmup:       # timings, duration and rail bytes start here
                    t_begin = time.monotonic()
                    rb0 = dict(ctx.rail_bytes())
                continue
            enough = a.iterations is None or k >= a.iterations + a.warmup
            if a.duration is None:
                if enough:
                    break
            else:
                # both given: at least that many iterations and at least that long
                stop = np.array([1 if enough and time.monotonic() - t_begin >= a.duration
                                 else 0], dtype=np.int32)
                ctx.allreduce(stop, op="max")
                if stop[0]:
                    break
    except Exception as e:
        emit({"summary": True, "iterations": k, "ok": False, "error": f"{type(e).__name__}: {e}",
              "rank": ctx.rank, "system": a.system, "exit_code": EXIT_COMM})
        raise
    finally:
        stats = ctx.stats()
        ctx.close()
    mean = float(np.mean(times)) if times else 0.0
    algbw = size / mean if mean > 0 else 0.0
    rb = {r: v - rb0.get(r, 0) for r, v in ctx.rail_bytes().items()} if hasattr(ctx, "events") else {}
    code = EXIT_WRONG if bad_iters else EXIT_OK
    emit({"summary": True, "iterations": k, "warmup": min(k, a.warmup), "ok": not bad_iters,
          "failed_iterations": bad_iters,
          "mismatches": total_mis, "mean_s": mean, "algbw_Bps": algbw,
          "busbw_Bps": algbw * 2 * (n - 1) / n if n > 1 else algbw, "rail_bytes": rb,
          "shares": stats.get("shares"), "state": stats.get("state"), "rank": ctx.rank,
          "system": a.system, "bytes": size, "exit_code": code})
    if bad_iters:
        print(f"nezha.worker: rank {ctx.rank}: WRONG RESULTS in iterations {bad_iters[:10]} "
              f"({total_mis} elements)", file=sys.stderr)
    return code


def main(argv=None) -> int:
    from .errors import ConfigError, NezhaError
    a = build_parser().parse_args(argv)
    try:
        return run(a)
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
