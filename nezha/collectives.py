"""Collective algorithms, expressed as messages (op, step, peer) handed to the engine.

Ring allreduce = ring reduce-scatter (n-1 steps) + ring allgather (n-1 steps). Segment j of
the buffer is reduced along one fixed chain of ranks, always as ``mine = op(mine, incoming)``,
and the allgather copies the finished bytes, so every rank ends with identical bits.
All receives of an operation are posted before its first send.
Step numbering: reduce-scatter steps 0..n-2, allgather steps n-1..2n-3; broadcast step 0.
"""
from __future__ import annotations

import numpy as np

from . import wire

UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def bounds(count: int, n: int) -> list[int]:
    q, rem = divmod(count, n)
    out = [0]
    for j in range(n):
        out.append(out[-1] + q + (1 if j < rem else 0))
    return out


def byteview(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))


def ring_allreduce(eng, op_id, arr, redop, kind=wire.K_ALLREDUCE, shift=0, rs_only=False,
                   deadline=None):
    """In place on ``arr`` (1-D). With rs_only, stops after reduce-scatter; rank r then owns
    segment (r + 1 + shift) mod n. Returns the owned segment index."""
    n, r = eng.world, eng.rank
    owned = (r + 1 + shift) % n
    if n == 1:
        return owned
    right, left = (r + 1) % n, (r - 1) % n
    esz = arr.dtype.itemsize
    bd = bounds(len(arr), n)
    scratch = np.empty_like(arr)
    bv, sv = byteview(arr), byteview(scratch)
    dtc = wire.DTYPE_CODES[arr.dtype.name]
    rc = wire.REDOP_CODES[redop]
    op_total = arr.nbytes
    uf = UFUNCS[redop]

    def seg(j):
        return bd[j] * esz, bd[j + 1] * esz

    rs_slots, ag_slots = [], []
    for k in range(n - 1):
        lo, hi = seg((r - k - 1 + shift) % n)
        rs_slots.append(eng.post_recv(op_id, k, left, sv[lo:hi], kind, dtc, rc, op_total))
    if not rs_only:
        for k in range(n - 1):
            lo, hi = seg((owned - k - 1) % n)
            ag_slots.append(eng.post_recv(op_id, n - 1 + k, left, bv[lo:hi], kind, dtc, rc, op_total))
    eng.posted(op_id)
    sends = []
    for k in range(n - 1):
        lo, hi = seg((r - k + shift) % n)
        sends.append(eng.send(right, op_id, k, bv[lo:hi], kind, dtc, rc, op_total, elem=esz))
        eng.wait_recv(rs_slots[k], deadline)
        j = (r - k - 1 + shift) % n
        a, b = bd[j], bd[j + 1]
        if b > a:
            uf(arr[a:b], scratch[a:b], out=arr[a:b])
    if not rs_only:
        for k in range(n - 1):
            lo, hi = seg((owned - k) % n)
            sends.append(eng.send(right, op_id, n - 1 + k, bv[lo:hi], kind, dtc, rc, op_total, elem=esz))
            eng.wait_recv(ag_slots[k], deadline)
    eng.wait_sent(sends, deadline)
    return owned


def ring_allgather(eng, op_id, out, count, kind=wire.K_ALLGATHER, deadline=None):
    """``out`` holds n segments of ``count`` elements; this rank's is already in place."""
    n, r = eng.world, eng.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    esz = out.dtype.itemsize
    bv = byteview(out)
    dtc = wire.DTYPE_CODES[out.dtype.name]
    op_total = count * esz

    def seg(j):
        return j * count * esz, (j + 1) * count * esz

    slots = []
    for k in range(n - 1):
        lo, hi = seg((r - k - 1) % n)
        slots.append(eng.post_recv(op_id, k, left, bv[lo:hi], kind, dtc, 0, op_total))
    eng.posted(op_id)
    sends = []
    for k in range(n - 1):
        lo, hi = seg((r - k) % n)
        sends.append(eng.send(right, op_id, k, bv[lo:hi], kind, dtc, 0, op_total, elem=esz))
        eng.wait_recv(slots[k], deadline)
    eng.wait_sent(sends, deadline)


def star_broadcast(eng, op_id, arr, root, kind=wire.K_BROADCAST, deadline=None):
    n, r = eng.world, eng.rank
    if n == 1:
        return
    esz = arr.dtype.itemsize
    bv = byteview(arr)
    dtc = wire.DTYPE_CODES[arr.dtype.name]
    if r == root:
        eng.posted(op_id)
        sends = [eng.send(p, op_id, 0, bv, kind, dtc, 0, arr.nbytes, aux=root, elem=esz)
                 for p in range(n) if p != root]
        eng.wait_sent(sends, deadline)
    else:
        slot = eng.post_recv(op_id, 0, root, bv, kind, dtc, 0, arr.nbytes, aux=root)
        eng.posted(op_id)
        eng.wait_recv(slot, deadline)
