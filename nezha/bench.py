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
import os
import sys
import time

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


def bench_rank(rank, world, master, rails, systems, sizes, target_bytes=256 << 20, min_iters=3,
               max_iters=200, warmup=6, timeout=60.0, dtype="float32", events=None):
    from .baselines import make_context
    from .store import StoreClient, StoreServer
    host, _, port = master.rpartition(":")
    port = int(port)
    server = StoreServer("0.0.0.0", port) if rank == 0 else None
    store = StoreClient(host, port, timeout=timeout)
    results, errors = {}, {}
    try:
        for si, system in enumerate(systems):
            rows = []
            try:
                kw = dict(rank=rank, world_size=world, rails=rails, timeout=timeout)
                if system == "gloo":
                    kw["master"] = f"{host}:{port + 1 + si}"
                else:
                    kw.update(store=store, group=f"bench/{system}/{si}", events=events)
                ctx = make_context(system, **kw)
            except Exception as e:
                errors[system] = f"{type(e).__name__}: {e}"
                store.set(f"bench/{system}/{si}/failed/{rank}", "1")
                continue
            try:
                for size in sizes:
                    count = max(1, size // np.dtype(dtype).itemsize)
                    buf = np.zeros(count, dtype=dtype)
                    for _ in range(warmup):
                        ctx.allreduce(buf)
                    iters = iters_for(size, target_bytes, min_iters, max_iters)
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
                    rows.append({"size": buf.nbytes, "iters": iters, "latency_s": lat,
                                 "latency_p50_s": float(np.median(per)),
                                 "algbw_Bps": algbw,
                                 "busbw_Bps": algbw * 2 * (world - 1) / world if world > 1 else algbw,
                                 "rail_shares": [x / tot for x in d], "state": st.get("state")})
            except Exception as e:
                errors[system] = f"{type(e).__name__}: {e}"
            finally:
                ctx.close()
            results[system] = rows
        try:
            store.set(f"bench/done/{rank}", "1")
        except Exception:
            if rank == 0:
                raise       # others: rank 0 may close the store the moment our key lands
        if rank == 0:   # keep serving the store until every rank is through
            store.wait([f"bench/done/{r}" for r in range(world)], timeout)
            time.sleep(0.2)
    finally:
        store.close()
        if server is not None:
            server.close()
    return {"world": world, "nrails": len(rails.split(",")) if isinstance(rails, str) else len(rails),
            "sizes": sizes, "systems": systems, "results": results, "errors": errors}


def _local_rank(rank, world, port, **kw):
    from .testing import loopback_rails
    kw["timeout"] = kw.pop("ctx_timeout")
    return bench_rank(rank, world, f"127.0.0.1:{port}", loopback_rails(kw.pop("nrails")), **kw)


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
    p = argparse.ArgumentParser(prog="python -m nezha.bench", description=__doc__.split("\n")[0])
    p.add_argument("--local", type=int, help="spawn this many local ranks on loopback rails")
    p.add_argument("--nrails", type=int, default=2, help="loopback rails with --local")
    p.add_argument("--rank", type=int, default=os.environ.get("NEZHA_RANK"))
    p.add_argument("--world-size", type=int, default=os.environ.get("NEZHA_WORLD_SIZE"))
    p.add_argument("--rails", default=os.environ.get("NEZHA_RAILS"))
    p.add_argument("--master", default=os.environ.get("NEZHA_MASTER"))
    p.add_argument("--systems", default="nezha,single,stripe")
    p.add_argument("--sizes", default="4K:64M")
    p.add_argument("--target-bytes", default="256M", help="bytes moved per size (sets iterations)")
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--events", default=os.environ.get("NEZHA_EVENT_LOG"))
    p.add_argument("--out")
    a = p.parse_args(argv)
    kw = dict(systems=a.systems.split(","), sizes=size_list(a.sizes),
              target_bytes=parse_size(a.target_bytes), min_iters=a.min_iters,
              max_iters=a.max_iters, warmup=a.warmup)
    if a.local:
        from .testing import run_ranks
        out = run_ranks(_local_rank, a.local, timeout=3600, nrails=a.nrails,
                        ctx_timeout=a.timeout, **kw)
        ok, res = out[0]
        if not ok:
            print(f"nezha.bench: rank 0 failed: {res}", file=sys.stderr)
            return 1
    else:
        if None in (a.rank, a.world_size, a.rails, a.master):
            p.error("give --local N, or --rank --world-size --rails --master")
        res = bench_rank(a.rank, a.world_size, a.master, a.rails, events=a.events,
                         timeout=a.timeout, **kw)
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    print(table(res), file=sys.stderr)
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
