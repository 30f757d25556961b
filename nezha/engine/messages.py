"""The engine's records: what the frames of a call say about it (Desc), a posted receive
(RecvSlot), a message being sent (SendMsg) and its chunks (SendChunk). A message is named
(op_id, step, peer); a chunk by its byte offset."""
from __future__ import annotations

from dataclasses import dataclass

A_SAMPLE_MAX = 64 << 10
ACK_PROGRESS = 2     # ACK.op_total: 0 = delivered, 1 = delivered after staging, 2 = progress only
OP_WINDOW = 64


@dataclass(frozen=True)
class Desc:
    """What every DATA frame of one collective call says about the call (wire codes); a
    receiver checks it against its own, so a mismatch is an error, never a wrong result."""
    kind: int
    dtype: int = 0
    redop: int = 0
    op_total: int = 0       # bytes of the sender's whole buffer
    aux: int = 0            # broadcast root


class RecvSlot:
    __slots__ = ("key", "view", "total", "kind", "dtype", "redop", "op_total", "aux", "done",
                 "got", "frames", "writers", "complete", "t_first", "t_prev", "t_last", "rbytes",
                 "busy", "copied", "pending")

    def __init__(self, key, view, d: Desc):
        self.key = key
        self.view = view
        self.total = len(view)
        self.kind, self.dtype, self.redop = d.kind, d.dtype, d.redop
        self.op_total, self.aux = d.op_total, d.aux
        self.done: dict[int, int] = {}
        self.got = 0
        self.frames = 0
        self.writers = 0
        self.complete = False
        # per rail: first header, the rail's previous share's end, last byte, bytes (cost.py)
        self.t_first: dict[int, float] = {}
        self.t_prev: dict[int, float] = {}
        self.t_last: dict[int, float] = {}
        self.rbytes: dict[int, int] = {}
        self.busy: dict = {}    # offset being read in place right now -> its Connection
        self.copied: dict[int, int] = {}   # late rail -> bytes of its share hedge copies carried
        self.pending: dict[int, list] = {}   # late rail -> [start, own bytes, last own byte]


class SendChunk:
    __slots__ = ("msg", "idx", "offset", "length", "rail", "acked", "t_send", "tries", "out",
                 "hedged")

    def __init__(self, msg, idx, offset, length, rail):
        self.msg, self.idx, self.offset, self.length, self.rail = msg, idx, offset, length, rail
        self.acked = False
        self.t_send = 0.0
        self.tries = 0
        self.out: list[int] = []    # rails holding a copy not yet acknowledged on that rail
        self.hedged = False         # a copy was also queued on another rail (hedge.py)


class SendMsg:
    __slots__ = ("key", "dst", "view", "total", "kind", "dtype", "redop", "op_total", "aux",
                 "chunks", "unacked", "t0", "share", "complete", "t_queued", "left", "done_at",
                 "idle", "detached")

    def __init__(self, key, dst, view, d: Desc):
        self.key, self.dst, self.view = key, dst, view
        self.total = len(view)
        self.kind, self.dtype, self.redop = d.kind, d.dtype, d.redop
        self.op_total, self.aux = d.op_total, d.aux
        self.chunks: list[SendChunk] = []
        self.unacked = 0
        self.t0: dict[int, float] = {}
        self.share: dict[int, int] = {}
        self.complete = False
        self.t_queued = 0.0
        self.left: dict[int, int] = {}        # share rail -> chunks not yet acknowledged
        self.done_at: dict[int, float] = {}   # share rail -> when its last chunk was
        # rails with nothing unacknowledged when queued -> the peer's payload bytes we had
        # read on them then (engine.send._sample_a)
        self.idle: dict[int, int] = {}
        # from a private buffer that nothing waits to get back (a direct allreduce's own
        # copy): outlives its operation until acknowledged (core.Engine.end_op)
        self.detached = False
