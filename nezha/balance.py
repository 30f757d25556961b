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
    ACK (minus s*b_r), minimum of the samples of the last A_MAX_AGE_S (queueing only ever
    inflates a sample; a retransmission too, and a rail that carries only large shares is
    never sampled again, so an old sample expires). Without a recent one the agreement takes
    the best rail's, or ``A_NOMINAL``; a probed rail starts up as fast as the best.
  * slack: how early each rail was done against its messages' last rail (costs.py), agreed
    as the least over the ranks. A rail done early gets cheaper by no more than its slack
    and EARLY_FALL allow per table (``RailState._within_slack``): a token bucket that
    refilled while it waited makes its estimate several times too cheap.

Agreement (why all ranks split identically): every rank's local table per rail (a, b, the
sample count, and what its last operation cost: ``last``, ``rise``, ``fall``, see
RailEstimator) is exchanged with a tiny allgather (collective kind CONTROL) at deterministic
points (``want_exchange``: it depends only on the agreed state and the sizes of the ops since
the last exchange, which every rank shares). Each rank then computes the same agreed a_r
(median over ranks) and b_r: the *largest* over the ranks, because a ring moves at its
slowest hop and every rank measures the hop into it (one slow attachment slows the whole
rail). Each rank runs the same state machine on the same numbers, so split decisions are
identical everywhere. (The receiver does not need the split for correctness: frames carry
their offsets; identical splits keep the ring's links evenly loaded.)

Exchange schedule (``want_exchange``): in COLD before every op of >= EXCH_MIN_BYTES (the
estimates take MIN_SAMPLES such ops); in HOT once the ops since the last exchange should
have taken EXCH_PERIOD_S at the agreed rates: before every op when ops are long (a 8 MiB
allreduce on 2 x 200 Mbit/s: ~230 ms), every ~20 ops of 1 MiB at 1 Gbit/s; in any state at
least every 64 (COLD) / 128 (HOT) ops; and after a table that moved the split, as soon
as the ops since have filled the windows it needs (``patience``), whatever the model predicts
(a model a token bucket flattered predicts ops far shorter than they are). An exchange costs one small allgather (under a
millisecond on 3 hosts), so a change is seen one operation after it happens.

Cold/hot state machine for the current set of live rails::

    COLD --(an agreed estimate for every live rail)--> HOT
    HOT  --(a rail leaves, or one comes back that was measured before)--> HOT
    HOT  --(a rail joins that was never measured)--> COLD

COLD split: messages < COLD_SMALL bytes ride the single best rail (lowest agreed a) unless
their operation is metered (>= SAMPLE_MIN_OP: its samples are what leaves COLD), larger ones
are split in equal shares. HOT split: the cost model above; messages below MIN_SPLIT bytes
ride the best rail when it carries them in under SPLIT_SMALL_S, and a rail is added only if
it saves more than the agreed rail overhead: the CPU seconds one more rail costs a message
(RAIL_CPU_S), stretched by how long each rank's threads wait for a CPU (``rail_overhead``,
``cpuload.RunQueueStretch``; the median over the ranks). In HOT each agreed table

  * makes a rail whose last operation shows a change jump to its new cost (RailState._shifts):
    slower on every hop at once, on one hop twice in a row, faster (compared at the same
    split) back to what it was worth before it slowed; and
  * moves every other rail's cost in use part of the way towards its estimate (a damped
    iteration with a step per rail, RailState._steps) once the estimates span ``patience``
    operations (doubled by every turn back, so noise does not make the split hover),

and only when that saves more than HYSTERESIS of a 16 MiB message's time (``_saving``).

Measured (3 hosts x 2 rails of 200 Mbit/s, 8 MiB allreduce, r1 down to 50 Mbit/s for 5 s,
topologies/slowing-rail.yaml): the split follows one operation after the drop and after the
return (adaptation_ms 654, before this schedule 3502); iterations during the slowdown 1.07x
the ideal for the 250 Mbit/s left (MPTCP: 2.7x); on steady 300 + 100 Mbit/s rails the split
moved 3 times in the first 1.1 s and never again in 24 s. With the jump back on the first
table (``RailState._way_back``) the iterations are back within 1.1x of their pre-slowdown
time 0.72 s after the return on this shape (1.25 s before); with the tail (``_way_back``)
0.25-0.79 s on the 18 shapes x kinds of ``testbed adapt`` at 8ce56e7 (0.53-1.76 s before the
one-table jump; README, *A rail that changes*).
"""
from __future__ import annotations

import functools
import math
import time
from collections import deque
from typing import NamedTuple

import numpy as np

from .config import Config
from .cpuload import RunQueueStretch
from .costs import gives_samples
from .trial import MARGIN as TRIAL_MARGIN
from .trial import OverheadTrial

COLD, HOT = "cold", "hot"

A_NOMINAL = 100e-6
A_MAX_AGE_S = 1.0      # a start-up sample is trusted this long (RailEstimator.a): one taken in
                       # a 30 % loss burst (51-191 ms, RTOs) kept a 200 Mbit/s rail at a
                       # quarter of its share, or out of the split, for the rest of the run
WINDOW = 8             # cost samples (operations) per rail estimate
MIN_BUSY_S = 0.005     # busy time an estimate must span (share times are monotonic-clock
                       # stamps of frame arrivals; 20 ms kept a 636 Mbit/s rail's 25 KB
                       # shares from ever giving one: 3 hosts, 4 MiB, see RailState.probed)
MIN_SAMPLES = 2
EXCH_PERIOD_S = 0.1    # in HOT, exchange once the ops since the last one should have taken this
SHIFT = 1.5            # a rail's last operation this far off is a change, not noise (_shifts)
FALL_MAX = 4.0         # ...and a rail that got faster jumps to at most this many times cheaper
REJUMP = 1.2           # a rail that jumped slower jumps again if every hop says this x more
FALL_SAMPLES = 6       # operations at one split before a rail can tell it got faster
WORTH_SHARE = 0.5      # a rail's worth is remembered only from at least this x an equal share
STEP_START = 0.5       # a table moves a rail's cost in use half way towards it at first,
STEP_MAX = 1.0         # ...all the way while the rail keeps moving in one direction,
STEP_MIN = 0.0625      # ...and 1/16 of the way once it turned back four times
PROBE_AFTER = 3        # tables without news of a rail before it is given a probing share
PROBE_AFTER_MAX = 12   # (doubled by every probe that leaves it out again, up to this)...
PROBE_RATIO = 20.0     # ...as if it cost this many times the best rail per byte,
PROBE_MEASURES = 2     # ...and its first this many measurements replace its cost whole,
PROBE_GROWTH = 2.0     # ...the first no more than this many times cheaper than the probe's
PROBE_RATIO_MAX = 100.0  # a rail its last two probes found slower than PROBE_RATIO is probed
                       # at the faster of those costs, up to this many times the best (a
                       # share too small to time measures nothing): 10 Mbit/s rails next to
                       # 356 (35x) probed at 20x carried 1.8x what they could, and each probe
                       # made two operations 1.6x slower (seed 20 of `testbed shapes`)
EARLY_FALL = 0.8       # a rail done before the pace-setter moves at most this much cheaper per
                       # table by its estimate (_within_slack; jumps and probes have their own)
EARLY_SLACK = 0.5      # a rail done this early whose cost is still COLD's may jump back
                       # (_out_of_a_cold_stall)
HOP_RISE_SAMPLES = 3   # one hop's rise counts from this many operations at a split (_slower_hops)
HOLD = 2.0             # a rail that carries HOLD_SHARE of the split is charged overhead / HOLD
HOLD_SHARE = 0.1       # (cost_split, RailState.hold): the stretch moves 2x between tables when
                       # 12 ranks share 2 cores (1.0 -> 2.1 ms), and a 30 Mbit/s rail next to
                       # 90 (a quarter of the bytes) went out and in with it
HYSTERESIS = 0.02      # a move must save this much of an operation's time (_saving)
COLD_SMALL = 64 << 10
MIN_SPLIT = 32 << 10   # HOT: a message below this rides one rail...
SPLIT_SMALL_S = 10e-3  # ...unless that rail would take this long (Balancer.split): 16 hosts
                       # x 60 + 20 Mbit/s, 256 KiB (16 KiB blocks, 2.2 ms on r0) were 0.74 of
                       # the single-rail ring split by the model at 2 ms, 0.83 on one rail
# CPU seconds one rank spends per rail per message (its frame out and that frame's ACK in,
# the neighbour's frame in and its ACK out; thread wake-ups included), before the run-queue
# stretch (rail_overhead). 5 ranks on loopback used 150 us more per rail and ring step with
# 14 rails than with 1 (nezha.bench, stripe); on shaped rails, where a slow rail's share is
# many small skbs, 300 x the measured stretch left out the rails whose shares cost more CPU
# than they save: 6 hosts x 14-15 rails of 10-91 Mbit/s went 1.3-1.35x faster, and no shape
# of examples/held-out lost (README, *Seeds 0-19 again*). NEZHA_RAIL_CPU_US's
# default (config.py) is the one figure
RAIL_CPU_S = Config.rail_cpu_us * 1e-6
EXCH_MIN_BYTES = 128 << 10
REF_SIZE = 16 << 20
TABLE_COLUMNS = 11     # a rank's table per rail: a, b, samples, last, rise, fall (RailEstimator),
OVERHEAD_COLUMN = 6    # ...the rank's rail overhead (the same in every row),
TAIL_COLUMN = 7        # ...the cost of the last operation's tail (RailEstimator.tail),
TAIL_RISE_COLUMN = 8   # ...that tail over the earlier operations at the same split
SLACK_COLUMN = 9       # ...the rail's slack over the window (RailEstimator.slack)
OP_TIME_COLUMN = 10    # ...and the rank's operation time per byte since the last table (trial.py)


def cost_split(nbytes: int, a, b, elem: int = 1, overhead: float = 0.0,
               forced=(), held=()) -> list[int]:
    """Bytes per rail (multiples of ``elem``, summing to ``nbytes``) that make all used
    rails finish together under T_r(s) = a_r + s*b_r. Rails with b <= 0 or nan are unusable.
    A rail is used only if it saves more than ``overhead``, except the ``forced`` ones (rails
    being probed: a probe that the overhead leaves out measures nothing); a ``held`` rail
    (one the split already uses) stays while it saves more than overhead / HOLD.
    Deterministic: same inputs give the same split on every machine. Memoized: every ring
    step asks again with the same agreed model, and on 14 rails the search took a sixth of
    a rank's Python time (5 ranks on loopback, py-spy --gil)."""
    bk = tuple(x if x is not None and x > 0 else None for x in b)    # nan > 0 is False
    if not any(x is not None for x in bk):
        raise ValueError("no usable rail")
    forced = tuple(sorted(r for r in forced if bk[r] is not None))
    held = tuple(sorted(r for r in held if bk[r] is not None))
    return list(_cost_split(int(nbytes), tuple(a), bk, elem, overhead, forced, held))


@functools.lru_cache(maxsize=512)
def _cost_split(nbytes: int, a: tuple, b: tuple, elem: int, overhead: float,
                forced: tuple = (), held: tuple = ()) -> tuple:
    n = len(a)
    out = [0] * n
    usable = [r for r in range(n) if b[r] is not None]
    if nbytes <= 0:
        return tuple(out)

    def finish(rs):
        # water-filling: drop rails whose start-up exceeds the common finish time
        rs = list(rs)
        while True:
            T = (nbytes + sum(a[r] / b[r] for r in rs)) / sum(1.0 / b[r] for r in rs)
            keep = [r for r in rs if a[r] < T]
            if len(keep) == len(rs) or not keep:
                return T, rs
            rs = keep

    # rails are added in the order that finishes soonest (greedy: the rail whose addition
    # gives the least finish time next), and the best of those sets, rail overhead counted,
    # is kept. By start-up first, then per byte (the order before): a fast rail whose
    # start-up was 0.1 ms worse than seven slow rails' came after them, and when those did
    # not pay for their overhead it was left out too (5 hosts x 14 rails, r1 of 82 Mbit/s)
    chosen: list = []
    left = list(usable)
    best = None
    A = B = 0.0            # sum of a/b and of 1/b over the rails that finish(chosen) keeps

    def finish_with(r):    # finish(chosen + [r])'s time; a rail it would drop ranks last
        return (nbytes + A + a[r] / b[r]) / (B + 1.0 / b[r])

    while left:
        nxt = min(left, key=lambda r: (finish_with(r), r))
        chosen.append(nxt)
        left.remove(nxt)
        T, rs = finish(chosen)
        A, B = sum(a[r] / b[r] for r in rs), sum(1.0 / b[r] for r in rs)
        each = [overhead / HOLD if r in held else overhead for r in rs]
        cost = T + sum(each) - min(each)     # (one rail is free: a held one)
        if best is None or cost < best[0] - 1e-15:
            best = (cost, T, rs)
    _, T, rs = best
    if any(r not in rs for r in forced):
        T, rs = finish(sorted(set(rs) | set(forced)))
    nelem = nbytes // elem
    if len(rs) == 1:
        out[rs[0]] = nbytes
        return tuple(out)
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
    return tuple(out)


def rail_overhead(rail_cpu_s: float = RAIL_CPU_S, stretch: float = 1.0) -> float:
    """Seconds one more rail adds to a message on this host: RAIL_CPU_S, times how much
    longer this rank's CPU work takes than its CPU time (``cpuload.RunQueueStretch``). With
    5 ranks on 2 cores and 14 rails, seven 10 Mbit/s rails carried 3.5 % of the bytes but
    half the frames, and leaving them out made the ring 1.6x faster (a pinned split, 208 ->
    333 Mbit/s); on a host of its own a rank pays the CPU time alone."""
    return rail_cpu_s * max(1.0, stretch)


def _usable(x) -> bool:
    """A cost per byte that can be used: a finite positive number."""
    return x is not None and x > 0 and not math.isinf(x)


def weighted_split(nbytes: int, weights, rails, nrails: int, elem: int = 1) -> list[int]:
    """Bytes per rail in proportion to ``weights`` over ``rails`` (equal if None or if they
    weigh nothing): a pinned split, which is also what tells the balancer's split from the
    best static one on a shape whose rates are known."""
    w = [weights[r] if weights is not None and r in rails else 0.0 for r in range(nrails)]
    if not any(w):
        return equal_split(nbytes, rails, nrails, elem)
    return cost_split(nbytes, [0.0] * nrails, [1.0 / x if x > 0 else float("nan") for x in w],
                      elem)


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
        self.b_window: deque = deque(maxlen=window)
        self.a_window: deque = deque(maxlen=2 * window)     # (monotonic time, seconds)
        # per operation of b_window: (seconds done before the messages' last rail, spans)
        self.slack_window: deque = deque(maxlen=window)
        # seconds per byte of the last operation's last messages (costs.ShareCosts._tail)
        self.tail = float("nan")

    def record_a(self, seconds: float, now: float | None = None):
        if seconds <= 0:
            return
        self.a_window.append((time.monotonic() if now is None else now, seconds))

    def fresh_a(self, now: float | None = None) -> float:
        """The start-up cost: the least sample of the last A_MAX_AGE_S (a sample can only be
        inflated, by an ACK queued behind bulk data going the other way, a busy CPU or a
        retransmission, never deflated); nan when none is that recent. Samples come only
        from small shares, which a rail in a split of large messages never carries: an old
        one would stay for good, and an inflated one (taken in a loss burst) keeps the rail
        out of the split that could measure it again. The agreement fills a rail without
        one with the best measured start-up (Balancer.agree)."""
        now = time.monotonic() if now is None else now
        fresh = [x for t, x in tuple(self.a_window) if now - t <= A_MAX_AGE_S]
        return float(min(fresh)) if fresh else float("nan")

    @property
    def a(self) -> float:
        """fresh_a, or A_NOMINAL without a recent sample (the watchdog's limit)."""
        x = self.fresh_a()
        return A_NOMINAL if math.isnan(x) else x

    def record_b(self, nbytes: int, seconds: float, tail: float = float("nan"),
                 slack: tuple = (0.0, 0.0)):
        """One operation's bytes on this rail, the time its shares took, the cost per byte
        of its last ones and its slack (costs.py). No bytes in some time is a valid sample: a
        share the rail did not deliver at all (hedge copies did) costs time all the same."""
        if nbytes >= 0 and seconds > 0 and nbytes + seconds > 0:
            self.b_window.append((nbytes, seconds))
            self.slack_window.append(tuple(slack))
            self.tail = tail

    @property
    def slack(self) -> float:
        """The part of its messages' spans by which this rail was done before their last rail,
        over the window (nan if it shared none with another rail): 0 for the rail that sets
        the pace, near 1 for one whose shares pass at once."""
        window = tuple(self.slack_window)
        span = sum(s for _, s in window)
        return sum(x for x, _ in window) / span if span > 0 else float("nan")

    def _samples(self) -> tuple:
        """The window as it is now: one C-level copy, so that a sample the engine records
        meanwhile cannot change it under an iteration. The health thread reads ``b`` without
        the engine's lock (its watchdog's limit); iterating the deque itself once raised
        "deque mutated during iteration" there, which ended that rank's health thread and
        its heartbeats, and its peers then took its rails for dead, 1464 times in one run."""
        return tuple(self.b_window)

    @staticmethod
    def _per_byte(samples) -> float:
        n = sum(n for n, _ in samples)
        t = sum(s for _, s in samples)
        return t / n if n > 0 else 1.0    # delivered nothing: as costly as a rail can be

    @property
    def b(self) -> float:
        """Seconds per byte: total busy time / total bytes over the window; nan until the
        window holds MIN_SAMPLES samples spanning MIN_BUSY_S."""
        window = self._samples()
        if len(window) < MIN_SAMPLES:
            return float("nan")
        if sum(s for _, s in window) < MIN_BUSY_S:
            return float("nan")
        return self._per_byte(window)

    @property
    def last(self) -> float:
        """Seconds per byte of the last operation alone (nan if none since the last reset)."""
        window = self._samples()
        if not window:
            return float("nan")
        return self._per_byte(window[-1:])

    def _costs(self) -> list:
        return [self._per_byte([x]) for x in self._samples()]

    @property
    def rise(self) -> float:
        """The last operation's cost over the median earlier one in the window, i.e. at the
        same split (the window restarts when the split moves); nan before two samples."""
        costs = self._costs()
        return costs[-1] / self._earlier(costs) if len(costs) >= 2 else float("nan")

    @staticmethod
    def _earlier(costs: list) -> float:
        """The median cost of the operations before the last at this split."""
        return float(np.median(costs[:-1]))

    @property
    def tail_rise(self) -> float:
        """The last operation's tail over the median earlier operation at the same split (nan
        before two samples): well below 1 when the rail got faster during the operation, which
        its whole cost (``rise``, part slow and part fast) may not show."""
        costs = self._costs()
        if len(costs) < 2 or not _usable(self.tail):
            return float("nan")
        return self.tail / self._earlier(costs)

    @property
    def fall(self) -> float:
        """The costlier of the last two operations over the median earlier one at the same
        split, leaving out the first operation after the move (nan before FALL_SAMPLES): < 1
        only if the rail got faster for two operations in a row. A share's cost depends on
        its size (a token bucket passes a small share at once), so only a comparison at one
        split tells a rail that got faster. The first operations after a move wait behind
        what the previous split left in the rail's socket buffers (a slowed rail's hedged
        bytes still drain at its new rate): compared with them, a rail that had just slowed
        looked as if it had recovered, three times in 5 s."""
        costs = self._costs()
        if len(costs) < FALL_SAMPLES:
            return float("nan")
        return max(costs[-2:]) / float(np.median(costs[1:-2]))

    def forget_a(self):
        """Drop the start-up samples (RailState._hold_start_up_of_slowed)."""
        self.a_window.clear()

    def reset(self):
        self.b_window.clear()
        self.slack_window.clear()
        self.tail = float("nan")


class Recent(NamedTuple):
    """What the ranks' last operations say, per rail, over the ranks that sent on it (nan
    where some of them cannot tell): the least and largest last cost per byte, the least
    and largest ``rise``, the largest ``fall`` and the least ``tail_rise`` (RailEstimator)."""
    last_lo: list
    last_hi: list
    rise_lo: list
    rise_hi: list
    fall_hi: list
    samples: list         # per rail: the fewest samples any rank that sent on it has
    tail_hi: list         # per rail: the largest cost of the last operation's tail
    tail_rise_lo: list    # per rail: the least tail over the earlier operations at its split
    slack_lo: list        # per rail: the least slack over the window (RailEstimator.slack)
    hop_last: list        # per rail: each rank's last cost (nan: it did not send on the rail)
    hop_rise: list        # per rail: each rank's rise (nan: as above, or too few samples:
                          # HOP_RISE_SAMPLES)


def _agreed_columns(tables: np.ndarray) -> tuple[list, list, Recent]:
    """Balancer.agree's reading of the gathered tables, every rail at once: the median
    start-up, and over the ranks that sent on a rail its largest estimate and the least or
    largest of each recent column (nan where none sent, or where one of them cannot tell).
    Whole-table numpy, not per rail: a table is read every operation when operations are
    long, and per-rail reductions made the agreement 0.6-0.7 ms on 4 rails (2.4 ms on 16)."""
    sending = tables[:, :, 2] > 0
    anyone = sending.any(axis=0)

    def pick(column: int, most: bool) -> list:
        x = np.where(sending, tables[:, :, column], -np.inf if most else np.inf)
        v = x.max(axis=0) if most else x.min(axis=0)     # a nan among the senders stays
        return np.where(anyone, v, np.nan).tolist()

    samples = np.where(sending, tables[:, :, 2], np.inf).min(axis=0)
    recent = Recent(
        last_lo=pick(3, False), last_hi=pick(3, True), rise_lo=pick(4, False),
        rise_hi=pick(4, True), fall_hi=pick(5, True),
        samples=[int(x) if ok else 0 for x, ok in zip(samples.tolist(), anyone.tolist())],
        tail_hi=pick(TAIL_COLUMN, True), tail_rise_lo=pick(TAIL_RISE_COLUMN, False),
        slack_lo=pick(SLACK_COLUMN, False),
        hop_last=list(np.where(sending, tables[:, :, 3], np.nan).T.tolist()),
        hop_rise=list(np.where(tables[:, :, 2] >= HOP_RISE_SAMPLES, tables[:, :, 4],
                               np.nan).T.tolist()))
    a = [_median([x for x in col if not math.isnan(x)]) for col in tables[:, :, 0].T.tolist()]
    return a, pick(1, True), recent


def _median(xs: list) -> float:
    """np.median's value (the mean of the middle two for an even count), nan for none."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


class RailState:
    """The agreed cold/hot state of the live rail set (identical on all ranks)."""

    def __init__(self, nrails: int):
        self.nrails = nrails
        self.slack: list = []      # the last table's agreed slack per rail (_within_slack)
        self.state = COLD
        self.live: tuple = tuple(range(nrails))
        self.a = [A_NOMINAL] * nrails
        self.b = [float("nan")] * nrails
        self.used_a = None
        self.used_b = None
        self.step = [STEP_START] * nrails  # per rail: how far a table moves its cost (damping)
        self.trend = [0] * nrails         # per rail: direction of its last move (+1 / -1)
        self.silent = [0] * nrails        # per rail: tables in a row without news of it
        # per rail: its cost in use is the probing guess (PROBE_RATIO x the best), not a
        # measurement: its first PROBE_MEASURES replace it whole. Damped from the guess, a
        # 150 Mbit/s rail probed at 1/20 of 59 Mbit/s kept 2 % of the message while three
        # rails of 12-18 Mbit/s carried 60 % (0.27 of the optimum, half the single rail)
        self.probed = [0] * nrails        # measurements still to take whole (PROBE_MEASURES)
        # per rail: silent tables before its next probe. Doubled by each probe, back to
        # PROBE_AFTER once the split uses the rail again: three rails of 12-16 Mbit/s next to
        # one of 439 (4 hosts, 64 MiB) were probed every fourth operation at 1/20 of the
        # best, more than they carry, and each probe cost that operation 20 %
        self.probe_after = [PROBE_AFTER] * nrails
        self.probe_found: list[list] = [[] for _ in range(nrails)]   # the last probes' costs
        # per rail: the split (not a probe) has carried it since HOT began: such a rail can be
        # fast, and what made it slow (a loss burst) may pass at any moment (_probe_cost)
        self.carried = [False] * nrails
        # per rail: its cost in use is still what COLD measured (no jump, no HOT table agreed)
        self.from_cold = [False] * nrails
        self.shift = [0] * nrails         # per rail: the last table's sign of change (_shifts)
        self.slow_hops: list = [frozenset()] * nrails   # ...and the hops it found slower
        self.jumped = [False] * nrails    # per rail: the last table made it jump slower
        self.worth = [0.0] * nrails       # per rail: its cost before it last slowed (_shifts)
        self.guessed = [False] * nrails   # per rail: its worth is a guess (_out_of_a_cold_stall)
        self.before = [0.0] * nrails      # per rail: its cost in use when it began to look slower
        self.confirmed = [False] * nrails  # per rail: a HOT table agreed with its cost in use
        self.held: tuple = ()             # rails the applied split used at the last table
        # per rail: the share at which its cost in use was measured (0: unknown), and the one
        # its worth was measured at (_grew: a rise at a share SHIFT x larger keeps no worth)
        self.measured_at = [0.0] * nrails
        self.worth_at = [0.0] * nrails
        self.backed = [False] * nrails    # per rail: the last table made it jump back faster
        self.doubted = [False] * nrails   # per rail: a jump back of it proved wrong (_shifts)
        self.patience = MIN_SAMPLES       # samples a table needs to move a rail by a step
        self.moved = False        # the last table changed the model in use
        self.stale_a: frozenset = frozenset()   # rails whose start-up samples the move voids
        self.overhead = RAIL_CPU_S   # agreed seconds one more rail adds to a message
        self.block = 0               # bytes of the last message split in HOT (applied_shares)
        self.reason = "start"

    def _enter_cold(self, reason):
        changed = self.state != COLD
        self.state = COLD
        self.used_a = self.used_b = None
        self.step = [STEP_START] * self.nrails
        self.trend = [0] * self.nrails
        self.worth = [0.0] * self.nrails
        self.guessed = [False] * self.nrails
        self.before = [0.0] * self.nrails
        self.measured_at = [0.0] * self.nrails
        self.worth_at = [0.0] * self.nrails
        # per rail: a HOT table's estimate agreed with its cost in use (worth needs one)
        self.confirmed = [False] * self.nrails
        self.held = ()
        self.probed = [0] * self.nrails
        self.probe_after = [PROBE_AFTER] * self.nrails
        self.probe_found = [[] for _ in range(self.nrails)]
        self.carried = [False] * self.nrails
        self.from_cold = [False] * self.nrails
        self.reason = reason
        return [("state", {"state": COLD, "reason": reason})] if changed else []

    def set_live(self, live) -> list:
        """A change of the rail set. A rail that leaves is simply not used; one that comes
        back is worth what it was worth before it left, so HOT goes on with the remembered
        costs and a rail back from a failure gets its share at the next operation (the next
        tables correct it if it came back different). Only a rail never measured sends the
        state back to COLD (equal shares until it is)."""
        live = tuple(sorted(live))
        if live == self.live:
            return []
        self.live = live
        self.probe_after = [PROBE_AFTER] * self.nrails    # a rail set changed: look again
        if self.state == HOT and all(_usable(self.used_b[r]) for r in live):
            self.reason = "rail set changed"
            self.patience = MIN_SAMPLES
            return [("weights", self.weights_fields())]
        return self._enter_cold("rail set changed")

    def observe(self, a, b, counts, recent: "Recent | None" = None) -> list:
        """Feed one agreed table. Returns a list of (event, fields) for the log.

        News of a rail is an estimate from every rank that sent on it. A rail without news
        (the split left it out, or its windows are still filling) keeps its last agreed cost
        and does not hold the others back. COLD switches to HOT on the first table with news
        of every live rail, or after PROBE_AFTER tables without news of some rail (one whose
        shares are always rescued by hedge copies never reports), which then starts from a
        probing share. In HOT a rail whose last operation shows a change (``_shifts``) jumps
        to its new cost; the others move by a damped step (``_damped_move``) once their
        estimates span ``patience`` operations."""
        self.a = list(a)
        self.moved = False
        self.stale_a = frozenset()
        live = self.live
        usable = [r for r in live if counts[r] >= MIN_SAMPLES and b[r] > 0]
        best = self._best_in_use() if self.state == HOT else float("nan")
        for r in live:
            # a rail priced beyond the probing class that still carries a crumb of a share
            # gives no news: the crumb measures start-up, not rate. Counted as news, a rail
            # at 170x after a 30 % loss burst kept 0.6 % of the message, was never silent,
            # never probed, and never came back (2 hosts x 2 rails)
            beyond = self.state == HOT and not self.probed[r] \
                and self.used_b[r] > PROBE_RATIO * best
            news = r in usable and not beyond
            self.silent[r] = 0 if news else self.silent[r] + 1
            if news and not self.probed[r]:
                self.probe_after[r] = PROBE_AFTER          # carried by the split, not a probe
                self.carried[r] = self.carried[r] or self.state == HOT
        self.b = [y if y > 0 else x for x, y in zip(self.b, b)]
        if self.state == COLD:
            enough = len(usable) == len(live) or (
                bool(usable) and max(self.silent[r] for r in live) >= PROBE_AFTER)
            return self._enter_hot(a, b, usable) if enough else []
        jumps = self._shifts(recent) if recent is not None else {}
        self._confirm(b, usable, recent, jumps)
        self._look_again_soon(jumps)
        probes = self._measured_probes(b, usable, counts, recent)
        jumps.update(probes)
        if recent is not None:
            b = self._within_slack(b, jumps, recent.slack_lo)
            b = self._without_past_rises(b, jumps, recent.last_hi)
        self._take_start_up_falls(a)
        news = [r for r in usable if counts[r] >= self.patience]
        if not news and not jumps and not self._probe_due():
            return []
        return self._damped_move(a, b, news, jumps, measured=bool(probes))

    def _confirm(self, b, usable, rec: Recent | None, jumps: dict) -> None:
        """A HOT table confirms a rail's cost in use when its estimate, or its last operation
        on its slowest hop, is within SHIFT x of it. The last operation counts too: the
        estimate needs MIN_SAMPLES operations at one split, and a rail that slowed at the
        second operation after HOT began (a loss burst) was never confirmed, so its worth
        was not remembered and it had no way back (``_way_back``). Not a rail that jumps at
        this table (``jumps``): its cost in use is no longer the one the table measured. A
        rail confirmed within SHIFT x of its worth is back, and the worth is done: done when
        the jump landed instead, a worth guessed from a share done early was gone by the
        time the next table found it wrong, and the rail then "slowed" from it, which made
        it the worth again (seed 44 of ``testbed shapes``). A confirmed cost is measured at
        the rail's share in the split now (``measured_at``, ``_grew``)."""
        shares = self.shares()
        for r in self.live:
            if r in jumps:           # judged against a cost no longer in use
                continue
            x = self.used_b[r]
            est = b[r] if r in usable else float("nan")
            last = rec.last_hi[r] if rec is not None else float("nan")
            if any(_usable(c) and x / SHIFT <= c <= SHIFT * x for c in (est, last)):
                self.confirmed[r] = True
                self.measured_at[r] = shares[r]
                if self.worth[r] and x <= SHIFT * self.worth[r]:
                    self.worth[r], self.guessed[r] = 0.0, False     # back: worth done

    def _within_slack(self, b, jumps: dict, slack) -> list:
        """Bound how much cheaper a rail that was done early may become: its share may grow,
        against the rail that set the pace (the least slack), by no more than its slack
        lets it fill, i.e. its new cost is at least (1 - slack) x its cost in use, scaled by
        what the pace-setter's own cost did. Where a share's time grows with its size in
        proportion, that is exactly its estimate, so the bound does not bind. A token
        bucket that refilled while the rail waited (htb in the testbed; NIC and cloud rate
        limiters) passes an early rail's next share at once, and its estimate then says it
        is 5-6x cheaper than it is: 12 hosts x 90 + 30 Mbit/s, 1 MiB, where the fast rail's
        23-43 KB shares fit its 48 KB bucket, swung the split between 1.0 / 0.0 and
        0.53 / 0.47 (the best: 0.75 / 0.25). EARLY_FALL bounds the step further, since the
        slack itself is a bucket's too. Jumps are left alone: a rail back from a slowdown
        during the operation is early by less than it got faster (its tail tells,
        ``_way_back``), and jumps back have their own guards (``worth``, ``doubted``).
        Returns the bounded estimates."""
        known = [x is not None and 0.0 <= x <= 1.0 for x in slack]
        self.slack = [round(x, 3) if k else None for x, k in zip(slack, known)]
        live = [r for r in self.live if known[r] and _usable(self.used_b[r])]
        if len(live) < 2:
            return b
        new = {r: jumps.get(r, b[r]) for r in live}
        pace = min(live, key=lambda r: (slack[r], -(new[r] / self.used_b[r])
                                        if _usable(new[r]) else 0.0))
        if not _usable(new[pace]):
            return b
        scale = new[pace] / self.used_b[pace]
        b = list(b)
        for r in live:
            # (never above its cost in use: slack cannot tell that a rail got slower)
            floor = float(min(1.0, scale * (1.0 - slack[r])) * self.used_b[r])
            if r not in jumps and r != pace and _usable(b[r]):
                b[r] = max(b[r], floor, EARLY_FALL * self.used_b[r])
        return b

    def _without_past_rises(self, b, jumps: dict, last_hi) -> list:
        """A window that says a rail got SHIFT x costlier than its cost in use, while the
        rail's last operation on its slowest hop cost no more than SHIFT x that, is the past:
        a stall that is over (a loss burst that ended, an operation slowed by a hiccup).
        Such a rail is held at the larger of its cost in use and its last cost, not raised
        towards the window. Raised, a 200 Mbit/s rail back from a 2 s loss burst of 30 %
        went from 0.49 of the split to 0.04-0.20 at the first table after its return and
        took 4-6 s (one operation a second) to get its share back (4 hosts x 2 rails,
        tests/test_failover.py). A rail whose stalls go on (steady loss) rises at the next
        table whose last operation shows one, so its estimate still carries its stalls.
        Returns the bounded estimates."""
        b = list(b)
        for r in self.live:
            x, last = self.used_b[r], last_hi[r]
            if r in jumps or not (_usable(x) and _usable(last) and _usable(b[r])):
                continue
            if b[r] > SHIFT * x and last <= SHIFT * x:
                b[r] = max(x, last)
        return b

    def _look_again_soon(self, jumps: dict) -> None:
        """A rail that just fell below the probing class (PROBE_RATIO x the best rail's cost)
        is probed again after one table without news, not PROBE_AFTER: what made it fall may
        be over in a moment (a 2 s loss burst of 30 %: a rail left out at its end waited
        3.4 s, three tables of one-rail operations, for its probe). ``jumps``: the changes
        the rails' last operations show (``_shifts``), not probes' measurements: a probe
        that finds a rail as slow as before leaves it to the usual, growing interval (10
        Mbit/s rails next to 390 probed every third table cost each of those operations
        1.6x)."""
        was = self._best_in_use()
        if not jumps or not _usable(was):
            return
        best = min(was, min(jumps.values()))
        for r, cost in jumps.items():
            if cost > PROBE_RATIO * best and self.used_b[r] <= PROBE_RATIO * was \
                    and not self.probed[r]:
                self.probe_after[r] = 1

    def _probe_due(self) -> bool:
        """Is some live rail due for a probe (silent for its ``probe_after`` tables, priced
        beyond the probing class)? Then the table moves the split even if no other rail's
        windows are full yet: a rail left out by a jump after a 30 % loss burst waited for
        the other rail's MIN_SAMPLES operations at the new split, 2.2 s, for its probe."""
        best = self._best_in_use()
        return _usable(best) and any(self._probe_is_due(r, self.used_b[r], best)
                                     for r in self.live)

    def _probe_is_due(self, r: int, cost: float, best: float) -> bool:
        """Rail ``r`` at ``cost`` has been silent for its ``probe_after`` tables and is
        priced beyond the probing class: its next table probes it (``_damped_move``)."""
        return self.silent[r] >= self.probe_after[r] and cost > PROBE_RATIO * best

    def _measured_probes(self, b, usable, counts, rec: "Recent | None") -> dict:
        """Probed rails that have been measured: {rail: cost}. The first PROBE_MEASURES
        measurements replace the cost whole, each from one operation (its last cost on the
        slowest hop; the estimate needs two: on operations of 1 s, a rail back from a 30 %
        loss burst waited 3.4 s for its share). Not only the first: it is taken at the small
        probing share, which htb's bucket may pass at once (a 200 Mbit/s rail looked 4.5x
        cheaper than its twin), or while the rail suffers what made it silent (a loss
        burst: 14x its cost, and the damped steps then took more than 5 s to bring it back);
        the second is taken at the share the first gave it."""
        out = {}
        for r in self.live:
            if not self.probed[r]:
                continue
            cost = b[r] if r in usable else (
                rec.last_hi[r] if rec is not None and counts[r] >= 1 else float("nan"))
            if _usable(cost):
                if self.probed[r] == PROBE_MEASURES and self._found_slow(r):
                    # the first is taken at the probing share, which a token bucket refilled
                    # while the rail sat out may pass whole: it tells how fast the rail is
                    # for a share that size, not for more. Taken whole, 10 Mbit/s rails
                    # (MTU 9000: a 36 KB bucket) that every probe found 23-30x the best
                    # looked 2-7x at the next, got 6-15 % of the following message where
                    # 2 % was right, and that operation ran 2-3x as long (seed 44 of
                    # ``testbed shapes``). The second, at the share this one gives, is
                    # taken whole
                    out[r] = max(cost, self.used_b[r] / PROBE_GROWTH)
                else:
                    out[r] = cost
                self.probed[r] -= 1
                if self.probed[r] and cost > PROBE_RATIO * self._best_in_use():
                    # found beyond the probing class: its next share is a crumb (0.6 % of
                    # a block at 60x) that measures start-up, not rate, and came in so rarely
                    # that a rail back from a collapse stayed "probed" at that crumb, never
                    # silent, never probed again, for 8 s (collapsing-rail.yaml, 1 run in 6)
                    self.probed[r] = 0
                if not self.probed[r]:      # what this probe found, for the next one
                    last = self.probe_found[r][-1] if self.probe_found[r] else None
                    self.probe_found[r] = (self.probe_found[r] + [cost])[-2:]
                    if last is not None and cost < 0.5 * last:
                        # getting faster: it may be back in a moment (a probe that straddled
                        # a collapsed rail's return found 21x after 57x, and the doubled
                        # interval left it out 2 s more: collapsing-rail.yaml)
                        self.probe_after[r] = 1
        return out

    def _found_slow(self, r: int) -> bool:
        """Whether the last probe of rail ``r`` found it beyond the probing class: then a
        first measurement that finds it far cheaper contradicts that, and is trusted for at
        most PROBE_GROWTH x the probing share (``_measured_probes``). A rail no probe has
        found slow (one back from a loss burst) is taken at its first measurement whole."""
        found = self.probe_found[r]
        best = self._best_in_use()
        return bool(found) and _usable(best) and found[-1] > PROBE_RATIO * best

    def _best_in_use(self) -> float:
        """The least cost per byte in use among the live rails (nan if none is known)."""
        known = [self.used_b[r] for r in self.live if _usable(self.used_b[r])]
        return min(known) if known else float("nan")

    def _probe_cost(self, r: int, best: float) -> float:
        """The cost per byte a probe of rail ``r`` assumes: PROBE_RATIO x the best rail's,
        unless its last two probes (or the measurement it entered HOT with and a probe) both
        found it slower and the split has never carried it since HOT began; then the faster
        of what they found (up to PROBE_RATIO_MAX x the best), so a rail that has only ever
        been slow is probed at the share it carries, and one that got faster shows it all the
        same (its share ends early). A rail the split carried before it fell keeps the
        generous guess: probes taken in a 2 s loss burst of 30 % found it 10-1000x slower,
        and a probe at that share was too small to show its return before the run ended
        (2 hosts x 3 rails). One finding is never enough."""
        guess = PROBE_RATIO * best
        found = self.probe_found[r]
        if not self.carried[r] and len(found) == 2 and min(found) > guess:
            return min(min(found), PROBE_RATIO_MAX * best)
        return guess

    def _shifts(self, rec: "Recent") -> dict:
        """Rails whose last operation says they changed: {rail: new cost per byte}.

        Slower: the last operation cost SHIFT x the cost in use, or SHIFT x the median earlier
        one at the same split. Every hop slower (the rail's rate dropped, another job loads
        it) is followed at once; one hop (traffic between two hosts) must say so in two
        tables in a row, so one stall never moves the split. The new cost is the larger of
        the last cost (every hop's least when all slowed: the slowest may also carry a hedge
        copy's wait; else the slowest hop's, as in the agreement) and the cost in use times
        the rise: a share too small to tell can look cheap in absolute terms while it got
        slower (taking its last cost made a 25 Mbit/s rail 57x cheaper). A rail that jumped
        slower may jump again at the next table: the operation during which it slowed is
        part fast, and its first jump can fall short (to 0.37 of an 8 MiB message for a rail
        at a quarter, where 0.2 is right); waiting for three operations at the new share
        kept it there for two, and the split took 1.6-1.7 s to settle instead of 0.8-0.9
        (slowing-rail.yaml). Its first operations at the new share can look slower still (on
        3 x 3 rails a rail down to a quarter jumped to 5x, then 12x its cost): the way back
        below corrects that. What it was worth before is remembered, but only from a
        share of at least WORTH_SHARE x an equal one (on 14 rails, 10 Mbit/s rails whose
        worth came from 2 % probing shares jumped back to twice their share).

        Faster: only a rail that slowed, back to what it was worth (``_way_back``).
        """
        out = {}
        shares = self.shares()
        for r in self.live:
            x, hi = self.used_b[r], rec.last_hi[r]
            if not _usable(hi):
                self.shift[r] = 0
                self.slow_hops[r] = frozenset()
                self.jumped[r] = False
                continue
            slower_all = rec.last_lo[r] >= SHIFT * x or rec.rise_lo[r] >= SHIFT
            slower = hi >= SHIFT * x or rec.rise_hi[r] >= SHIFT
            jump, looks_back = self._way_back(r, rec, x, hi)
            way = 1 if slower else (-1 if looks_back else 0)
            # what it cost before it began to look slower: a rail slower on one hop waits for
            # a second table, and the first one's damped move already raised its cost in use
            # (h2.r0 at a quarter on 3 x 2: worth 5.7e-8 where 4.1e-8 was right; the jump back
            # gave 0.42 of the message, not 0.50, and two damped tables did the rest: 1.1 s)
            self.before[r] = (self.before[r] or x) if slower else 0.0
            if slower and self.backed[r]:        # (every hop slower implies the slowest is)
                self._doubt(r)
            self.backed[r] = False
            slowed = self._slower_jump(r, rec, x, slower_all, slower, shares[r])
            if slowed is not None:
                out[r] = slowed
                way = 0
            elif jump is not None:
                out[r] = jump
                way = 0
                self.backed[r] = True
            if r in out:
                self.from_cold[r] = False
            self.shift[r] = way
        return out

    def _doubt(self, r: int) -> None:
        """Rail ``r`` jumped back faster, and the next table finds it slower: from now on its
        jumps back must show in two tables in a row (``doubted``). A worth guessed from a
        share done early (``_out_of_a_cold_stall``) was a token bucket's burst, and is
        forgotten: kept, it sent four 10 Mbit/s rails back to a quarter of their cost, their
        shares to 4x what they carry, every few tables for the whole run (5 hosts x 10
        rails, seed 44 of ``testbed shapes``: 1.5x the pinned split's time)."""
        self.doubted[r] = True
        if self.guessed[r]:
            self.worth[r] = self.before[r] = 0.0
            self.guessed[r] = False

    def _slower_jump(self, r: int, rec: Recent, x: float, slower_all: bool, slower: bool,
                     share: float) -> float | None:
        """Rail ``r``'s new cost if it jumps slower at this table (every hop slower, or the
        same hop in this table and the one before), else None; remembers the hops that said
        so, and what the rail was worth before it slowed. A rail that jumped at the last
        table jumps again once every hop says it costs REJUMP x more still: the operation
        in which it slowed was part fast, and a first jump to 2.8x (a rail cut to a quarter,
        3 x 3) left a rest of 1.43x, under SHIFT, that damped steps took 1.1 s more to
        follow."""
        hops = self._slower_hops(r, rec, x) if slower else frozenset()
        again = hops & self.slow_hops[r]
        self.slow_hops[r] = hops
        rest = self.jumped[r] and _usable(rec.last_lo[r]) and rec.last_lo[r] >= REJUMP * x
        self.jumped[r] = False
        if not (slower_all or rest or (again and self.shift[r] > 0)):
            return None
        # every hop at least this slow (the slowest may also carry a hedge's cost); a rise
        # at the same split scales the cost in use, whatever the share's size
        last, rise = ((rec.last_lo[r], rec.rise_lo[r]) if slower_all or rest
                      else self._hops_cost(r, rec, again))
        self._keep_worth(r, self.before[r], share)
        self.jumped[r] = True
        return max(c for c in (last, x * rise, x) if _usable(c))

    @staticmethod
    def _slower_hops(r: int, rec: Recent, x: float) -> frozenset:
        """The hops (ranks, each measuring the hop into it) whose last operation on rail
        ``r`` cost SHIFT x ``x`` or SHIFT x their earlier ones at this split."""
        last, rise = rec.hop_last[r], rec.hop_rise[r]
        return frozenset(int(k) for k in range(len(last))
                         if (_usable(last[k]) and last[k] >= SHIFT * x)
                         or (_usable(rise[k]) and rise[k] >= SHIFT))

    @staticmethod
    def _hops_cost(r: int, rec: Recent, hops: frozenset) -> tuple:
        """(last cost, rise) of the hops that said twice in a row that rail ``r`` got slower:
        the slowest of them. Not the slowest of all hops: with 12 hops and two operations at
        a split, some hop's rise is 1.5-3x by chance (its first operation's share passed in
        a token bucket's burst), and taken with another hop's rise in the table before it
        jumped a 90 Mbit/s rail to 1.3x, and a 30 Mbit/s one to 2.8x their cost (12 hosts)."""
        lasts = [rec.hop_last[r][k] for k in hops if _usable(rec.hop_last[r][k])]
        rises = [rec.hop_rise[r][k] for k in hops if _usable(rec.hop_rise[r][k])]
        return (float(max(lasts)) if lasts else float("nan"),
                float(max(rises)) if rises else float("nan"))

    def _way_back(self, r: int, rec: "Recent", x: float, hi: float) -> tuple:
        """Rail ``r`` (cost in use ``x``, slowest hop's last cost ``hi``) on its way back to
        what it was worth: (its new cost, or None if it does not jump now; whether it looks
        faster at all).

        Only a rail that slowed jumps faster, back to what it was worth (at most FALL_MAX x
        cheaper in one jump; the worth is kept until it is reached), when every hop's last
        two operations were SHIFT x cheaper than the median earlier one at the same split
        (RailEstimator.fall), or at once when the slowest hop's last cost, or the cost of the
        last messages of its last operation (``tail``: a rail that recovered during the
        operation; its whole cost is part slow), is within SHIFT x of the worth; and part of
        the way when its last cost is SHIFT x below the cost in use (the operation during
        which the rail recovered is part slow, part fast; a jump
        slower that overshot: 7x for a rail at a quarter): half way on a log scale, since a
        share's cost grows with its size and the last one was measured at a smaller share
        (to the last cost itself, a rail at a quarter got 0.24 of the message where 0.2 is
        right). Waiting for a second table cost each recovery an operation at the slow
        split: on 2 rails the iterations took 0.94-1.76 s to get back within 1.1x (adapt
        matrix), 0.55-0.85 s without. Not when the last operation was no cheaper than
        earlier ones at the same split on every hop (``rise``): then the rail looks cheaper
        only because its share is smaller. A share's
        cost depends on its size (a token bucket that refilled while the rail idled passes
        a small share at once), so a jump back can be wrong: the next table sends the rail
        back up, and from then on its jumps back need two tables in a row (``doubted``), so
        it cannot flap. A rail that never slowed is not trusted to jump faster at all: on 8
        rails a 25 Mbit/s rail's last two operations looked 1.5x cheaper than its earlier
        ones, the jump gave it 58 % of a 16 MiB message, and that operation took 3.4 s
        instead of 0.37. Damped steps move it."""
        worth = self.worth[r]
        if not worth:
            return self._out_of_a_cold_stall(r, rec, x, hi)
        # no hop cheaper than before at this split: a share-size effect. (Not "some hop no
        # cheaper": a hop that never slowed never gets cheaper, so one host's link back from
        # a slowdown, h2.r0 on 3 x 2, waited a table more at its slow share.) Unless some
        # hop's tail is: the rail got faster during the operation, whose whole cost is part
        # slow (its rise 0.7-0.9: r1 back from a quarter on 3 x 2 waited a table at 0.21)
        fell_during = _usable(rec.tail_rise_lo[r]) and rec.tail_rise_lo[r] <= 1 / SHIFT
        same = _usable(rec.rise_lo[r]) and rec.rise_lo[r] > 1 / SHIFT and not fell_during
        latest = min(hi, rec.tail_hi[r]) if _usable(rec.tail_hi[r]) else hi
        back = latest <= SHIFT * worth and not same
        cheaper = hi <= x / SHIFT and not same      # every hop (hi is the slowest's)
        if rec.fall_hi[r] <= 1 / SHIFT or (
                (back or cheaper) and (self.shift[r] < 0 or not self.doubted[r])):
            target = max(math.sqrt(x * hi) if cheaper and not back else worth, x / FALL_MAX)
            # (a rail already at its worth has nowhere to jump: kept until a table confirms
            # it there, the worth would otherwise send it "back" to where it is)
            return (target, True) if target < x else (None, True)
        return None, back or cheaper

    def _out_of_a_cold_stall(self, r: int, rec: Recent, x: float, hi: float) -> tuple:
        """_way_back for a rail without a worth whose cost in use is still COLD's (no jump, no
        table agreed with it), when its last operation was SHIFT x cheaper on every hop and it
        was done early (slack at least EARLY_SLACK): COLD measured it in a bad moment (a loss
        burst during the first operations). It jumps half way on a log scale, and what it
        costs now becomes its worth, so the next table returns it there, or, if the next
        operation finds it slower after all (a share that fit a token bucket's burst), sends
        it back up, doubts it and forgets that worth (``guessed``, ``_shifts``). Without it such a rail came back only by
        damped steps that its slack bounds to EARLY_FALL a table: 0.19-0.23 of the split for
        the 5 s left of the run, where 0.5 was right (4 hosts x 2 rails, HOT 1.7 s into a 2 s
        loss burst of 30 % with one core kept busy)."""
        slack = rec.slack_lo[r]
        rose = _usable(rec.rise_hi[r]) and rec.rise_hi[r] >= SHIFT
        if rose or not (self.from_cold[r] and not self.confirmed[r] and _usable(hi)
                        and hi <= x / SHIFT and _usable(slack) and slack >= EARLY_SLACK):
            return None, False
        self.worth[r], self.guessed[r] = hi, True
        self.worth_at[r] = self.shares()[r]
        return max(math.sqrt(x * hi), x / FALL_MAX), True

    def _take_start_up_falls(self, a) -> None:
        """A start-up cost that fell is taken at once, with or without a move of the split
        (one that rose is damped, _damped_move): its estimate is a minimum, which only an
        expired inflated sample raised, and the hysteresis is judged on a 16 MiB message,
        which hardly notices a stale 10 ms where a ring block of 2 MiB on 200 Mbit/s rails
        (45 ms) loses a fifth of a rail's share to it."""
        self.used_a = [min(x, y) if r in self.live else x
                       for r, (x, y) in enumerate(zip(self.used_a, a))]

    def _probing_start_up(self, sa) -> None:
        """A probed rail starts up no slower than the best live rail: its probing share is
        for measuring it, and a start-up cost that exceeds a message's time on the other
        rails gives it nothing of that message (2 MiB blocks on 200 Mbit/s rails: 45 ms,
        where one taken in a loss burst was 191 ms)."""
        best = min(sa[r] for r in self.live)
        for r in self.live:
            if self.probed[r]:
                sa[r] = best

    def _enter_hot(self, a, b, news) -> list:
        best = min(b[r] for r in news)
        self.state = HOT
        self.patience = MIN_SAMPLES
        self.used_a = list(a)
        self.used_b = [b[r] if r in news or r not in self.live else PROBE_RATIO * best
                       for r in range(self.nrails)]
        self.probed = [PROBE_MEASURES if r in self.live and r not in news else 0
                       for r in range(self.nrails)]
        # a rail measured now counts as found by a probe (``_probe_cost``): COLD's equal
        # shares are large, and a rail they found slow need not be overloaded twice
        self.probe_found = [[b[r]] if r in news else [] for r in range(self.nrails)]
        self.from_cold = [r in news for r in range(self.nrails)]
        self.measured_at = [1.0 / len(self.live) if r in news else 0.0   # COLD's equal share
                            for r in range(self.nrails)]
        self._probing_start_up(self.used_a)
        self.moved = True
        self.reason = "estimates for every rail"
        return [("state", {"state": HOT, "reason": self.reason}),
                ("weights", self.weights_fields())]

    def _damped_move(self, a, b, news, jumps=None, measured: bool = False) -> list:
        """Move each live rail's cost in use part of the way towards the table (a rail in
        ``jumps`` all the way to its new cost), and only if that saves more than HYSTERESIS of
        a 16 MiB message's time (``_saving``). A share's cost depends on its size (a token bucket
        that refills while a rail idles passes a small share at once, a large one at the
        rate; a small share pays a thread wake-up), so the split is found by a damped
        iteration (``_steps``). A rail without news for PROBE_AFTER tables is assumed no
        worse than PROBE_RATIO x the best rail, so it gets a small share and is measured
        again (the next table puts it back if it really is bad); a rail that each probe
        leaves out again waits twice as long for the next (``probe_after``)."""
        live, jumps = self.live, jumps or {}
        step, trend, turned = self._steps(b, news, jumps)
        sa = [(x + y) / 2 for x, y in zip(self.used_a, a)]   # (falls: _take_start_up_falls)
        sb = self._stepped(b, news, step)
        for r, cost in jumps.items():
            sb[r] = cost
        best = min(sb[r] for r in live)
        probing = False
        for r in live:
            # a jump slower is news of a rail; a jump back is not. One that lands within the
            # probing class is not probed anyway (sb[r] holds the jump: the test below), and
            # one that leaves the rail beyond it keeps a crumb of a share and, saving
            # nothing, is not even taken. A rail at 180x after a 30 % loss burst, back at its
            # worth by its crumb's cost, jumped back by FALL_MAX (to 45x) at every table, each
            # dropped, and was never probed (2 hosts x 2 rails: one rail for 5.7 s)
            news_of_it = r in jumps and jumps[r] >= self.used_b[r]
            if not news_of_it and self._probe_is_due(r, sb[r], best):
                sb[r] = min(sb[r], self._probe_cost(r, best))
                self.silent[r] = 0
                self.probed[r], probing = PROBE_MEASURES, True
                self.probe_after[r] = min(PROBE_AFTER_MAX, 2 * self.probe_after[r])
        self._probing_start_up(sa)
        self._hold_start_up_of_slowed(sa, sb)
        old = self.shares(REF_SIZE)
        new = self._model_shares(REF_SIZE, sa, sb)
        # judged by where the estimates lead, not by the damped step alone: half steps each
        # saving under HYSTERESIS left 300 + 100 Mbit/s rails at 0.77 / 0.23 where the
        # estimates, steady for 12 tables, said 0.75 (3 hosts, 16 MiB: 1.5 % slower)
        full = [b[r] if r in news else x for r, x in enumerate(sb)]
        for r, cost in jumps.items():
            full[r] = cost
        target = self._model_shares(REF_SIZE, sa, full)
        # a probe is a measurement, made and taken (``measured``: a first one PROBE_GROWTH
        # bounded, dropped, left the rail at its probing share) where the model sees no saving
        saving = max(self._saving(old, new), self._saving(old, target))
        if not probing and not measured and saving <= HYSTERESIS:
            return []
        self.step, self.trend = step, trend
        if jumps:
            self.patience = MIN_SAMPLES
        elif turned:
            self.patience = min(WINDOW, self.patience * 2)
        self._remember_worth(sb, jumps)
        self._measured_at(old, news, jumps)
        self.used_a, self.used_b = sa, sb
        self.moved = True
        fields = self.weights_fields()
        if jumps:
            fields["shifted"] = sorted(jumps)
        return [("weights", fields)]

    def _measured_at(self, old, news, jumps: dict) -> None:
        """Where the costs this move puts in use were measured: at the split the operations
        ran at (``old``), except a jump back to a worth, measured where the worth was."""
        for r in self.live:
            if r in jumps:
                back = jumps[r] < self.used_b[r] and jumps[r] == self.worth[r]
                self.measured_at[r] = self.worth_at[r] if back else old[r]
            elif r in news:
                self.measured_at[r] = old[r]

    def _stepped(self, b, news, step) -> list:
        """Each live rail's cost in use moved its ``step`` of the way towards the table's
        estimate ``b`` (if it has news). A rail that is down keeps its cost in use, so it
        comes back at what it was worth (``set_live``): given the table's, a 10 Mbit/s rail
        down for 30 ms came back 5x cheaper, from the crumb its failed operation measured,
        took 16 % of the next message, and that operation ran 1.9x as long (4 hosts x 8
        rails, seed 45 of ``testbed shapes``)."""
        return [x + step[r] * ((b[r] if r in news else x) - x) if r in self.live
                else (x if _usable(x) else self.b[r]) for r, x in enumerate(self.used_b)]

    def _hold_start_up_of_slowed(self, sa, sb) -> None:
        """A rail this move makes SHIFT x costlier per byte keeps its start-up cost in use,
        and its start-up samples so far are dropped (``stale_a``; Balancer.agree): taken
        while it slowed, they time the backlog that its old share left queued at the new
        rate, which the per-byte cost now prices. Taken as start-up, a 4-byte message's
        85 ms behind that backlog (a 200 Mbit/s rail cut to 50) gave the rail no share
        of a 2 MiB block for 2 s, where a quarter of its old one was right (3 hosts x 3
        rails, one core kept busy). A start-up that really rose (a longer path) is
        measured again at the new split."""
        self.stale_a = frozenset(self._raised(sb))
        for r in self.stale_a:
            sa[r] = min(sa[r], self.used_a[r])

    def _remember_worth(self, sb, jumps: dict) -> None:
        """A rail that a damped move makes SHIFT x costlier at once is remembered at what it
        was worth before, as a jump slower is (``_slower_jump``; on the same conditions,
        ``_keep_worth``), so the way back (``_way_back``) can return it in one table.
        Without it, a rail raised to 4.8x by the operation that straddled the end of a 2 s
        loss burst of 30 % came back only by the slack-bounded damped steps: 0.17 -> 0.19 of
        the split in 5 s, where 0.5 was right (4 hosts x 2 rails of 200 Mbit/s)."""
        shares = self.shares()
        for r in self._raised(sb):
            if r not in jumps:
                self._keep_worth(r, self.used_b[r], shares[r])

    def _raised(self, sb) -> list:
        """The live rails that costs ``sb`` make SHIFT x costlier than their cost in use."""
        return [r for r in self.live if _usable(self.used_b[r]) and _usable(sb[r])
                and sb[r] >= SHIFT * self.used_b[r]]

    def _keep_worth(self, r: int, cost: float, share: float) -> None:
        """Remember ``cost`` as what rail ``r``, slowing at ``share`` of the split, was worth
        before (unless a worth is kept already). Only from a share of at least WORTH_SHARE x
        an equal one (on 14 rails, 10 Mbit/s rails whose worth came from 2 % probing shares
        jumped back to twice their share), and only a cost a HOT table confirmed, or one the
        rail had at a share no more than SHIFT x COLD's equal one, where it was measured.
        Not a cost the rail was found beyond at a far larger share: COLD's equal share of a
        90 Mbit/s rail fit a token bucket's burst, its estimate was 6x too cheap, HOT gave it
        most of the message, and a jump back to that estimate gave the other rail nothing
        (12 hosts x 90 + 30 Mbit/s, 1 MiB). But a rail that slowed at its COLD share, at the
        first operation after HOT began (a loss burst), is worth what it was: refused, it had
        no way back and kept 0.21 of the split for the 6 s left of the run, where 0.5 was
        right (4 hosts x 2 rails of 200 Mbit/s)."""
        n = len(self.live)
        if not self.worth[r] and share >= WORTH_SHARE / n \
                and (self.confirmed[r] or share <= SHIFT / n) and not self._grew(r, share):
            self.worth[r], self.guessed[r] = cost, False
            self.worth_at[r] = self.measured_at[r]

    def _grew(self, r: int, share: float) -> bool:
        """Whether rail ``r`` slows at a ``share`` more than SHIFT x the one its cost in use
        was measured at: then the rise is the share's size as much as a change of the rail
        (a token bucket passes a small share at once), and that cost is no worth to go back
        to. Kept, a 10 Mbit/s rail's cost from a 2 % share that its bucket passed whole (MTU
        9000) sent it back to 7-10 % of the message every few tables, each such operation
        1.7-2.4x as long (5 hosts x 10 rails, seed 44 of ``testbed shapes``)."""
        at = self.measured_at[r]
        return at > 0 and share > SHIFT * at

    def _saving(self, old, new) -> float:
        """What part of an operation's time a move from shares ``old`` to ``new`` saves, as
        the new model sees it: the new split's rails finish together, the old one's when its
        most over-loaded rail does (``old / new`` of that time). A bound on the shares' change
        in absolute terms (0.01 of the message) let a rail at 0.19 where 0.18 was right stay
        there for 13 operations, each 6 % slower (traffic on 4 x 3 rails): a small share's
        error costs as much time as a large one's, in proportion to its size."""
        over = [old[r] / new[r] if new[r] > 0 else (math.inf if old[r] > 0 else 1.0)
                for r in self.live]
        return max(over) - 1.0

    def _steps(self, b, news, jumps) -> tuple[list, list, bool]:
        """Per rail, how far this table moves its cost: the step is halved when the rail
        turns back (down to STEP_MIN: a rail flapping between two shares settles between
        them) and grown x1.5 while it keeps one direction (up to STEP_MAX). A rail that
        jumped starts afresh at STEP_START in no direction (a jump's first measurement tends
        to overshoot: the drop itself stalls the rail, so its correction is not a turn
        back). Also returns whether some rail turned back: a turn back doubles the samples
        the next step needs (noise is what makes a split hover around its optimum; averaging
        it out stops that)."""
        step, trend, turned = list(self.step), list(self.trend), False
        for r in self.live:
            x = self.used_b[r]
            if r in jumps:
                step[r], trend[r] = STEP_START, 0
                continue
            if r not in news:
                continue
            way = int(b[r] > x) - int(b[r] < x)
            if way and trend[r] and way != trend[r]:
                step[r] = max(STEP_MIN, step[r] / 2)
                turned = True
            elif way and way == trend[r]:
                step[r] = min(STEP_MAX, step[r] * 1.5)
            trend[r] = way or trend[r]
        return step, trend, turned

    def _model_shares(self, nbytes, a, b):
        aa = [a[r] if r in self.live else 0.0 for r in range(self.nrails)]
        bb = [b[r] if r in self.live else float("nan") for r in range(self.nrails)]
        s = cost_split(nbytes, aa, bb, 1, 0.0)
        return [x / nbytes for x in s]

    def predict(self, nbytes: int) -> float:
        """Seconds ``nbytes`` should take on the rails in use (0 until HOT): what spaces the
        exchanges in time, identically on every rank."""
        if self.state != HOT:
            return 0.0
        return nbytes / sum(1.0 / self.used_b[r] for r in self.live)

    def shares(self, nbytes=REF_SIZE):
        if self.state == HOT:
            return self._model_shares(nbytes, self.used_a, self.used_b)
        s = equal_split(nbytes, self.live, self.nrails)
        return [x / nbytes for x in s]

    def hold(self) -> None:
        """Before a table changes the overhead: the rails that carry HOLD_SHARE or more of
        the split now are held (cost_split, HOLD), judged at the block size it cut last
        (each rank's last block; they differ by an element at most, and a split that
        differs between ranks costs balance, never correctness: frames carry their
        offsets). Not a rail with a crumb: there the overhead is what decides, and four
        ~10 Mbit/s rails of 6 hosts x 8 rails (3 % of the bytes each) held through a
        stretch of 7-8 made the ring 6 % slower (seed 17 of ``testbed shapes``)."""
        self.held = tuple(r for r, x in enumerate(self.applied_shares()) if x >= HOLD_SHARE) \
            if self.state == HOT and self.block else ()

    def probing(self) -> tuple:
        """The live rails being probed: the split gives them bytes whatever their overhead."""
        return tuple(r for r in self.live if self.probed[r])

    def applied_shares(self) -> list:
        """The shares the split gives a message of the last size it cut in HOT (rails that
        do not pay for their overhead left out): what goes on the wire, where ``shares`` is
        the model's split with no overhead (what the damping and the hysteresis judge)."""
        if self.state != HOT or not self.block:
            return self.shares()
        return [x / self.block for x in self.split_block(self.overhead)]

    def split_block(self, overhead: float, held: bool = True) -> list:
        """The HOT split of the last block cut (bytes per rail) with the rail ``overhead``
        given (and the rails held by the last table, or none)."""
        aa = [self.used_a[r] if r in self.live else 0.0 for r in range(self.nrails)]
        bb = [self.used_b[r] if r in self.live else float("nan") for r in range(self.nrails)]
        return cost_split(self.block, aa, bb, 1, overhead, self.probing(),
                          self.held if held else ())

    def block_time(self, sizes) -> float:
        """Seconds the last block takes split as ``sizes`` (bytes per rail), by the model in
        use: its last rail's a + s x b."""
        return max(self.used_a[r] + n * self.used_b[r] for r, n in enumerate(sizes) if n > 0)

    def weights_fields(self):
        return {"shares": [round(x, 4) for x in self.applied_shares()], "state": self.state,
                "model_shares": [round(x, 4) for x in self.shares()],
                "overhead_us": round(self.overhead * 1e6, 1),
                "a": self.used_a or self.a, "b": self.used_b or self.b, "slack": self.slack}

    def best_rail(self) -> int:
        return min(self.live, key=lambda r: (self.a[r], r))


class Balancer:
    """Decides, for one message, which byte range goes on which rail."""

    MODES = ("nezha", "stripe", "single")

    def __init__(self, nrails: int, mode: str = "nezha", chunk_bytes: int = 512 << 10,
                 pinned=None, rail_cpu_s: float = RAIL_CPU_S):
        if mode not in self.MODES:
            raise ValueError(f"unknown balancing mode {mode!r}")
        if pinned is not None and len(pinned) != nrails:
            raise ValueError(f"{len(pinned)} pinned shares for {nrails} rails")
        self.pinned = pinned     # stripe: proportions per rail (None: equal)
        self.rail_cpu_s = rail_cpu_s   # NEZHA_RAIL_CPU_US
        self.nrails = nrails
        self.mode = mode
        self.chunk_bytes = chunk_bytes
        self.est = [RailEstimator() for _ in range(nrails)]
        self.rs = RailState(nrails)
        self.rs.overhead = rail_cpu_s
        self.stretch = RunQueueStretch()
        self.trial = OverheadTrial()   # whether the overhead is counted (trial.py)
        self.agreed_overhead = rail_cpu_s   # the agreed rail overhead, before the trial's scale
        self.op_times: list = []       # this rank's op seconds per byte since the last table
        self.ops_since_exchange = 0
        self.pending_s = 0.0     # what the ops since the last exchange should have taken
        self.unsettled = False   # the last table moved the split (or entered HOT)

    # ---- measurements (called from transport threads)
    def record_a(self, rail, seconds):
        self.est[rail].record_a(seconds)

    def record_b(self, rail, nbytes, seconds, tail=float("nan"), slack=(0.0, 0.0)):
        self.est[rail].record_b(nbytes, seconds, tail, slack)

    # ---- agreement
    def local_table(self) -> np.ndarray:
        """This rank's [a, b, samples, last, rise, fall] per rail (see RailEstimator), its
        rail overhead, the last operation's tail cost and its tail rise, and the rank's
        operation time per byte since the last table."""
        t = np.zeros((self.nrails, TABLE_COLUMNS), dtype=np.float64)
        over = rail_overhead(self.rail_cpu_s, self.stretch.sample())
        op_time = float(np.median(self.op_times)) if self.op_times else float("nan")
        for r, e in enumerate(self.est):
            t[r] = (e.fresh_a(), e.b, len(e.b_window), e.last,
                    e.rise, e.fall, over, e.tail, e.tail_rise, e.slack, op_time)
        return t

    def want_exchange(self, nbytes: int) -> bool:
        """COLD: before every op of >= EXCH_MIN_BYTES. HOT: once the ops since the last
        exchange should have taken EXCH_PERIOD_S at the agreed rates (every op when ops are
        long, so a change is seen after one; a few % of the time when they are short)."""
        if self.mode != "nezha" or self.nrails < 2:
            return False
        k = self.ops_since_exchange
        if self.rs.state == COLD:
            return (k >= 1 and nbytes >= EXCH_MIN_BYTES) or k >= 64
        # a split just moved is looked at again as soon as its window can tell: a prediction
        # from costs a token bucket flattered said 20 ms for a 186 ms operation (12 hosts x
        # 90 + 30 Mbit/s, 1 MiB), and the first HOT split, which left the 30 Mbit/s rail
        # out, stood for 7 operations
        due = self.pending_s >= EXCH_PERIOD_S or (self.unsettled and k >= self.rs.patience)
        return (k >= 1 and due and nbytes >= EXCH_MIN_BYTES) or k >= 128

    def agree(self, tables: np.ndarray) -> list:
        """tables: (world, nrails, TABLE_COLUMNS) gathered local tables. Same result on every
        rank.

        b_r is the largest estimate among the ranks that sent on rail r (a ring runs at its
        slowest hop), and exists only once every one of them has one; so do the least and
        the largest last-operation costs that tell a change (RailState._shifts)."""
        self.ops_since_exchange = 0
        self.pending_s = 0.0
        a, b, recent = _agreed_columns(tables[:, :, :TABLE_COLUMNS])
        counts = recent.samples
        # a rail never used for a small message has no start-up estimate: assume the best
        # measured one (the rails differ in rate far more than in start-up), else nominal
        known = [x for x in a if not math.isnan(x)]
        fill = min(known) if known else A_NOMINAL
        a = [fill if math.isnan(x) else x for x in a]
        over = [x for x in tables[:, 0, OVERHEAD_COLUMN].tolist() if not math.isnan(x)]
        self.rs.hold()
        self.agreed_overhead = _median(over) if over else self.rail_cpu_s
        self._use_overhead()
        evs = self.rs.observe(a, b, counts, recent)
        evs += self._try_overhead(tables[:, 0, OP_TIME_COLUMN])
        self.unsettled = self.rs.moved and self.rs.state == HOT
        if self.rs.moved:
            # the samples so far describe the old split: measure the new one afresh
            self._restart_windows()
            for r in self.rs.stale_a:
                self.est[r].forget_a()
        return evs

    def _try_overhead(self, op_times: np.ndarray) -> list:
        """The overhead trial's turn at this table (trial.py), and the overhead it leaves in
        use. It runs only in HOT, where the overhead leaves out a rail the model would use."""
        self.op_times = []
        rs = self.rs
        if rs.state != HOT:
            evs = self.trial.reset()
        else:
            per_byte = _median([x for x in op_times.tolist() if not math.isnan(x)])
            evs = self.trial.observe(per_byte, rs.moved, self._worth_a_trial())
        if self._use_overhead() and rs.state == HOT:    # the split on the wire changes
            evs.append(("weights", rs.weights_fields()))
        return evs

    def _use_overhead(self) -> bool:
        """Put the agreed overhead times the trial's scale in use; whether that changed it."""
        new = self.agreed_overhead * self.trial.scale
        changed = new != self.rs.overhead
        self.rs.overhead = new
        return changed

    def _worth_a_trial(self) -> bool:
        """Whether the rails that the overhead leaves out of the last block would make it
        finish TRIAL_MARGIN sooner by the model: a trial that cannot win by more is not run.
        A 2 Mbit/s rail next to three of 100 (collapsing-rail.yaml) would get 0.6 % of the
        block; trials of that crumb gave it a share on and off, through its return."""
        rs = self.rs
        if not rs.block:
            return False
        kept, every = rs.split_block(self.agreed_overhead), rs.split_block(0.0, False)
        if [x > 0 for x in kept] == [x > 0 for x in every]:
            return False
        return rs.block_time(every) < (1.0 - TRIAL_MARGIN) * rs.block_time(kept)

    def note_op(self, nbytes: int = 0, seconds: float = float("nan")):
        """One collective of ``nbytes`` done in ``seconds`` (called by the Context,
        identically on every rank; the time only where the op is metered)."""
        self.ops_since_exchange += 1
        self.pending_s += self.rs.predict(nbytes)
        if nbytes > 0 and not math.isnan(seconds):
            self.op_times.append(seconds / nbytes)

    def set_live(self, live) -> list:
        if tuple(sorted(live)) == self.rs.live:
            return []
        evs = self.trial.reset()     # what it measured was another rail set
        self._use_overhead()
        changed = self.rs.set_live(live)
        if changed:
            self._restart_windows()
        return evs + changed

    def _restart_windows(self) -> None:
        for e in self.est:
            e.reset()
        # a change is judged against the cost in use and what the rail was worth, whatever
        # the split: a move meanwhile does not restart its confirmation. It did: on 2 x 2 a
        # rail back from a slowdown waited two more operations at its slow share (adapt
        # matrix); one host's link at a quarter (h2.r0 on 3 x 2) was slower on two hops in
        # the first table, whose damped move cleared that, and the jump came at the third
        # table, 1.5 s after the change, not the second (RailState.shift is kept)

    # ---- the split
    def split(self, nbytes: int, elem: int, live=None,
              op_total: int = 0) -> list[tuple[int, int, int]]:
        """[(rail, offset, length), ...] covering [0, nbytes); one (rail, 0, 0) if empty.

        ``op_total``: bytes of the whole collective buffer the message belongs to (the
        frames carry it, so a receiver computes the same split). A small message of an
        operation that is metered is still split in COLD, so every rail gets cost samples:
        a ring's block is the buffer over the host count (16 KiB for 1 MiB on 64 hosts),
        and a rule on the block alone kept a second rail unmeasured, and unused, for good.
        In HOT a small message rides one rail unless that rail would take SPLIT_SMALL_S or
        more, then the cost model decides (2 Mbit/s rails: 65 ms for 16 KiB)."""
        live = tuple(self.rs.live if live is None else live)
        if not live:
            raise ValueError("no live rail")
        if self.mode == "single" or nbytes == 0 or len(live) == 1:
            rail = live[0] if self.mode == "single" else self._best(live, nbytes)
            return [(rail, 0, nbytes)]
        if self.mode == "stripe":
            sizes = weighted_split(nbytes, self.pinned, live, self.nrails, elem)
        elif self.rs.state == HOT and set(live) == set(self.rs.live):
            a = [self.rs.used_a[r] if r in live else 0.0 for r in range(self.nrails)]
            b = [self.rs.used_b[r] if r in live else float("nan") for r in range(self.nrails)]
            if nbytes < MIN_SPLIT:
                best = self._best(live, nbytes)
                if not a[best] + nbytes * b[best] >= SPLIT_SMALL_S:    # (nan: not known)
                    return [(best, 0, nbytes)]
            self.rs.block = nbytes
            sizes = cost_split(nbytes, a, b, elem, self.rs.overhead, self.rs.probing(),
                               self.rs.held)
        else:
            if nbytes < COLD_SMALL and not gives_samples(op_total):
                return [(self._best(live, nbytes), 0, nbytes)]
            sizes = equal_split(nbytes, live, self.nrails, elem)
        out, off = [], 0
        for r in range(self.nrails):
            if sizes[r] > 0:
                out.append((r, off, sizes[r]))
                off += sizes[r]
        return out

    def spread(self, nbytes: int, count: int, live) -> list[int]:
        """Rails for ``count`` messages of ``nbytes`` sent at once, each whole on one rail:
        each goes where it would finish soonest behind those placed before it (a_r + k s b_r;
        round robin by a_r while rates are unknown). A direct allreduce's copies to its peers
        then use every rail without paying for a split of each."""
        live = tuple(live)
        a, b = self.rs.a, self.rs.b
        known = all(not math.isnan(b[r]) for r in live)
        placed = dict.fromkeys(live, 0)
        out = []
        for _ in range(count):
            def finish(r):
                return (a[r] + (placed[r] + 1) * nbytes * b[r] if known
                        else (placed[r], a[r]), r)
            r = min(live, key=finish)
            placed[r] += 1
            out.append(r)
        return out

    def _best(self, live, nbytes=0):
        """The single rail that moves ``nbytes`` soonest by the agreed model (a_r + s*b_r;
        by a_r alone while rates are unknown)."""
        a, b = self.rs.a, self.rs.b
        if all(not math.isnan(b[r]) for r in live):
            return min(live, key=lambda r: (a[r] + nbytes * b[r], r))
        return min(live, key=lambda r: (a[r], r))
