"""The engine's records: a posted receive (RecvSlot), a message being sent (SendMsg) and its
chunks (SendChunk). A message is named (op_id, step, peer); a chunk by its byte offset."""
from __future__ import annotations

import time

A_SAMPLE_MAX = 64 << 10
ACK_PROGRESS = 2     # ACK.op_total: 0 = delivered, 1 = delivered after staging, 2 = progress only
OP_WINDOW = 64


class RecvSlot:
    __slots__ = ("key", "view", "total", "kind", "dtype", "redop", "op_total", "aux", "done",
                 "got", "frames", "first", "last", "rbytes", "writers", "complete", "t_post",
                 "afirst", "alast")

    def __init__(self, key, view, kind, dtype, redop, op_total, aux):
        self.key = key
        self.view = view
        self.total = len(view)
        self.kind, self.dtype, self.redop, self.op_total, self.aux = kind, dtype, redop, op_total, aux
        self.done: dict[int, int] = {}
        self.got = 0
        self.frames = 0
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.rbytes: dict[int, int] = {}
        self.afirst: dict[int, int] = {}   # the connection's arrived() at first / last
        self.alast: dict[int, int] = {}
        self.writers = 0
        self.complete = False
        self.t_post = time.monotonic()


class SendChunk:
    __slots__ = ("msg", "idx", "offset", "length", "rail", "acked", "t_send", "tries")

    def __init__(self, msg, idx, offset, length, rail):
        self.msg, self.idx, self.offset, self.length, self.rail = msg, idx, offset, length, rail
        self.acked = False
        self.t_send = 0.0
        self.tries = 0


class SendMsg:
    __slots__ = ("key", "dst", "view", "total", "kind", "dtype", "redop", "op_total", "aux",
                 "chunks", "unacked", "t0", "share", "complete")

    def __init__(self, key, dst, view, kind, dtype, redop, op_total, aux):
        self.key, self.dst, self.view = key, dst, view
        self.total = len(view)
        self.kind, self.dtype, self.redop, self.op_total, self.aux = kind, dtype, redop, op_total, aux
        self.chunks: list[SendChunk] = []
        self.unacked = 0
        self.t0: dict[int, float] = {}
        self.share: dict[int, int] = {}
        self.complete = False
