"""The estimate exchange: at the points balance.want_exchange picks (the same on every
rank), every rank's per-rail table [a, b, n, last, live] goes round a tiny ring allgather
(collective kind CONTROL), and each rank feeds the same gathered tables to its balancer, so
all ranks agree on the live rails, the state and the split (see balance.py)."""
from __future__ import annotations

import time

import numpy as np

from . import collectives, wire
from .balance import TABLE_COLUMNS


def maybe_exchange(eng, balancer, events, nbytes: int) -> None:
    """Before a collective of ``nbytes``: exchange and apply the tables if it is time."""
    if not balancer.want_exchange(nbytes):
        return
    world, rank, nrails = eng.world, eng.rank, eng.nrails
    live = np.ones((nrails, 1))
    for p in range(world):
        if p != rank:
            for r in range(nrails):
                if (p, r) in eng.dead:
                    live[r] = 0.0
    mine = np.concatenate([balancer.local_table(), live], axis=1).reshape(-1)
    out = np.zeros(world * mine.size, dtype=np.float64)
    out[rank * mine.size:(rank + 1) * mine.size] = mine
    t0 = time.monotonic()
    op_id = eng.begin_op()
    try:
        collectives.ring_allgather(collectives.Call(eng, op_id), out, mine.size,
                                   kind=wire.K_CONTROL)
    finally:
        eng.end_op(op_id)
    t1 = time.monotonic()
    cols = TABLE_COLUMNS + 1
    tables = out.reshape(world, nrails, cols)
    evs = []
    agreed_live = [r for r in range(nrails) if tables[:, r, TABLE_COLUMNS].min() > 0]
    if agreed_live:
        evs += balancer.set_live(agreed_live)
    evs += balancer.agree(tables[:, :, :TABLE_COLUMNS])
    if events.log_ops:
        # what the exchange costs the operation it precedes: the allgather (wake-ups on a
        # busy machine more than hops) and the agreement (Python, about 0.7 ms on 4 rails)
        evs.append(("exchange", {"gather_ms": round((t1 - t0) * 1e3, 3),
                                 "agree_ms": round((time.monotonic() - t1) * 1e3, 3)}))
    for name, fields in evs:
        if name == "state":
            events.state = fields["state"]
        if name == "weights":
            events.weights = fields["shares"]
        events.emit(name, **fields)
