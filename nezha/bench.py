"""Allreduce benchmark: latency, algorithm and bus bandwidth and rail shares per message
size, for several systems side by side.

Development run on loopback (spawns the ranks; rails 127.0.0.1, 127.0.0.2, ...)::

    python -m nezha.bench --local 2 --nrails 2 --systems nezha,single,stripe --sizes 4K:64M

Across hosts (one process per host; rank 0 serves the store at --master)::

    python -m nezha.bench --rank 0 --world-size 4 --rails 10.0.0.1,10.1.0.1 \\
        --master 10.0.0.1:29500 --systems nezha,single,stripe,mptcp --out bench.json

busbw = algbw * 2(n-1)/n (allreduce). Output (stdout and --out)::

    {"world": n, "nrails": k, "sizes": [...], "systems": [...],
     "results": {"nezha": [{"size", "iters", "latency_s" (mean), "latency_p50_s" (median),
                            "algbw_Bps", "busbw_Bps",
                            "rail_shares": [..], "state"}, ...], ...},
     "errors": {"system": "message"}}
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .worker import parse_size


def size_list(spec: str) -> list[int]:
    """'4K:64M' (powers of 4 between) | '4K,1M,16M'."""
    if ":" in spec:
        lo, hi = (parse_size(x) for x in spec.split(":"))
        out, s = [], lo
        while s <= hi:
            out.append(s)
            s *= 4
        if out[-1] != hi:
            out.append(hi)
        return out
    return [parse_size(x) for x in spec.split(",") if x]


def iters_for(size, target_bytes, lo, hi):
    return int(max(lo, min(hi, target_bytes // max(size, 1))))


@dataclass(frozen=True)
class BenchPlan:
    """What to measure: the same on every rank."""
    systems: tuple
    sizes: tuple
    target_bytes: int = 256 << 20     # bytes moved per size (sets the iterations)
    min_iters: int = 3
    max_iters: int = 200
    warmup: int = 6
    timeout: float = 60.0
    dtype: str = "float32"
    events: Optional[str] = None


def bench_rank(rank, world, master, rails, plan: BenchPlan) -> dict:
    """One rank's part: every system in turn, every size; rank 0 serves the store."""
    from .baselines import make_context
    from .config import Config
    from .store import StoreClient, StoreServer
    host, _, port = master.rpartition(":")
    port = int(port)
    secret = Config.from_env().job_secret      # NEZHA_JOB_SECRET, as every Context reads it
    server = StoreServer(host, port, secret=secret) if rank == 0 else None
    store = StoreClient(host, port, timeout=plan.timeout, secret=secret)
    results, errors = {}, {}
    try:
        for si, system in enumerate(plan.systems):
            try:
                kw = dict(rank=rank, world_size=world, rails=rails, timeout=plan.timeout)
                if system == "gloo":
                    kw["master"] = f"{host}:{port + 1 + si}"
                else:
                    kw.update(store=store, group=f"bench/{system}/{si}", events=plan.events)
                ctx = make_context(system, **kw)
            except Exception as e:
                errors[system] = f"{type(e).__name__}: {e}"
                store.set(f"bench/{system}/{si}/failed/{rank}", "1")
                continue
            rows = []
            try:
                for size in plan.sizes:
                    rows.append(_measure(ctx, size, plan, world))
            except Exception as e:
                errors[system] = f"{type(e).__name__}: {e}"
            finally:
                ctx.close()
            results[system] = rows
        _finish(store, rank, world, plan.timeout)
    finally:
        store.close()
        if server is not None:
            server.close()
    return {"world": world, "nrails": len(rails.split(",")) if isinstance(rails, str) else len(rails),
            "sizes": list(plan.sizes), "systems": list(plan.systems), "results": results,
            "errors": errors}


def _measure(ctx, size: int, plan: BenchPlan, world: int) -> dict:
    """One row: warm up, then time ``iters`` allreduces of ``size`` bytes."""
    count = max(1, size // np.dtype(plan.dtype).itemsize)
    buf = np.zeros(count, dtype=plan.dtype)
    for _ in range(plan.warmup):
        ctx.allreduce(buf)
    iters = iters_for(size, plan.target_bytes, plan.min_iters, plan.max_iters)
    ctx.barrier()
    rb0 = ctx.rail_bytes()
    t0 = time.monotonic()
    per = []
    for _ in range(iters):
        t1 = time.monotonic()
        ctx.allreduce(buf)
        per.append(time.monotonic() - t1)
    lat = (time.monotonic() - t0) / iters
    rb1 = ctx.rail_bytes()
    d = [rb1[k] - rb0.get(k, 0) for k in sorted(rb1, key=int)]
    tot = sum(d) or 1
    algbw = buf.nbytes / lat
    st = ctx.stats()
    return {"size": buf.nbytes, "iters": iters, "latency_s": lat,
            "latency_p50_s": float(np.median(per)),
            "algbw_Bps": algbw,
            "busbw_Bps": algbw * 2 * (world - 1) / world if world > 1 else algbw,
            "rail_shares": [x / tot for x in d], "state": st.get("state")}


def _finish(store, rank: int, world: int, timeout: float) -> None:
    """Say we are through; rank 0 keeps serving the store until every rank is."""
    try:
        store.set(f"bench/done/{rank}", "1")
    except Exception:
        if rank == 0:
            raise       # others: rank 0 may close the store the moment our key lands
    if rank == 0:
        store.wait([f"bench/done/{r}" for r in range(world)], timeout)
        time.sleep(0.2)


def _local_rank(rank, world, port, nrails: int, plan: BenchPlan):
    from .testing import loopback_rails
    return bench_rank(rank, world, f"127.0.0.1:{port}", loopback_rails(nrails), plan)


def table(res) -> str:
    systems = [s for s in res["systems"] if s in res["results"]]
    lines = ["size      " + "".join(f"{s + ' busbw MB/s':>22}{'lat ms':>9}" for s in systems)]
    for i, size in enumerate(res["sizes"]):
        row = f"{size:<10}"
        for s in systems:
            rows = res["results"][s]
            if i < len(rows):
                r = rows[i]
                sh = "/".join(f"{x * 100:.0f}" for x in r["rail_shares"])
                row += f"{r['busbw_Bps'] / 1e6:>12.1f} [{sh:>7}]{r['latency_s'] * 1e3:>9.2f}"
            else:
                row += f"{'-':>22}{'-':>9}"
        lines.append(row)
    for s, e in res["errors"].items():
        lines.append(f"{s}: {e}")
    return "\n".join(lines)


def main(argv=None):
    from .config import Config, Workload
    cfg, wl = Config.from_env(), Workload.from_env()
    p = argparse.ArgumentParser(prog="python -m nezha.bench", description=__doc__.split("\n")[0])
    p.add_argument("--local", type=int, help="spawn this many local ranks on loopback rails")
    p.add_argument("--nrails", type=int, default=2, help="loopback rails with --local")
    p.add_argument("--rank", type=int, default=cfg.rank)
    p.add_argument("--world-size", type=int, default=cfg.world_size)
    p.add_argument("--rails", default=cfg.rails)
    p.add_argument("--master", default=wl.master)
    p.add_argument("--systems", default="nezha,single,stripe")
    p.add_argument("--sizes", default="4K:64M")
    p.add_argument("--target-bytes", default="256M", help="bytes moved per size (sets iterations)")
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--events", default=cfg.event_log)
    p.add_argument("--out")
    a = p.parse_args(argv)
    plan = BenchPlan(systems=tuple(a.systems.split(",")), sizes=tuple(size_list(a.sizes)),
                     target_bytes=parse_size(a.target_bytes), min_iters=a.min_iters,
                     max_iters=a.max_iters, warmup=a.warmup, timeout=a.timeout)
    if a.local:
        from .testing import run_ranks
        out = run_ranks(_local_rank, a.local, timeout=3600, nrails=a.nrails, plan=plan)
        ok, res = out[0]
        if not ok:
            print(f"nezha.bench: rank 0 failed: {res}", file=sys.stderr)
            return 1
    else:
        if None in (a.rank, a.world_size, a.rails, a.master):
            p.error("give --local N, or --rank --world-size --rails --master")
        res = bench_rank(a.rank, a.world_size, a.master, a.rails, replace(plan, events=a.events))
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    print(table(res), file=sys.stderr)
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
