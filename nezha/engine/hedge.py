"""Hedging: a share that falls behind is also sent on a rail that has already finished.

A message is done when its last share is. When one rail's share is late (its siblings on
the other rails were all acknowledged a while ago and, once the split comes from measured
costs, it has been on its rail longer than the model says it takes) its unacknowledged
chunks are queued
again on the best finished rail; the receiver keeps whichever copy arrives first (chunks are
named by offset) and acknowledges both. What a retransmission timeout, a burst of loss, a
stalled peer thread or a rail that just died costs one message is then about the lateness
threshold plus one chunk's time on a good rail, where TCP alone waits out its RTO (200 ms
by default) and failure detection takes longer still.

Four things keep this honest:
  * the late rail is charged for what it delivered itself and how long that took, never
    with the bytes the copies carried: a copy names the rail whose share it is (wire DATA
    aux, COPY_SHIFT) so the receiver can tell (costs.py), and a rail that keeps falling
    behind gets a smaller share;
  * the late rail's own copy stays outstanding on its connection (core.Engine.end_op hands
    it over as an orphan when the message is done), so the failure detector (health.py)
    still sees a rail that delivers nothing;
  * each chunk is copied at most once, and only onto a finished rail that is idle (nothing
    else of ours queued on it), so a copy uses capacity that would go unused;
  * a late copy never writes into a buffer once another copy of its chunk is in: the
    sender may reuse its buffer as soon as that copy is acknowledged, so the late copy's
    remaining bytes may no longer be the message's. A copy that lands while another is still
    being read in place cuts that read off before it writes (transport Connection.revoke:
    the rest goes to scratch), and so does the end of the operation (core.Engine.end_op);
    a copy whose chunk is already in is read into a private buffer and dropped. Before
    this, full suites gave wrong results (about 20,000 elements on every rank, in one
    operation) under a 30 % loss burst and a rail collapsing to 1 % of its rate, about once
    per 24 failover tests.
"""
from __future__ import annotations

import math

from ..balance import HOT

HEDGE_MIN_S = 0.010       # a share is late only this long after its last sibling finished...
HEDGE_FACTOR = 0.1        # ...and by a tenth of the time the siblings took (1 % loss, 2 x 200
                          # Mbit/s: 0.1 gave 1.18x the single rail, 0.25 1.09x, 1.0 1.02x)
HEDGE_OVERDUE = 1.5       # in HOT, only a share on its rail for this x what the agreed model
                          # says it takes (Hedging._overdue)


class Hedging:
    """Mixin of Engine (state in core.Engine.__init__); ``hedge`` runs on the health tick."""

    def hedge(self, now: float) -> None:
        """Copy the late shares of every message in flight onto a finished rail."""
        done = []
        with self.cond:
            if self.error is not None or self.closing or not self.sends:
                return
            for msg in self.sends.values():
                if msg.complete or not msg.done_at:
                    continue
                last = max(msg.done_at.values())
                # the siblings' own time: from their first byte out (a rail may first have
                # finished earlier messages) to their last ACK
                took = max(t - msg.t0.get(r, msg.t_queued) for r, t in msg.done_at.items())
                if now - last < max(HEDGE_MIN_S, HEDGE_FACTOR * took):
                    continue
                late = [r for r, n in msg.left.items() if n > 0 and self._overdue(msg, r, now)]
                to = self._hedge_target(msg) if late else None
                if to is None:
                    continue
                conn = self.conns[(msg.dst, to)]
                for r in late:
                    n = 0
                    for ch in msg.chunks:
                        if ch.rail == r and not ch.acked and not ch.hedged and to not in ch.out:
                            ch.hedged = True
                            ch.tries = 99      # no start-up sample from a copied chunk
                            self._queue(conn, ch)
                            n += 1
                    if n:
                        self.events.rails[r].hedged_chunks += n
                        done.append((msg.dst, r, n, to, (now - last) * 1e3, msg.key))
        for peer, rail, n, to, late_ms, key in done:
            self.events.emit("hedged", peer=peer, rail=rail, chunks=n, to=to,
                             late_ms=round(late_ms, 1), op=key[0], step=key[1])

    def _overdue(self, msg, rail: int, now: float) -> bool:
        """Is the share on ``rail`` late by the agreed model, not only by its siblings? In HOT
        the split is set by each rail's slowest hop of the ring, so on a faster hop some rail
        finishes first every time: one slow attachment (4 hosts, r0 200 + r1 100 Mbit/s, one
        host's r0 link at 40) had every hop but the slow one copying shares, 600 chunks in 16
        operations; the copies delayed the next shares, made the rails look up to twice as
        slow as they are and the split wander (122 Mbit/s, 129 without hedging, like MPTCP).
        A share is overdue once it has been on its rail HEDGE_OVERDUE x a + bytes x b; a
        rail that slowed or stalls on a loss still is, at once. Without a model (COLD, a
        pinned split) the siblings alone tell."""
        rs = self.balancer.rs
        if self.balancer.mode != "nezha" or rs.state != HOT or rs.used_b is None:
            return True
        b = rs.used_b[rail]
        if not (b > 0 and math.isfinite(b)):
            return True
        expected = rs.used_a[rail] + msg.share.get(rail, 0) * b
        return now - msg.t0.get(rail, msg.t_queued) > HEDGE_OVERDUE * expected

    def _hedge_target(self, msg):
        """The finished, idle rail to ``msg.dst`` with the lowest agreed cost per byte.
        Idle: nothing else of ours waits on it, so a copy takes only capacity that would go
        unused and never delays a share queued behind it."""
        live = self.live_rails(msg.dst)
        b = self.balancer.rs.b
        done = [r for r in msg.done_at if msg.left.get(r, 0) == 0 and r in live
                and self.conns[(msg.dst, r)].unacked == 0]
        if not done:
            return None
        return min(done, key=lambda r: (b[r] if not math.isnan(b[r]) else math.inf, r))
