"""Observability: per-rail counters and a JSON-lines event log.

Every event-log line is one JSON object::

    {"t": <time.monotonic()>, "event": "<name>", "rank": <int>, ...fields}

Event names and their fields (``rail`` is the rail index, ``peer`` a rank):

  init            system, world, rails (addresses)
  connected       peers, rails
  link_monitor    ok, rails {ifindex: rail} | error     (netlink link-event watcher)
  state           state "cold"|"hot", reason, [live]     (agreed balancing state)
  weights         shares [per rail, for a 16 MiB message], state, a [s], b [s/byte],
                  [shifted: rails whose last operation showed a change, balance._shifts]
  overhead_trial  phase "start"|"kept"|"reverted"|"abandoned", scale (1: the rail overhead
                  counted, 0: not), before_ns_per_kb, [after_ns_per_kb]  (agreed, trial.py)
  rail_check      peer, rail, stalled_ms, window_ms, tcp {rto_ms, rtt_ms, cwnd, ...}
                                                         (watchdog: asks the peer if bytes arrive)
  rail_alive      peer, rail, bytes, waited_ms           (the peer said yes: slow, not dead)
  rail_suspected  rail, [peer], reason, [last_rail]      (watchdog, heartbeat, netlink)
  rail_down       peer, rail, reason                     (this rank stopped using it)
  rerouted        peer, rail, chunks, to [rails]         (unacked chunks moved)
  hedged          peer, rail, chunks, to, late_ms, op, step  (a late share's chunks also sent on
                                                         rail ``to``, engine/hedge.py)
  rail_agreed     rail, state "down"|"up", by, peer, op  (rail usable by nobody / again)
  probe           peer, rail, next_in | ok=false, error  (re-connect attempt)
  rail_up         peer, rail, how "reconnected"|"accepted"
  peer_unreachable  peer, rail, parked, reason           (the last rail to the peer failed: its
                                                         chunks wait for a rail to come back)
  peer_reachable  peer, rail, chunks, outage_ms          (a rail is back: the parked chunks go)
  stray_connection  rail, peer "addr:port", reason        (a rail connection refused: not one of
                                                         ours, no proof of the secret, too many)
  store_refused   peer "addr:port", reason               (the store refused a connection or request)
  unauthenticated message                                (no job secret: said once per Context)
  hybrid_split    rail (aggregation rail name), shares {tcp, aggregation} (of a 16 MiB
                  allreduce), state, up, b_ring, b_agg [s/byte], a_agg [s]  (hybrid.py: the
                                                         agreed split across protocols)
  agg_failed      rail, op, error                        (this rank's aggregation half failed)
  agg_down        rail, reason, failed [ranks], unreachable [ranks], recomputed_bytes
                                                         (agreed: no aggregation share until back)
  agg_back        rail, down_ms                          (agreed: every rank reaches the switch)
  error           error (class), message                 (the communicator failed)
  call / op_start / op_end   kind, bytes, [op]           (only with log_ops / NEZHA_LOG_OPS=1)
  b_sample        rail, bytes, seconds, op               (an operation's cost sample on a rail,
                                                         costs.py; only with NEZHA_DEBUG_SAMPLES=1)
  a_sample        rail, share, dst, seconds, b, op, step (a start-up sample: a small share's send
                                                         to last ACK, seconds, before b x share is
                                                         taken off; engine/send.py, the same flag)
  tx / rx         rail, peer, op, step, off, len, t0     (one per chunk, only with NEZHA_TRACE=1)
  close
CLOCK_MONOTONIC is shared by all network namespaces of one machine, so logs of several
ranks can be merged on one timeline.
"""
from __future__ import annotations

import json
import os
import threading
import time


class RailCounters:
    __slots__ = ("bytes_sent", "bytes_recv", "chunks_sent", "chunks_recv", "rerouted_chunks",
                 "hedged_chunks")

    def __init__(self):
        self.bytes_sent = self.bytes_recv = 0
        self.chunks_sent = self.chunks_recv = self.rerouted_chunks = self.hedged_chunks = 0

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__slots__}


class Events:
    """Counters and the event log of one rank; ``path`` None: no log (the Context passes
    NEZHA_EVENT_LOG's value from the config)."""

    def __init__(self, rank: int, nrails: int, path: str | None = None, log_ops: bool = False):
        self.rank = rank
        self.rails = [RailCounters() for _ in range(nrails)]
        self.weights = [1.0 / nrails] * nrails if nrails else []
        self.state = "cold"
        self.rail_status = ["up"] * nrails
        self.log_ops = log_ops
        self._lock = threading.Lock()
        self._fh = None
        if path:
            d = os.path.dirname(path)
            if d:
                os.makedirs(d, exist_ok=True)
            self._fh = open(path, "a", buffering=1)
        self.path = path

    def emit(self, event: str, **fields):
        if self._fh is None:
            return
        rec = {"t": time.monotonic(), "event": event, "rank": self.rank}
        rec.update(fields)
        line = json.dumps(rec, default=str)
        with self._lock:
            if self._fh is not None:
                self._fh.write(line + "\n")

    def rail_bytes(self):
        """{"0": bytes sent on rail 0, ...} (cumulative)."""
        return {str(i): c.bytes_sent for i, c in enumerate(self.rails)}

    def snapshot(self):
        return {"state": self.state, "weights": list(self.weights),
                "rail_status": list(self.rail_status),
                "rails": [c.as_dict() for c in self.rails]}

    def close(self):
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
