"""Rail health: failure detection in layers, and re-probing of failed rails.

1. Socket errors / EOF fail a connection at once (transport reader and writer threads).
2. Progress watchdog: a connection with unacknowledged chunks and bytes in flight, whose
   kernel-level delivery counter (TCP_INFO tcpi_delivered, i.e. TCP ACKs incl. SACKs) has not
   moved and on which no ACK at all (tcpi_last_ack_recv, not even a duplicate) arrived for
   ``stall_limit(rail)`` = max(WATCHDOG_MIN, WATCHDOG_FACTOR * (a_r + 64 KiB * b_r),
   WATCHDOG_RTO * tcpi_rto before back-off), is *checked*: the peer is asked over another rail
   whether bytes still reach it on that connection. Nothing (or no answer within
   CHECK_TIMEOUT) means a black hole, if the probes agree; some means slow, not dead. A
   congested or lossy rail keeps returning ACKs while delivery waits on a retransmission; the
   RTO term keeps a plain loss from triggering a check; the sockets' minimum RTO
   (``NEZHA_TCP_RTO_MIN_MS``, or the routes' ``rto_min``) keeps detection fast. Kernel ACKs
   are used, not nezha ACKs, because a nezha ACK may wait behind bulk data going the other
   way. Where TCP_INFO is not available (MPTCP), nezha ACKs are
   used with a 10x larger limit; receivers acknowledge staged chunks with a progress-only
   ACK, so a peer that is merely behind is not taken for dead. Only segments in flight
   without delivery count: a slow receiver closes its window (nothing in flight). The last
   live rail to a peer is never failed on suspicion (only by socket errors; the collective's
   timeout covers the rest). "Nothing" is evidence, not yet a verdict: the path probes decide
   (pathprobe.py; their burst starts at PROBE_EARLY of the limit): the rail is dead when its
   probes go unanswered while another rail's to the same peer are answered. A connection in
   back-off sends one segment per RTO, so for a few RTOs a 30 % loss burst and a black hole
   look alike to TCP; to 12 probes they do not.
2b. The receiver's side: a rail that owes us a share of a message whose other rails deliver
   it, silent for the same limit, is checked the other way round: the sender is asked
   whether its TCP still gets ACKs on it (``_silent``); none is evidence, and the probes
   decide.
3. Heartbeats: every connection idle for HEARTBEAT_INTERVAL sends a HEARTBEAT; one that has
   received nothing for HEARTBEAT_TIMEOUT (bytes waiting in the kernel's receive queue
   count as received) is evidence, unless the peer's kernel acknowledged our own heartbeats
   meanwhile (``_acked``: the path works, the peer's process is slow); the path probes
   decide, and a peer that answers them on no rail is slow, so no rail is failed for it.
   Every 250 ms by default (6 per timeout): at 100 ms the heartbeats of 56 idle connections (5
   ranks x 14 rails, on loopback) took 7 % of a core per rank, half of what an idle job cost;
   with idle connections looked at every IDLE_EVERY_S too, an idle job went from 13.6 % to
   5.6 % of a core per rank.
4. Link events (optional, pyroute2): a rail interface going down fails its connections.
5. TCP_USER_TIMEOUT on every socket (NEZHA_TCP_USER_TIMEOUT_MS) bounds kernel retries.
WATCHDOG_MIN, CHECK_TIMEOUT, HEARTBEAT_INTERVAL and HEARTBEAT_TIMEOUT are NEZHA_WATCHDOG_MS,
NEZHA_CHECK_TIMEOUT_MS, NEZHA_HEARTBEAT_MS and NEZHA_HEARTBEAT_TIMEOUT_MS from the config
(Health.watchdog_min, .check_timeout, .heartbeat_interval, .heartbeat_timeout, in seconds).

A failed connection's unacknowledged chunks move to the surviving rails (engine/failover.py)
and every rank is told (CONTROL "down"): all stop using that rail for data, the split
restarts COLD for the new rail set at the next estimate exchange. The higher rank of the
pair re-connects with exponential back-off (PROBE_MIN .. PROBE_MAX; each dial waits its step,
DIAL_MIN .. DIAL_MAX, and one that timed out renews the neighbour entry), through the same
authenticated handshake as the first connect (``rejoin`` is rendezvous.Rendezvous.redial: it
raises while the path is broken or the peer refuses, e.g. an unauthenticated peer whose end of
the connection is still alive); on success the rail rejoins (CONTROL "up") once no rank
reports it down. A rank whose end of a connection failed says so in every answer about it
(a path probe's DROPPED flag, wire.NO_CONNECTION for "arrivals?" and "acks?"): the peer fails
its own end, stale since the rank's FIN never reached it, at once (``_stale``), rather than at
its TCP's next retransmission, seconds after a host's links come back.

When every rail to a peer has failed (the peer is *unreachable*, engine/failover.py), its
rails are re-dialled every PROBE_UNREACHABLE at most, so the job resumes within a fraction of
a second of a rail's return; and every LIVENESS_EVERY the peer's listeners are dialled
(``refuses``, rendezvous.Rendezvous.refuses): when every rail refuses the connection, the
peer's process is gone and the job fails at once with PeerClosedError, instead of waiting
out the collective's timeout as it must for a path that is merely broken.
Events: rail_check, rail_alive, probe_verdict, rail_suspected, rail_down, rerouted, rail_agreed,
probe, rail_up, peer_unreachable, peer_reachable.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence

from . import wire
from .config import Config
from .errors import CommError, PeerClosedError
from .pathprobe import PROBE_COUNT, PROBE_TIMEOUT_MIN, PathProber
from .transport.tcpinfo import TcpInfo, tcp_info

CHECK_MEMORY = 2.0     # s a peer's "bytes arrive" answer widens later questions (see check)
WATCHDOG_FACTOR = 3.0
WATCHDOG_NOMINAL_BPS = 12.5e6   # assumed rail speed (100 Mbit/s) before anything is measured
SLOWEST_BPS = 125e3     # the slowest rail (1 Mbit/s) the limits wait on (measured_cost)
PROBE_MIN, PROBE_MAX = 0.1, 1.0
# a redial's connect waits this long, or its back-off step if longer (Health.probe). A SYN
# lost because the peer's end of the link was not up yet is resent by the kernel only after
# 1 s: with a 0.5 s wait, a rail back from a 2 s outage waited 0.8 s for its connection (and
# the health thread stood still meanwhile); a path with a long RTT gets up to DIAL_MAX
DIAL_MIN, DIAL_MAX = 0.15, 0.5
PROBE_UNREACHABLE = 0.1    # s between re-dials of a peer that has no rail at all
LIVENESS_EVERY = 0.2       # s between "does its process still listen?" checks of such a peer
RTO_FACTOR = 1.25       # a question's window and the receiver's silence, in RTOs
# the watchdog's limit in RTOs (before back-off): no ACK for that long means TCP has timed
# out; what decides is the peer's count and the probes, and 1.25 cost every black hole 5 ms
WATCHDOG_RTO = 1.0
TICK = 0.01             # s between the health thread's looks, at most...
TICK_MAX = 0.05          # ...unless every rail's stall limit is long: then this fraction of
TICK_FRACTION = 0.15     # the shortest, up to TICK_MAX (_tick). Each wake-up of a Python
                         # thread cost ~100 us of CPU with 32 ranks on 2 cores, and the
                         # health threads took half of every rank's CPU there
LIMITS_EVERY_S = 0.05    # s between two computations of every rail's stall limit (_tick)
IDLE_EVERY_S = 0.05      # s between looks at an idle connection (Health.run)
LOOP_IDLE = 0.5          # s the re-dial and liveness loops sleep while no rail is down; a
                         # failure wakes them at once (Engine.on_trouble)
RX_FACTOR = 2.0          # the receiver's silence limit, in the sender watchdog's limits...
RX_FLOOR = 0.1           # ...and at least this (s)
RX_RECHECK = 0.02        # s before a quiet rail that owed nothing is asked about again
Q_ARRIVALS, Q_ACKS = 1, 2   # the questions that also go as datagrams (pathprobe.question)
PROBE_EARLY = 0.3        # of the watchdog's limit: path probes start, so their verdict is in
UNHEARD_S = 1.0          # s a peer may leave its first probes unanswered before it counts as
                         # one that never answers them (UDP filtered), not as a slow one
PROBE_TIMEOUT_UNTIMED = 0.25   # s a probe is given on a rail nothing has timed yet (see
                               # Health._probe_timeout)


class RailStalled(CommError):
    """No progress on a rail with outstanding work (watchdog) or no traffic (heartbeat)."""


class Health:
    """Watches one rank's connections. Given what it works with: the engine (connections,
    estimates, events, CONTROL), ``rejoin(peer, rail, dial_s)`` which reconnects a failed rail
    to a lower rank (raises while it is still broken; does nothing if it is no longer), the rail addresses (for link events) and
    the config (timings)."""

    def __init__(self, eng, rejoin: Callable[[int, int, float], None], rail_addrs: Sequence[str],
                 config: Config = Config(), refuses: Optional[Callable[[int], bool]] = None,
                 prober: Optional[PathProber] = None):
        self.eng = eng
        self.prober = prober         # path probes (pathprobe.py): the arbiter of "dead"
        self.rejoin = rejoin
        self.refuses = refuses       # peer -> every rail refuses a connection (it exited)
        self.liveness_at: dict[int, float] = {}
        self.rail_addrs = list(rail_addrs)
        self._limits: list[float] = []    # stall_limit of every rail (_tick)...
        self._limits_t = -1e9               # ...as of then
        self.rail_ifindex: dict[int, int] = {}   # rail -> our interface on it (link monitor)
        self.watchdog_min = config.watchdog_ms / 1e3
        self.check_timeout = config.check_timeout_ms / 1e3
        self.heartbeat_interval = config.heartbeat_ms / 1e3
        self.heartbeat_timeout = config.heartbeat_timeout_ms / 1e3
        self.link_events = config.link_events
        self.stop = threading.Event()
        self.backoff: dict = {}
        self.next_probe: dict = {}
        self.last_dial: dict = {}     # (peer, rail) -> when the probe loop last dialled it
        self.thread = threading.Thread(target=self._guarded, args=(self.run,), daemon=True,
                                       name="nz-health")
        # probes connect (and may wait on a dead path): never in the heartbeat thread
        self.probe_thread = threading.Thread(target=self._guarded, args=(self.probe_loop,),
                                             daemon=True, name="nz-probe")
        self.liveness_thread = threading.Thread(target=self._guarded, args=(self.liveness_loop,),
                                                daemon=True, name="nz-liveness")
        self.link_thread = None
        self._check_seq = 0
        self._wake_probe = threading.Event()
        self._wake_live = threading.Event()
        eng.on_trouble = self._trouble
        self.eng.on_arrivals = self.on_arrivals
        self._answers = threading.Lock()
        if prober is not None:
            prober.on_question, prober.on_answer = self._udp_question, self._udp_answer
        self.eng.on_acks_question = self.on_acks_question
        self.eng.on_acks = self.on_acks
        self.eng.on_redial = self.redial_soon

    def start(self):
        self.thread.start()
        self.probe_thread.start()
        self.liveness_thread.start()
        self._start_link_monitor()

    def _trouble(self) -> None:
        """A rail failed (engine/failover.py): the re-dial and liveness loops wake."""
        self._wake_probe.set()
        self._wake_live.set()

    def close(self):
        self.stop.set()
        self._trouble()
        self.thread.join(2.0)
        self.probe_thread.join(2.0)
        self.liveness_thread.join(2.0)
        ipr = getattr(self, "_ipr", None)
        if ipr is not None:
            try:
                ipr.close()
            except Exception:
                pass

    def stall_limit(self, rail) -> float:
        est = self.eng.balancer.est[rail]
        return max(self.watchdog_min, WATCHDOG_FACTOR * (est.a + (64 << 10) * self.cost(rail)))

    def cost(self, rail: int) -> float:
        """Seconds per byte that the limits assume for ``rail``: the larger of this rank's
        estimate and the agreed cost in use (``measured_cost``), else
        WATCHDOG_NOMINAL_BPS's. The estimate's window restarts whenever the split moves, and
        a small share can pass in a token bucket's burst: judged at 100 Mbit/s or more, 10
        Mbit/s rails, whose 64 KiB segments take 52 ms, were failed in runs with no fault
        (a stall of 22 ms against a limit of 20, of 31 against 24), their path probes queued
        behind their bulk data and given 10 ms (4 and 5 hosts x 8-10 rails of 10-233 Mbit/s;
        seeds 45 and 44 of ``testbed shapes``)."""
        known = self.measured_cost(rail)
        return 1.0 / WATCHDOG_NOMINAL_BPS if known is None else known

    def measured_cost(self, rail: int) -> float | None:
        """The larger of this rank's estimate of ``rail`` and the agreed cost in use (the
        last agreed table's while COLD), or None before anything has measured the rail; at
        most SLOWEST_BPS's. A rail that delivered nothing in an operation is charged about
        1 byte over the operation's time (costs.ShareCosts.op_ended): right for the split,
        which then gives it nothing, but not a rate to wait on. Every limit here grows with
        the cost, and a black-holed rail charged 0.12 s per byte was given 4.5 hours to
        answer a probe: it was never failed."""
        bal = self.eng.balancer
        rs = bal.rs
        used = rs.used_b        # read once: COLD sets it to None from the engine's thread
        agreed = used[rail] if used is not None else float("nan")
        if not agreed > 0:                      # (nan > 0 is False)
            agreed = rs.b[rail]
        known = [x for x in (bal.est[rail].b, agreed) if x > 0]
        return min(max(known), 1.0 / SLOWEST_BPS) if known else None

    def _guarded(self, loop: Callable[[], None]) -> None:
        """Run one of the health loops; an exception it did not expect is a bug, and the job
        fails with it: a rank whose health thread ended in silence sent no more heartbeats,
        and its peers took every rail to it for dead over and over (1464 times in one run)."""
        try:
            loop()
        except Exception as e:
            self.eng.fatal(e)

    def _tick(self) -> float:
        """How long the health thread sleeps: TICK, or longer when every rail's stall limit
        is long (slow rails: 160 ms at 10 Mbit/s), so that its precision stays a small part
        of the limit it enforces."""
        now = time.monotonic()
        if now - self._limits_t >= LIMITS_EVERY_S:
            self._limits_t = now
            self._limits = [self.stall_limit(r) for r in range(len(self.rail_addrs))]
        shortest = min(self._limits, default=0.0)
        return min(TICK_MAX, max(TICK, TICK_FRACTION * shortest))

    def _limit(self, rail: int) -> float:
        """stall_limit as of the last LIMITS_EVERY_S. Each look at a busy connection needs
        it (twice), and computing it reads the rail's estimates: with 5 ranks x 15 rails that
        was a quarter of the health thread's CPU; the estimates change once an operation,
        not per look."""
        limits = self._limits
        return limits[rail] if rail < len(limits) else self.stall_limit(rail)

    def run(self):
        eng = self.eng
        idle_look = 0.0
        while not self.stop.wait(self._tick()):
            if eng.error is not None or eng.closing:
                continue
            now = time.monotonic()
            look_idle = now - idle_look >= IDLE_EVERY_S
            if look_idle:
                idle_look = now
            if eng.hedging:
                eng.hedge(now)
            # peers we expect data from (an incomplete posted receive): their silence counts
            expecting = {key[2] for key, slot in list(eng.slots.items()) if not slot.complete}
            for (peer, rail), conn in list(eng.conns.items()):
                if not conn.alive:
                    continue
                # an idle connection (nothing of ours out, nothing read since it was last
                # looked at, nothing expected) is looked at every IDLE_EVERY_S: 56 of them
                # (5 ranks x 14 rails) looked at every tick took 6 % of a core per rank
                if conn.unacked == 0 and conn.rx_all == conn.rx_seen and not look_idle \
                        and peer not in expecting and not conn.dead_why:
                    continue
                if conn.rx_all != conn.rx_seen:
                    # bytes of a frame still coming in (a 512 KiB chunk over a rail at 30 %
                    # loss takes seconds): received, though no header was read meanwhile
                    conn.last_rx = max(conn.last_rx, now)
                conn.rx_seen = conn.rx_all
                arrived = conn.arrived()
                if conn.arrivals and arrived != conn.arrivals[-1][1]:
                    # in the kernel's receive queue, not yet read (our reader thread waits
                    # for the CPU): received all the same
                    conn.last_rx = max(conn.last_rx, now)
                conn.arrivals.append((now, arrived))
                if conn.dead_why and self._judge(conn, now):
                    continue
                if conn.unacked > 0 and self._watch(conn, rail, now):
                    continue
                if self._silent(conn, now):
                    continue
                if now - conn.last_rx > self.heartbeat_timeout and not conn.dead_why \
                        and not self._acked(conn):
                    # silence is the peer's as much as the rail's: the probes decide, and a
                    # peer that answers them on no rail is slow, not behind a dead rail
                    self.dead(conn, f"nothing received for {(now - conn.last_rx) * 1e3:.0f} ms",
                              now, answered=False)
                    continue
                if now - conn.last_tx > self.heartbeat_interval and conn.q.empty():
                    conn.last_tx = now
                    conn.put(wire.Header(wire.HEARTBEAT, rail=rail, src=eng.rank).pack())

    def _acked(self, conn) -> bool:
        """The peer's kernel acknowledged what we sent (our heartbeats at least) within the
        heartbeat timeout: the rail carries both ways, and a peer that sends nothing is a
        process waiting for the CPU (64 ranks on 2 cores: 111 rails failed for 1.5-1.7 s of
        silence in one run), or hung, which the collective's timeout reports. Without
        TCP_INFO (MPTCP) silence alone decides."""
        ti = tcp_info(conn.sock) if conn.tcp_info_ok else None
        return ti is not None and ti.last_ack < self.heartbeat_timeout

    def _watch(self, conn, rail: int, now: float) -> bool:
        """The watchdog of a connection with outstanding chunks; True if it is stuck (and a
        check of the path is under way)."""
        limit = self._limit(rail)
        ti = tcp_info(conn.sock) if conn.tcp_info_ok else None
        if ti is None:
            conn.tcp_info_ok = False
            since = max(conn.busy_since, conn.last_ack)
            limit *= 10
            stuck = now - since > limit
        else:
            # segments in flight and none delivered: the path is black. (A slow
            # receiver closes its window instead: nothing in flight, not a fault.)
            if ti.delivered != conn.tcp_delivered or not ti.unacked:
                conn.tcp_delivered = ti.delivered
                conn.tcp_moved = now
                # before back-off: our own small frames (ACKs) may be what backs it off
                conn.tcp_rto = ti.rto_base
            since = max(conn.tcp_moved, conn.busy_since)
            # one lost segment costs TCP a retransmission timeout: not a fault.
            # The RTO as it was when delivery last moved: during a black hole
            # TCP backs off (doubles) the current one, which would push the
            # limit further out with every retransmission.
            limit = max(limit, WATCHDOG_RTO * min(ti.rto, conn.tcp_rto or ti.rto))
            # ...and no ACK at all for as long: a congested or lossy rail still
            # returns (duplicate) ACKs while delivery waits on a retransmission;
            # a black hole returns nothing
            stuck = ti.unacked > 0 and now - since > limit and ti.last_ack > limit
        if stuck:
            self.check(conn, now, now - since, limit, ti)
            return True
        if self.prober is not None and now - since > PROBE_EARLY * limit and (
                ti is None or ti.last_ack > PROBE_EARLY * limit):
            # under way already, so its verdict is in by the time the check needs it
            self._probe(conn, now)
        conn.check_id = None
        return False

    def probe_loop(self):
        self._loop_while(lambda: self.eng.dead, self._wake_probe, self.probe)

    def liveness_loop(self):
        """Its own thread: a dial to a broken path waits for its timeout, and the re-dials
        (probe_loop) must not wait behind it."""
        self._loop_while(lambda: self.eng.unreachable, self._wake_live, self.check_unreachable)

    def _loop_while(self, work, wake: threading.Event, step: Callable[[float], None]) -> None:
        """Call ``step(now)`` every 20 ms while ``work()`` has something; otherwise sleep
        until ``wake`` (a rail failed) or LOOP_IDLE passes. Two loops at 50 Hz each doing
        nothing took 0.9 % of a core per rank with 32 ranks on 2 cores."""
        eng = self.eng
        while not self.stop.is_set():
            if not work():
                wake.wait(LOOP_IDLE)
                wake.clear()
                continue
            if self.stop.wait(0.02):
                return
            if eng.error is None and not eng.closing:
                step(time.monotonic())

    def check_unreachable(self, now: float) -> None:
        """A peer without any rail: a process that exited refuses every new connection, a
        broken path does not (see the module docstring)."""
        eng = self.eng
        for peer, (since, why) in list(eng.unreachable.items()):
            last = max(since, self.liveness_at.get(peer, since))   # this outage's checks only
            if self.refuses is None or now - last < LIVENESS_EVERY:
                continue
            self.liveness_at[peer] = now
            if peer in eng.unreachable and self.refuses(peer):
                eng.fatal(PeerClosedError(
                    f"rank {peer} exited: every rail to it failed (first: {why}) and it "
                    f"refuses new connections on every rail"))
                return

    def check(self, conn, now: float, stalled: float, limit: float,
              ti: Optional[TcpInfo] = None) -> None:
        """The watchdog saw no progress: ask the peer, over another rail, whether our bytes
        still reach it in the last ``stalled`` seconds. A rail whose rate was cut tenfold keeps
        delivering data while its ACKs queue behind full buffers (or TCP sits out a spurious
        retransmission timeout); a black hole delivers nothing. No answer within CHECK_TIMEOUT
        counts as nothing arriving. Once the peer has confirmed the rail alive, later questions
        cover at least 1.25 x TCP's current (backed-off) RTO: in back-off TCP sends one segment
        per RTO, so a shorter window can fall between two of them."""
        why = (f"no progress for {stalled * 1e3:.0f} ms with {conn.unacked} chunks outstanding "
               f"(limit {limit * 1e3:.0f} ms)")
        if conn.check_id is not None:
            if now - conn.check_t > self.check_timeout:
                conn.check_id = None
                self.dead(conn, why + f"; rank {conn.peer} did not say within "
                                      f"{self.check_timeout * 1e3:.0f} ms whether bytes arrive",
                          now, answered=False)
            return
        others = [r for r in self.eng.live_rails(conn.peer, data=False) if r != conn.rail]
        if not others:
            self.suspect(conn, why)          # the last rail: only logged, see suspect()
            return
        window = stalled
        if ti is not None and now - conn.check_ok_t < CHECK_MEMORY:
            window = max(stalled, RTO_FACTOR * ti.rto)
        self._check_seq += 1
        # the answer may clear check_id before the datagram goes: ask with this id
        ident = self._check_seq
        conn.check_id, conn.check_t, conn.check_why = ident, now, why
        if self.prober is not None:
            self._probe(conn, now)
        self.eng.events.emit("rail_check", peer=conn.peer, rail=conn.rail, stalled_ms=stalled * 1e3,
                             window_ms=window * 1e3, tcp=ti.for_log() if ti else None)
        self.eng.send_control(conn.peer, {"what": "arrivals?", "rail": conn.rail,
                                          "id": ident, "window": window},
                              avoid=conn.rail)
        self._ask_udp(conn, Q_ARRIVALS, window, ident)

    def _ask_udp(self, conn, what: int, window: float, ident: int) -> None:
        """The same question as a datagram on another rail too (pathprobe.question)."""
        ref = self._ref_rail(conn) if self.prober is not None else None
        if ref is not None:
            self.prober.question(conn.peer, ref, what, conn.rail, window, ident)

    def _udp_question(self, what: int, peer: int, rail: int, window: float) -> int:
        if what == Q_ACKS:
            return self.on_acks_question(peer, rail, min(max(window, 0.0), 5.0))
        return self.eng.arrivals_within(peer, rail, window)

    def _udp_answer(self, what: int, peer: int, rail: int, ident: int, value: int) -> None:
        (self.on_acks if what == Q_ACKS else self.on_arrivals)(peer, rail, ident, value)

    def _take(self, conn, attr: str, ident: int) -> bool:
        """Clear a pending question if ``ident`` answers it; False if it was answered already
        (the TCP and the datagram answers race)."""
        with self._answers:
            if conn is None or getattr(conn, attr) != ident or not conn.alive:
                return False
            setattr(conn, attr, None)
            return True

    def on_arrivals(self, peer: int, rail: int, ident: int, nbytes: int) -> None:
        """The peer's answer to check(): bytes that reached it on this rail in the window."""
        conn = self.eng.conns.get((peer, rail))
        if not self._take(conn, "check_id", ident):
            return
        if nbytes == wire.NO_CONNECTION:
            self._stale(conn)
        elif nbytes > 0:                     # slow, not dead: watch it afresh
            now = time.monotonic()
            conn.tcp_moved = conn.last_ack = conn.check_ok_t = now
            self.eng.events.emit("rail_alive", peer=peer, rail=rail, bytes=nbytes,
                                 waited_ms=(now - conn.check_t) * 1e3)
        else:
            self.dead(conn, conn.check_why + f"; rank {peer} received nothing on it meanwhile",
                      time.monotonic())

    # ---------------------------------------------------------------- path probes
    def dead(self, conn, why: str, now: float, answered: bool = True) -> None:
        """Evidence that a rail is dead: the path probes decide (``_judge``); without them
        (no probe socket on the rail) the evidence alone does, as before. ``answered``:
        the peer answered the question behind it (False: it did not say in time, which
        tells of a slow peer as much as of a dead rail)."""
        if self.prober is None or not self.prober.available(conn.rail):
            self.suspect(conn, why)
            return
        conn.dead_why, conn.dead_t, conn.dead_answered = why, now, answered
        self._probe(conn, now)
        self._judge(conn, now)

    def _probe_timeout(self, conn) -> float:
        """The least a probe on the rail is given: it queues behind the rail's bulk data, so
        twice the connection's smoothed RTT (which grows with that queue when a rail slows;
        a black hole leaves it as it was) and two 64 KiB segments at the rail's cost.

        A rail nothing has timed yet (the first operation) gets PROBE_TIMEOUT_UNTIMED: its
        cost is a guess, and TCP's RTT was sampled before the queues filled. A 10 Mbit/s
        rail at MTU 9000 queues 20 frames, 144 ms, each way: its probes came back after up
        to 157 ms, and three of them, given 27-52 ms in the first half second of a run, failed
        a live rail (4-5 hosts x 10-11 rails; seeds 1 and 44 of ``testbed shapes``). A
        black hole in the first operation is told 0.2 s later; one in any later operation
        is not (the rail has been timed by then). Unless TCP has measured the rail: then
        the probe is given twice the time its bytes in flight take to drain at the
        delivery rate it last measured (there and back), up to PROBE_TIMEOUT_UNTIMED. A
        black hole 3 s into a job on 4 hosts x 2 rails of 100 Mbit/s, whose first
        operations were still untimed, was told 260 ms after it began, where its queue
        drains in 7 ms."""
        ti = tcp_info(conn.sock) if conn.tcp_info_ok else None
        known = self.measured_cost(conn.rail)
        if known is not None:
            least = max(PROBE_TIMEOUT_MIN, 2 * (64 << 10) * known)
        elif ti is not None and ti.delivery_rate > 0 and ti.mss > 0:
            drain = ti.unacked * ti.mss / ti.delivery_rate
            least = min(PROBE_TIMEOUT_UNTIMED, max(PROBE_TIMEOUT_MIN, 2 * drain))
        else:
            least = PROBE_TIMEOUT_UNTIMED
        return max(least, 2 * ti.rtt if ti else 0.0)

    def _ref_rail(self, conn) -> Optional[int]:
        others = [r for r in self.eng.live_rails(conn.peer, data=False) if r != conn.rail]
        return others[0] if others else None

    def _probe(self, conn, now: float) -> None:
        """Path probes to the peer on the rail, and on a reference rail to compare with."""
        self.prober.ask(conn.peer, conn.rail, now, self._ref_rail(conn))

    def _judge(self, conn, now: float) -> bool:
        """The probes' verdict on a rail with evidence against it; True if it was failed."""
        verdict = self.prober.verdict(conn.peer, conn.rail, now, self._ref_rail(conn),
                                      self._probe_timeout(conn))
        if verdict is None:
            if conn.peer not in self.prober.heard and now - conn.dead_t > self.check_timeout \
                    and now - self.prober.first_asked.get(conn.peer, now) > UNHEARD_S \
                    and conn.dead_answered:
                # this peer never answered a probe in all that time (UDP filtered on the
                # way?): the evidence alone decides, as it did before there were probes. Not
                # sooner: a peer first probed 100 ms ago on a host that runs 32 ranks on 2
                # cores has not answered yet either, and its rails were failed on that. Nor
                # when the evidence is that the peer did not answer our question either: a
                # peer that answers nothing is slow (32 ranks on 2 cores), and a rail is not
                # failed for it; the probes decide once it answers them
                why, conn.dead_why = conn.dead_why, ""
                self.suspect(conn, why + "; no path probe was ever answered by this peer")
                return True
            self._probe(conn, now)       # a no-op while a burst is under way
            return False
        why, conn.dead_why = conn.dead_why, ""
        if verdict and self.prober.peer_dropped(conn.peer, conn.rail, conn.opened):
            self._stale(conn)                # it answers, but our connection is gone there
            return True
        if verdict:                          # it answers: slow or lossy, not dead
            conn.tcp_moved = conn.last_ack = conn.check_ok_t = conn.rx_ok_t = now
            conn.last_rx = max(conn.last_rx, now)    # (its answer came on this rail)
            if conn.check_why and why.startswith(conn.check_why):
                # (a receiver's silence that the probes clear is routine on a loaded rail,
                # and not logged: it would be an event every PROBE_FRESH per connection)
                self.eng.events.emit("rail_alive", peer=conn.peer, rail=conn.rail, bytes=0,
                                     probes=True, evidence=why)
            return False
        ref = self._ref_rail(conn)
        self.eng.events.emit("probe_verdict", peer=conn.peer, rail=conn.rail, ref=ref,
                             burst=self.prober.describe(conn.peer, conn.rail, now),
                             ref_burst=None if ref is None else
                             self.prober.describe(conn.peer, ref, now))
        self.suspect(conn, why + f"; {PROBE_COUNT} path probes unanswered"
                                 + ("" if ref is None else f" while rail {ref} answered"))
        return True

    def _silent(self, conn, now: float) -> bool:
        """The receiver's evidence: nothing arrives on this rail although the peer's share
        of a message on it is due (the split is the same on every rank) and its other rails
        deliver that message. As the sender's watchdog asks the receiver, the receiver asks
        the sender (over another rail) whether its TCP still gets ACKs on the rail: a slow or
        congested rail still returns some, a black hole none. No ACKs (or no answer within
        CHECK_TIMEOUT) is evidence, and the path probes decide (``dead``)."""
        if conn.rx_check_id is not None:
            if now - conn.rx_check_t > self.check_timeout:
                conn.rx_check_id = None
                self.dead(conn, conn.rx_check_why + f"; rank {conn.peer} did not say within "
                          f"{self.check_timeout * 1e3:.0f} ms whether its ACKs arrive", now,
                          answered=False)
                return not conn.alive
            return False
        # the sender's watchdog is the first line (it sees TCP's own progress); this one
        # catches what it cannot (a sender whose data never reaches its socket), later: a
        # rail whose rate was just cut tenfold is quiet for two or three of its 64 KiB
        # segments (26 ms each at 20 Mbit/s), before any estimate or RTT has caught up
        floor = max(RX_FLOOR, RX_FACTOR * self._limit(conn.rail))
        quiet = now - max(conn.last_rx, conn.rx_ok_t)
        if self.prober is None or quiet < floor or conn.dead_why:
            return False
        if self.measured_cost(conn.rail) is None:
            # nothing has timed this rail yet (the first operation): when its share is late
            # is unknown. COLD gives a 10 Mbit/s rail of 15 as much as a 91 Mbit/s one, and
            # such rails, silent for 101-235 ms in a TCP back-off, were failed with nothing
            # wrong (5-6 hosts x 10-15 rails; seeds 6 and 30 of ``testbed shapes``). The
            # sender's watchdog, which sees TCP's own progress, still judges it
            return False
        ti = tcp_info(conn.sock) if conn.tcp_info_ok else None
        if ti is not None and quiet < RX_FACTOR * RTO_FACTOR * ti.rto_base:
            return False          # quiet for less than this rail's own round trips allow
        if now < conn.rx_due_next:
            return False
        since = now - quiet
        sibs = [c for (p, r), c in list(self.eng.conns.items())
                if p == conn.peer and r != conn.rail and c.alive and c.last_rx > since]
        if not sibs or not self.eng.share_due(conn.peer, conn.rail):
            # a rail the split leaves out is quiet for good: recomputing the split of every
            # pending message for it each tick cost more than all the other checks
            conn.rx_due_next = now + RX_RECHECK
            return False
        self._check_seq += 1
        ident = self._check_seq    # the TCP answer may clear rx_check_id before the datagram
        conn.rx_check_id, conn.rx_check_t = ident, now
        conn.rx_check_why = (f"nothing received for {quiet * 1e3:.0f} ms while rank "
                             f"{conn.peer}'s other rails delivered and its share on this rail "
                             f"was due")
        self._probe(conn, now)
        self.eng.send_control(conn.peer, {"what": "acks?", "rail": conn.rail,
                                          "id": ident, "window": quiet},
                              avoid=conn.rail)
        self._ask_udp(conn, Q_ACKS, quiet, ident)
        return False

    def on_acks_question(self, peer: int, rail: int, window: float) -> int:
        """The peer hears nothing from us on ``rail``: 1 if the path is not what keeps it
        quiet (nothing of ours is out on it, or an ACK came back within ``window`` s), else
        0. TCP's ACKs count while it has segments in flight, within two smoothed RTTs too (a
        slowed rail's queue holds them back that long; a black hole leaves the RTT where it
        was). Chunks out but every byte written to the socket acknowledged: this rank has not
        written them yet (32 ranks on 2 cores: a rank preempted between its rails' shares of
        a message for 100+ ms, whose idle rail was then failed), so the path is not the
        cause, unless the test hooks hold them back as a black hole would. Otherwise (the
        writer cannot write: written bytes wait unsent), our own ACKs. wire.NO_CONNECTION
        if our end of the connection failed (engine ``dropped``): the peer's is stale."""
        conn = self.eng.conns.get((peer, rail))
        if conn is None or not conn.alive:
            return wire.NO_CONNECTION if self.eng.dropped(peer, rail) else 0
        if conn.unacked == 0:
            return 1
        ti = tcp_info(conn.sock) if conn.tcp_info_ok else None
        if ti is not None and ti.unacked > 0:
            return 1 if ti.last_ack < max(window, 2 * ti.rtt) else 0
        if ti is not None and conn.written_unacked() == 0 \
                and not (conn.blackhole or self.eng.silenced):
            return 1
        return 1 if time.monotonic() - conn.last_ack < window else 0

    def on_acks(self, peer: int, rail: int, ident: int, moving: int) -> None:
        """The peer's answer to ``_silent``'s question."""
        conn = self.eng.conns.get((peer, rail))
        if not self._take(conn, "rx_check_id", ident):
            return
        now = time.monotonic()
        if moving == wire.NO_CONNECTION:
            self._stale(conn)
        elif moving:
            conn.rx_ok_t = now                   # slow, not dead: quiet is measured afresh
        else:
            self.dead(conn, conn.rx_check_why + f"; rank {peer}'s TCP got no ACK on it "
                      f"meanwhile", now)

    def _stale(self, conn) -> None:
        """The peer answered wire.NO_CONNECTION: its end of this connection failed, so ours
        will carry nothing more, though our TCP holds it open (all of a host's links went
        down: it dropped its connections, and its FIN or RST never arrived; our TCP, in
        back-off, learns of it only at a retransmission seconds after the links' return).
        Failed now, even as the last rail to the peer (the peer's word, not a suspicion), so
        the pair's dialler dials it again at once."""
        self.eng.events.emit("rail_suspected", peer=conn.peer, rail=conn.rail,
                             reason="the peer's end of the connection failed")
        conn.fail(PeerClosedError(f"rail {conn.rail} to rank {conn.peer}: its end of the "
                                  f"connection failed (it answered so when asked)"))

    def suspect(self, conn, why):
        eng = self.eng
        others = [r for r in eng.live_rails(conn.peer, data=False) if r != conn.rail]
        if not others:
            # never take down the last rail to a peer on suspicion alone: socket errors, the
            # collective's timeout and the peer's own view decide about that one
            if not conn.suspected:
                conn.suspected = True
                eng.events.emit("rail_suspected", peer=conn.peer, rail=conn.rail, reason=why,
                                last_rail=True)
            return
        eng.events.emit("rail_suspected", peer=conn.peer, rail=conn.rail, reason=why)
        conn.fail(RailStalled(f"rail {conn.rail} to rank {conn.peer}: {why}"))

    # ---------------------------------------------------------------- re-probe / rejoin
    def probe(self, now):
        eng = self.eng
        for (peer, rail) in list(eng.dead):
            if peer >= eng.rank or peer in eng.gone:
                continue   # the higher rank of a pair reconnects
            key = (peer, rail)
            if now < self.next_probe.get(key, 0.0):
                continue
            delay = self.backoff.get(key, PROBE_MIN)
            if peer in eng.unreachable:
                delay = min(delay, PROBE_UNREACHABLE)
            self.backoff[key] = min(PROBE_MAX, delay * 2)
            self.next_probe[key] = now + delay
            self.last_dial[key] = now
            eng.events.emit("probe", peer=peer, rail=rail, next_in=delay)
            try:
                self.rejoin(peer, rail, min(DIAL_MAX, max(DIAL_MIN, delay)))
            except Exception as e:   # still broken: try again later
                eng.events.emit("probe", peer=peer, rail=rail, ok=False, error=str(e)[:200])
                if isinstance(e, TimeoutError):
                    self._renew_neighbour(peer, rail)
                continue
            self.backoff.pop(key, None)
            self.next_probe.pop(key, None)

    def _renew_neighbour(self, peer: int, rail: int) -> None:
        """Drop our neighbour entry for ``peer`` on ``rail`` after a dial timed out, so the
        next dial asks for its address at once. An ARP request lost in the first
        milliseconds of a link's return (seen on the testbed's bridges) leaves the entry
        INCOMPLETE, and the kernel asks again only a second later, holding every SYN to that
        peer meanwhile: a rail back from a 2 s outage took 0.8-1.0 s to reconnect. Needs
        CAP_NET_ADMIN; without it the kernel's own retry stands."""
        ifindex = self.rail_ifindex.get(rail)
        if ifindex is None or self.prober is None:
            return
        try:
            from pyroute2 import IPRoute
            with IPRoute() as q:
                q.neigh("del", dst=self.prober.endpoint(peer, rail)[0], ifindex=ifindex)
        except Exception:       # noqa: BLE001 - no entry, or not allowed: nothing to renew
            pass

    def link_up(self, rail: int) -> None:
        """Our link on ``rail`` is up again (netlink): the failed connections on it are
        redialled now, not at the next back-off step (up to PROBE_MAX later: a rail back
        from a 3 s outage waited 0.5 s for its dial). We dial the lower ranks ourselves and
        ask the higher ones, which dial us, to do so at once."""
        eng = self.eng
        for (peer, r) in list(eng.dead):
            if r != rail or peer in eng.gone:
                continue
            if peer < eng.rank:
                self.redial_soon(peer, rail)
            else:
                eng.send_control(peer, {"what": "redial", "rail": rail}, avoid=rail)

    def redial_soon(self, peer: int, rail: int) -> None:
        """Dial the failed connection to ``peer`` on ``rail`` at the probe loop's next turn
        (if we are the pair's dialler and it is down); at most once per PROBE_MIN, however
        often we are asked."""
        key = (peer, rail)
        if peer >= self.eng.rank or key not in self.eng.dead:
            return
        soon = max(time.monotonic(), self.last_dial.get(key, 0.0) + PROBE_MIN)
        if soon < self.next_probe.get(key, 0.0):
            self.next_probe[key] = soon
            self.backoff[key] = PROBE_MIN

    # ---------------------------------------------------------------- link events
    def _start_link_monitor(self):
        if not self.link_events:
            return
        try:
            from pyroute2 import IPRoute
        except ImportError:
            return
        addrs = self.rail_addrs
        try:
            index = {}
            with IPRoute() as q:
                for msg in q.get_addr(family=2):
                    a = msg.get_attr("IFA_ADDRESS")
                    if a in addrs:
                        index[msg["index"]] = addrs.index(a)
            if not index or any(a.startswith("127.") for a in addrs):
                return
            self.rail_ifindex = {rail: i for i, rail in index.items()}
        except Exception as e:
            self.eng.events.emit("link_monitor", ok=False, error=repr(e)[:200])
            return

        def loop():
            try:
                # pyroute2 >= 0.9 runs an asyncio loop per socket: create it in this thread;
                # a fresh socket, because bind() must come before any request
                ipr = IPRoute()
                ipr.bind()
                self._ipr = ipr
                self.eng.events.emit("link_monitor", ok=True, rails={str(v): k for k, v in index.items()})
                while not self.stop.is_set():
                    for msg in ipr.get():
                        if msg.get("event") != "RTM_NEWLINK" or msg["index"] not in index:
                            continue
                        rail = index[msg["index"]]
                        carrier = msg.get_attr("IFLA_CARRIER")
                        up = bool(msg["flags"] & 1)                     # IFF_UP
                        if carrier == 1 and up:
                            self.link_up(rail)
                        elif carrier == 0 or not up:
                            self.eng.events.emit("rail_suspected", rail=rail, reason="link down (netlink)")
                            for (p, r), c in list(self.eng.conns.items()):
                                if r == rail and c.alive:
                                    c.fail(RailStalled(f"rail {rail}: local link down"))
            except Exception as e:
                if not self.stop.is_set():
                    self.eng.events.emit("link_monitor", ok=False, error=repr(e)[:200])
            finally:
                try:
                    self._ipr.close()
                except Exception:
                    pass

        self.link_thread = threading.Thread(target=loop, daemon=True, name="nz-link")
        self.link_thread.start()
