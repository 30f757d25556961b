"""Path probes: does a rail still carry packets between two ranks? Decided in tens of
milliseconds by a burst of small UDP datagrams, each answered by the peer (BFD's echo, on
demand).

Why not TCP's own view: a connection in retransmission back-off sends one segment per RTO,
so for the first few RTOs a black hole and a 30 % loss burst look the same to it (and to the
bytes that reach the peer); telling them apart from TCP alone takes several RTOs. The burst
does not wait for TCP: a black hole answers none of PROBE_COUNT probes, while a rail that
loses 30 % each way answers each with p = 0.49, all of them failing with p = 0.51^12 ~ 3e-4
(and the health thread needs other evidence too). A probe answered at all means the path is
alive, however slow or lossy it is; it is dead only when PROBE_COUNT probes go unanswered
while a reference rail to the same peer answers (``verdict``). The health thread asks for a
burst when its evidence says a rail may be dead (the sender's watchdog, the receiver's
silence, health.py) and acts on the verdict.

Each rank binds one UDP socket per rail to the rail's address and the port of its TCP
listener on that rail (UDP ports are a separate space), so a peer knows where to probe from
the rendezvous. Datagrams carry an HMAC under the job's rail key and a random session id, so
a stranger can neither answer for a dead rail (making it look alive) nor replay an old
answer; it cannot make a live rail look dead either, since only silence counts as evidence.
Where a socket cannot be bound the rail has no probe and health.py decides as it did before
(``verdict`` is None). An answer also says whether the answering rank's end of the pair's
connection on that rail has failed (DROPPED): the asker's end is then stale (health.py).

A datagram that this host's own queue drops (the rail's qdisc full of this rank's TCP data)
is sent again, every millisecond for up to RESEND_FOR: with IP_RECVERR the kernel says so
(ENOBUFS) instead of counting it in SndbufErrors and going on. A rank that wrote its late
share onto a slow rail's queue a moment before dropped its answers to the peer's probes
there, while its other rail's went out: the rail was failed (32 hosts x 2 x 10 Mbit/s on 2
cores, 0-62 such drops per host and run). A drop further on, in a switch, is not seen, as on
any network.
"""
from __future__ import annotations

import errno
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Callable, Optional, Sequence

from . import auth

PROBE_COUNT = 12           # probes per burst
PROBE_INTERVAL = 0.0005    # s between two probes of a burst
PROBE_TIMEOUT_MIN = 0.008  # s a probe is given at least before it counts as lost...
RTT_FACTOR = 1.5           # ...or this many round trips of the reference rail's first answer
PROBE_TIMEOUT_ALONE = 0.02  # s a probe is given when there is no reference rail
PROBE_FRESH = 0.1          # s a verdict stands: asked again later, a new burst starts
RESEND_FOR = 0.05          # s a datagram our own queue dropped is tried again (every loop
                           # turn, 1 ms): a 10 Mbit/s rail's queue is 24 ms deep
IP_RECVERR = getattr(socket, "IP_RECVERR", 11)   # linux/in.h (Python does not name it)
RESEND_MAX = 256           # datagrams waiting to be sent again, at most (the oldest go first)
REQ, REP = 1, 2
ASK, ANSWER = 3, 4        # a health question about another rail, and its answer (below)
DROPPED = 1               # a REP's flag (its ``about`` field): the answering rank's end of
                          # the pair's connection on this rail failed (``dropped``)
MAGIC = b"NZPB"
_HEAD = struct.Struct("!4sBBHIIII")     # magic, type, rail, about, src, dst, session, seq
# (about: 0 on a REQ; DROPPED or 0 on a REP; the question and its rail on an ASK or ANSWER)
TAG_BYTES = 16
SIZE = _HEAD.size + TAG_BYTES


class _Burst:
    __slots__ = ("session", "t0", "sent", "t_sent", "answered", "dropped", "wait")

    def __init__(self, t0: float) -> None:
        self.session = secrets.randbits(32)
        self.t0 = t0
        self.sent = 0
        self.t_sent = t0                          # when the last probe went out
        self.answered: Optional[float] = None     # when the first answer came
        self.dropped = False       # the first answer said: its end of our connection failed
        self.wait = 0.0            # the longest its verdict was asked to give its probes

    def rtt(self) -> Optional[float]:
        """The first answer's delay: the round trip of the burst's first probe (the peer
        process's scheduling included), since later probes are not sent once it is in."""
        return None if self.answered is None else self.answered - self.t0

    def over(self, now: float, timeout: float) -> bool:
        """Every probe sent and the last one given ``timeout``."""
        return self.sent >= PROBE_COUNT and now - self.t_sent >= timeout


class PathProber:
    """One rank's probe sockets (one per rail), its answers to the peers' probes, and its own
    bursts. ``endpoint(peer, rail)`` is where the peer listens on that rail (the rendezvous;
    None while its record is unread); ``blocked(peer, rail)`` is the engine's test hook for a
    black-holed connection or a silenced rank (those move no probe either);
    ``dropped(peer, rail)`` says whether our end of the connection to the peer on that rail
    failed, which every answer to its probes there tells it (the engine's ``dropped``)."""

    def __init__(self, rank: int, rail_addrs: Sequence[tuple[str, int]], key: bytes,
                 endpoint: Callable[[int, int], tuple[str, int] | None],
                 blocked: Callable[[int, int], bool] = lambda p, r: False,
                 dropped: Callable[[int, int], bool] = lambda p, r: False) -> None:
        self.rank = rank
        self.key = auth.mac(key, b"nezha-probe-key")
        self.endpoint = endpoint
        self.blocked = blocked
        self.dropped = dropped
        self.socks: list[Optional[socket.socket]] = []
        for addr, port in rail_addrs:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                s.bind((addr, port))
                s.setblocking(False)
                # a datagram our own full queue drops is an error (ENOBUFS), not a silent
                # SndbufErrors count: it is sent again (module docstring)
                s.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
            except OSError:
                s.close()
                s = None
            self.socks.append(s)
        self.bursts: dict[tuple[int, int], _Burst] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self.answered = 0                      # probes of our peers we answered (stats)
        self.resent = 0                        # datagrams sent again after a local drop
        self._resend: deque = deque()          # (give up at, rail, dest, datagram)
        self.inconclusive = 0                  # bursts that neither rail answered (stats)
        self.heard: set[int] = set()           # peers that ever answered a probe
        self.first_asked: dict[int, float] = {}   # peer -> when it was first probed
        # health.py: (what, peer, rail, window) -> answer, and (what, peer, rail, id, answer)
        self.on_question: Optional[Callable[[int, int, int, float], int]] = None
        self.on_answer: Optional[Callable[[int, int, int, int, int], None]] = None
        self.thread = threading.Thread(target=self._loop, daemon=True, name="nz-probe-udp")

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self._wake()
        if self.thread.is_alive():
            self.thread.join(2.0)
        for s in self.socks:
            if s is not None:
                s.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def available(self, rail: int) -> bool:
        return 0 <= rail < len(self.socks) and self.socks[rail] is not None

    # ------------------------------------------------------------------ asking
    def ask(self, peer: int, rail: int, now: float, ref: Optional[int] = None) -> None:
        """Start a burst to ``peer`` on ``rail`` unless one is under way or fresh, and one on
        the reference rail ``ref`` (another live rail to the peer) with it."""
        if not self.available(rail):
            return
        with self.lock:
            self.first_asked.setdefault(peer, now)
            for r in (rail, ref):
                if r is None or not self.available(r):
                    continue
                b = self.bursts.get((peer, r))
                if b is None or self._replaceable(b, now):
                    self.bursts[(peer, r)] = _Burst(now)
        self._wake()

    @staticmethod
    def _replaceable(b: _Burst, now: float) -> bool:
        """May ``ask`` replace the burst? Once its verdict is PROBE_FRESH old. An unanswered
        burst's verdict comes only when its last probe was given the wait ``verdict`` was
        asked for: replaced sooner, it would never come. A rail whose probes are given more
        than PROBE_FRESH (the wait grows with the rail's cost: two 64 KiB segments, 105 ms
        at 10 Mbit/s) was never found dead: every look started a new burst (a rail
        black-holed in the first operation of 2 ranks, charged as the rail that delivered
        nothing, was given 0.1-16000 s and still carried its shares when the job ended)."""
        wait = 0.0 if b.answered is not None else b.wait
        return now - b.t0 >= PROBE_COUNT * PROBE_INTERVAL + wait + PROBE_FRESH

    def verdict(self, peer: int, rail: int, now: float, ref: Optional[int] = None,
                least: float = PROBE_TIMEOUT_MIN) -> Optional[bool]:
        """True: the rail answered. False: its burst went unanswered while the reference
        rail's answered (or there is no reference rail), each probe given RTT_FACTOR times
        the reference's round trip, and at least ``least`` (health.py gives a slow rail the
        time its queue of bulk data needs): a peer or a network slowed by a loaded CPU
        answers late on every rail, and late answers widen the wait. None:
        no burst, still waiting, or neither answered: then the peer (or this rank) is too
        slow to answer at all, which says nothing about the rail; both bursts are dropped
        and the next ``ask`` starts afresh. A slow process is not a dead rail."""
        with self.lock:
            b = self.bursts.get((peer, rail))
            if b is None:
                return None
            if b.answered is not None:
                return True
            if ref is None or not self.available(ref):
                b.wait = max(b.wait, least, PROBE_TIMEOUT_ALONE)
                return False if b.over(now, max(least, PROBE_TIMEOUT_ALONE)) else None
            rb = self.bursts.get((peer, ref))
            if rb is not None and rb.answered is not None:
                timeout = max(least, RTT_FACTOR * rb.rtt())
                b.wait = max(b.wait, timeout)
                return False if b.over(now, timeout) else None
            if rb is not None and not rb.over(now, PROBE_TIMEOUT_ALONE):
                return None
            self.bursts.pop((peer, rail), None)
            self.bursts.pop((peer, ref), None)
            self.inconclusive += 1
            return None

    def peer_dropped(self, peer: int, rail: int, since: float) -> bool:
        """The peer answered this rail's burst (one started at ``since`` or later: after our
        connection there opened), saying its end of our connection there has failed: ours
        is stale however well the path carries (health.Health._judge)."""
        with self.lock:
            b = self.bursts.get((peer, rail))
            return b is not None and b.t0 >= since and b.answered is not None and b.dropped

    def describe(self, peer: int, rail: int, now: float) -> dict:
        """A burst as the event log shows it (ms since its start)."""
        with self.lock:
            b = self.bursts.get((peer, rail))
            if b is None:
                return {}
            return {"sent": b.sent, "age_ms": round((now - b.t0) * 1e3, 1),
                    "last_sent_ms": round((b.t_sent - b.t0) * 1e3, 1),
                    "answer_ms": None if b.answered is None
                    else round((b.answered - b.t0) * 1e3, 1)}

    def forget(self, peer: int, rail: int) -> None:
        with self.lock:
            self.bursts.pop((peer, rail), None)

    # ------------------------------------------------------------------ the wire
    def _datagram(self, kind: int, rail: int, dst: int, session: int, seq: int,
                  about: int = 0) -> bytes:
        head = _HEAD.pack(MAGIC, kind, rail, about, self.rank, dst, session, seq)
        return head + auth.mac(self.key, b"nezha-probe", head)[:TAG_BYTES]

    def _parse(self, data: bytes, rail: int) -> Optional[tuple]:
        if len(data) != SIZE:
            return None
        head, tag = data[:_HEAD.size], data[_HEAD.size:]
        magic, kind, r, about, src, dst, session, seq = _HEAD.unpack(head)
        if magic != MAGIC or r != rail or kind not in (REQ, REP, ASK, ANSWER):
            return None
        if not auth.same(tag, auth.mac(self.key, b"nezha-probe", head)[:TAG_BYTES]):
            return None
        return kind, src, dst, session, seq, about

    # ------------------------------------------------------------------ questions
    def question(self, peer: int, via: int, what: int, about: int, window: float,
                 ident: int) -> None:
        """Ask ``peer`` over rail ``via`` a health question ``what`` about rail ``about``
        (health.py's "arrivals?" or "acks?", which also go over TCP): a datagram does not
        queue behind the megabytes a loaded rail's TCP socket holds, which made the TCP
        question and its answer take 50 ms on two 200 Mbit/s rails. The first answer counts."""
        if self.available(via) and not self.blocked(peer, via):
            self._send(via, self.endpoint(peer, via),
                       self._datagram(ASK, via, peer, int(min(window, 60.0) * 1e6), ident,
                                      about=(what << 8) | about))

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        fds = {}
        for rail, s in enumerate(self.socks):
            if s is not None:
                poller.register(s.fileno(), select.POLLIN)
                fds[s.fileno()] = rail
        while not self.stop.is_set():
            now = time.monotonic()
            timeout = 1 if self._send_due(now) | self._resend_due(now) else 200
            for fd, ev in poller.poll(timeout):
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 512)
                    except OSError:
                        pass
                    continue
                if ev & select.POLLERR:
                    # an ICMP error on the error queue (IP_RECVERR): poll reports it until it
                    # is read, even once a send has reported (and cleared) the socket's error
                    self._clear_errors(self.socks[fds[fd]])
                self._drain(fds[fd])

    def _send_due(self, now: float) -> bool:
        """Send the probes whose time has come; True while a burst still has probes to send."""
        with self.lock:
            due = [(k, b) for k, b in self.bursts.items()
                   if b.sent < PROBE_COUNT and b.answered is None]
        busy = False
        for (peer, rail), b in due:
            while b.sent < PROBE_COUNT and now >= b.t0 + b.sent * PROBE_INTERVAL:
                b.sent += 1
                b.t_sent = now
                if not self.blocked(peer, rail):
                    self._send(rail, self.endpoint(peer, rail),
                               self._datagram(REQ, rail, peer, b.session, b.sent))
            busy = busy or b.sent < PROBE_COUNT
        return busy

    def _on_question(self, kind: int, rail: int, addr, src: int, value: int, ident: int,
                     about: int) -> None:
        what, on = about >> 8, about & 0xFF
        if kind == ASK and self.on_question is not None:
            got = self.on_question(what, src, on, value / 1e6)
            self._send(rail, addr, self._datagram(ANSWER, rail, src, min(int(got), 2**32 - 1),
                                                  ident, about=about))
        elif kind == ANSWER and self.on_answer is not None:
            self.on_answer(what, src, on, ident, value)

    def _sendto(self, rail: int, dest: tuple[str, int], data: bytes) -> int:
        """0 if the datagram went out, else the errno. With IP_RECVERR an ICMP error that
        came in earlier (a peer's port closed) is reported by the next send, which then did
        not send: that one is tried once more."""
        for attempt in (0, 1):
            try:
                self.socks[rail].sendto(data, dest)
                return 0
            except OSError as e:
                if e.errno == errno.ENOBUFS or attempt:
                    return e.errno or -1

    def _send(self, rail: int, dest: tuple[str, int] | None, data: bytes) -> None:
        if dest is None:        # the peer's record is not read yet: lost, as on a black hole
            return
        err = self._sendto(rail, dest, data)
        if err:
            if err == errno.ENOBUFS:          # our own queue was full: again, shortly
                with self.lock:
                    if len(self._resend) >= RESEND_MAX:
                        self._resend.popleft()
                    self._resend.append((time.monotonic() + RESEND_FOR, rail, dest, data))
                if threading.current_thread() is not self.thread:
                    self._wake()
            # otherwise a link that is down: the datagram is lost, as on a black hole

    def _resend_due(self, now: float) -> bool:
        """Try the locally dropped datagrams again; True while some still wait."""
        with self.lock:
            todo, self._resend = self._resend, deque()
        for item in todo:
            give_up, rail, dest, data = item
            if now > give_up:
                continue
            err = self._sendto(rail, dest, data)
            if not err:
                self.resent += 1
            elif err == errno.ENOBUFS:
                with self.lock:
                    self._resend.append(item)
        with self.lock:
            return bool(self._resend)

    @staticmethod
    def _clear_errors(s: socket.socket) -> None:
        """Read the socket's error queue (IP_RECVERR: an ICMP error, e.g. a peer's port
        gone)."""
        while True:
            try:
                s.recvmsg(SIZE + 1, 512, socket.MSG_ERRQUEUE)
            except OSError:
                return

    def _drain(self, rail: int) -> None:
        s = self.socks[rail]
        errors = 0
        while True:
            try:
                data, addr = s.recvfrom(SIZE + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # the socket's pending error (IP_RECVERR), cleared by this read: take its
                # queue too and read on; twice in a row, the socket itself is broken
                errors += 1
                if errors > 1:
                    return
                self._clear_errors(s)
                continue
            errors = 0
            got = self._parse(data, rail)
            if got is None:
                continue
            kind, src, dst, session, seq, about = got
            if dst != self.rank or self.blocked(src, rail):
                continue
            if kind == REQ:
                self.answered += 1
                self._send(rail, addr, self._datagram(REP, rail, src, session, seq,
                                                      about=DROPPED if self.dropped(src, rail)
                                                      else 0))
                continue
            if kind in (ASK, ANSWER):
                self._on_question(kind, rail, addr, src, session, seq, about)
                continue
            with self.lock:
                b = self.bursts.get((src, rail))
                if b is not None and b.session == session and b.answered is None:
                    b.answered = time.monotonic()
                    b.dropped = about == DROPPED
                    self.heard.add(src)
