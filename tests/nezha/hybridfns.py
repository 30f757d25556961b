"""Rank functions of the hybrid (TCP ring + aggregation switch) allreduce tests."""
from __future__ import annotations

import json
import os
import time

import numpy as np

from nezha import Config, Context
from nezha.testing import loopback_rails

from rankfns import data, digest, reference

SECRET = "hybrid-test-secret-0123456789"


def make_ctx(rank, world, port, agg_port, nrails=1, events=None, timeout=20.0):
    cfg = Config(aggregators=(("r1", "127.0.0.1", agg_port),), job_secret=SECRET)
    return Context(rank, world, rails=loopback_rails(nrails), master=f"127.0.0.1:{port}",
                   timeout=timeout, config=cfg, events=events)


def exact(rank, world, port, agg_port, cases, nrails=1):
    """Every (dtype, op, count) case allreduced, checked against numpy; returns the failures,
    the result digests, and the split of every hybrid op (op, aggregation bytes, ring bytes)."""
    fails, digests = [], []
    with make_ctx(rank, world, port, agg_port, nrails) as ctx:
        for it, (dt, op, count) in enumerate(cases):
            a = data(rank, it, count, dt, op)
            ctx.allreduce(a, op=op)
            ref = reference(world, it, count, dt, op)
            if a.dtype != np.dtype(dt) or not np.array_equal(a, ref):
                fails.append((dt, op, count, int((a != ref).sum())))
            digests.append(digest(a))
        h = ctx.stats()["hybrid"]
    return fails, digests, h["history"], h["agg_bytes"]


def until_stopped(rank, world, port, agg_port, stop_file, events, count=1 << 20,
                  pause=0.05, limit=400):
    """Allreduce (exactly checked) until the parent creates ``stop_file`` (rank 0 looks and
    tells the others): returns failures, iterations, stats."""
    fails, it = [], 0
    with make_ctx(rank, world, port, agg_port, 2, events=events) as ctx:
        flag = np.zeros(1, np.int32)
        while it < limit:
            flag[0] = 1 if rank == 0 and os.path.exists(stop_file) else 0
            ctx.broadcast(flag, root=0)
            if flag[0]:
                break
            a = data(rank, it, count, "float32")
            ctx.allreduce(a)
            if not np.array_equal(a, reference(world, it, count, "float32", "sum")):
                fails.append(it)
            it += 1
            time.sleep(pause)
        h = ctx.stats()["hybrid"]
    return fails, it, {k: h[k] for k in ("agg_bytes", "recomputed_bytes", "history", "up")}


def read_events(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
