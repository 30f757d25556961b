"""Failover in the engine: a connection that fails moves its unacknowledged chunks to the
surviving rails to the same peer (receivers accept a chunk from any rail and ignore repeats),
tells every rank (agreement.py), and fails the communicator only when no rail to the peer
is left or the failure was a protocol violation."""
from __future__ import annotations

from ..errors import (AllRailsDownError, CommError, PeerAbortedError, PeerClosedError,
                      ProtocolError)


class Failover:
    """Mixin of Engine (state in core.Engine.__init__)."""

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

    def rail_failed(self, conn, exc):
        peer, rail = conn.peer, conn.rail
        with self.cond:
            if (peer, rail) in self.dead:
                return
            self.dead.add((peer, rail))
            # prefer rails nobody reported down; a reported-down rail that still works for
            # this peer is better than giving up
            live = self.live_rails(peer) or self.live_rails(peer, data=False)
            if live:
                moved = self._reroute(peer, rail, live)
            else:
                moved = 0
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
