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

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import wire
from .config import Config
from .engine import Desc

UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def bounds(count: int, n: int) -> list[int]:
    q, rem = divmod(count, n)
    out = [0]
    for j in range(n):
        out.append(out[-1] + q + (1 if j < rem else 0))
    return out


def byteview(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))


PIPE_BLOCK = Config.pipe_block      # NEZHA_PIPE_BLOCK's default
MAX_BLOCKS = 16


@dataclass(frozen=True)
class Call:
    """One collective call as the algorithms see it: the engine that carries its messages,
    its sequence number, and the pipeline block size (equal on every rank: it sets the
    step ids)."""
    eng: Any
    op_id: int
    pipe_block: int = PIPE_BLOCK


def nblocks(count: int, n: int, esz: int, pipe_block: int = PIPE_BLOCK) -> int:
    """Pipeline depth: every segment is cut into this many blocks (same on all ranks)."""
    seg_bytes = -(-count // n) * esz
    return max(1, min(MAX_BLOCKS, seg_bytes // pipe_block))


def ring_allreduce(call: Call, arr, redop, kind=wire.K_ALLREDUCE) -> None:
    """In place on ``arr`` (1-D): every rank ends with the reduction of all ranks' arrays.

    Pipelined: each segment is cut into B blocks (``nblocks``); block b of a step is
    forwarded as soon as it has arrived and been reduced, so the rails never wait for a
    whole step. Message step ids: reduce-scatter step k block b -> k*B + b, allgather
    step k block b -> (n-1)*B + k*B + b."""
    if call.eng.world > 1:
        _Ring(call, arr, redop, kind, shift=0, rs_only=False).run()


def ring_reduce_scatter(call: Call, arr, redop) -> None:
    """The reduce-scatter half of ring_allreduce, in place on ``arr``: rank r then owns the
    reduction of segment r (its neighbours' copies are partial)."""
    if call.eng.world > 1:
        _Ring(call, arr, redop, wire.K_REDUCE_SCATTER, shift=-1, rs_only=True).run()


class _Ring:
    """The plan of one ring allreduce / reduce-scatter: segment j of the buffer goes round
    the ring in B blocks; rank r owns segment (r + 1 + shift) mod n after reduce-scatter."""

    def __init__(self, call: Call, arr, redop, kind, shift: int, rs_only: bool):
        eng = call.eng
        n, r = eng.world, eng.rank
        self.call, self.eng, self.arr, self.n, self.r = call, eng, arr, n, r
        self.shift, self.rs_only = shift, rs_only
        self.owned = (r + 1 + shift) % n
        self.right, self.left = (r + 1) % n, (r - 1) % n
        self.esz = arr.dtype.itemsize
        bd = bounds(len(arr), n)
        self.B = nblocks(len(arr), n, self.esz, call.pipe_block)
        self.scratch = eng.scratch.take(arr.nbytes, arr.dtype)
        self.bv, self.sv = byteview(arr), byteview(self.scratch)
        self.desc = Desc(kind, wire.DTYPE_CODES[arr.dtype.name], wire.REDOP_CODES[redop],
                         arr.nbytes)
        self.uf = UFUNCS[redop]
        self.sub = [[bd[j] + x for x in bounds(bd[j + 1] - bd[j], self.B)] for j in range(n)]
        self.ag0 = (n - 1) * self.B       # first allgather step id
        self.sends: list = []

    def elems(self, j, b):
        return self.sub[j][b], self.sub[j][b + 1]

    def bytes_(self, j, b):
        return self.sub[j][b] * self.esz, self.sub[j][b + 1] * self.esz

    def rs_segment(self, k):
        """Segment received (and reduced) in reduce-scatter step k."""
        return (self.r - k - 1 + self.shift) % self.n

    def ag_segment(self, k):
        """Segment received in allgather step k."""
        return (self.owned - k - 1) % self.n

    def post(self, step0, segment, view):
        """Receives for every block of every step, before the first send (engine rule)."""
        slots = {}
        for k in range(self.n - 1):
            for b in range(self.B):
                lo, hi = self.bytes_(segment(k), b)
                slots[k, b] = self.eng.post_recv(self.call.op_id, step0 + k * self.B + b,
                                                 self.left, view[lo:hi], self.desc)
        return slots

    def send(self, step, j, b):
        lo, hi = self.bytes_(j, b)
        self.sends.append(self.eng.send(self.right, self.call.op_id, step, self.bv[lo:hi],
                                        self.desc, elem=self.esz))

    def run(self) -> None:
        n, B, arr, scratch = self.n, self.B, self.arr, self.scratch
        rs_slots = self.post(0, self.rs_segment, self.sv)
        ag_slots = {} if self.rs_only else self.post(self.ag0, self.ag_segment, self.bv)
        self.eng.posted(self.call.op_id)
        for b in range(B):
            self.send(b, (self.r + self.shift) % n, b)
        for k in range(n - 1):
            j = self.rs_segment(k)
            for b in range(B):
                self.eng.wait_recv(rs_slots[k, b])
                a, e = self.elems(j, b)
                if e > a:
                    self.uf(arr[a:e], scratch[a:e], out=arr[a:e])
                if k < n - 2:
                    self.send((k + 1) * B + b, j, b)
                elif not self.rs_only:
                    self.send(self.ag0 + b, j, b)      # j is the owned segment: start the allgather
        for k in range(n - 1 if not self.rs_only else 0):
            j = self.ag_segment(k)
            for b in range(B):
                self.eng.wait_recv(ag_slots[k, b])
                if k < n - 2:
                    self.send(self.ag0 + (k + 1) * B + b, j, b)
        self.eng.wait_sent(self.sends)


DIRECT_MAX_BYTES = Config.direct_max   # direct_allreduce while size x (world - 1) <= this...
DIRECT_MAX_WORLD = 8                   # ...and the world this small (it reaches every peer)


def use_direct(nbytes: int, world: int, limit: int = DIRECT_MAX_BYTES) -> bool:
    """Whether an allreduce of ``nbytes`` goes in one direct round rather than the ring (every
    rank decides the same from size and world). What a small message costs is its messages,
    not its bytes: each one is a wake-up of a reader thread and of the caller (a 4 KiB ring
    allreduce on 3 ranks spends 1.3 of its 2.0 ms waiting for its 4 receives, and each send
    costs 0.08 ms of Python). The ring has 2(n-1) sends and receives in a row; the direct
    round n-1 of each at once, for (n-1) x size bytes per rank where the ring moves
    2(n-1)/n x size, spread over the rails."""
    return 1 < world <= DIRECT_MAX_WORLD and 0 < nbytes * (world - 1) <= limit


def _spread(eng, nbytes: int, count: int) -> list:
    with eng.cond:
        return eng.balancer.spread(nbytes, count, eng.balancer.rs.live)


def direct_allreduce(call: Call, arr, redop, kind=wire.K_ALLREDUCE) -> None:
    """In place on ``arr`` (1-D), in one round: every rank sends its whole array to every other
    rank and reduces the n copies in rank order, so every rank computes the same bits. Each
    copy goes whole on one rail, the copies spread over the rails (Balancer.spread): a split
    would cost every copy a start-up per rail."""
    eng, op_id = call.eng, call.op_id
    n, r = eng.world, eng.rank
    if n == 1:
        return
    copies = np.empty((n, len(arr)), dtype=arr.dtype)
    desc = Desc(kind, wire.DTYPE_CODES[arr.dtype.name], wire.REDOP_CODES[redop], arr.nbytes)
    peers = [(r + k) % n for k in range(1, n)]     # the next rank first: the ring's neighbour
    slots = {p: eng.post_recv(op_id, 0, p, byteview(copies[p]), desc) for p in peers}
    eng.posted(op_id)
    copies[r] = arr
    mine = byteview(copies[r])
    # sent detached: ``copies`` is this call's own, so nothing needs it back, and the
    # operation is done when the peers' copies are in and ours are written. Waiting for our
    # copies' ACKs too (a reader's and the caller's wake-up at each peer, then ours) was
    # the last millisecond of a 2 ms allreduce of 64 KiB on 3 hosts
    sends = [eng.send(p, op_id, 0, mine, desc, elem=arr.dtype.itemsize, rail=rail,
                      detached=True)
             for p, rail in zip(peers, _spread(eng, arr.nbytes, n - 1))]
    for p in peers:
        eng.wait_recv(slots[p])
    _reduce_in_rank_order(copies, UFUNCS[redop], arr)
    eng.wait_written(sends)


def _reduce_in_rank_order(copies: np.ndarray, uf, out: np.ndarray) -> None:
    """out = copies[0] op copies[1] op ... op copies[n-1], always in this order (``out`` is not
    one of the copies: this rank's own copy is what its sends are still reading)."""
    np.copyto(out, copies[0])
    for p in range(1, len(copies)):
        uf(out, copies[p], out=out)


def ring_allgather(call: Call, out, count, kind=wire.K_ALLGATHER) -> None:
    """``out`` holds n segments of ``count`` elements; this rank's is already in place."""
    eng, op_id = call.eng, call.op_id
    n, r = eng.world, eng.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    esz = out.dtype.itemsize
    bv = byteview(out)
    desc = Desc(kind, wire.DTYPE_CODES[out.dtype.name], 0, count * esz)

    def seg(j):
        return j * count * esz, (j + 1) * count * esz

    slots = []
    for k in range(n - 1):
        lo, hi = seg((r - k - 1) % n)
        slots.append(eng.post_recv(op_id, k, left, bv[lo:hi], desc))
    eng.posted(op_id)
    sends = []
    for k in range(n - 1):
        lo, hi = seg((r - k) % n)
        sends.append(eng.send(right, op_id, k, bv[lo:hi], desc, elem=esz))
        eng.wait_recv(slots[k])
    eng.wait_sent(sends)


BCAST_CHAIN_MIN = 256 << 10   # from this size on (and 3+ ranks) broadcast is a pipelined chain
BCAST_BLOCK = 512 << 10


def broadcast(call: Call, arr, root) -> None:
    """Small messages: a star (one hop from the root). Large ones: a pipelined chain, since a
    star sends the message n-1 times over the root's rails while a chain sends it once over
    every host's."""
    if call.eng.world > 2 and arr.nbytes >= BCAST_CHAIN_MIN:
        chain_broadcast(call, arr, root)
    else:
        star_broadcast(call, arr, root)


def chain_broadcast(call: Call, arr, root, kind=wire.K_BROADCAST) -> None:
    """root -> root+1 -> ... -> root-1, in blocks: a rank forwards block b as soon as it has
    arrived, so all links work at once and the time tends to size / (rails' rate)."""
    eng, op_id = call.eng, call.op_id
    n, r = eng.world, eng.rank
    if n == 1:
        return
    pos = (r - root) % n
    prev = (r - 1) % n if pos > 0 else None
    nxt = (r + 1) % n if pos < n - 1 else None
    esz = arr.dtype.itemsize
    bv = byteview(arr)
    desc = Desc(kind, wire.DTYPE_CODES[arr.dtype.name], 0, arr.nbytes, aux=root)
    B = max(1, min(MAX_BLOCKS, arr.nbytes // BCAST_BLOCK))
    cut = bounds(len(arr), B)
    slots = []
    if prev is not None:
        for b in range(B):
            slots.append(eng.post_recv(op_id, b, prev, bv[cut[b] * esz:cut[b + 1] * esz], desc))
    eng.posted(op_id)
    sends = []
    for b in range(B):
        if prev is not None:
            eng.wait_recv(slots[b])
        if nxt is not None:
            sends.append(eng.send(nxt, op_id, b, bv[cut[b] * esz:cut[b + 1] * esz], desc,
                                  elem=esz))
    eng.wait_sent(sends)


def star_broadcast(call: Call, arr, root, kind=wire.K_BROADCAST) -> None:
    eng, op_id = call.eng, call.op_id
    n, r = eng.world, eng.rank
    if n == 1:
        return
    esz = arr.dtype.itemsize
    bv = byteview(arr)
    desc = Desc(kind, wire.DTYPE_CODES[arr.dtype.name], 0, arr.nbytes, aux=root)
    if r == root:
        eng.posted(op_id)
        sends = [eng.send(p, op_id, 0, bv, desc, elem=esz)
                 for p in range(n) if p != root]
        eng.wait_sent(sends)
    else:
        slot = eng.post_recv(op_id, 0, root, bv, desc)
        eng.posted(op_id)
        eng.wait_recv(slot)
