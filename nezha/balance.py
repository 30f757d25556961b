"""Multi-rail load balancing: per-rail cost estimates, the cold/hot state machine, the split.

Cost model (per rail r): sending s bytes takes T_r(s) = a_r + s * b_r.
All used rails should finish together::

    T   = (S + sum(a_r / b_r)) / sum(1 / b_r)
    s_r = (T - a_r) / b_r          (rails with a_r >= T get nothing)

Estimates:
  * b_r (seconds per byte) is what this rank's incoming shares on rail r took to *finish*
    (costs.py): per message, from the moment the share could start (the message's first
    header on any rail, or the end of the rail's previous share) to its last byte, summed per
    operation. One sample per rail per operation of >= SAMPLE_MIN_OP bytes, however small the
    shares (8 or 16 rails, many hosts); stalls (loss, a slow hop, a drained token bucket) are
    charged, idling between pipeline blocks is not. The estimate is total time / total bytes
    over the last ``WINDOW`` samples (an outlier is diluted, not dropped: a lossy rail's
    stalls are part of its cost), trusted from MIN_SAMPLES samples spanning MIN_BUSY_S.
  * a_r (start-up seconds) is measured by the *sender* from small messages: send start ->
    ACK (minus s*b_r), minimum of the last samples (queueing only ever inflates a sample).
    Until measured it is ``A_NOMINAL``.

Agreement (why all ranks split identically): every rank's local table ``[a, b, n]`` per rail
is exchanged with a tiny allgather (collective kind CONTROL) at deterministic points (see
``want_exchange``: it depends only on the agreed state, the op count and the message size,
which every rank shares). Each rank then computes the same agreed a_r (median over ranks) and
b_r: the *largest* over the ranks, because a ring moves at its slowest hop and every rank
measures the hop into it (one slow attachment slows the whole rail). Each rank runs the same
state machine on the same numbers, so split decisions are identical everywhere. (The
receiver does not need the split for correctness: frames carry their offsets; identical
splits keep the ring's links evenly loaded.)

Exchange schedule (``want_exchange``): in COLD before every op of >= EXCH_MIN_BYTES (the
estimates take MIN_SAMPLES such ops); in HOT MIN_SAMPLES such ops after the model last moved
(every rank then restarts its windows, so the next table measures the new split), doubling
up to HOT_INTERVAL while it holds; in any state at least every 64 (COLD) / 128 (HOT) ops.

Cold/hot state machine for the current set of live rails::

    COLD --(an agreed estimate for every live rail)--> HOT
    HOT  --(the rail set changes)--> COLD

COLD split: messages < COLD_SMALL bytes ride the single best rail (lowest agreed a), larger
ones are split in equal shares. HOT split: the cost model above; messages below MIN_SPLIT
bytes ride the best rail, and a rail is added only if it saves more than PER_RAIL_OVERHEAD
seconds (CPU cost of driving one more rail). In HOT each agreed table moves every rail's cost
in use part of the way towards it (a damped iteration with a step per rail, see
RailState.observe), and only when that changes the shares of a 16 MiB message by more than
HYSTERESIS.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

COLD, HOT = "cold", "hot"

A_NOMINAL = 100e-6
WINDOW = 8             # cost samples (operations) per rail estimate
MIN_BUSY_S = 0.02      # busy time an estimate must span (the kernel counts in 1-4 ms ticks)
MIN_SAMPLES = 2
HOT_INTERVAL = 16      # most ops between two exchanges in HOT while the split holds
STEP_START = 0.5       # a table moves a rail's cost in use half way towards it at first,
STEP_MAX = 1.0         # ...all the way while the rail keeps moving in one direction,
STEP_MIN = 0.0625      # ...and 1/16 of the way once it turned back four times
PROBE_AFTER = 3        # tables without news of a rail before it is given a probing share...
PROBE_RATIO = 20.0     # ...as if it cost this many times the best rail per byte
HYSTERESIS = 0.01
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

    def __init__(self, window: int = WINDOW):
        self.a = A_NOMINAL
        self.a_samples = 0
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
        """One operation's bytes on this rail and the time its shares took (costs.py). No
        bytes in some time is a valid sample: a share the rail did not deliver at all (hedge
        copies did) costs time all the same."""
        if nbytes >= 0 and seconds > 0 and nbytes + seconds > 0:
            self.b_window.append((nbytes, seconds))

    @property
    def b(self) -> float:
        """Seconds per byte: total busy time / total bytes over the window; nan until the
        window holds MIN_SAMPLES samples spanning MIN_BUSY_S."""
        if len(self.b_window) < MIN_SAMPLES:
            return float("nan")
        t = sum(s for _, s in self.b_window)
        if t < MIN_BUSY_S:
            return float("nan")
        n = sum(n for n, _ in self.b_window)
        return t / n if n > 0 else 1.0    # delivered nothing: as costly as a rail can be

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
        self.step = [STEP_START] * nrails  # per rail: how far a table moves its cost (damping)
        self.trend = [0] * nrails         # per rail: direction of its last move (+1 / -1)
        self.silent = [0] * nrails        # per rail: tables in a row without news of it
        self.enough = False       # the last table had an estimate for every live rail
        self.moved = False        # ...and it changed the model in use
        self.reason = "start"

    def _enter_cold(self, reason):
        changed = self.state != COLD
        self.state = COLD
        self.used_a = self.used_b = None
        self.step = [STEP_START] * self.nrails
        self.trend = [0] * self.nrails
        self.reason = reason
        return [("state", {"state": COLD, "reason": reason})] if changed else []

    def set_live(self, live) -> list:
        live = tuple(sorted(live))
        if live == self.live:
            return []
        self.live = live
        return self._enter_cold("rail set changed")

    def observe(self, a, b, counts) -> list:
        """Feed one agreed table. Returns a list of (event, fields) for the log.

        News of a rail is an estimate from every rank that sent on it. A rail without news
        (the split left it out, or its windows are still filling) keeps its last agreed cost
        and does not hold the others back. COLD switches to HOT on the first table with news
        of every live rail, or after PROBE_AFTER tables without news of some rail (one whose
        shares are always rescued by hedge copies never reports), which then starts from a
        probing share. In HOT each table moves the costs in use (``_damped_move``)."""
        self.a = list(a)
        self.moved = False
        live = self.live
        news = [r for r in live if counts[r] >= MIN_SAMPLES and b[r] > 0]
        for r in live:
            self.silent[r] = 0 if r in news else self.silent[r] + 1
        self.b = [y if y > 0 else x for x, y in zip(self.b, b)]
        self.enough = bool(news)
        if self.state == COLD and len(news) < len(live):
            self.enough = self.enough and max(self.silent[r] for r in live) >= PROBE_AFTER
        if not self.enough:
            return []
        if self.state == COLD:
            return self._enter_hot(a, b, news)
        return self._damped_move(a, b, news)

    def _enter_hot(self, a, b, news) -> list:
        best = min(b[r] for r in news)
        self.state = HOT
        self.used_a = list(a)
        self.used_b = [b[r] if r in news or r not in self.live else PROBE_RATIO * best
                       for r in range(self.nrails)]
        self.moved = True
        self.reason = "estimates for every rail"
        return [("state", {"state": HOT, "reason": self.reason}),
                ("weights", self.weights_fields())]

    def _damped_move(self, a, b, news) -> list:
        """Move each live rail's cost in use part of the way towards the table, and only if
        that moves some share of a 16 MiB message by more than HYSTERESIS. A share's cost
        depends on its size (a token bucket that refills while a rail idles passes a small
        share at once, a large one at the rate), so the split is found by a damped
        iteration: each rail moves by its own step (STEP_START at first), halved whenever it
        turns back (down to STEP_MIN: a rail flapping between two shares settles between
        them) and grown x1.5 while it keeps one direction (up to STEP_MAX: a rail that really
        changed is followed at once). A rail without news for PROBE_AFTER tables is assumed
        no worse than PROBE_RATIO x the best rail, so it gets a small share and is measured
        again (the next table puts it back if it really is bad)."""
        live = self.live
        sa = [(x + y) / 2 for x, y in zip(self.used_a, a)]
        sb = [x + self.step[r] * ((b[r] if r in news else x) - x) if r in live else self.b[r]
              for r, x in enumerate(self.used_b)]
        best = min(sb[r] for r in live)
        for r in live:
            if self.silent[r] >= PROBE_AFTER and sb[r] > PROBE_RATIO * best:
                sb[r] = PROBE_RATIO * best
                self.silent[r] = 0
        old = self.shares(REF_SIZE)
        new = self._model_shares(REF_SIZE, sa, sb)
        if max(abs(x - y) for x, y in zip(old, new)) <= HYSTERESIS:
            return []
        for r in live:
            way = (sb[r] > self.used_b[r]) - (sb[r] < self.used_b[r])
            if way and self.trend[r] and way != self.trend[r]:
                self.step[r] = max(STEP_MIN, self.step[r] / 2)
            elif way and way == self.trend[r]:
                self.step[r] = min(STEP_MAX, self.step[r] * 1.5)
            self.trend[r] = way or self.trend[r]
        self.used_a, self.used_b = sa, sb
        self.moved = True
        return [("weights", self.weights_fields())]

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
        # in HOT, exchange MIN_SAMPLES ops after the model moved (the estimates are then
        # fresh samples of the new split), backing off x2 up to HOT_INTERVAL while it holds
        self.hot_interval = MIN_SAMPLES

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
            return (k >= 1 and nbytes >= EXCH_MIN_BYTES) or k >= 64
        return (k >= self.hot_interval and nbytes >= EXCH_MIN_BYTES) or k >= 128

    def agree(self, tables: np.ndarray) -> list:
        """tables: (world, nrails, 3) gathered local tables. Same result on every rank.

        b_r is the largest estimate among the ranks that sent on rail r (a ring runs at its
        slowest hop), and exists only once every one of them has one."""
        self.ops_since_exchange = 0
        a, b, counts = [], [], []
        for r in range(self.nrails):
            col = tables[:, r, :]
            As = col[:, 0][~np.isnan(col[:, 0])]
            a.append(float(np.median(As)) if len(As) else float("nan"))
            sent = col[col[:, 2] > 0]
            bs = sent[:, 1]
            ok = len(bs) > 0 and not np.isnan(bs).any()
            b.append(float(bs.max()) if ok else float("nan"))
            counts.append(int(sent[:, 2].min()) if len(sent) else 0)
        # a rail never used for a small message has no start-up estimate: assume the best
        # measured one (the rails differ in rate far more than in start-up), else nominal
        known = [x for x in a if not math.isnan(x)]
        fill = min(known) if known else A_NOMINAL
        a = [fill if math.isnan(x) else x for x in a]
        evs = self.rs.observe(a, b, counts)
        if self.rs.moved:
            # the samples so far describe the old split: measure the new one afresh
            self.hot_interval = MIN_SAMPLES
            for e in self.est:
                e.reset()
        elif self.rs.enough:
            self.hot_interval = min(HOT_INTERVAL, self.hot_interval * 2)
        return evs

    def note_op(self):
        self.ops_since_exchange += 1

    def set_live(self, live) -> list:
        evs = self.rs.set_live(live)
        if evs:
            self.hot_interval = MIN_SAMPLES
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
