"""Run a function as several local ranks (separate processes, spawn) on loopback rails.

Used by the tests and by ``nezha.bench`` for development runs. Rails are 127.0.0.1,
127.0.0.2, ... (all of 127/8 is local on Linux).
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import queue as _queue
import socket
import time
import traceback


def free_port() -> int:
    """A free TCP port below the kernel's ephemeral range (so that no outgoing connection
    grabs it between this call and the bind)."""
    import random
    for _ in range(200):
        p = random.randint(20000, 32000)
        s = socket.socket()
        try:
            s.bind(("0.0.0.0", p))
            return p
        except OSError:
            continue
        finally:
            s.close()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def loopback_rails(k: int) -> list[str]:
    return [f"127.0.0.{i + 1}" for i in range(k)]


class RankFailure:
    """What a rank raised: exception class names (MRO), message, traceback text."""

    def __init__(self, exc: BaseException):
        self.types = [c.__name__ for c in type(exc).__mro__]
        self.type = type(exc).__name__
        self.message = str(exc)
        self.tb = traceback.format_exc()

    def isa(self, name: str) -> bool:
        return name in self.types

    def __repr__(self):
        return f"RankFailure({self.type}: {self.message})"


def _entry(q, fn, rank, world, port, kwargs):
    if isinstance(fn, str):
        mod, _, name = fn.partition(":")
        fn = getattr(importlib.import_module(mod), name)
    try:
        res = fn(rank, world, port, **kwargs)
        q.put((rank, True, res))
    except BaseException as e:  # report, never hang the parent
        q.put((rank, False, RankFailure(e)))


def run_ranks(fn, world: int, timeout: float = 60.0, ranks=None, per_rank=None, **kwargs):
    """Start ``fn(rank, world, port, **kwargs)`` in one process per rank. Returns
    {rank: (ok, result_or_RankFailure)}; ranks that neither return nor raise within
    ``timeout`` get (False, "hung") and are killed. ``per_rank`` maps rank -> extra kwargs."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ranks = list(range(world)) if ranks is None else list(ranks)
    procs = {}
    for r in ranks:
        kw = dict(kwargs)
        if per_rank and r in per_rank:
            kw.update(per_rank[r])
        p = ctx.Process(target=_entry, args=(q, fn, r, world, port, kw), daemon=True)
        p.start()
        procs[r] = p
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(ranks):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            r, ok, res = q.get(timeout=min(left, 0.5))
            out[r] = (ok, res)
        except _queue.Empty:
            # a process that died without reporting (os._exit, a crash)
            for r, p in procs.items():
                if r not in out and not p.is_alive() and p.exitcode is not None:
                    try:
                        r2, ok, res = q.get(timeout=0.2)
                        out[r2] = (ok, res)
                    except _queue.Empty:
                        out[r] = (False, f"exited with code {p.exitcode}")
    for r, p in procs.items():
        if r not in out:
            out[r] = (False, "hung")
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    return out
