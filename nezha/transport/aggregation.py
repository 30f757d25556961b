"""The aggregation transport: one rank's connection to an aggregation switch (in-network
reduction, SHARP / NetReduce style; the testbed's is testbed/aggregation/service.py).

The rank sends its contribution for (op_id, chunk) and gets back the reduction over every rank
of the job: each host sends and receives s bytes for an allreduce of s bytes, where a ring
moves 2(n-1)/n x s. ``AggregationChannel.allreduce`` pushes a contiguous array (a byte range
of a bigger buffer, say) as a pipeline of chunks, at most ``window`` bytes in flight (what
the switch holds for us; keep world x window under its per-job bound), and the reader thread
receives every result straight into its place in ``out``. When ``allreduce`` raises, no
result of that call is written into ``out`` afterwards (its chunks still in flight are
abandoned: a late result is read and dropped), so the caller may recompute the range elsewhere. Failures are exceptions of
nezha.errors: AggregatorUnavailable (the switch or its connection is gone: every chunk in
flight failed, move them elsewhere), AggregatorTimeout (no result in time),
AggregationRefused (one chunk refused or given up by the switch; the connection stays up).
Protocol: nezha/aggwire.py. Addresses: NEZHA_AGGREGATORS (``Config.aggregators``).
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .. import aggwire, auth
from ..errors import (AggregationRefused, AggregatorError, AggregatorTimeout,
                      AggregatorUnavailable, ConfigError, ProtocolError)
from .base import recv_exact_into, send_vec, set_congestion, set_rto_min

DEFAULT_CHUNK = 1 << 20           # bytes per chunk of a pipelined allreduce
DEFAULT_WINDOW = 8 << 20          # bytes of contributions in flight per channel
TCP_USER_TIMEOUT = 18


@dataclass
class Pending:
    """One chunk in flight: where its result goes, and how it ended."""
    key: tuple[int, int]
    out: np.ndarray
    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[AggregatorError] = None
    abandoned: bool = False          # its result, if it still comes, never reaches ``out``
    writing: bool = False            # the reader is filling ``out`` right now

    def wait(self, timeout: Optional[float]) -> np.ndarray:
        """The result (in ``out``), or the chunk's exception."""
        if not self.done.wait(timeout):
            raise AggregatorTimeout(f"op {self.key[0]} chunk {self.key[1]}: no result from the "
                                    f"aggregation switch within {timeout:g} s")
        if self.error is not None:
            raise self.error
        return self.out


class AggregationChannel:
    """A rank's authenticated connection to one aggregation switch (thread-safe)."""

    def __init__(self, address: str, port: int, rank: int, world: int,
                 secret: str | bytes | None = None, job: str = "nezha", *,
                 timeout: float = 30.0, connect_timeout: float = 5.0,
                 window: int = DEFAULT_WINDOW, chunk_bytes: int = DEFAULT_CHUNK,
                 source: Optional[str] = None, congestion: str = "",
                 rto_min_ms: float = 0.0) -> None:
        if not 0 <= rank < world <= aggwire.MAX_WORLD:
            raise ConfigError(f"rank {rank} / world {world}: expected 0 <= rank < world <= "
                              f"{aggwire.MAX_WORLD}")
        if not 0 < chunk_bytes <= aggwire.MAX_CHUNK or window < chunk_bytes:
            raise ConfigError(f"chunk_bytes {chunk_bytes} / window {window}: expected 0 < "
                              f"chunk_bytes <= {aggwire.MAX_CHUNK} and window >= chunk_bytes")
        self.address, self.port, self.rank, self.world, self.job = address, port, rank, world, job
        self.timeout, self.window, self.chunk_bytes = timeout, window, chunk_bytes
        self.congestion = congestion
        self.rto_min_ms = rto_min_ms      # the TCP rails' (NEZHA_TCP_RTO_MIN_MS)
        self._secret = auth.secret_bytes(secret)
        self._pending: dict[tuple[int, int], Pending] = {}
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._inflight = 0
        self._failure: Optional[AggregatorUnavailable] = None
        self._sock = self._connect(connect_timeout, source)
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"agg-{address}:{port}")
        self._reader.start()

    # ------------------------------------------------------------------ connection
    def _connect(self, timeout: float, source: Optional[str]) -> socket.socket:
        try:
            s = socket.create_connection((self.address, self.port), timeout=timeout,
                                         source_address=(source, 0) if source else None)
        except OSError as e:
            raise AggregatorUnavailable(f"aggregation switch {self.address}:{self.port}: "
                                        f"{e.strerror or e}") from None
        try:
            set_congestion(s, self.congestion, "NEZHA_TCP_CONGESTION")
            set_rto_min(s, self.rto_min_ms)
        except ConfigError:
            s.close()
            raise
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT, int(self.timeout * 1000))
            self._handshake(s)
            s.settimeout(None)
            return s
        except (OSError, ProtocolError) as e:
            s.close()
            raise AggregatorUnavailable(f"aggregation switch {self.address}:{self.port}: "
                                        f"handshake failed: {e}") from None
        except BaseException:
            s.close()
            raise

    def _handshake(self, s: socket.socket) -> None:
        """HELLO / CHALLENGE / PROOF / WELCOME (aggwire); the switch proves the secret first."""
        nr = auth.nonce()
        s.sendall(aggwire.control(aggwire.HELLO, {"job": self.job, "rank": self.rank,
                                                  "world": self.world, "nonce": nr.hex()}))
        body = self._read_control(s, aggwire.CHALLENGE)
        try:
            ns, proof = bytes.fromhex(body["nonce"]), bytes.fromhex(body["proof"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("CHALLENGE without a hex nonce and proof") from None
        t = aggwire.transcript(nr, ns, self.job, self.rank, self.world)
        if len(ns) != auth.NONCE_BYTES or not auth.same(
                proof, auth.mac(self._secret, aggwire.SWITCH_LABEL, *t)):
            raise ProtocolError("the switch did not prove the job secret (NEZHA_JOB_SECRET "
                                "differs, or is missing on one side)")
        s.sendall(aggwire.control(aggwire.PROOF, {
            "proof": auth.mac(self._secret, aggwire.RANK_LABEL, *t).hex()}))
        self._read_control(s, aggwire.WELCOME)

    @staticmethod
    def _read_control(s: socket.socket, want: int) -> dict:
        buf = bytearray(aggwire.HEADER_SIZE)
        if not recv_exact_into(s, memoryview(buf), "handshake"):
            raise ProtocolError(f"closed before {aggwire.TYPE_NAMES[want]}")
        h = aggwire.unpack(buf)
        payload = bytearray(h.length)
        if h.length:
            recv_exact_into(s, memoryview(payload), "handshake")
        if h.type == aggwire.ERROR:
            raise ProtocolError(f"refused: {payload.decode(errors='replace')}")
        if h.type != want:
            raise ProtocolError(f"{aggwire.TYPE_NAMES[h.type]} where "
                                f"{aggwire.TYPE_NAMES[want]} belongs")
        return aggwire.parse_json(bytes(payload), aggwire.TYPE_NAMES[want])

    def close(self) -> None:
        """Close the connection; chunks still in flight fail with AggregatorUnavailable."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5.0)      # its recv ends with the shutdown
        self._sock.close()
        self._fail(AggregatorUnavailable("aggregation channel closed"))

    def abandon(self, pending: list[Pending], grace: float = 1.0) -> None:
        """Give up chunks: once this returns, none of their results is written into its
        ``out`` (one being written now is waited for, ``grace`` s at most, else the channel
        is closed: a stalled connection must not hold the caller)."""
        deadline = time.monotonic() + grace
        with self._cond:
            for p in pending:
                p.abandoned = True
            while any(p.writing for p in pending):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            stalled = any(p.writing for p in pending)
        if stalled:
            self.close()

    def __enter__(self) -> "AggregationChannel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ sending
    def submit(self, op_id: int, chunk: int, data: np.ndarray, op: str = "sum",
               out: Optional[np.ndarray] = None, timeout: Optional[float] = None) -> Pending:
        """Send one contribution; returns its Pending (``wait`` gives the result in ``out``,
        a new array unless given). Blocks while the window is full."""
        data = np.ascontiguousarray(data).reshape(-1)
        code, redop = aggwire.dtype_code(data.dtype), aggwire.redop_code(op)
        out = np.empty_like(data) if out is None else out
        if out.shape != data.shape or out.dtype != data.dtype or not out.flags.c_contiguous:
            raise ConfigError("out: expected a C-contiguous array of the contribution's shape "
                              "and dtype")
        if not 0 < data.nbytes <= self.chunk_bytes:
            raise ConfigError(f"chunk of {data.nbytes} bytes: expected 1 to {self.chunk_bytes}")
        p = Pending((op_id, chunk), out, data.nbytes)
        self._admit(p, self.timeout if timeout is None else timeout)
        hdr = aggwire.header(type=aggwire.CONTRIB, dtype=code, redop=redop, rank=self.rank,
                             world=self.world, count=data.size, op_id=op_id, chunk=chunk,
                             length=data.nbytes)
        try:
            with self._send_lock:
                send_vec(self._sock, [hdr, data.view(np.uint8)])
        except OSError as e:
            self._fail(AggregatorUnavailable(f"aggregation switch {self.address}:{self.port}: "
                                             f"send failed: {e.strerror or e}"))
        return p

    def _admit(self, p: Pending, timeout: float) -> None:
        """Register ``p`` once the window has room for it (or the channel has failed)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._failure is None and self._inflight and \
                    self._inflight + p.nbytes > self.window:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AggregatorTimeout(f"window of {self.window} bytes still full after "
                                            f"{timeout:g} s: the switch returns no results")
                self._cond.wait(left)
            if self._failure is not None:
                raise self._failure
            if p.key in self._pending:
                raise ConfigError(f"op {p.key[0]} chunk {p.key[1]} is already in flight")
            self._pending[p.key] = p
            self._inflight += p.nbytes

    def allreduce_chunk(self, op_id: int, chunk: int, data: np.ndarray, op: str = "sum",
                        timeout: Optional[float] = None) -> np.ndarray:
        """One chunk, reduced over every rank (a new array)."""
        t = self.timeout if timeout is None else timeout
        p = self.submit(op_id, chunk, data, op, timeout=t)
        try:
            return p.wait(t)
        except AggregatorTimeout:
            self.abandon([p])
            raise

    def allreduce(self, op_id: int, data: np.ndarray, op: str = "sum",
                  out: Optional[np.ndarray] = None, first_chunk: int = 0,
                  timeout: Optional[float] = None) -> np.ndarray:
        """A contiguous array reduced over every rank, pipelined in chunks of ``chunk_bytes``
        (numbered from ``first_chunk``: two ranges of one op take disjoint numbers). ``out``
        may be ``data`` itself (in place). Every rank must pass the same size and dtype."""
        flat = np.ascontiguousarray(data).reshape(-1)
        target = np.empty_like(flat) if out is None else out.reshape(-1)
        if target.shape != flat.shape or target.dtype != flat.dtype:
            raise ConfigError("out: expected an array of the data's size and dtype")
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        step = max(1, self.chunk_bytes // flat.itemsize)
        pending: list[Pending] = []
        try:
            for i, a in enumerate(range(0, flat.size, step)):
                pending.append(self.submit(op_id, first_chunk + i, flat[a:a + step], op,
                                           out=target[a:a + step],
                                           timeout=max(0.0, deadline - time.monotonic())))
            for p in pending:
                p.wait(max(0.0, deadline - time.monotonic()))
        except BaseException:
            self.abandon(pending)
            raise
        return target.reshape(np.shape(data)) if out is None else out

    # ------------------------------------------------------------------ receiving
    def _read_loop(self) -> None:
        """Results and errors into their Pending, until the connection ends."""
        hdr = memoryview(bytearray(aggwire.HEADER_SIZE))
        try:
            while recv_exact_into(self._sock, hdr, "aggregation header"):
                self._dispatch(aggwire.unpack(hdr))
            why = "closed the connection"
        except ConnectionResetError:
            # a switch that exits with our contribution unread resets instead of closing
            # (a full suite saw each): the same event, told the same way
            why = "closed the connection (reset)"
        except (OSError, ProtocolError, AggregatorError) as e:
            why = str(e)
        self._fail(AggregatorUnavailable(f"aggregation switch {self.address}:{self.port}: "
                                         f"{why}"))

    def _dispatch(self, h: aggwire.Header) -> None:
        if h.type not in (aggwire.RESULT, aggwire.ERROR):
            raise ProtocolError(f"{aggwire.TYPE_NAMES[h.type]} after the handshake")
        with self._cond:
            p = self._pending.get(h.key)
        if h.type == aggwire.ERROR:
            payload = bytearray(h.length)
            recv_exact_into(self._sock, memoryview(payload), "error")
            reason = payload.decode(errors="replace")
            if p is None:
                raise ProtocolError(f"the switch ended the connection: {reason}")
            name = aggwire.ERROR_NAMES.get(h.code, str(h.code))
            self._finish(p, AggregationRefused(f"aggregation switch: {reason}", name))
            return
        if p is None or h.length != p.nbytes or h.dtype != aggwire.dtype_code(p.out.dtype):
            raise ProtocolError(f"unexpected {h.describe()}")
        with self._cond:
            p.writing = not p.abandoned
        if not p.writing:                       # nobody wants it any more: read and drop
            recv_exact_into(self._sock, memoryview(bytearray(h.length)), "result")
            self._finish(p, AggregatorError(f"op {h.op_id} chunk {h.chunk} was abandoned"))
            return
        try:
            recv_exact_into(self._sock, memoryview(p.out).cast("B"), "result")
        finally:
            with self._cond:
                p.writing = False
                self._cond.notify_all()
        self._finish(p, None)

    def _finish(self, p: Pending, error: Optional[AggregatorError]) -> None:
        with self._cond:
            if self._pending.pop(p.key, None) is None:
                return
            self._inflight -= p.nbytes
            p.error = error
            p.done.set()
            self._cond.notify_all()

    def _fail(self, error: AggregatorUnavailable) -> None:
        """The channel is unusable: every chunk in flight, and every later submit, fails."""
        with self._cond:
            if self._failure is None:
                self._failure = error
            for p in self._pending.values():
                p.error = self._failure
                p.done.set()
            self._pending.clear()
            self._inflight = 0
            self._cond.notify_all()

