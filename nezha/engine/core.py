"""The Engine object: its state, operation bracketing, waiting, and fatal failure.

Its methods live in five modules by concern (receive, send, agreement, failover, hedge), combined
here; every piece of state is created in ``Engine.__init__`` below.
"""
from __future__ import annotations

import threading
import time

from ..buffers import Scratch
from ..config import Config
from ..costs import ShareCosts
from ..errors import AllRailsDownError, CommTimeout, PeerClosedError
from .agreement import Agreement
from .failover import Failover
from .hedge import Hedging
from .messages import RecvSlot, SendMsg
from .receive import Receiving
from .send import Sending


class Engine(Receiving, Sending, Agreement, Failover, Hedging):
    def __init__(self, rank, world, nrails, balancer, events, config: Config = Config()):
        self.rank, self.world, self.nrails = rank, world, nrails
        self.balancer = balancer
        self.events = events
        self.timeout = config.timeout
        self.staging_limit = config.staging_limit
        self.scratch = Scratch()     # the ring's receive buffer (collectives._Ring)
        self.debug_samples = config.debug_samples   # b_sample / a_sample events per sample
        self.hedging = config.hedge                 # engine/hedge.py (NEZHA_HEDGE=0: off)
        self.trace = config.trace                   # a tx/rx event per chunk
        self.conns: dict[tuple[int, int], object] = {}
        self.dead: set[tuple[int, int]] = set()
        self.gone: set[int] = set()
        # peer -> (since, why): every rail to it failed; its chunks wait for one to come back
        self.unreachable: dict[int, tuple[float, str]] = {}
        self.cond = threading.Condition()
        self.slots: dict[tuple, RecvSlot] = {}
        self.staged: dict[tuple, list] = {}
        self.staged_bytes = 0
        self.sends: dict[tuple, SendMsg] = {}
        self.error: BaseException | None = None
        self.op_seq = -1
        self.op_rx: tuple = (time.monotonic(), {})   # begin_op: (time, conn key -> (conn, rx_all))
        self.posted_op = -1
        self.done_op = -1
        self.closing = False
        self.silenced = False     # test hook (Context._debug_silence)
        self._aborted = False
        # rail -> {(reporting rank, peer)}: a rail somebody reported down is not used for data
        self.rail_down_reports: dict[int, set] = {}
        self._report_seq: dict = {}
        self._my_seq = 0
        self._rr = 0
        self.on_arrivals = None   # health.Health's answer handler (rank, rail, id, bytes)
        self.on_acks_question = None   # health.Health: (rank, rail, window) -> 1 moving / 0
        self.on_acks = None            # health.Health's handler of that answer
        self.on_redial = None          # health.Health: (rank, rail) a peer's link came back
        self.on_trouble = None         # health.Health: a rail failed (its re-dial loops wake)
        # rendezvous.Rendezvous.reach: connects a peer that is not a start peer on first use
        self.reach_peer = None
        self.costs = ShareCosts(nrails)   # per-rail share times of the current op (costs.py)

    def live_rails(self, peer, data: bool = True) -> list[int]:
        """Rails with a working connection to ``peer``; for data also not agreed down."""
        return [r for r in range(self.nrails)
                if (peer, r) in self.conns and (peer, r) not in self.dead
                and not (data and self.rail_down_reports.get(r))]

    def reach(self, peer: int) -> None:
        """Before a message to ``peer``: connect to it if this rank never was (only the ring
        neighbours are connected at start, rendezvous.py). Failing that fails the job, as a
        lost connection would: the peer waits for this message."""
        if self.reach_peer is None or peer == self.rank:
            return
        if any((peer, r) in self.conns for r in range(self.nrails)):
            return
        if self.error is not None:
            raise self.error
        try:
            self.reach_peer(peer)
        except Exception as e:
            self.fatal(e)
            raise

    # ------------------------------------------------------------------ ops
    def begin_op(self) -> int:
        with self.cond:
            if self.error is not None:
                raise self.error
            self.op_seq += 1
            # what had reached us on each connection (costs.op_ended: a rail whose shares
            # were all carried by copies is charged what came in on it since)
            self.op_rx = (time.monotonic(), {k: (c, c.rx_all) for k, c in self.conns.items()})
            return self.op_seq

    def end_op(self, op_id):
        with self.cond:
            # the caller gets its buffers back: a late copy still being read into them (a
            # hedged or rerouted chunk) finishes into scratch
            ended = [k for k in self.slots if k[0] <= op_id]
            for k in ended:
                for conn in list(self.slots[k].busy.values()):
                    conn.revoke()
            t_begin, rx0 = self.op_rx
            self.costs.op_ended([self.slots[k] for k in ended], self._delivered_since(rx0),
                                time.monotonic() - t_begin)
            for k in ended:
                del self.slots[k]
            for k in [k for k in self.sends if k[0] <= op_id]:
                if self.sends[k].detached and not self.sends[k].complete:
                    continue        # still the only copy of its bytes on the way: on_ack
                msg = self.sends.pop(k)
                for ch in msg.chunks:       # copies still out: their ACKs come later
                    for r in ch.out:
                        c = self.conns.get((msg.dst, r))
                        if c is not None:
                            c.orphans += 1
            for k in [k for k in self.staged if k[0] <= op_id]:
                for _, buf, *_ in self.staged.pop(k):
                    self.staged_bytes -= len(buf)
            self.done_op = op_id

    def _delivered_since(self, rx0: dict):
        """(peer, rail) -> bytes that reached us on that connection since ``rx0`` was taken
        (read, or waiting in the kernel's queue: a reader short of CPU is not a slow rail);
        None if it is not the same connection (re-dialled meanwhile: nothing to compare)."""
        def delivered(peer: int, rail: int) -> int | None:
            c = self.conns.get((peer, rail))
            then = rx0.get((peer, rail))
            if c is None or then is None or then[0] is not c:
                return None
            return max(0, c.arrived() - then[1])
        return delivered

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
                        raise self._fail_waiting(PeerClosedError(
                            f"rank {p} closed the communicator while rank {self.rank} was "
                            f"waiting for {what}"))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._fail_waiting(self._timed_out(what, peers))
                self.cond.wait(min(left, 0.25))

    def _timed_out(self, what: str, peers) -> BaseException:
        """The error of a wait whose deadline passed (under cond): an unreachable peer (the
        one waited for first) is the likely cause and is named with how long it was."""
        waited = set(peers() if callable(peers) else peers)
        gone = sorted(self.unreachable, key=lambda p: (p not in waited, p))
        text = f"rank {self.rank}: timed out after {self.timeout:g} s waiting for {what}"
        if not gone:
            return CommTimeout(text)
        since, why = self.unreachable[gone[0]]
        return AllRailsDownError(
            f"{text}: rank {gone[0]} unreachable for {time.monotonic() - since:.1f} s, every "
            f"rail to it down (first: {why})")

    def _fail_waiting(self, exc: BaseException) -> BaseException:
        """``fatal(exc)`` from inside ``wait`` (which holds cond); returns exc to raise."""
        self.cond.release()
        try:
            self.fatal(exc)
        finally:
            self.cond.acquire()
        return exc

    def wait_written(self, msgs, deadline=None):
        """Until every chunk of ``msgs`` was handed to its rail (and counted there: a caller
        reading the rail counters after the collective sees its bytes) or acknowledged. A
        detached message's caller waits for this, not for its ACKs."""
        msgs = list(msgs)

        def unwritten(m) -> bool:
            return not m.complete and any(ch.t_send <= 0 for ch in m.chunks)
        self.wait(lambda: not any(map(unwritten, msgs)),
                  f"our messages to ranks {sorted({m.dst for m in msgs})} to be written",
                  lambda: {m.dst for m in msgs if unwritten(m)}, deadline)

    def settle_detached(self, timeout: float) -> None:
        """Before closing: give the detached messages still on the way (a peer may still be
        waiting for one) ``timeout`` s to be acknowledged. Never raises."""
        end = time.monotonic() + timeout
        with self.cond:
            while self.error is None and any(
                    m.detached and not m.complete and m.dst not in self.gone
                    for m in self.sends.values()):
                left = end - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(min(left, 0.05))

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
