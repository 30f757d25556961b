"""The data plane: posted receives, staging, sends split over rails, ACKs, failures.

The engine is the ``handler`` of every Connection. A message is one step of a collective
from one rank to another; it is named (op_id, step, src) and cut into chunks, each chunk
named by its byte offset. Receivers accept a chunk from any rail and ignore repeats, so a
sender may move unacknowledged chunks of a failed rail to the surviving ones.

Receive path: the reader thread parses a header, asks ``data_target`` for the destination
slice of the posted receive and ``recv_into``s straight into it. A frame that arrives
before its receive is posted goes to a bounded staging area (never blocks a rail thread);
it is copied and acknowledged when the receive is posted. ACKs of staged chunks are
therefore delayed, which bounds how far a peer can run ahead (one operation).
"""
from __future__ import annotations

import json
import threading
import time

from . import wire
from .balance import B_MIN_BYTES
from .errors import (AllRailsDownError, CommError, CommTimeout, MismatchError, PeerAbortedError,
                     PeerClosedError, ProtocolError)

A_SAMPLE_MAX = 64 << 10
ACK_PROGRESS = 2     # ACK.op_total: 0 = delivered, 1 = delivered after staging, 2 = progress only
OP_WINDOW = 64
_DEBUG_SAMPLES = bool(__import__('os').environ.get('NEZHA_DEBUG_SAMPLES'))
_TRACE = bool(__import__('os').environ.get('NEZHA_TRACE'))   # a tx/rx event per chunk


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


class Engine:
    def __init__(self, rank, world, nrails, balancer, events, timeout, staging_limit=1 << 30):
        self.rank, self.world, self.nrails = rank, world, nrails
        self.balancer = balancer
        self.events = events
        self.timeout = timeout
        self.staging_limit = staging_limit
        self.conns: dict[tuple[int, int], object] = {}
        self.dead: set[tuple[int, int]] = set()
        self.gone: set[int] = set()
        self.cond = threading.Condition()
        self.slots: dict[tuple, RecvSlot] = {}
        self.staged: dict[tuple, list] = {}
        self.staged_bytes = 0
        self.sends: dict[tuple, SendMsg] = {}
        self.error: BaseException | None = None
        self.op_seq = -1
        self.posted_op = -1
        self.done_op = -1
        self.closing = False
        self._aborted = False
        # rail -> {(reporting rank, peer)}: a rail somebody reported down is not used for data
        self.rail_down_reports: dict[int, set] = {}
        self._report_seq: dict = {}
        self._my_seq = 0
        self._rr = 0
        self.on_arrivals = None   # health.Health's answer handler (rank, rail, id, bytes)

    # ------------------------------------------------------------------ helpers
    def live_rails(self, peer, data: bool = True) -> list[int]:
        """Rails with a working connection to ``peer``; for data also not agreed down."""
        return [r for r in range(self.nrails)
                if (peer, r) in self.conns and (peer, r) not in self.dead
                and not (data and self.rail_down_reports.get(r))]

    def _queue(self, conn, ch):
        """Queue a data chunk on a connection and account it for the progress watchdog."""
        if conn.unacked == 0:
            conn.busy_since = time.monotonic()
        conn.unacked += 1
        conn.put(ch)

    def _settle(self, ch):
        c = self.conns.get((ch.msg.dst, ch.rail))
        if c is not None and c.unacked > 0:
            c.unacked -= 1

    def _ctrl(self, peer, frame: bytes, avoid=None) -> bool:
        """Queue a control frame to ``peer`` on a live rail, one other than ``avoid`` when there
        is one. False if no rail to the peer is left."""
        rails = self.live_rails(peer, data=False)
        if not rails:
            return False
        others = [r for r in rails if r != avoid]
        self.conns[(peer, (others or rails)[0])].put(frame)
        return True

    def _ack(self, conn, h, delayed: bool):
        frame = wire.pack(wire.ACK, h.kind, 0, 0, conn.rail, self.rank, h.length, h.op_id, h.step,
                          h.chunk, h.offset, 0, h.msg_total, 1 if delayed else 0)
        if conn.alive:
            conn.put(frame)
        else:
            self._ctrl(conn.peer, frame)

    def _check(self, slot: RecvSlot, h, conn):
        if (h.kind, h.dtype, h.redop, h.op_total, h.msg_total) != (
                slot.kind, slot.dtype, slot.redop, slot.op_total, slot.total) or (
                h.kind == wire.K_BROADCAST and h.aux != slot.aux):
            def d(kind, dtype, redop, op_total, total, aux):
                s = (f"{wire.KIND_NAMES.get(kind)} of {op_total} bytes of "
                     f"{wire.DTYPES.get(dtype)} op={wire.REDOPS.get(redop)}")
                return s + (f" root={aux}" if kind == wire.K_BROADCAST else "") + f" (step message {total} bytes)"
            raise MismatchError(
                f"collective mismatch at op {h.op_id}: rank {h.src} called "
                f"{d(h.kind, h.dtype, h.redop, h.op_total, h.msg_total, h.aux)} but rank {self.rank} called "
                f"{d(slot.kind, slot.dtype, slot.redop, slot.op_total, slot.total, slot.aux)}")

    # ------------------------------------------------------------------ ops
    def begin_op(self) -> int:
        with self.cond:
            if self.error is not None:
                raise self.error
            self.op_seq += 1
            return self.op_seq

    def end_op(self, op_id):
        with self.cond:
            # a late duplicate copy may still be writing (a rerouted chunk): its rail was
            # shut down, so that ends at once; wait so nobody writes into a returned buffer
            deadline = time.monotonic() + 1.0
            while any(s.writers for k, s in self.slots.items() if k[0] == op_id):
                if time.monotonic() > deadline:
                    break
                self.cond.wait(0.01)
            for k in [k for k in self.slots if k[0] <= op_id]:
                del self.slots[k]
            for k in [k for k in self.sends if k[0] <= op_id]:
                del self.sends[k]
            for k in [k for k in self.staged if k[0] <= op_id]:
                for _, buf, *_ in self.staged.pop(k):
                    self.staged_bytes -= len(buf)
            self.done_op = op_id
        self.balancer.note_op()

    def post_recv(self, op_id, step, src, view, kind, dtype, redop, op_total, aux=0) -> RecvSlot:
        key = (op_id, step, src)
        slot = RecvSlot(key, view, kind, dtype, redop, op_total, aux)
        err = None
        with self.cond:
            self.slots[key] = slot
            for h, buf, t1, t2, a1, a2 in self.staged.pop(key, ()):
                self.staged_bytes -= len(buf)
                if err is None:
                    try:
                        self._check(slot, h, None)
                    except CommError as e:
                        err = e
                        continue
                    if h.offset not in slot.done:
                        view[h.offset:h.offset + h.length] = buf
                        self._mark(slot, h, t1, t2, a1, a2)
                conn = self.conns.get((src, h.rail))
                if conn is not None:
                    self._ack(conn, h, True)
        if err is not None:
            self.fatal(err)
        return slot

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

    def _mark(self, slot, h, t_first, t_end, a_first=0, a_end=0):
        slot.frames += 1
        if h.offset in slot.done:
            return
        if slot.got + h.length > slot.total:
            raise ProtocolError(f"rank {h.src} sent more than {slot.total} bytes for op {h.op_id} step {h.step}")
        slot.done[h.offset] = h.length
        slot.got += h.length
        r = h.rail
        if r not in slot.first or t_first < slot.first[r]:
            slot.first[r], slot.afirst[r] = t_first, a_first
        if t_end >= slot.last.get(r, 0.0):
            slot.last[r], slot.alast[r] = t_end, a_end
        slot.rbytes[r] = slot.rbytes.get(r, 0) + h.length
        if r < len(self.events.rails):
            c = self.events.rails[r]
            c.bytes_recv += h.length
            c.chunks_recv += 1
        if slot.got == slot.total and slot.frames >= 1:
            slot.complete = True
            for rr, nb in slot.rbytes.items():
                # the rail's arrival rate while this share came in: bytes that reached the
                # socket between its first header and its last byte (not the bytes we read:
                # some may have queued before the first header, others after it)
                arrived = slot.alast[rr] - slot.afirst[rr]
                seconds = slot.last[rr] - slot.first[rr]
                if nb >= B_MIN_BYTES and arrived >= B_MIN_BYTES // 2:
                    self.balancer.record_b(rr, arrived, seconds)
                if _DEBUG_SAMPLES:
                    self.events.emit("b_sample", rail=rr, bytes=nb, arrived=arrived,
                                     seconds=seconds, since_post=slot.last[rr] - slot.t_post,
                                     op=slot.key[0], step=slot.key[1])
            self.cond.notify_all()

    def send(self, dst, op_id, step, view, kind, dtype, redop, op_total, aux=0, elem=1) -> SendMsg:
        key = (op_id, step, dst)
        msg = SendMsg(key, dst, view, kind, dtype, redop, op_total, aux)
        with self.cond:
            if self.error is not None:
                raise self.error
            live = self.live_rails(dst) or self.live_rails(dst, data=False)
            if not live:
                raise AllRailsDownError(f"no live rail to rank {dst}")
            plan = self.balancer.split(len(view), elem, live)
            cb = self.balancer.chunk_bytes
            for rail, off, length in plan:
                msg.share[rail] = length
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
            self.sends[key] = msg
            for ch in msg.chunks:
                self._queue(self.conns[(dst, ch.rail)], ch)
        return msg

    # ------------------------------------------------------------------ waiting
    def wait(self, pred, what: str, peers=(), deadline=None):
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        with self.cond:
            while True:
                if self.error is not None:
                    raise self.error
                if pred():
                    return
                for p in (peers() if callable(peers) else peers):
                    if p in self.gone:
                        exc = PeerClosedError(f"rank {p} closed the communicator while rank "
                                              f"{self.rank} was waiting for {what}")
                        self.cond.release()
                        try:
                            self.fatal(exc)
                        finally:
                            self.cond.acquire()
                        raise exc
                left = deadline - time.monotonic()
                if left <= 0:
                    exc = CommTimeout(f"rank {self.rank}: timed out after {self.timeout:g} s "
                                      f"waiting for {what}")
                    self.cond.release()
                    try:
                        self.fatal(exc)
                    finally:
                        self.cond.acquire()
                    raise exc
                self.cond.wait(min(left, 0.25))

    def wait_recv(self, slot: RecvSlot, deadline=None):
        op, step, src = slot.key
        self.wait(lambda: slot.complete, f"op {op} step {step} from rank {src}", (src,), deadline)

    def wait_sent(self, msgs, deadline=None):
        msgs = list(msgs)
        if not msgs:
            return
        self.wait(lambda: all(m.complete for m in msgs),
                  f"acknowledgements from ranks {sorted({m.dst for m in msgs})}",
                  lambda: {m.dst for m in msgs if not m.complete}, deadline)

    # ------------------------------------------------------------------ connection callbacks
    def before_send(self, conn, ch: SendChunk):
        with self.cond:
            if ch.acked or ch.msg.complete or ch.rail != conn.rail:
                return None
            msg = ch.msg
            now = time.monotonic()
            ch.t_send = now
            ch.tries += 1
            msg.t0.setdefault(conn.rail, now)
        hdr = wire.pack(wire.DATA, msg.kind, msg.dtype, msg.redop, conn.rail, self.rank, msg.aux,
                        msg.key[0], msg.key[1], ch.idx, ch.offset, ch.length, msg.total, msg.op_total)
        return hdr, msg.view[ch.offset:ch.offset + ch.length]

    def after_send(self, conn, ch: SendChunk):
        if _TRACE:
            self.events.emit("tx", rail=conn.rail, peer=conn.peer, op=ch.msg.key[0],
                             step=ch.msg.key[1], off=ch.offset, len=ch.length, t0=ch.t_send)
        c = self.events.rails[conn.rail]
        c.bytes_sent += ch.length
        c.chunks_sent += 1

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
            if h.offset in slot.done:
                return None
            slot.writers += 1
            conn.cur_slot = slot
            return slot.view[h.offset:h.offset + h.length]

    def release_target(self, conn):
        with self.cond:
            slot = getattr(conn, "cur_slot", None)
            if slot is not None:
                slot.writers -= 1
                conn.cur_slot = None
                self.cond.notify_all()

    def data_done(self, conn, h):
        now = time.monotonic()
        with self.cond:
            slot = conn.cur_slot
            conn.cur_slot = None
            slot.writers -= 1
            # queue the ACK before the op can complete (and the app close the connection)
            self._ack(conn, h, False)
            self._mark(slot, h, conn.t_hdr, now, conn.arr_hdr, conn.arr_end)
            if _TRACE:
                self.events.emit("rx", rail=conn.rail, peer=conn.peer, op=h.op_id, step=h.step,
                                 off=h.offset, len=h.length, t0=conn.t_hdr)
            if slot.writers == 0:
                self.cond.notify_all()

    def data_staged(self, conn, h, buf):
        now = time.monotonic()
        err = None
        with self.cond:
            if self.closing or self.error is not None:
                return
            key = (h.op_id, h.step, h.src)
            slot = self.slots.get(key)
            if slot is not None:             # posted meanwhile, or a duplicate
                self._check(slot, h, conn)
                self._ack(conn, h, False)
                if h.offset not in slot.done:
                    slot.view[h.offset:h.offset + h.length] = buf
                    self._mark(slot, h, conn.t_hdr, now, conn.arr_hdr, conn.arr_end)
                ack = False
            elif h.op_id <= self.done_op:    # late duplicate of a finished op
                ack = True
            elif h.op_id <= self.posted_op:
                raise self._unexpected(h)
            else:
                # tell the sender the bytes arrived (progress for its watchdog) without
                # completing the chunk: that ACK comes when the receive is posted
                conn.put(wire.pack(wire.ACK, h.kind, 0, 0, conn.rail, self.rank, h.length, h.op_id,
                                   h.step, h.chunk, h.offset, 0, h.msg_total, ACK_PROGRESS))
                self.staged.setdefault(key, []).append((h, buf, conn.t_hdr, now, conn.arr_hdr,
                                                        conn.arr_end))
                self.staged_bytes += len(buf)
                if self.staged_bytes > self.staging_limit:
                    err = ProtocolError(f"staging area overflow ({self.staged_bytes} bytes "
                                        f"arrived before their receives were posted)")
                ack = False
        if err is not None:
            raise err
        if ack:
            self._ack(conn, h, False)

    def on_ack(self, conn, h):
        now = time.monotonic()
        conn.last_ack = now
        if h.op_total == ACK_PROGRESS:
            return
        with self.cond:
            msg = self.sends.get((h.op_id, h.step, h.src))
            if msg is None or h.chunk >= len(msg.chunks):
                return
            ch = msg.chunks[h.chunk]
            if ch.acked:
                return
            if ch.offset != h.offset or ch.length != h.aux:
                raise ProtocolError(f"rank {h.src} acknowledged chunk {h.chunk} with wrong "
                                    f"offset/length")
            ch.acked = True
            self._settle(ch)
            msg.unacked -= 1
            rail = ch.rail
            share = msg.share.get(rail, 0)
            if not h.op_total and share <= A_SAMPLE_MAX and ch.tries == 1 and rail in msg.t0:
                if all(c.acked for c in msg.chunks if c.rail == rail):
                    t = now - msg.t0[rail]
                    b = self.balancer.est[rail].b if rail < len(self.balancer.est) else float("nan")
                    if b == b:
                        t -= share * b
                    self.balancer.record_a(rail, t)
            if msg.unacked == 0:
                msg.complete = True
                self.cond.notify_all()

    def on_abort(self, conn, h, text):
        self.fatal(PeerAbortedError(f"rank {h.src} failed: {text}"))

    def on_control(self, conn, h, payload):
        try:
            m = json.loads(payload)
            kind, rail = m["what"], int(m["rail"])
            if kind == "arrivals?":
                window, ident = float(m["window"]), int(m["id"])
            elif kind == "arrivals":
                nbytes, ident = int(m["bytes"]), int(m["id"])
        except (ValueError, KeyError, TypeError):
            raise ProtocolError(f"bad CONTROL payload from rank {h.src}")
        if not 0 <= rail < self.nrails:
            raise ProtocolError(f"CONTROL for unknown rail {rail} from rank {h.src}")
        if kind == "arrivals?":
            # the peer's watchdog sees no progress on its connection to us on this rail: tell
            # it how many bytes reached us on it lately (a slow rail: some; a black hole: none)
            c = self.conns.get((h.src, rail))
            got = c.arrived_within(min(max(window, 0.0), 5.0)) if c is not None and c.alive else 0
            self.send_control(h.src, {"what": "arrivals", "rail": rail, "id": ident, "bytes": got},
                              avoid=rail)
        elif kind == "arrivals":
            if self.on_arrivals is not None:
                self.on_arrivals(h.src, rail, ident, nbytes)
        else:
            self._apply_report(kind, rail, h.src, int(m.get("peer", -1)), m.get("op"),
                               int(m.get("seq", 0)), m.get("conn"))

    def send_control(self, peer: int, body: dict, avoid=None) -> bool:
        """A CONTROL frame with a JSON body to ``peer`` (see ``_ctrl`` for the rail)."""
        data = json.dumps(body).encode()
        return self._ctrl(peer, wire.pack(wire.CONTROL, 0, 0, 0, 0, self.rank, 0, self.op_seq,
                                          0, 0, 0, len(data), 0, 0) + data, avoid)

    def _apply_report(self, kind, rail, reporter, peer, op, seq=0, ident=None):
        if kind == "down" and peer == self.rank and reporter != self.rank:
            # the other end of our connection saw it fail: do not wait for our own detection
            # (only if it is the same TCP connection, not one that has rejoined since)
            c = self.conns.get((reporter, rail))
            if c is not None and c.alive and ident and list(c.ident[::-1]) == list(ident):
                c.fail(PeerClosedError(f"rank {reporter} reported rail {rail} down"))
        with self.cond:
            last = self._report_seq.get((reporter, peer, rail), -1)
            if seq <= last:
                return                      # an older report overtaken by a newer one
            self._report_seq[(reporter, peer, rail)] = seq
            rep = self.rail_down_reports.setdefault(rail, set())
            before = bool(rep)
            if kind == "down":
                rep.add((reporter, peer))
            elif kind == "up":
                rep.discard((reporter, peer))
            after = bool(rep)
            self.cond.notify_all()
        if before != after:
            self.events.emit("rail_agreed", rail=rail, state="down" if after else "up",
                             by=reporter, peer=peer, op=op)
            if rail < len(self.events.rail_status):
                self.events.rail_status[rail] = "down" if after else "up"

    def report_rail(self, kind: str, rail: int, peer: int, conn=None):
        """Tell every rank (over any working rail) that our link to ``peer`` on ``rail`` went
        down / came back, and apply it here. Everyone stops / resumes using the rail for data.
        Reports carry a per-sender sequence number (they may travel on different rails and
        overtake each other) and the TCP ports of the connection concerned."""
        with self.cond:
            self._my_seq += 1
            seq = self._my_seq
        body = {"what": kind, "rail": rail, "peer": peer, "op": self.op_seq, "seq": seq,
                "conn": list(conn.ident) if conn is not None else None}
        for p in range(self.world):
            if p != self.rank:
                self.send_control(p, body)
        self._apply_report(kind, rail, self.rank, peer, self.op_seq, seq)

    def on_probe(self, conn, h):
        pass

    def on_bye(self, conn):
        # the peer is closing: flush what we queued for it, then close our side
        conn.q.put(None)

    def on_closed(self, conn):
        with self.cond:
            self.dead.add((conn.peer, conn.rail))
            if not self.live_rails(conn.peer):
                self.gone.add(conn.peer)
            self.cond.notify_all()

    def on_failed(self, conn, exc, protocol: bool):
        self.release_target(conn)
        if self.closing:
            return
        if protocol:
            if isinstance(exc, CommError):
                exc = type(exc)(f"{exc} (frame from rank {conn.peer} on rail {conn.rail})")
            else:
                exc = ProtocolError(f"internal error handling a frame from rank {conn.peer} "
                                    f"on rail {conn.rail}: {exc!r}")
            self.fatal(exc)
            return
        self.rail_failed(conn, exc)

    def rail_failed(self, conn, exc):
        peer, rail = conn.peer, conn.rail
        moved = 0
        with self.cond:
            if (peer, rail) in self.dead:
                return
            self.dead.add((peer, rail))
            # prefer rails nobody reported down; a reported-down rail that still works for
            # this peer is better than giving up
            live = self.live_rails(peer) or self.live_rails(peer, data=False)
            if live:
                for msg in list(self.sends.values()):
                    if msg.dst != peer or msg.complete:
                        continue
                    for ch in msg.chunks:
                        if not ch.acked and ch.rail == rail:
                            ch.tries = 99      # no start-up sample from a rerouted chunk
                            ch.rail = live[self._rr % len(live)]
                            self._rr += 1
                            self._queue(self.conns[(peer, ch.rail)], ch)
                            self.events.rails[rail].rerouted_chunks += 1
                            moved += 1
            else:
                self.gone.add(peer)
            self.cond.notify_all()
        self.events.emit("rail_down", peer=peer, rail=rail, reason=str(exc))
        if live and not self.closing:
            self.report_rail("down", rail, peer, conn)
        if moved:
            self.events.emit("rerouted", peer=peer, rail=rail, chunks=moved, to=live)
        if not live:
            if isinstance(exc, PeerClosedError):
                self.fatal(PeerClosedError(f"{exc} (no rail to rank {peer} is left)"))
            else:
                self.fatal(AllRailsDownError(f"all rails to rank {peer} failed; last on rail "
                                             f"{rail}: {exc}"))

    # ------------------------------------------------------------------ failure
    def fatal(self, exc: BaseException):
        with self.cond:
            if self.error is not None:
                return
            self.error = exc
            self.cond.notify_all()
        self.events.emit("error", error=type(exc).__name__, message=str(exc))
        if self.closing or self._aborted:
            return
        self._aborted = True
        reason = f"{type(exc).__name__}: {exc}"
        for (peer, rail), conn in list(self.conns.items()):
            if conn.alive:
                conn.send_abort(reason, self.rank)
