"""Collective algorithms, expressed as messages (op, step, peer) handed to the engine.

Ring allreduce = ring reduce-scatter (n-1 steps) + ring allgather (n-1 steps). Segment j of
the buffer is reduced along one fixed chain of ranks, always as ``mine = op(mine, incoming)``,
and the allgather copies the finished bytes, so every rank ends with identical bits.
All receives of an operation are posted before its first send.
Large segments are pipelined in blocks (see ring_allreduce for the step ids); allgather uses
step 0..n-2 per message; broadcast is a star (step 0) for small messages and a pipelined chain
(step = block) for large ones.
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


PIPE_BLOCK = int(__import__("os").environ.get("NEZHA_PIPE_BLOCK", 2 << 20))
MAX_BLOCKS = 16


def nblocks(count: int, n: int, esz: int) -> int:
    """Pipeline depth: every segment is cut into this many blocks (same on all ranks)."""
    seg_bytes = -(-count // n) * esz
    return max(1, min(MAX_BLOCKS, seg_bytes // PIPE_BLOCK))


def ring_allreduce(eng, op_id, arr, redop, kind=wire.K_ALLREDUCE, shift=0, rs_only=False,
                   deadline=None):
    """In place on ``arr`` (1-D). With rs_only, stops after reduce-scatter; rank r then owns
    segment (r + 1 + shift) mod n. Returns the owned segment index.

    Pipelined: each segment is cut into B blocks (``nblocks``); block b of a step is
    forwarded as soon as it has arrived and been reduced, so the rails never wait for a
    whole step. Message step ids: reduce-scatter step k block b -> k*B + b, allgather
    step k block b -> (n-1)*B + k*B + b."""
    n, r = eng.world, eng.rank
    owned = (r + 1 + shift) % n
    if n == 1:
        return owned
    right, left = (r + 1) % n, (r - 1) % n
    esz = arr.dtype.itemsize
    bd = bounds(len(arr), n)
    B = nblocks(len(arr), n, esz)
    scratch = np.empty_like(arr)
    bv, sv = byteview(arr), byteview(scratch)
    dtc = wire.DTYPE_CODES[arr.dtype.name]
    rc = wire.REDOP_CODES[redop]
    op_total = arr.nbytes
    uf = UFUNCS[redop]
    sub = [[bd[j] + x for x in bounds(bd[j + 1] - bd[j], B)] for j in range(n)]

    def elems(j, b):
        return sub[j][b], sub[j][b + 1]

    def bytes_(j, b):
        return sub[j][b] * esz, sub[j][b + 1] * esz

    ag0 = (n - 1) * B
    rs_slots, ag_slots = {}, {}
    for k in range(n - 1):
        j = (r - k - 1 + shift) % n
        for b in range(B):
            lo, hi = bytes_(j, b)
            rs_slots[k, b] = eng.post_recv(op_id, k * B + b, left, sv[lo:hi], kind, dtc, rc, op_total)
    if not rs_only:
        for k in range(n - 1):
            j = (owned - k - 1) % n
            for b in range(B):
                lo, hi = bytes_(j, b)
                ag_slots[k, b] = eng.post_recv(op_id, ag0 + k * B + b, left, bv[lo:hi], kind, dtc,
                                               rc, op_total)
    eng.posted(op_id)
    sends = []

    def send(step, j, b):
        lo, hi = bytes_(j, b)
        sends.append(eng.send(right, op_id, step, bv[lo:hi], kind, dtc, rc, op_total, elem=esz))

    for b in range(B):
        send(b, (r + shift) % n, b)
    for k in range(n - 1):
        j = (r - k - 1 + shift) % n
        for b in range(B):
            eng.wait_recv(rs_slots[k, b], deadline)
            a, e = elems(j, b)
            if e > a:
                uf(arr[a:e], scratch[a:e], out=arr[a:e])
            if k < n - 2:
                send((k + 1) * B + b, j, b)
            elif not rs_only:
                send(ag0 + b, j, b)          # j is the owned segment: start the allgather
    if not rs_only:
        for k in range(n - 1):
            j = (owned - k - 1) % n
            for b in range(B):
                eng.wait_recv(ag_slots[k, b], deadline)
                if k < n - 2:
                    send(ag0 + (k + 1) * B + b, j, b)
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


BCAST_CHAIN_MIN = 256 << 10   # from this size on (and 3+ ranks) broadcast is a pipelined chain
BCAST_BLOCK = 512 << 10


def broadcast(eng, op_id, arr, root, deadline=None):
    """Small messages: a star (one hop from the root). Large ones: a pipelined chain, since a
    star sends the message n-1 times over the root's rails while a chain sends it once over
    every host's."""
    if eng.world > 2 and arr.nbytes >= BCAST_CHAIN_MIN:
        chain_broadcast(eng, op_id, arr, root, deadline=deadline)
    else:
        star_broadcast(eng, op_id, arr, root, deadline=deadline)


def chain_broadcast(eng, op_id, arr, root, kind=wire.K_BROADCAST, deadline=None):
    """root -> root+1 -> ... -> root-1, in blocks: a rank forwards block b as soon as it has
    arrived, so all links work at once and the time tends to size / (rails' rate)."""
    n, r = eng.world, eng.rank
    if n == 1:
        return
    pos = (r - root) % n
    prev = (r - 1) % n if pos > 0 else None
    nxt = (r + 1) % n if pos < n - 1 else None
    esz = arr.dtype.itemsize
    bv = byteview(arr)
    dtc = wire.DTYPE_CODES[arr.dtype.name]
    B = max(1, min(MAX_BLOCKS, arr.nbytes // BCAST_BLOCK))
    cut = bounds(len(arr), B)
    slots = []
    if prev is not None:
        for b in range(B):
            slots.append(eng.post_recv(op_id, b, prev, bv[cut[b] * esz:cut[b + 1] * esz], kind,
                                       dtc, 0, arr.nbytes, aux=root))
    eng.posted(op_id)
    sends = []
    for b in range(B):
        if prev is not None:
            eng.wait_recv(slots[b], deadline)
        if nxt is not None:
            sends.append(eng.send(nxt, op_id, b, bv[cut[b] * esz:cut[b + 1] * esz], kind, dtc, 0,
                                  arr.nbytes, aux=root, elem=esz))
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
