"""Receive side of the engine: posted receives, staging, ACKs.

The reader thread parses a header, asks ``data_target`` for the destination slice of the
posted receive and ``recv_into``s straight into it. A frame that arrives before its receive
is posted goes to a bounded staging area (never blocks a rail thread); it is copied and
acknowledged when the receive is posted. ACKs of staged chunks are therefore delayed, which
bounds how far a peer can run ahead (one operation).
"""
from __future__ import annotations

import math
import time

import numpy as np

from .. import wire
from ..errors import CommError, MismatchError, ProtocolError
from .messages import ACK_PROGRESS, OP_WINDOW, Desc, RecvSlot

ELEM_BYTES = {code: np.dtype(name).itemsize for code, name in wire.DTYPES.items()}


class Receiving:
    """Mixin of Engine (state in core.Engine.__init__)."""

    def _ack_frame(self, conn, h, status: int) -> bytes:
        """ACK of DATA frame ``h``; status 0 delivered, 1 after staging, ACK_PROGRESS."""
        return wire.Header(wire.ACK, kind=h.kind, rail=conn.rail, src=self.rank, aux=h.length,
                           op_id=h.op_id, step=h.step, chunk=h.chunk, offset=h.offset,
                           msg_total=h.msg_total, op_total=status).pack()

    def _ack(self, conn, h, delayed: bool):
        frame = self._ack_frame(conn, h, 1 if delayed else 0)
        if conn.alive:
            conn.put(frame)
        else:
            self._ctrl(conn.peer, frame)

    def _check(self, slot: RecvSlot, h, conn):
        if (h.kind, h.dtype, h.redop, h.op_total, h.msg_total) != (
                slot.kind, slot.dtype, slot.redop, slot.op_total, slot.total) or (
                h.kind == wire.K_BROADCAST and h.aux & wire.ROOT_MASK != slot.aux):
            def d(kind, dtype, redop, op_total, total, aux):
                s = (f"{wire.KIND_NAMES.get(kind)} of {op_total} bytes of "
                     f"{wire.DTYPES.get(dtype)} op={wire.REDOPS.get(redop)}")
                return s + (f" root={aux}" if kind == wire.K_BROADCAST else "") + f" (step message {total} bytes)"
            raise MismatchError(
                f"collective mismatch at op {h.op_id}: rank {h.src} called "
                f"{d(h.kind, h.dtype, h.redop, h.op_total, h.msg_total, h.aux)} but rank {self.rank} called "
                f"{d(slot.kind, slot.dtype, slot.redop, slot.op_total, slot.total, slot.aux)}")

    def post_recv(self, op_id, step, src, view, desc: Desc) -> RecvSlot:
        """Expect message (op_id, step) from ``src`` into ``view``; staged frames land now."""
        key = (op_id, step, src)
        slot = RecvSlot(key, view, desc)
        err = None
        with self.cond:
            self.slots[key] = slot
            for h, buf, t_hdr, t_prev, t_end in self.staged.pop(key, ()):
                self.staged_bytes -= len(buf)
                if err is None:
                    try:
                        self._check(slot, h, None)
                    except CommError as e:
                        err = e
                        continue
                    if h.offset not in slot.done:
                        view[h.offset:h.offset + h.length] = buf
                        self._mark(slot, h, t_hdr, t_prev, t_end)
                conn = self.conns.get((src, h.rail))
                if conn is not None:
                    self._ack(conn, h, True)
        if err is not None:
            self.fatal(err)
        return slot

    def share_due(self, src: int, rail: int) -> bool:
        """Does rank ``src`` owe us bytes on ``rail`` of a message that its other rails have
        begun to deliver? The split is computed as the sender computed it (the same on every
        rank); health.py takes a silent rail that owes bytes as evidence of a dead one.
        Bytes that hedge copies carried on another rail are still owed: the sender keeps
        the late rail's own copy outstanding (engine/hedge.py), and a rail whose every share
        is rescued by copies would otherwise never owe anything while it delivers nothing
        (2 ranks, a rail black-holed in the first operation: no rank failed it in 4 runs of
        40, each share copied within 13-70 ms, the window between checks)."""
        with self.cond:
            slots = [s for k, s in self.slots.items() if k[2] == src and not s.complete
                     and any(n for r, n in s.rbytes.items() if r != rail)]
            live = self.live_rails(src)
        if rail not in live:
            return False
        for slot in slots:
            try:
                plan = self.balancer.split(slot.total, ELEM_BYTES.get(slot.dtype, 1), live,
                                           slot.op_total)
            except (ValueError, ZeroDivisionError):
                continue
            share = sum(length for r, _, length in plan if r == rail)
            if share > slot.rbytes.get(rail, 0):
                return True
        return False

    def posted(self, op_id):
        """All receives of ``op_id`` are posted: anything else staged for it is unexpected."""
        with self.cond:
            self.posted_op = op_id
            bad = [k for k in self.staged if k[0] == op_id]
        if bad:
            h = self.staged[bad[0]][0][0]
            self.fatal(self._unexpected(h))

    def _unexpected(self, h):
        return MismatchError(f"collective mismatch at op {h.op_id}: rank {h.src} sent "
                             f"{wire.KIND_NAMES.get(h.kind)} step {h.step} data that rank "
                             f"{self.rank} does not expect (different collective, root or "
                             f"world view)")

    def _mark(self, slot, h, t_hdr: float, t_prev: float, t_end: float):
        """Frame ``h`` of ``slot`` is in: its header was read at ``t_hdr`` and its last byte
        at ``t_end``; the rail's previous frame from this peer ended at ``t_prev``."""
        slot.frames += 1
        copy_of = h.aux >> wire.COPY_SHIFT
        if not copy_of and h.rail in slot.t_first and math.isnan(slot.t_prev[h.rail]):
            # the late rail's first own frame, after copies of its share (a repeat of one
            # they delivered included): where its time starts (costs.op_ended)
            slot.t_prev[h.rail] = t_prev
        if h.offset in slot.done:
            return
        if slot.got + h.length > slot.total:
            raise ProtocolError(f"rank {h.src} sent more than {slot.total} bytes for op {h.op_id} step {h.step}")
        slot.done[h.offset] = h.length
        slot.got += h.length
        if h.rail < len(self.events.rails):
            c = self.events.rails[h.rail]
            c.bytes_recv += h.length
            c.chunks_recv += 1
        if copy_of:
            # a hedge copy: it is not the late rail's delivery (costs.py charges that rail
            # with its own frames only, from the end of its previous frame: unknown, nan,
            # until its first own frame of this message comes in)
            r = copy_of - 1
            slot.copied[r] = slot.copied.get(r, 0) + h.length
            if r not in slot.t_first:
                slot.t_first[r], slot.t_prev[r] = t_hdr, math.nan
            slot.rbytes.setdefault(r, 0)
        else:
            r = h.rail
            if r not in slot.t_first:
                slot.t_first[r], slot.t_prev[r] = t_hdr, t_prev
            if t_end > slot.t_last.get(r, 0.0):
                slot.t_last[r] = t_end
            slot.rbytes[r] = slot.rbytes.get(r, 0) + h.length
        if slot.got == slot.total and slot.frames >= 1:
            slot.complete = True
            if slot.kind != wire.K_CONTROL:
                self.costs.add_message(slot)
            self.cond.notify_all()

    # ------------------------------------------------------------------ connection callbacks
    def data_target(self, conn, h, now):
        with self.cond:
            if self.closing or self.error is not None:
                return None      # failed already: drain quietly so our ABORT gets out
            key = (h.op_id, h.step, h.src)
            slot = self.slots.get(key)
            if slot is None:
                # peers may legitimately run a few ops ahead (a broadcast receiver does not
                # wait for the other receivers); far ahead means a broken peer
                if h.op_id > self.op_seq + OP_WINDOW:
                    raise ProtocolError(f"rank {h.src} sent data for op {h.op_id}, but rank "
                                        f"{self.rank} is at op {self.op_seq}")
                conn.t_hdr = now
                return None
            self._check(slot, h, conn)
            conn.t_hdr = now
            if h.offset in slot.done or h.offset in slot.busy:
                return None      # a repeat, or another copy is being read in place
            slot.writers += 1
            slot.busy[h.offset] = conn
            conn.cur_slot, conn.cur_off = slot, h.offset
            return slot.view[h.offset:h.offset + h.length]

    def release_target(self, conn):
        with self.cond:
            slot = getattr(conn, "cur_slot", None)
            if slot is not None:
                slot.writers -= 1
                slot.busy.pop(conn.cur_off, None)
                conn.cur_slot = None
                self.cond.notify_all()

    def data_done(self, conn, h):
        now = time.monotonic()
        with self.cond:
            slot = conn.cur_slot
            conn.cur_slot = None
            slot.writers -= 1
            slot.busy.pop(h.offset, None)
            # queue the ACK before the op can complete (and the app close the connection)
            self._ack(conn, h, False)
            if h.offset in slot.done:         # revoked: another copy came first
                if not h.aux >> wire.COPY_SHIFT:
                    self.costs.late_frame(slot, h.rail, h.length, now)
            self._mark(slot, h, conn.t_hdr, getattr(conn, "t_end", 0.0), now)
            conn.t_end = now
            if self.trace:
                self.events.emit("rx", rail=conn.rail, peer=conn.peer, op=h.op_id, step=h.step,
                                 off=h.offset, len=h.length, t0=conn.t_hdr)
            if slot.writers == 0:
                self.cond.notify_all()

    def data_staged(self, conn, h, buf):
        now = time.monotonic()
        t_prev, conn.t_end = getattr(conn, "t_end", 0.0), now
        err = None
        with self.cond:
            if self.closing or self.error is not None:
                return
            key = (h.op_id, h.step, h.src)
            slot = self.slots.get(key)
            if slot is not None:             # posted meanwhile, or a duplicate
                self._check(slot, h, conn)
                if h.offset not in slot.done:
                    # another copy being read in place is cut off first: once this one is
                    # acknowledged the sender may reuse its buffer, so that copy's later
                    # bytes may differ
                    writer = slot.busy.get(h.offset)
                    if writer is not None:
                        writer.revoke()
                    slot.view[h.offset:h.offset + h.length] = buf
                elif not h.aux >> wire.COPY_SHIFT:
                    self.costs.late_frame(slot, h.rail, h.length, now)
                self._mark(slot, h, conn.t_hdr, t_prev, now)   # (a repeat: its times only)
                self._ack(conn, h, False)
                ack = False
            elif h.op_id <= self.done_op:    # late duplicate of a finished op
                ack = True
            elif h.op_id <= self.posted_op:
                raise self._unexpected(h)
            else:
                err = self._stage(conn, h, buf, key, (conn.t_hdr, t_prev, now))
                ack = False
        if err is not None:
            raise err
        if ack:
            self._ack(conn, h, False)

    def _stage(self, conn, h, buf, key, times):
        """Keep a frame whose receive is not posted yet; the error if staging overflows."""
        # tell the sender the bytes arrived (progress for its watchdog) without
        # completing the chunk: that ACK comes when the receive is posted
        conn.put(self._ack_frame(conn, h, ACK_PROGRESS))
        self.staged.setdefault(key, []).append((h, buf, *times))
        self.staged_bytes += len(buf)
        if self.staged_bytes > self.staging_limit:
            return ProtocolError(f"staging area overflow ({self.staged_bytes} bytes "
                                 f"arrived before their receives were posted)")
        return None
