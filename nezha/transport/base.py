"""Transport interface and the socket Connection (reader + writer thread)."""
from __future__ import annotations

import errno
import fcntl
import queue
import select
import socket
import struct
import termios
import threading
import time
from collections import deque

from .. import wire
from ..config import Config
from ..errors import CommError, ConfigError, PeerClosedError, ProtocolError
from .tcpinfo import tcp_info


def recv_exact_into(sock, view, what="frame", counter=None) -> bool:
    """Fill ``view`` from ``sock``. False on EOF before the first byte; raises
    PeerClosedError on EOF in the middle (a truncated frame). ``counter`` (a Connection) has
    its ``rx_all`` advanced as bytes come in, so its arrival count moves during a long read."""
    n = len(view)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return False
            raise PeerClosedError(f"connection closed in the middle of a {what} "
                                  f"({got} of {n} bytes)")
        got += k
        if counter is not None:
            counter.rx_all += k
    return True


def set_congestion(sock: socket.socket, name: str, setting: str) -> None:
    """TCP congestion control ``name`` on ``sock`` (nothing if empty); ConfigError naming
    ``setting`` if the kernel refuses it. Every TCP path of a job uses the same one: the
    aggregation switch's connections under the host's default (bbr here) ran at 0.8 of their
    link next to a cubic ring."""
    if not name:
        return
    try:   # TCP_CONGESTION: per socket, whatever the host's default is
        sock.setsockopt(socket.IPPROTO_TCP, 13, name.encode())
    except OSError as e:
        raise ConfigError(f"{setting}={name!r}: the kernel refused it ({e.strerror or e}); see "
                          f"/proc/sys/net/ipv4/tcp_available_congestion_control") from e


RCVLOWAT_MAX = 128 << 10     # bytes a payload's reader waits for before it wakes (_await_bytes)
RCVLOWAT_POLL_MS = 20        # ...or this long, doubled after each wait that ran out within
RCVLOWAT_POLL_MAX_MS = 320   # a payload, up to this (_await_bytes)
TCP_RTO_MIN_US = 45          # linux/tcp.h, Linux >= 6.15
_RTO_MIN_CAP_US = 200_000    # the kernel's own minimum RTO: TCP_RTO_MIN_US refuses more


def set_rto_min(sock: socket.socket, ms: float) -> float:
    """The least retransmission timeout on ``sock``; returns what the kernel took, in ms (the
    request rounded up to its clock: two ticks at least, 8 ms at HZ=250), or 0.0 where the
    kernel has no per-socket minimum (before Linux 6.15; MPTCP sockets). Why: a lost last
    segment of a share waits one RTO, 200 ms by default, and every operation waits for its
    slowest share; on 4 hosts x (150 + 120 Mbit/s, 1 % loss) the lossy rail's stalls made the
    split worth less than the clean rail alone. A route's locked ``rto_min`` wins over it."""
    if ms <= 0:
        return 0.0
    us = max(1, int(ms * 1000))
    while True:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, us)
        except OSError as e:
            if e.errno == errno.EINVAL and us < _RTO_MIN_CAP_US:
                us = min(_RTO_MIN_CAP_US, us * 2)    # below the kernel's two clock ticks
                continue
            if e.errno in (errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.EINVAL):
                return 0.0
            raise
        return sock.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US) / 1000


def _consume(bufs: list, n: int) -> None:
    """Drop the first ``n`` bytes of ``bufs`` (memoryviews), in place."""
    while n:
        if n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        else:
            bufs[0] = bufs[0][n:]
            n = 0


def send_vec(sock, bufs):
    """sendmsg with partial-write handling."""
    bufs = [memoryview(b).cast("B") for b in bufs if len(b)]
    while bufs:
        _consume(bufs, sock.sendmsg(bufs))


def send_vec_now(sock, bufs) -> list:
    """As much of ``bufs`` as the socket takes without waiting; returns what is left (as
    memoryviews; empty when all of it went)."""
    bufs = [memoryview(b).cast("B") for b in bufs if len(b)]
    while bufs:
        try:
            n = sock.sendmsg(bufs, [], socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return bufs
        _consume(bufs, n)
    return bufs


class Transport:
    """Set-up side of a protocol: listening sockets per logical rail and outgoing connects."""
    name = "base"
    link_events = True     # health.py fails a rail's connections when its interface goes down

    def __init__(self, rails, config: Config = Config()):
        self.rails = list(rails)
        self.sockbuf = config.sockbuf
        # bounds the kernel's retries; by default the context's timeout
        self.user_timeout_ms = config.tcp_user_timeout_ms or int(config.timeout * 1000)
        self.notsent_lowat = config.notsent_lowat
        self.congestion = config.tcp_congestion
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if self.congestion:   # refuse a bad name now, on every rank, not at connect time
                self._set_congestion(probe)
            # what the kernel makes of NEZHA_TCP_RTO_MIN_MS (0.0: no per-socket minimum here)
            self.rto_min_ms = set_rto_min(probe, config.tcp_rto_min_ms)
        finally:
            probe.close()
        self.listeners: list[socket.socket] = []

    @property
    def nrails(self) -> int:
        return len(self.rails)

    def new_socket(self) -> socket.socket:
        raise NotImplementedError

    def _set_congestion(self, s: socket.socket) -> None:
        try:
            set_congestion(s, self.congestion, "NEZHA_TCP_CONGESTION")
        except ConfigError:
            if self.name != "mptcp" or s.proto != 262:
                raise
            # older kernels refuse it on MPTCP sockets: their subflows use the default

    def tune(self, s: socket.socket):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.notsent_lowat:
            try:   # keep little unsent data in the kernel: control frames do not wait long
                s.setsockopt(socket.IPPROTO_TCP, 25, int(self.notsent_lowat))  # TCP_NOTSENT_LOWAT
            except OSError:
                pass
        if self.congestion:
            self._set_congestion(s)
        if self.rto_min_ms:
            set_rto_min(s, self.rto_min_ms)
        if self.sockbuf:
            for opt, force in ((socket.SO_SNDBUF, 32), (socket.SO_RCVBUF, 33)):
                try:
                    s.setsockopt(socket.SOL_SOCKET, force, self.sockbuf)  # SO_*BUFFORCE (root)
                except OSError:
                    s.setsockopt(socket.SOL_SOCKET, opt, self.sockbuf)
        if self.user_timeout_ms:
            try:
                s.setsockopt(socket.IPPROTO_TCP, 18, int(self.user_timeout_ms))  # TCP_USER_TIMEOUT
            except OSError:
                pass

    def listen(self) -> list[tuple[str, int]]:
        """Open one listener per logical rail; returns [(addr, port)]."""
        from ..errors import RailConfigError
        eps = []
        for r, addr in enumerate(self.rails):
            s = self.new_socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, 0))
            except OSError as e:
                s.close()
                self.close()
                raise RailConfigError(f"rail {r}: cannot bind to {addr}: {e.strerror or e} "
                                      f"(is the address configured on this host?)") from e
            s.listen(256)
            self.listeners.append(s)
            eps.append((addr, s.getsockname()[1]))
        return eps

    def connect(self, rail: int, dest: tuple[str, int], timeout: float,
                retry: bool = True) -> socket.socket:
        """Connect from the rail's local address to ``dest``, retrying until ``timeout``
        (one attempt of at most ``timeout`` with retry=False)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.new_socket()
            try:
                s.bind((self.rails[rail], 0))
                s.settimeout(max(0.1, min(2.0, deadline - time.monotonic())))
                s.connect(tuple(dest))
                s.settimeout(None)
                self.tune(s)
                return s
            except OSError:
                s.close()
                if not retry or time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def close(self):
        for s in self.listeners:
            try:
                s.close()
            except OSError:
                pass
        self.listeners = []


_WAKE = object()


class _Rest:
    """The end of a frame that a caller thread began to write and the socket did not take
    at once (Connection.put): whoever next writes on the connection holding its write lock
    is the writer thread, and it sends this first."""
    __slots__ = ("bufs", "item")

    def __init__(self, bufs: list, item):
        self.bufs, self.item = bufs, item


class Connection:
    """One socket to one peer on one rail. ``handler`` is the engine (nezha/engine/)."""

    def __init__(self, sock: socket.socket, peer: int, rail: int, handler):
        self.sock = sock
        self.peer = peer
        self.rail = rail
        self.handler = handler
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.pq: queue.SimpleQueue = queue.SimpleQueue()   # control frames jump the data queue
        self.alive = True
        self.bye_seen = False
        self.closing = False
        self.aborting = False
        self.last_rx = time.monotonic()
        self.last_tx = self.last_rx
        self.opened = self.last_rx    # (health.py: a probe's answer older than this is not
                                      # about this connection)
        self.rx_bytes = 0
        self.rx_all = 0           # every byte read from the socket (headers included)
        self.rx_seen = -1         # rx_all when the health thread last looked (health.py)
        self.t_hdr = 0.0
        self.arr_hdr = 0          # arrived() when the current DATA header was read...
        self.arr_end = 0          # ...and when its payload was
        self._inq_ok = True
        self.cur_slot = None
        self.unacked = 0          # data chunks queued/sent here and not yet acknowledged
        self.orphans = 0          # ...of which their message is done (engine/hedge.py)
        self.t_end = 0.0          # when the last DATA payload ended (engine costs)
        self.busy_since = 0.0
        self.last_ack = 0.0
        # test hooks, checked once per frame: this connection (blackhole) or the whole rank
        # (the engine's silenced, which also covers connections made later) moves no bytes
        self.blackhole = False
        self._health_state()
        try:   # (local port, remote port): names this TCP connection in rail reports
            self.ident = (sock.getsockname()[1], sock.getpeername()[1])
        except OSError:
            self.ident = (0, 0)
        self._lock = threading.Lock()
        # held by whoever writes a frame (the writer thread, or a caller sending at once)
        self._wlock = threading.Lock()
        self._rest: _Rest | None = None    # a frame begun by a caller (_send_now)
        # where the DATA payload being read in place goes; ``revoke`` redirects the rest to
        # scratch between two non-blocking reads (held only around one such read)
        self._rx_lock = threading.Lock()
        self.rx_target: memoryview | None = None
        self._lowat = 1           # the socket's SO_RCVLOWAT (_await_bytes)
        self._poll_ms = RCVLOWAT_POLL_MS   # how long _await_bytes waits for it
        self._lowat_ok = True
        self._rx_poll = select.poll()
        self._rx_poll.register(sock, select.POLLIN)
        self.reader = threading.Thread(target=self._read_loop, daemon=True,
                                       name=f"nz-rx-p{peer}-r{rail}")
        self.writer = threading.Thread(target=self._write_loop, daemon=True,
                                       name=f"nz-tx-p{peer}-r{rail}")

    def _health_state(self) -> None:
        """What health.py keeps per connection: the progress watchdog, the questions to the
        peer and the evidence waiting for the path probes."""
        self.tcp_info_ok = True   # progress watchdog state (health.py)
        self.tcp_delivered = -1
        self.tcp_moved = 0.0
        self.tcp_rto = 0.0            # TCP RTO when delivery last moved (before any back-off)
        self.suspected = False
        self.arrivals: deque = deque(maxlen=128)   # (t, arrived()) each health tick
        self.check_id = None      # a pending "do bytes still arrive?" question to the peer
        self.check_t = 0.0
        self.check_why = ""
        self.check_ok_t = -1e9    # when the peer last said our bytes still arrive
        self.dead_why = ""        # evidence of a dead rail waiting for the path probes' verdict
        self.dead_t = 0.0         # ...since then
        self.dead_answered = True  # ...and whether the peer answered the question behind it
        self.rx_ok_t = -1e9       # when this rail, silent, was last found alive
        self.rx_check_id = None   # a pending "do your ACKs still arrive?" question (receiver)
        self.rx_check_t = 0.0
        self.rx_due_next = 0.0    # health.py: when a quiet rail's share may be looked at again
        self.rx_check_why = ""

    def __repr__(self):
        return f"<Connection peer={self.peer} rail={self.rail} alive={self.alive}>"

    def start(self):
        self.reader.start()
        self.writer.start()

    # ---------------------------------------------------------------- sending
    def put(self, item):
        """Send a data chunk (engine object) or a control frame (bytes). It goes out from
        the calling thread when nothing waits before it and the socket takes it without
        waiting: a hop to the writer thread per chunk cost about 1 ms per rail and ring step
        with 5 ranks x 14 rails on 2 cores. Otherwise it is queued: a control frame ahead of
        all data."""
        if self._send_now(item):
            return
        if isinstance(item, (bytes, bytearray)):
            self.pq.put(item)
            self.q.put(_WAKE)
        else:
            self.q.put(item)

    def _send_now(self, item) -> bool:
        """Write ``item`` from the calling thread, never waiting on the socket; False if it
        must be queued instead. A frame the socket took only in part is left to the writer
        thread (_rest), and nothing else goes out from another thread before it is done."""
        if self.blackhole or self.handler.silenced or not self.alive or self.closing \
                or self.aborting or not self.q.empty() or not self.pq.empty():
            return False
        if not self._wlock.acquire(blocking=False):
            return False
        try:
            if self._rest is not None:
                return False
            control = isinstance(item, (bytes, bytearray))
            prep = [item] if control else self.handler.before_send(self, item)
            if prep is None:
                return True
            rest = send_vec_now(self.sock, list(prep))
            if rest:
                self._rest = _Rest(rest, None if control else item)
                self.q.put(_WAKE)
                return True
            self.last_tx = time.monotonic()
            if not control:
                self.handler.after_send(self, item)
            return True
        except OSError:
            # the writer meets the error again and fails the connection from its own
            # thread: the caller may be in the middle of spreading a message (engine lock)
            return False
        finally:
            self._wlock.release()

    def _finish_rest(self, sock) -> None:
        """Send the end of a frame a caller began (the writer thread, holding the lock)."""
        rest, self._rest = self._rest, None
        if rest is not None:
            send_vec(sock, rest.bufs)
            self.last_tx = time.monotonic()
            if rest.item is not None:
                self.handler.after_send(self, rest.item)

    def _flush_control(self, sock):
        while True:
            try:
                frame = self.pq.get_nowait()
            except queue.Empty:
                return
            send_vec(sock, [frame])
            self.last_tx = time.monotonic()

    def _write_loop(self):
        sock = self.sock
        try:
            while True:
                item = self.q.get()
                while (self.blackhole or self.handler.silenced) and self.alive and not self.closing:
                    time.sleep(0.005)
                with self._wlock:
                    self._finish_rest(sock)
                    self._flush_control(sock)
                if item is _WAKE:
                    continue
                if item is None:
                    if self.closing or self.bye_seen:
                        try:
                            sock.shutdown(socket.SHUT_WR)
                        except OSError:
                            pass
                    break
                if self.aborting or not self.alive:
                    continue
                with self._wlock:
                    self._finish_rest(sock)
                    prep = self.handler.before_send(self, item)
                    if prep is None:
                        continue
                    send_vec(sock, list(prep))
                    self.last_tx = time.monotonic()
                    self.handler.after_send(self, item)
        except (OSError, ValueError) as e:
            self.fail(e)
        except Exception as e:  # a bug: make it visible as a comm failure
            self.fail(e)

    # ---------------------------------------------------------------- receiving
    def revoke(self) -> bool:
        """The DATA payload being read in place is no longer wanted there (another copy of
        the chunk is in, or its operation ended and the caller has the buffer back): read
        the rest of it into scratch. True if a payload was being read in place."""
        with self._rx_lock:
            if self.rx_target is None:
                return False
            self.rx_target = memoryview(bytearray(len(self.rx_target)))
            return True

    def _recv_in_place(self, target) -> None:
        """Read a DATA payload straight into ``target`` (the posted receive) by non-blocking
        reads, so that ``revoke`` can redirect it between two of them."""
        n, got = len(target), 0
        self._poll_ms = RCVLOWAT_POLL_MS
        with self._rx_lock:
            self.rx_target = target
        try:
            while got < n:
                with self._rx_lock:
                    try:
                        k = self.sock.recv_into(self.rx_target[got:], n - got, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        k = -1
                if k == 0:
                    raise PeerClosedError(f"rank {self.peer} closed rail {self.rail} in the "
                                          f"middle of a payload ({got} of {n} bytes)")
                if k < 0:
                    self._await_bytes(n - got)
                    continue
                got += k
                self.rx_all += k
        finally:
            with self._rx_lock:
                self.rx_target = None
            if self._lowat != 1:     # a header or an ACK is smaller: wake for any byte again
                self._set_lowat(1)

    def _await_bytes(self, left: int) -> None:
        """Sleep until ``left`` bytes, or RCVLOWAT_MAX of them, wait in the socket (or it is
        shut down). Why: a shaped rail delivers a few segments at a time, and a wake-up per
        segment is a pass through Python and the GIL; with this wait 5 ranks x 15 rails of 10-120
        Mbit/s on 2 cores switched threads half as often. SO_RCVLOWAT holds the wake-up
        (poll and the receive path both honour it); the last piece of a payload asks for
        exactly what is left, so a payload's end is seen when its last byte arrives. The
        poll gives up after RCVLOWAT_POLL_MS, and the caller then reads what there is: a
        kernel that held more than it said can cost that much, never a hang. Each wait that
        runs out doubles the next one's, up to RCVLOWAT_POLL_MAX_MS, for the rest of the
        payload: a rail slower than 128 KiB per 20 ms (50 Mbit/s) woke its reader every 20 ms
        for what had trickled in, 50 times a second per connection (64 hosts x 2 rails of 1
        Mbit/s on 2 cores, where the ranks' threads left the CPU no idle tick). The wait
        cannot hold the sender up: the kernel keeps the mark within half the receive buffer
        (tcp_set_rcvlowat), so the window stays open until it is reached."""
        want = min(left, RCVLOWAT_MAX) if self._lowat_ok else 1
        if want != self._lowat:
            self._set_lowat(want)
        if self._lowat <= 1:
            self._rx_poll.poll(None)
        elif not self._rx_poll.poll(self._poll_ms):
            self._poll_ms = min(2 * self._poll_ms, RCVLOWAT_POLL_MAX_MS)

    def _set_lowat(self, n: int) -> None:
        """SO_RCVLOWAT = ``n``. The kernel compares it with the queued bytes before waking
        any reader, also a blocking read of a 64-byte header: between payloads it is 1."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
            self._lowat = n
        except OSError:          # a protocol without it (MPTCP on older kernels)
            self._lowat_ok = False

    def arrived(self) -> int:
        """Bytes that have reached this socket so far: read by us plus waiting in the kernel's
        receive queue (SIOCINQ). Rate samples use it so that bytes which sat in the queue while
        the reader was busy do not look as if they arrived in no time."""
        q = 0
        if self._inq_ok:
            try:
                q = struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.FIONREAD,
                                                   b"\0\0\0\0"))[0]
            except (OSError, ValueError):
                self._inq_ok = False
        return self.rx_all + q

    def written_unacked(self) -> int:
        """Bytes written to the socket that TCP has not had acknowledged yet, sent or not
        (SIOCOUTQ); -1 if the kernel does not say."""
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ,
                                                  b"\0\0\0\0"))[0]
        except (OSError, ValueError):
            return -1

    def arrived_within(self, seconds: float) -> int:
        """Bytes that reached this socket in the last ``seconds`` (from the health thread's
        samples; the oldest sample if the history is shorter), and 0 if the kernel says no
        data segment came in that long. The samples are a health tick (10 ms) apart, so they
        answer for a longer window than asked: a sender's question 30 ms into a black hole
        was answered with the 148 KB that arrived just before it, and the rail was failed
        one watchdog limit later (75 ms instead of 45)."""
        ti = tcp_info(self.sock) if self.tcp_info_ok else None
        if ti is not None and ti.last_data_recv >= seconds:
            return 0
        now, cur = time.monotonic(), self.arrived()
        ref = None
        # one C-level copy: the health thread appends a tick's sample meanwhile, and iterating
        # the deque itself raised "deque mutated during iteration" in this (the reader's)
        # thread, which is fatal to the job (32 hosts on 2 cores)
        for t, a in reversed(tuple(self.arrivals)):
            ref = a
            if t <= now - seconds:
                break
        return cur - (cur if ref is None else ref)

    def _read_loop(self):
        hview = memoryview(bytearray(wire.HEADER_SIZE))
        try:
            while True:
                while (self.blackhole or self.handler.silenced) and self.alive and not self.closing:
                    time.sleep(0.005)
                if not self.alive:
                    return
                if not recv_exact_into(self.sock, hview, "header", self):
                    self._at_eof()
                    return
                now = time.monotonic()
                self.last_rx = now
                h = wire.unpack(hview)
                if h.src != self.peer:
                    raise ProtocolError(f"frame claims src rank {h.src} on the connection to "
                                        f"rank {self.peer}")
                self._dispatch(h, now)
        except PeerClosedError as e:
            self.fail(e)
        except CommError as e:          # protocol violation or mismatch: fatal for the job
            self.fail(e, protocol=True)
        except (OSError, ValueError) as e:
            self.fail(e)
        except Exception as e:
            self.fail(e, protocol=True)
        finally:
            self.handler.release_target(self)

    def _at_eof(self):
        """The peer closed the stream between frames: expected after a BYE, a failure if not."""
        if self.bye_seen or self.closing:
            self._mark_dead()
            self.handler.on_closed(self)
        else:
            self.fail(PeerClosedError(f"rank {self.peer} closed its connection on rail {self.rail}"))

    def _dispatch(self, h, now: float):
        """Read the rest of frame ``h`` (its payload) and hand it to the handler."""
        t = h.type
        if t == wire.DATA:
            self._read_data(h, now)
        elif t == wire.ACK:
            self.handler.on_ack(self, h)
        elif t in (wire.ABORT, wire.HELLO, wire.AUTH, wire.CONTROL):
            payload = bytearray(h.length)
            if h.length and not recv_exact_into(self.sock, memoryview(payload), "payload", self):
                raise PeerClosedError("closed before a control payload")
            if t == wire.ABORT:
                self.handler.on_abort(self, h, payload.decode("utf-8", "replace"))
            elif t == wire.CONTROL:
                self.handler.on_control(self, h, bytes(payload))
            else:   # the handshake is over before a Connection reads anything
                raise ProtocolError(f"unexpected {wire.TYPE_NAMES[t]} on an established connection")
        elif t == wire.BYE:
            self.bye_seen = True
            self.handler.on_bye(self)
        elif t == wire.PROBE:
            self.handler.on_probe(self, h)
        # HEARTBEAT: nothing to do (last_rx moved)

    def _read_data(self, h, now: float):
        """A DATA payload: straight into the posted receive, or into a staging buffer."""
        self.arr_hdr = self.arrived()
        target = self.handler.data_target(self, h, now)
        if target is None:
            buf = bytearray(h.length)
            if h.length:
                recv_exact_into(self.sock, memoryview(buf), "payload", self)
            self.rx_bytes += h.length
            self.arr_end = self.arrived()
            self.handler.data_staged(self, h, buf)
            return
        if h.length:
            self._recv_in_place(target)
        self.rx_bytes += h.length
        self.arr_end = self.arrived()
        self.handler.data_done(self, h)

    # ---------------------------------------------------------------- lifecycle
    def _mark_dead(self) -> bool:
        with self._lock:
            if not self.alive:
                return False
            self.alive = False
        return True

    def fail(self, exc, protocol: bool = False):
        """The connection is unusable (socket error, EOF, garbage). Tell the engine once."""
        if not self._mark_dead():
            return
        if protocol:
            # record the error before the peer can see the connection go away (and tell
            # everyone a different story first); the stream cannot be read any more, but it
            # can still carry our ABORT to this peer: the writer sends it, then closes
            self.handler.on_failed(self, exc, protocol)
            err = getattr(self.handler, "error", None) or exc
            self.send_abort(f"{type(err).__name__}: {err}", self.handler.rank)
            self.closing = True
            self.q.put(None)
            return
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.q.put(None)
        self.handler.on_failed(self, exc, protocol)

    def send_abort(self, reason: str, src: int):
        self.aborting = True
        payload = reason.encode("utf-8", "replace")[: wire.MAX_CONTROL_PAYLOAD]
        self.put(wire.frame(wire.ABORT, payload, rail=self.rail, src=src))

    def send_bye(self, src: int):
        self.closing = True
        self.put(wire.Header(wire.BYE, rail=self.rail, src=src).pack())

    def close(self, wait: float = 1.0):
        self.closing = True
        self.q.put(None)
        self.writer.join(wait)
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.reader.join(wait)
        self._mark_dead()
        try:
            self.sock.close()
        except OSError:
            pass
