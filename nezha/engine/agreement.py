"""Control plane of the engine: CONTROL frames, and the agreement on which rails carry data.

A rank that sees its link to a peer fail (or come back) tells every rank (``report_rail``);
a rail somebody reports down is used by nobody for data until every report is withdrawn
(``rail_down_reports``). Reports carry a per-sender sequence number, since they may travel
on different rails and overtake each other. A rank holds connections to its ring
neighbours only (and to the peers it has exchanged data with, rendezvous.py), so a report
goes to every peer the reporter is connected to and each rank that learns something new
from it relays it to its ring neighbours (``_relay``): it goes round the ring both ways, so
one failed link (or a whole unreachable neighbour) does not stop it, and the per-sender
sequence number, which already drops an overtaken report, ends the relaying. The
watchdog's "do my bytes still arrive?" question and its answer (health.py) travel as CONTROL
frames too (to the peer of the connection in question: always a connected one).
"""
from __future__ import annotations

import json

from .. import wire
from ..errors import PeerClosedError, ProtocolError


class Agreement:
    """Mixin of Engine (state in core.Engine.__init__)."""

    def _ctrl(self, peer, frame: bytes, avoid=None) -> bool:
        """Queue a control frame to ``peer`` on a live rail, one other than ``avoid`` when there
        is one. False if no rail to the peer is left."""
        rails = self.live_rails(peer, data=False)
        if not rails:
            return False
        others = [r for r in rails if r != avoid]
        self.conns[(peer, (others or rails)[0])].put(frame)
        return True

    def send_control(self, peer: int, body: dict, avoid=None) -> bool:
        """A CONTROL frame with a JSON body to ``peer`` (see ``_ctrl`` for the rail)."""
        data = json.dumps(body).encode()
        # op_seq is -1 before the first collective: the header's op_id is unsigned (and
        # nobody reads it on a CONTROL frame; the body's "op" says which op it was)
        return self._ctrl(peer, wire.frame(wire.CONTROL, data, src=self.rank,
                                           op_id=max(self.op_seq, 0)), avoid)

    def on_control(self, conn, h, payload):
        try:
            m = json.loads(payload)
            kind, rail = m["what"], int(m["rail"])
            if kind in ("arrivals?", "acks?"):
                window, ident = float(m["window"]), int(m["id"])
            elif kind in ("arrivals", "acks"):
                nbytes, ident = int(m["bytes"]), int(m["id"])
        except (ValueError, KeyError, TypeError):
            raise ProtocolError(f"bad CONTROL payload from rank {h.src}")
        if not 0 <= rail < self.nrails:
            raise ProtocolError(f"CONTROL for unknown rail {rail} from rank {h.src}")
        if kind == "arrivals?":
            # the peer's watchdog sees no progress on its connection to us on this rail: tell
            # it how many bytes reached us on it lately (a slow rail: some; a black hole: none)
            self.send_control(h.src, {"what": "arrivals", "rail": rail, "id": ident,
                                      "bytes": self.arrivals_within(h.src, rail, window)},
                              avoid=rail)
        elif kind == "arrivals":
            if self.on_arrivals is not None:
                self.on_arrivals(h.src, rail, ident, nbytes)
        elif kind == "acks?":
            # the peer receives nothing from us on this rail: does our TCP still get ACKs
            # on it (1) or has it had data in flight without any ACK for that long (0)?
            moving = 1 if self.on_acks_question is None else \
                self.on_acks_question(h.src, rail, min(max(window, 0.0), 5.0))
            self.send_control(h.src, {"what": "acks", "rail": rail, "id": ident,
                                      "bytes": moving}, avoid=rail)
        elif kind == "acks":
            if self.on_acks is not None:
                self.on_acks(h.src, rail, ident, nbytes)
        elif kind == "redial":
            if self.on_redial is not None:
                self.on_redial(h.src, rail)
        else:
            by = int(m.get("by", h.src))
            if not 0 <= by < self.world:
                raise ProtocolError(f"CONTROL report of unknown rank {by} from rank {h.src}")
            if self._apply_report(kind, rail, by, int(m.get("peer", -1)), m.get("op"),
                                  int(m.get("seq", 0)), m.get("conn")):
                self._relay(m, h.src)

    def arrivals_within(self, peer: int, rail: int, window: float) -> int:
        """Bytes that reached us from ``peer`` on ``rail`` in the last ``window`` s (at most
        5 s): the answer to its "arrivals?", as a CONTROL frame or a datagram (health.py);
        wire.NO_CONNECTION if our end of that connection failed (failover ``dropped``)."""
        c = self.conns.get((peer, rail))
        if c is None or not c.alive:
            return wire.NO_CONNECTION if self.dropped(peer, rail) else 0
        return min(c.arrived_within(min(max(window, 0.0), 5.0)), wire.NO_CONNECTION - 1)

    def _relay(self, body: dict, came_from: int) -> None:
        """Pass a report new to this rank on to its ring neighbours (not back where it came
        from, nor to its reporter)."""
        for p in {(self.rank - 1) % self.world, (self.rank + 1) % self.world}:
            if p not in (self.rank, came_from, body.get("by")):
                self.send_control(p, body)

    def _apply_report(self, kind, rail, reporter, peer, op, seq=0, ident=None) -> bool:
        """Apply one report (ours or another rank's); False if it was not new here."""
        if kind == "down" and peer == self.rank and reporter != self.rank:
            # the other end of our connection saw it fail: do not wait for our own detection
            # (only if it is the same TCP connection, not one that has rejoined since)
            c = self.conns.get((reporter, rail))
            if c is not None and c.alive and ident and list(c.ident[::-1]) == list(ident):
                c.fail(PeerClosedError(f"rank {reporter} reported rail {rail} down"))
        with self.cond:
            last = self._report_seq.get((reporter, peer, rail), -1)
            if seq <= last:
                return False                # seen already, or overtaken by a newer one
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
        return True

    def report_rail(self, kind: str, rail: int, peer: int, conn=None):
        """Tell every rank (over any working rail; the ones this rank is not connected to
        through the ring's relays) that our link to ``peer`` on ``rail`` went down / came
        back, and apply it here. Everyone stops / resumes using the rail for data. Reports
        carry a per-sender sequence number (they may travel on different rails and paths and
        overtake each other) and the TCP ports of the connection concerned."""
        with self.cond:
            self._my_seq += 1
            seq = self._my_seq
        body = {"what": kind, "rail": rail, "peer": peer, "op": self.op_seq, "seq": seq,
                "conn": list(conn.ident) if conn is not None else None, "by": self.rank}
        for p in sorted({p for p, _ in list(self.conns)} - {self.rank}):
            self.send_control(p, body)
        self._apply_report(kind, rail, self.rank, peer, self.op_seq, seq)
