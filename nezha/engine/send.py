"""Send side of the engine: a message cut into chunks over the rails, ACKs, start-up samples.

The split comes from the balancer (the same on every rank); each chunk is queued on its
rail's connection and stays unacknowledged until the receiver's ACK, so that a failed rail's
chunks can be moved (failover.py). Start-up cost samples (a_r) come from small shares: send
start -> last ACK, minus the bytes' time at the rail's b_r.
"""
from __future__ import annotations

import time

from .. import wire
from ..errors import AllRailsDownError, ProtocolError
from .messages import A_SAMPLE_MAX, ACK_PROGRESS, Desc, SendChunk, SendMsg


class Sending:
    """Mixin of Engine (state in core.Engine.__init__)."""

    def _queue(self, conn, ch):
        """Queue a data chunk on a connection and account it for the progress watchdog."""
        self._account(conn, ch)
        conn.put(ch)

    def _account(self, conn, ch):
        """``ch`` is on its way over ``conn`` (under cond): the progress watchdog waits for
        its ACK, and a failover of the rail moves it."""
        if conn.unacked == 0:
            conn.busy_since = time.monotonic()
        conn.unacked += 1
        ch.out.append(conn.rail)

    def _settle(self, ch, rail: int) -> None:
        """The copy of ``ch`` on ``rail`` was acknowledged (or given up): the rail's
        connection no longer waits for it."""
        if rail in ch.out:
            ch.out.remove(rail)
            c = self.conns.get((ch.msg.dst, rail))
            if c is not None and c.unacked > 0:
                c.unacked -= 1

    def _orphan_ack(self, conn) -> None:
        """An ACK for a copy whose message is gone (a hedge's other copy won the race):
        it still settles the connection's count (core.Engine.end_op)."""
        if conn.orphans > 0:
            conn.orphans -= 1
            if conn.unacked > 0:
                conn.unacked -= 1

    def send(self, dst, op_id, step, view, desc: Desc, elem=1, rail=None,
             detached=False) -> SendMsg:
        """Send message (op_id, step) to ``dst``, split over the rails in units of ``elem``
        (or whole on ``rail`` while that rail is live to ``dst``). ``detached``: ``view`` is
        a private buffer the caller will not wait on; the message is kept (rerouted on a
        failure) until acknowledged, past the end of its operation."""
        self.reach(dst)
        key = (op_id, step, dst)
        msg = SendMsg(key, dst, view, desc)
        msg.detached = detached
        msg.t_queued = time.monotonic()
        with self.cond:
            if self.error is not None:
                raise self.error
            live = self.live_rails(dst) or self.live_rails(dst, data=False)
            if not live and dst not in self.unreachable:
                raise AllRailsDownError(f"no live rail to rank {dst}")
            if not live:     # parked until a rail comes back (failover.rail_restored)
                self._cut(msg, [(0, 0, len(view))])
                for ch in msg.chunks:
                    ch.tries = 99
                self.sends[key] = msg
                return msg
            plan = [(rail, 0, len(view))] if rail in live else \
                self.balancer.split(len(view), elem, live, desc.op_total)
            self._cut(msg, plan)
            self.sends[key] = msg
            # a start-up sample is only honest from a rail with nothing of ours before it
            msg.idle = {r: c.rx_bytes for r in msg.share
                        if (c := self.conns[(dst, r)]).unacked == 0}
            todo = [(self.conns[(dst, ch.rail)], ch) for ch in msg.chunks]
            for conn, ch in todo:
                self._account(conn, ch)
        # written outside the lock (most go out from this thread at once, Connection.put):
        # the readers need the lock for every frame they take in
        for conn, ch in todo:
            conn.put(ch)
        return msg

    def _cut(self, msg: SendMsg, plan) -> None:
        """The balancer's (rail, offset, length) shares -> chunks of at most chunk_bytes."""
        cb = self.balancer.chunk_bytes
        for rail, off, length in plan:
            msg.share[rail] = length
            msg.left[rail] = max(1, -(-length // cb))
            if length == 0:
                msg.chunks.append(SendChunk(msg, len(msg.chunks), off, 0, rail))
                continue
            pos = off
            end = off + length
            while pos < end:
                n = min(cb, end - pos)
                msg.chunks.append(SendChunk(msg, len(msg.chunks), pos, n, rail))
                pos += n
        msg.unacked = len(msg.chunks)

    # ------------------------------------------------------------------ connection callbacks
    def before_send(self, conn, ch: SendChunk):
        with self.cond:
            if ch.acked or ch.msg.complete or conn.rail not in ch.out:
                return None
            msg = ch.msg
            now = time.monotonic()
            ch.t_send = now
            ch.tries += 1
            msg.t0.setdefault(conn.rail, now)
            # a hedge copy names the rail whose share it is (the receiver charges that rail)
            aux = msg.aux if conn.rail == ch.rail else msg.aux | ((ch.rail + 1) << wire.COPY_SHIFT)
            # counted here, under the lock, before the write: counted after it, a writer
            # preempted between its write and the count let the peer's ACK complete the
            # operation first, and a caller reading the counters after the collective saw
            # nothing sent (2 ranks, 16 KiB, under a full suite's load)
            c = self.events.rails[conn.rail]
            c.bytes_sent += ch.length
            c.chunks_sent += 1
            if msg.detached:
                self.cond.notify_all()      # its caller waits for this (wait_written)
        hdr = wire.Header(wire.DATA, kind=msg.kind, dtype=msg.dtype, redop=msg.redop,
                          rail=conn.rail, src=self.rank, aux=aux, op_id=msg.key[0],
                          step=msg.key[1], chunk=ch.idx, offset=ch.offset, length=ch.length,
                          msg_total=msg.total, op_total=msg.op_total).pack()
        return hdr, msg.view[ch.offset:ch.offset + ch.length]

    def after_send(self, conn, ch: SendChunk):
        if self.trace:
            self.events.emit("tx", rail=conn.rail, peer=conn.peer, op=ch.msg.key[0],
                             step=ch.msg.key[1], off=ch.offset, len=ch.length, t0=ch.t_send)

    def on_ack(self, conn, h):
        now = time.monotonic()
        conn.last_ack = now
        if h.op_total == ACK_PROGRESS:
            return
        with self.cond:
            msg = self.sends.get((h.op_id, h.step, h.src))
            if msg is None or h.chunk >= len(msg.chunks):
                self._orphan_ack(conn)
                return
            ch = msg.chunks[h.chunk]
            if ch.offset != h.offset or ch.length != h.aux:
                raise ProtocolError(f"rank {h.src} acknowledged chunk {h.chunk} with wrong "
                                    f"offset/length")
            self._settle(ch, conn.rail)
            if ch.acked:
                return
            ch.acked = True
            msg.unacked -= 1
            left = msg.left.get(ch.rail, 0) - 1
            msg.left[ch.rail] = left
            if left == 0:
                msg.done_at[ch.rail] = now
            if not h.op_total:
                self._sample_a(msg, ch.rail, ch.tries, now)
            if msg.unacked == 0:
                msg.complete = True
                if msg.detached and msg.key[0] <= self.done_op:
                    del self.sends[msg.key]     # its operation ended without it (end_op)
                self.cond.notify_all()

    def _sample_a(self, msg: SendMsg, rail: int, tries: int, now: float) -> None:
        """A small share fully acknowledged at its first try, on a rail that was idle when it
        was queued (else it waited for earlier data): one start-up sample a_r, once b_r is
        known. Without b_r the sample is mostly the bytes' own time: 60 KB shares of a
        14-rail COLD split gave 10 Mbit/s rails a_r = 46 ms and 80 Mbit/s ones 3-5 ms, so
        in HOT the best rail carried 25 % of each block instead of 19 % and set the pace
        (1.4x slower than that split pinned).

        Nor when the peer's own data came in on the rail meanwhile: its acknowledgement
        queued behind that data (in the peer's socket and on the wire), so the sample is
        the peer's backlog, not our start-up. Between 2 ranks every rail carries data both
        ways; 62 KB shares of a 36 Mbit/s rail sampled a_r = 38 ms, which took the rail out
        of the split for seconds at a time (2 hosts x 16 rails, seed 32 of ``testbed
        shapes``)."""
        share = msg.share.get(rail, 0)
        rx0, conn = msg.idle.get(rail), self.conns.get((msg.dst, rail))
        if share <= A_SAMPLE_MAX and tries == 1 and rail in msg.t0 and rx0 is not None \
                and conn is not None and conn.rx_bytes == rx0:
            if all(c.acked for c in msg.chunks if c.rail == rail):
                b = self.balancer.est[rail].b if rail < len(self.balancer.est) else float("nan")
                if b == b:
                    seconds = now - msg.t0[rail]
                    self.balancer.record_a(rail, seconds - share * b)
                    if self.debug_samples:
                        self.events.emit("a_sample", rail=rail, share=share, dst=msg.dst,
                                         seconds=seconds, b=b, op=msg.key[0], step=msg.key[1])
