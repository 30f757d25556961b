"""Failover in the engine: a connection that fails moves its unacknowledged chunks to the
surviving rails to the same peer (receivers accept a chunk from any rail and ignore repeats),
tells every rank (agreement.py: directly or through the ring's relays), and fails the
communicator only on a protocol violation.

When the last rail to a peer fails, the peer is *unreachable*, not lost: its chunks are parked
(unsent, unacknowledged) and the health thread keeps re-dialling; the first rail that comes
back (``rail_restored``) carries them, and the collective goes on with exact results. A switch
that reboots or a NIC reset (every rail of a host down for 1.5 s) used to end the job with
AllRailsDownError although the collective's timeout was 30 s; one TCP connection would have
retransmitted through it. The wait's deadline still bounds the outage (core.Engine.wait names
how long the peer was unreachable), and a peer whose process is gone is told apart at once:
every rail refuses a connection (health.py), which fails the job with PeerClosedError.
"""
from __future__ import annotations

import time

from ..errors import CommError, PeerAbortedError, ProtocolError


class Failover:
    """Mixin of Engine (state in core.Engine.__init__)."""

    def on_probe(self, conn, h):
        pass

    def on_bye(self, conn):
        # the peer is closing: flush what we queued for it, then close our side
        conn.q.put(None)

    def _replaced(self, conn) -> bool:
        """A rejoin installed another connection on ``conn``'s rail (rendezvous._install):
        what ``conn`` does now says nothing about the rail."""
        return self.conns.get((conn.peer, conn.rail), conn) is not conn

    def on_closed(self, conn):
        with self.cond:
            if self._replaced(conn):
                return
            self.dead.add((conn.peer, conn.rail))
            if not self.live_rails(conn.peer):
                self.gone.add(conn.peer)
            self.cond.notify_all()
        self._trouble()

    def _trouble(self) -> None:
        if self.on_trouble is not None:
            self.on_trouble()

    def on_abort(self, conn, h, text):
        self.fatal(PeerAbortedError(f"rank {h.src} failed: {text}"))

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

    def dropped(self, peer: int, rail: int) -> bool:
        """Our end of the connection to ``peer`` on ``rail`` failed (``rail_failed`` or the
        peer's BYE) and no other has replaced it: an end the peer still holds is stale, which
        our answers to its probes and questions tell it (health.py)."""
        c = self.conns.get((peer, rail))
        return (peer, rail) in self.dead and (c is None or not c.alive)

    def rail_failed(self, conn, exc):
        peer, rail = conn.peer, conn.rail
        with self.cond:
            if self._replaced(conn):
                # its end (an EOF read after the new one was installed, or the replacing
                # rendezvous failing it) is not the rail's: its unacknowledged chunks go again
                # on the live rails, the new connection among them; the rail stays up
                live = self.live_rails(peer) or self.live_rails(peer, data=False)
                if live:
                    self._reroute(peer, rail, live)
                self.cond.notify_all()
                return
            if (peer, rail) in self.dead:
                return
            self.dead.add((peer, rail))
            # prefer rails nobody reported down; a reported-down rail that still works for
            # this peer is better than giving up
            live = self.live_rails(peer) or self.live_rails(peer, data=False)
            moved = self._reroute(peer, rail, live) if live else self._park(peer, rail)
            if not live:
                self.unreachable.setdefault(peer, (time.monotonic(), f"rail {rail}: {exc}"))
            self.cond.notify_all()
        self._trouble()
        self.events.emit("rail_down", peer=peer, rail=rail, reason=str(exc))
        if live and not self.closing:
            self.report_rail("down", rail, peer, conn)
        if moved and live:
            self.events.emit("rerouted", peer=peer, rail=rail, chunks=moved, to=live)
        if not live:
            self.events.emit("peer_unreachable", peer=peer, rail=rail, parked=moved,
                             reason=str(exc)[:300])

    def _park(self, peer: int, rail: int) -> int:
        """The last rail to ``peer`` failed: its unacknowledged copies are given up (under
        cond) and wait, unsent, for a rail to come back. Returns how many chunks wait."""
        parked = 0
        for msg in self.sends.values():
            if msg.dst != peer or msg.complete:
                continue
            for ch in msg.chunks:
                self._settle(ch, rail)
                if not ch.acked and not ch.out:
                    ch.tries = 99      # no start-up sample from a chunk sent twice
                    parked += 1
        return parked

    def rail_restored(self, peer: int, rail: int) -> None:
        """A connection to ``peer`` on ``rail`` is up (rejoin): if the peer was unreachable,
        the parked chunks go out on it (the split of later operations spreads again once the
        rail agreement says so)."""
        with self.cond:
            since = self.unreachable.pop(peer, None)
            if since is None:
                return
            conn = self.conns[(peer, rail)]
            moved = 0
            for msg in self.sends.values():
                if msg.dst != peer or msg.complete:
                    continue
                for ch in msg.chunks:
                    if ch.acked or ch.out:
                        continue
                    msg.left[ch.rail] -= 1
                    msg.left[rail] = msg.left.get(rail, 0) + 1
                    ch.rail = rail
                    self._queue(conn, ch)
                    moved += 1
            self.cond.notify_all()
        self.events.emit("peer_reachable", peer=peer, rail=rail, chunks=moved,
                         outage_ms=round((time.monotonic() - since[0]) * 1e3, 1))

    def _reroute(self, peer: int, rail: int, live: list) -> int:
        """Deal the unacknowledged chunks to ``peer`` on ``rail`` round-robin over ``live``
        (under cond). A hedge copy on ``rail`` whose original is still out elsewhere needs
        no new copy. Returns how many moved."""
        moved = 0
        for msg in list(self.sends.values()):
            if msg.dst != peer or msg.complete:
                continue
            for ch in msg.chunks:
                if ch.acked or rail not in ch.out:
                    continue
                self._settle(ch, rail)
                if ch.rail != rail and ch.rail in ch.out:
                    continue
                ch.tries = 99      # no start-up sample from a rerouted chunk
                to = live[self._rr % len(live)]
                self._rr += 1
                msg.left[ch.rail] -= 1
                msg.left[to] = msg.left.get(to, 0) + 1
                ch.rail = to
                self._queue(self.conns[(peer, to)], ch)
                self.events.rails[rail].rerouted_chunks += 1
                moved += 1
        return moved
