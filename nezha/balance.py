"""Multi-rail load balancing: per-rail cost estimates, the cold/hot state machine, the split.

Cost model (per rail r): sending s bytes takes T_r(s) = a_r + s * b_r.
All used rails should finish together::

    T   = (S + sum(a_r / b_r)) / sum(1 / b_r)
    s_r = (T - a_r) / b_r          (rails with a_r >= T get nothing)

Estimates:
  * b_r (seconds per byte) is measured by the *receiver*: for every rail share of at least
    ``B_MIN_BYTES`` it takes the bytes that reached the socket (read + still in the kernel's
    receive queue, SIOCINQ) between the share's first header and its last byte, over that
    time. Counting arrivals rather than reads matters: bytes that waited in the queue while
    the reader thread was busy would otherwise look free and make a fast rail look up to 25 %
    faster than it is. Receiver-side timing is immune to ACK queueing behind bulk data. The
    estimate is total time / total bytes over the middle half of the last samples.
  * a_r (start-up seconds) is measured by the *sender* from small messages: send start ->
    ACK (minus s*b_r), minimum of the last samples (queueing only ever inflates a sample).
    Until measured it is ``A_NOMINAL``.

Agreement (why all ranks split identically): every rank's local table ``[a, b, n]`` per rail
is exchanged with a tiny allgather (collective kind CONTROL) at deterministic points (see
``want_exchange``: it depends only on the agreed state, the op count and the message size,
which every rank shares). Each rank then computes the same agreed a_r, b_r (medians over
ranks of the exact float64 values) and runs the same state machine, so split decisions are
identical everywhere. (The receiver does not need the split for correctness: frames carry
their offsets; identical splits keep the ring's links evenly loaded.)

Exchange schedule (``want_exchange``): in COLD before the next op of >= EXCH_MIN_BYTES once
``cold_interval`` ops have passed (1 at first; doubled up to 16 after each exchange that
leaves the state COLD; back to 1 when the rail set changes or HOT falls back to COLD); in HOT
every 16 such ops; in any state at least every 64 (COLD) / 128 (HOT) ops.

Cold/hot state machine for the current set of live rails::

    COLD --(every live rail has >= MIN_SAMPLES b samples on every rank, and two consecutive
            agreed tables differ by < STABLE_TOL)--> HOT
    HOT  --(rail set changes, or an agreed b_r moves > DRIFT_TOL from the one in use)--> COLD

COLD split: messages < COLD_SMALL bytes ride the single best rail (lowest agreed a), larger
ones are split in equal shares. HOT split: the cost model above; messages below MIN_SPLIT
bytes ride the best rail, and a rail is added only if it saves more than PER_RAIL_OVERHEAD
seconds (CPU cost of driving one more rail). In HOT each agreed table moves the model in use
half way towards it (smoothing), and only when that changes the shares of a 16 MiB message by
more than HYSTERESIS (hysteresis).
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

COLD, HOT = "cold", "hot"

A_NOMINAL = 100e-6
B_MIN_BYTES = 512 << 10
MIN_SAMPLES = 3
STABLE_TOL = 0.25
DRIFT_TOL = 0.5
HYSTERESIS = 0.02
COLD_SMALL = 64 << 10
MIN_SPLIT = 32 << 10
PER_RAIL_OVERHEAD = 50e-6
EXCH_MIN_BYTES = 128 << 10
REF_SIZE = 16 << 20


def cost_split(nbytes: int, a, b, elem: int = 1, overhead: float = 0.0) -> list[int]:
    """Bytes per rail (multiples of ``elem``, summing to ``nbytes``) that make all used
    rails finish together under T_r(s) = a_r + s*b_r. Rails with b <= 0 or nan are unusable.
    Deterministic: same inputs give the same split on every machine."""
    n = len(a)
    out = [0] * n
    usable = [r for r in range(n) if b[r] is not None and not math.isnan(b[r]) and b[r] > 0]
    if not usable:
        raise ValueError("no usable rail")
    if nbytes <= 0:
        return out
    order = sorted(usable, key=lambda r: (a[r], b[r], r))

    def finish(rs):
        # water-filling: drop rails whose start-up exceeds the common finish time
        rs = list(rs)
        while True:
            T = (nbytes + sum(a[r] / b[r] for r in rs)) / sum(1.0 / b[r] for r in rs)
            keep = [r for r in rs if a[r] < T]
            if len(keep) == len(rs) or not keep:
                return T, rs
            rs = keep

    best = None
    for k in range(1, len(order) + 1):
        T, rs = finish(order[:k])
        cost = T + overhead * (len(rs) - 1)
        if best is None or cost < best[0] - 1e-15:
            best = (cost, T, rs)
    _, T, rs = best
    nelem = nbytes // elem
    if len(rs) == 1:
        out[rs[0]] = nbytes
        return out
    shares = {r: max(0.0, (T - a[r]) / b[r]) for r in rs}
    tot = sum(shares.values())
    given = 0
    for r in rs:
        e = int(math.floor(shares[r] / tot * nelem))
        out[r] = e
        given += e
    big = max(rs, key=lambda r: (shares[r], -r))
    out[big] += nelem - given
    out = [e * elem for e in out]
    out[big] += nbytes - nelem * elem  # only when nbytes is not a multiple of elem
    return out


def equal_split(nbytes: int, rails, nrails: int, elem: int = 1) -> list[int]:
    out = [0] * nrails
    rails = list(rails)
    nelem = nbytes // elem
    q, rem = divmod(nelem, len(rails))
    for i, r in enumerate(rails):
        out[r] = (q + (1 if i < rem else 0)) * elem
    out[rails[0]] += nbytes - nelem * elem
    return out


class RailEstimator:
    """Local measurements of one rail (this rank's view)."""

    def __init__(self, window: int = 8, alpha: float = 0.3):
        self.a = A_NOMINAL
        self.a_samples = 0
        self.alpha = alpha
        self.b_window: deque = deque(maxlen=window)
        self.a_window: deque = deque(maxlen=2 * window)

    def record_a(self, seconds: float):
        if seconds <= 0:
            return
        self.a_window.append(seconds)
        # the minimum: a sample can only be inflated (an ACK queued behind bulk data going
        # the other way, a busy CPU), never deflated
        self.a = float(min(self.a_window))
        self.a_samples += 1

    def record_b(self, nbytes: int, seconds: float):
        if nbytes >= B_MIN_BYTES and seconds > 0:
            self.b_window.append((nbytes, seconds))

    @property
    def b(self) -> float:
        """Seconds per byte over the window, as total time / total bytes of the middle half
        of the samples by rate (from 4 samples on; large shares weigh more, outliers do not:
        a sender that paused mid-share makes a slow one, a short burst a fast one)."""
        if not self.b_window:
            return float("nan")
        w = sorted(self.b_window, key=lambda x: x[1] / x[0])
        if len(w) >= 4:
            cut = len(w) // 4
            w = w[cut:len(w) - cut]
        return sum(t for _, t in w) / sum(n for n, _ in w)

    def reset(self):
        self.b_window.clear()


class RailState:
    """The agreed cold/hot state of the live rail set (identical on all ranks)."""

    def __init__(self, nrails: int):
        self.nrails = nrails
        self.state = COLD
        self.live: tuple = tuple(range(nrails))
        self.a = [A_NOMINAL] * nrails
        self.b = [float("nan")] * nrails
        self.used_a = None
        self.used_b = None
        self.prev_b = None
        self.reason = "start"

    def _enter_cold(self, reason):
        changed = self.state != COLD
        self.state = COLD
        self.used_a = self.used_b = None
        self.prev_b = None
        self.reason = reason
        return [("state", {"state": COLD, "reason": reason})] if changed else []

    def set_live(self, live) -> list:
        live = tuple(sorted(live))
        if live == self.live:
            return []
        self.live = live
        return self._enter_cold("rail set changed")

    def observe(self, a, b, counts) -> list:
        """Feed one agreed table. Returns a list of (event, fields) for the log."""
        evs = []
        self.a = list(a)
        self.b = list(b)
        live = self.live
        enough = all(counts[r] >= MIN_SAMPLES and b[r] > 0 for r in live)
        if self.state == COLD:
            stable = (enough and self.prev_b is not None and
                      all(self.prev_b[r] > 0 and abs(b[r] - self.prev_b[r]) / self.prev_b[r] < STABLE_TOL
                          for r in live))
            self.prev_b = list(b) if enough else None
            if stable:
                self.state = HOT
                self.used_a, self.used_b = list(a), list(b)
                self.reason = "stable estimates"
                evs.append(("state", {"state": HOT, "reason": self.reason}))
                evs.append(("weights", self.weights_fields()))
        else:
            if not enough:
                return evs + self._enter_cold("estimates missing")
            drift = [r for r in live if abs(b[r] - self.used_b[r]) / self.used_b[r] > DRIFT_TOL]
            if drift:
                return evs + self._enter_cold(f"rate drift on rails {drift}")
            # smooth: move half way towards the new estimates, then apply with hysteresis
            sa = [(x + y) / 2 for x, y in zip(self.used_a, a)]
            sb = [(x + y) / 2 if r in live else y for r, (x, y) in enumerate(zip(self.used_b, b))]
            old = self.shares(REF_SIZE)
            new = self._model_shares(REF_SIZE, sa, sb)
            if max(abs(x - y) for x, y in zip(old, new)) > HYSTERESIS:
                self.used_a, self.used_b = sa, sb
                evs.append(("weights", self.weights_fields()))
        return evs

    def _model_shares(self, nbytes, a, b):
        aa = [a[r] if r in self.live else 0.0 for r in range(self.nrails)]
        bb = [b[r] if r in self.live else float("nan") for r in range(self.nrails)]
        s = cost_split(nbytes, aa, bb, 1, 0.0)
        return [x / nbytes for x in s]

    def shares(self, nbytes=REF_SIZE):
        if self.state == HOT:
            return self._model_shares(nbytes, self.used_a, self.used_b)
        s = equal_split(nbytes, self.live, self.nrails)
        return [x / nbytes for x in s]

    def weights_fields(self):
        return {"shares": [round(x, 4) for x in self.shares()], "state": self.state,
                "a": self.used_a or self.a, "b": self.used_b or self.b}

    def best_rail(self) -> int:
        return min(self.live, key=lambda r: (self.a[r], r))


class Balancer:
    """Decides, for one message, which byte range goes on which rail."""

    MODES = ("nezha", "stripe", "single")

    def __init__(self, nrails: int, mode: str = "nezha", chunk_bytes: int = 512 << 10):
        if mode not in self.MODES:
            raise ValueError(f"unknown balancing mode {mode!r}")
        self.nrails = nrails
        self.mode = mode
        self.chunk_bytes = chunk_bytes
        self.est = [RailEstimator() for _ in range(nrails)]
        self.rs = RailState(nrails)
        self.ops_since_exchange = 0
        # in COLD, exchange after every large op at first, then back off (x2 up to 16) while
        # the estimates do not settle, so a noisy environment does not pay for one every op
        self.cold_interval = 1
        self._last_live: tuple = tuple(range(nrails))

    # ---- measurements (called from transport threads)
    def record_a(self, rail, seconds):
        self.est[rail].record_a(seconds)

    def record_b(self, rail, nbytes, seconds):
        self.est[rail].record_b(nbytes, seconds)

    # ---- agreement
    def local_table(self) -> np.ndarray:
        t = np.zeros((self.nrails, 3), dtype=np.float64)
        for r, e in enumerate(self.est):
            t[r] = (e.a if e.a_samples else float("nan"), e.b, len(e.b_window))
        return t

    def want_exchange(self, nbytes: int) -> bool:
        if self.mode != "nezha" or self.nrails < 2:
            return False
        k = self.ops_since_exchange
        if self.rs.state == COLD:
            return (k >= self.cold_interval and nbytes >= EXCH_MIN_BYTES) or k >= 64
        return (k >= 16 and nbytes >= EXCH_MIN_BYTES) or k >= 128

    def agree(self, tables: np.ndarray) -> list:
        """tables: (world, nrails, 3) gathered local tables. Same result on every rank."""
        self.ops_since_exchange = 0
        a, b, counts = [], [], []
        for r in range(self.nrails):
            col = tables[:, r, :]
            As = col[:, 0][~np.isnan(col[:, 0])]
            a.append(float(np.median(As)) if len(As) else float("nan"))
            bs = col[:, 1][~np.isnan(col[:, 1])]
            b.append(float(np.median(bs)) if len(bs) == tables.shape[0] else float("nan"))
            counts.append(int(col[:, 2].min()))
        # a rail never used for a small message has no start-up estimate: assume the best
        # measured one (the rails differ in rate far more than in start-up), else nominal
        known = [x for x in a if not math.isnan(x)]
        fill = min(known) if known else A_NOMINAL
        a = [fill if math.isnan(x) else x for x in a]
        was = self.rs.state
        evs = self.rs.observe(a, b, counts)
        if self.rs.state == COLD:
            if was == HOT:
                self.cold_interval = 1
            else:
                self.cold_interval = min(16, self.cold_interval * 2)
        return evs

    def note_op(self):
        self.ops_since_exchange += 1

    def set_live(self, live) -> list:
        evs = self.rs.set_live(live)
        if evs or tuple(sorted(live)) != self._last_live:
            self.cold_interval = 1
        self._last_live = tuple(sorted(live))
        if evs:
            for e in self.est:
                e.reset()
        return evs

    # ---- the split
    def split(self, nbytes: int, elem: int, live=None) -> list[tuple[int, int, int]]:
        """[(rail, offset, length), ...] covering [0, nbytes); one (rail, 0, 0) if empty."""
        live = tuple(self.rs.live if live is None else live)
        if not live:
            raise ValueError("no live rail")
        if self.mode == "single" or nbytes == 0 or len(live) == 1:
            rail = live[0] if self.mode == "single" else self._best(live, nbytes)
            return [(rail, 0, nbytes)]
        if self.mode == "stripe":
            sizes = equal_split(nbytes, live, self.nrails, elem)
        elif self.rs.state == HOT and set(live) == set(self.rs.live):
            if nbytes < MIN_SPLIT:
                return [(self._best(live, nbytes), 0, nbytes)]
            a = [self.rs.used_a[r] if r in live else 0.0 for r in range(self.nrails)]
            b = [self.rs.used_b[r] if r in live else float("nan") for r in range(self.nrails)]
            sizes = cost_split(nbytes, a, b, elem, PER_RAIL_OVERHEAD)
        else:
            if nbytes < COLD_SMALL:
                return [(self._best(live, nbytes), 0, nbytes)]
            sizes = equal_split(nbytes, live, self.nrails, elem)
        out, off = [], 0
        for r in range(self.nrails):
            if sizes[r] > 0:
                out.append((r, off, sizes[r]))
                off += sizes[r]
        return out

    def _best(self, live, nbytes=0):
        """The single rail that moves ``nbytes`` soonest by the agreed model (a_r + s*b_r;
        by a_r alone while rates are unknown)."""
        a, b = self.rs.a, self.rs.b
        if all(not math.isnan(b[r]) for r in live):
            return min(live, key=lambda r: (a[r] + nbytes * b[r], r))
        return min(live, key=lambda r: (a[r], r))
