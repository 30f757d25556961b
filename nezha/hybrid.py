"""One allreduce split across protocols: a contiguous range through the aggregation
switch(es), the rest through the TCP multi-rail ring, both at once (protocols.py decides how
much).

Sequence of one hybrid operation (every rank runs the same steps, so the op ids match):

  1. op k: the aggregation half [0, x) runs in a worker thread (one per switch), its results
     go to a scratch buffer; the ring half [x, S) runs in the caller over the TCP rails.
  2. op k+1, the vote: a tiny allgather (collective kind CONTROL) of one row per rank: did my
     aggregation half succeed, can I reach every switch now, what did each half take.
  3. if any rank's aggregation half failed, op k+2 recomputes [0, x) through the ring from
     the untouched input (every rank: the ones whose half succeeded too, so the bits are the
     same everywhere); else the scratch results are copied into [0, x).
  4. every rank applies the same rows to its HybridState: the split of the next operation,
     and the aggregation going down or coming back (events ``hybrid_split``, ``agg_down``,
     ``agg_back``; ``agg_failed`` is one rank's own failure, with its error).

A failed channel is closed; a background thread probes its switch (PING, then the
authenticated handshake) every PROBE_S and hands the fresh channel back, and the next vote
takes the aggregation back once every rank has one.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from . import aggwire, collectives, wire
from .buffers import Scratch
from .errors import AggregatorError, ConfigError, ProtocolError
from .protocols import (AGG_BYTES, AGG_RTT, AGG_S, HOT, HYBRID_MIN, HYBRID_OPS, OK, REACHABLE,
                        RING_BYTES, RING_S, ROW_COLUMNS, HybridState)
from .transport.aggregation import AggregationChannel

PROBE_S = 0.1              # between two probes of a switch that is down: the rail is idle
PROBE_TIMEOUT = 0.3        # for one PING (twice that for the handshake); a SYN lost in a
                           # black hole costs this, and the rejoin waits for the operation in
                           # flight (a whole 16 MiB one rides the TCP rail: 1.4 s on 150 Mbit/s)
HALF_MIN_TIMEOUT = 1.0     # the aggregation half's deadline: at least this...
HALF_SLACK = 3.0           # ...and this many times its predicted time (HOT): a switch that
                           # vanished without a FIN (one rank in four, once) or a black-holed
                           # rail costs this much before the range moves to the ring
COLD_TIMEOUT = 10.0        # ...or this (COLD; but at most 1 s or twice the ring half's time
                           # after the ring half ended), never more than the context's timeout
# bytes per switch key: the switch answers a key once every rank's whole chunk is in, so an
# operation's first result waits a chunk's transfer; 256 KiB against 1 MiB took the switch
# half from 0.87 to 0.93-0.97 of its wire (16 MiB, 4 hosts, 150 Mbit/s: 341-345 vs 326 Mbit/s
# busbw). Smaller (128 KiB) gained nothing more and costs the switch more frames
AGG_CHUNK = 256 << 10
AGG_WINDOW = 8 << 20       # bytes in flight per switch
CLOSE_WAIT = 5.0           # for a half to end once its channel was closed under it
HISTORY = 1024             # operations remembered for stats (the split of each)


@dataclass
class Half:
    """How one rank's aggregation half ended."""
    ok: bool = True
    seconds: float = float("nan")
    error: str = ""


def ping(address: str, port: int, timeout: float = PROBE_TIMEOUT) -> bool:
    """Is the switch's service there at all (one PING / PONG, no secret needed)."""
    try:
        aggwire.ping(address, port, timeout)
        return True
    except (OSError, ValueError, ProtocolError):
        return False


class Switch:
    """One aggregation switch as a rank sees it: a channel, or a probe that gets one back."""

    def __init__(self, rail: str, address: str, port: int, open_channel) -> None:
        self.rail, self.address, self.port = rail, address, port
        self._open = open_channel
        self._lock = threading.Lock()
        self.channel: Optional[AggregationChannel] = None
        self.rtt = float("nan")           # half the last handshake: the start-up estimate
        self._prober: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def connect(self, timeout: float) -> bool:
        """Try once; True if there is a channel now."""
        t0 = time.monotonic()
        try:
            ch = self._open(self.address, self.port, timeout)
        except AggregatorError:
            return False
        with self._lock:
            if self._stop.is_set():
                ch.close()
                return False
            self.channel, self.rtt = ch, (time.monotonic() - t0) / 2
        return True

    def drop(self, ch: Optional[AggregationChannel]) -> None:
        """Close ``ch`` (a channel that failed) and probe for a fresh one; a fresh one that
        a probe made meanwhile stays."""
        with self._lock:
            if self.channel is ch:
                self.channel = None
        if ch is not None:
            ch.close()
        self.probe()

    def probe(self) -> None:
        with self._lock:
            if self.channel is not None or self._stop.is_set() or \
                    (self._prober is not None and self._prober.is_alive()):
                return
            self._prober = threading.Thread(target=self._probe_loop, daemon=True,
                                            name=f"agg-probe-{self.rail}")
            self._prober.start()

    def _probe_loop(self) -> None:
        while not self._stop.wait(PROBE_S):
            if ping(self.address, self.port) and self.connect(PROBE_TIMEOUT * 2):
                return

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            ch, self.channel = self.channel, None
        if ch is not None:
            ch.close()


class HybridAllreduce:
    """The aggregation side of a Context (system nezha with NEZHA_AGGREGATORS)."""

    def __init__(self, rank: int, world: int, tcp_rails: int,
                 aggregators: tuple[tuple[str, str, int], ...], secret, job: str,
                 timeout: float, events, congestion: str = "",
                 rto_min_ms: float = 0.0) -> None:
        if not aggregators:
            raise ConfigError("NEZHA_AGGREGATORS: no aggregation switch given")
        self.rank, self.world, self.timeout, self.events = rank, world, timeout, events
        self.state = HybridState(world, tcp_rails, len(aggregators))

        def open_channel(address: str, port: int, t: float) -> AggregationChannel:
            return AggregationChannel(address, port, rank, world, secret, job,
                                      timeout=timeout, connect_timeout=t,
                                      chunk_bytes=AGG_CHUNK, window=AGG_WINDOW,
                                      congestion=congestion, rto_min_ms=rto_min_ms)
        self.switches = [Switch(r, a, p, open_channel) for r, a, p in aggregators]
        for sw in self.switches:
            if not sw.connect(2.0):
                sw.probe()
        self._pool = ThreadPoolExecutor(len(self.switches), thread_name_prefix="agg-half")
        self._scratch = Scratch()
        self._op = -1
        self.down_at: Optional[float] = None
        self.agg_bytes = 0                  # moved through the switches (agreed ok)
        self.recomputed_bytes = 0           # failed over to the ring
        self.history: deque = deque(maxlen=HISTORY)   # (op, aggregation bytes, ring bytes)

    def applies(self, nbytes: int, op: str) -> bool:
        """Only sum / max / min (what a switch reduces) of HYBRID_MIN bytes or more."""
        return self.world > 1 and op in HYBRID_OPS and nbytes >= HYBRID_MIN

    # ------------------------------------------------------------------ one operation
    def allreduce(self, arr: np.ndarray, op: str, run_op: Callable, control_op: Callable) -> None:
        """``arr`` (1-D) reduced in place over all ranks. ``run_op(ring_bytes, fn)`` runs
        ``fn(call)`` as the Context's collective; ``control_op(fn)`` runs ``fn(call)`` as one
        more operation (the vote, the recompute)."""
        x = self.state.agg_bytes(arr.nbytes, arr.itemsize) // arr.itemsize
        scratch = self._scratch_for(arr, x)
        halves: list[Half] = []
        ring_s = float("nan")

        def both(call) -> None:
            nonlocal ring_s
            self._op = call.op_id
            deadline, futs = self._start(call.op_id, arr[:x], scratch, op, arr.nbytes) \
                if x else (0.0, [])
            t0 = time.monotonic()
            if x < len(arr):
                collectives.ring_allreduce(call, arr[x:], op)
                ring_s = time.monotonic() - t0
                if self.state.d.state != HOT:      # no prediction yet: the ring's time is one
                    deadline = min(deadline, t0 + ring_s + max(HALF_MIN_TIMEOUT, 2 * ring_s))
            halves.extend(self._finish(futs, deadline))
        run_op((len(arr) - x) * arr.itemsize, both)
        mine = self._row(x * arr.itemsize, halves, (len(arr) - x) * arr.itemsize, ring_s)
        rows = self._vote(mine, control_op)
        if x and rows[:, OK].min() <= 0:
            control_op(lambda call: collectives.ring_allreduce(call, arr[:x], op))
            self.recomputed_bytes += x * arr.itemsize
        elif x:
            arr[:x] = scratch
            self.agg_bytes += x * arr.itemsize
        self.history.append((self._op, x * arr.itemsize, (len(arr) - x) * arr.itemsize))
        self._apply(rows, x)

    def _scratch_for(self, arr: np.ndarray, x: int) -> np.ndarray:
        """Where the switch's results go until the vote says every rank has them."""
        return self._scratch.take(x * arr.itemsize, arr.dtype)

    def _start(self, op_id: int, data: np.ndarray, out: np.ndarray, op: str, nbytes: int):
        """One worker per switch, each on its contiguous part of the range."""
        m = len(self.switches)
        cut = collectives.bounds(len(data), m)
        pred = self.state.predict(nbytes)
        limit = COLD_TIMEOUT if pred is None else max(HALF_MIN_TIMEOUT, HALF_SLACK * pred)
        deadline = time.monotonic() + min(self.timeout, limit)
        return deadline, [self._pool.submit(self._half, sw, op_id, data[cut[i]:cut[i + 1]],
                                            out[cut[i]:cut[i + 1]], op, deadline)
                          for i, sw in enumerate(self.switches)]

    def _finish(self, futs: list, deadline: float) -> list[Half]:
        """Every half's end, by the deadline: a half still blocked then (a send into a
        black-holed rail blocks until TCP gives up) has its channel closed, which ends it."""
        out = []
        for sw, fut in zip(self.switches, futs):
            try:
                out.append(fut.result(max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                sw.drop(sw.channel)
                try:
                    out.append(fut.result(CLOSE_WAIT))
                except FutureTimeout:
                    out.append(Half(False, float("nan"), "no end after its channel closed"))
        return out

    def _half(self, sw: Switch, op_id: int, data, out, op: str, deadline: float) -> Half:
        t0 = time.monotonic()
        ch = sw.channel
        try:
            if ch is None:
                raise AggregatorError(f"no connection to the switch of {sw.rail}")
            ch.allreduce(op_id, data, op, out=out, timeout=max(0.0, deadline - t0))
            return Half(True, time.monotonic() - t0)
        except AggregatorError as e:
            if ch is not None:
                sw.drop(ch)
            self.events.emit("agg_failed", rail=sw.rail, op=op_id,
                             error=f"{type(e).__name__}: {e}")
            return Half(False, time.monotonic() - t0, str(e))

    # ------------------------------------------------------------------ agreement
    def _row(self, agg_bytes: int, halves: list[Half], ring_bytes: int, ring_s: float):
        row = np.full(ROW_COLUMNS, np.nan)
        row[OK] = 1.0 if all(h.ok for h in halves) else 0.0
        row[REACHABLE] = 1.0 if all(sw.channel is not None for sw in self.switches) else 0.0
        row[AGG_BYTES], row[RING_BYTES] = agg_bytes, ring_bytes
        row[AGG_S] = max((h.seconds for h in halves), default=float("nan"))
        row[RING_S] = ring_s if ring_bytes else float("nan")
        rtts = [sw.rtt for sw in self.switches if np.isfinite(sw.rtt)]
        row[AGG_RTT] = max(rtts) if rtts else float("nan")
        return row

    def _vote(self, mine: np.ndarray, control_op: Callable) -> np.ndarray:
        out = np.zeros(self.world * ROW_COLUMNS, dtype=np.float64)
        out[self.rank * ROW_COLUMNS:(self.rank + 1) * ROW_COLUMNS] = mine
        control_op(lambda call: collectives.ring_allgather(call, out, ROW_COLUMNS,
                                                           kind=wire.K_CONTROL))
        return out.reshape(self.world, ROW_COLUMNS)

    def _apply(self, rows: np.ndarray, x: int) -> None:
        """The agreed rows -> next split and events (the switch gives up the keys of a
        failed operation by itself)."""
        rails = [sw.rail for sw in self.switches]
        for name, fields in self.state.agree(rows):
            if name == "agg_down":
                # every rank reconnects: only a fresh channel proves the path end to end (a
                # rank whose half finished just before a black hole keeps a dead one)
                for sw in self.switches:
                    sw.drop(sw.channel)
                self.down_at = time.monotonic()
                fields.update(failed=[int(r) for r in np.flatnonzero(rows[:, OK] <= 0)],
                              unreachable=[int(r) for r in
                                           np.flatnonzero(rows[:, REACHABLE] <= 0)],
                              recomputed_bytes=int(rows[0, AGG_BYTES]) if x else 0)
            elif name == "agg_back" and self.down_at is not None:
                fields["down_ms"] = round((time.monotonic() - self.down_at) * 1000, 1)
            self.events.emit(name, rail=rails[0] if len(rails) == 1 else rails, **fields)
        for sw in self.switches:
            if sw.channel is None:
                sw.probe()

    def stats(self) -> dict:
        return dict(self.state.fields(), agg_bytes=self.agg_bytes,
                    recomputed_bytes=self.recomputed_bytes, history=list(self.history),
                    switches={sw.rail: sw.channel is not None for sw in self.switches})

    def close(self) -> None:
        self._scratch.release()
        for sw in self.switches:
            sw.close()
        self._pool.shutdown(wait=False)
