"""`shapes`: Nezha's load balancing judged on topologies nobody chose.

A hand-written topology tests what its author thought of; a balancer tuned on it can still fail
on the shape nobody thought of (one slow attachment, a lossy rail, 14 unequal rails). So this
module draws topologies from a seed, runs Nezha, the single-rail ring on the best rail and
kernel MPTCP side by side on each (the ``compare`` workload), computes the best any ring
allreduce could do on that shape, and prints one row per shape with the seed that reproduces it.

* ``draw(seed, options)``: a shape, deterministic from the seed (``random.Random(seed)``), as
  YAML topology text the spec loader reads (``--emit SEED`` prints it).
* ``optimum(topology)``: per rail, the rate its ring runs at (its slowest hop), as TCP goodput;
  the sum is the upper bound for the bus bandwidth of any multi-rail ring.
* ``sweep(...)``: the run loop; ``main(args)``: the ``python -m testbed shapes`` verb.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from testbed.errors import SpecError, TestbedError
from testbed.model.spec import Topology
from testbed.model.units import format_size

MIB = 1 << 20
DEFAULT_SIZES_MIB = (1, 2, 4, 8, 16, 32, 64)
SYSTEMS = ("nezha", "single", "mptcp")
RATE_MIN_MBIT = 10          # drawn rails (and overrides) never go below this, even after scaling
RATE_MAX_MBIT = 1000
DEFAULT_CPU_BUDGET_MBIT = 2400.0
# how often each feature is drawn (when allowed): frequent enough that 50 seeds see each a dozen
# times, rare enough that plain unequal rails stay the common case
P_EQUAL, P_OVERRIDE, P_LOSS, P_JUMBO = 0.3, 0.3, 0.25, 0.4
LOSS_PCT = (0.5, 2.0)
OVERRIDE_DIVISOR = (2.0, 10.0)
T_OPT_S = (0.1, 2.0)        # one iteration at the optimum: long enough to need every rail,
T_SINGLE_MAX_S = 3.0        # short enough for 20; the single-rail ring should not take minutes
BURST_SHARE_MAX = 0.05      # htb's bucket may pass at most this share of an iteration at once
ETH_HEADER = 14             # what htb counts on a veth beyond the IP packet (no FCS/preamble)
TCP_IP_HEADERS = 52         # IPv4 20 + TCP 20 + timestamps option 12: MSS = MTU - 52
TOLERANCE = 0.10            # ops to balance: every later iteration within 10 % of the median
LOSSY_PROBE_ITERATIONS = 8
LOSSY_PROBE_T_S = 1.0       # the lossy rail's own ring: iterations of about this long at its bound


# ------------------------------------------------------------------------------------ the draw
@dataclass(frozen=True)
class DrawOptions:
    """What may be drawn. Equal options and seed give the same shape, on any machine."""

    hosts: tuple[int, int] = (2, 6)
    rails: tuple[int, int] = (2, 16)
    sizes_mib: tuple[int, ...] = DEFAULT_SIZES_MIB
    cpu_budget_mbit: float = DEFAULT_CPU_BUDGET_MBIT
    loss: bool = True
    overrides: bool = True
    equal: bool = True
    jumbo: bool = True

    def cli_args(self) -> str:
        """The options that differ from the defaults, as `shapes` arguments (to rerun a seed)."""
        d = DrawOptions()
        out = []
        if self.hosts != d.hosts:
            out.append(f"--hosts {_range_text(self.hosts)}")
        if self.rails != d.rails:
            out.append(f"--rails {_range_text(self.rails)}")
        if self.sizes_mib != d.sizes_mib:
            out.append("--sizes " + ",".join(str(s) for s in self.sizes_mib))
        if self.cpu_budget_mbit != d.cpu_budget_mbit:
            out.append(f"--cpu-budget {self.cpu_budget_mbit:g}")
        for flag, on in (("--no-loss", self.loss), ("--no-override", self.overrides),
                         ("--no-equal", self.equal), ("--no-jumbo", self.jumbo)):
            if not on:
                out.append(flag)
        return " ".join(out)


@dataclass(frozen=True)
class RunOptions:
    """How each shape is run and judged (not part of the shape itself)."""

    iterations: int = 20
    warmup: int = 1
    steady_from: int = 10       # steady busbw = median over iterations with index >= this
    command: str | None = None
    systems: tuple[str, ...] = SYSTEMS   # without kernel MPTCP: nezha and single only
    # --pinned: also `stripe` with the split pinned at the optimum's proportions
    # (NEZHA_SHARES): the best a static split does, which tells the balancer's loss from the
    # transport's

    def cli_args(self) -> str:
        """The iteration options that differ from the defaults (they shape the emitted YAML)."""
        d = RunOptions()
        return " ".join(f"--{k} {getattr(self, k)}" for k in ("iterations", "warmup")
                        if getattr(self, k) != getattr(d, k))


@dataclass(frozen=True)
class DrawnRail:
    name: str
    mbit: int
    mtu: int = 1500
    loss_pct: float = 0.0


@dataclass(frozen=True)
class Drawn:
    """One drawn shape. Rails are named r0, r1, ... best first (the single-rail ring uses r0)."""

    seed: int
    hosts: int
    rails: tuple[DrawnRail, ...]
    size: int                                           # bytes per allreduce
    override: tuple[str, str, int] | None = None     # (host, rail, Mbit/s)
    equal: bool = False                                 # some rails were drawn equal
    options: DrawOptions = DrawOptions()

    @property
    def name(self) -> str:
        return f"shape-{self.seed}"

    @property
    def host_names(self) -> list[str]:
        return [f"h{i + 1}" for i in range(self.hosts)]

    def ring_mbit(self, rail: DrawnRail) -> int:
        """The rail's slowest link (an override on it slows both hops through that host)."""
        if self.override and self.override[1] == rail.name:
            return min(rail.mbit, self.override[2])
        return rail.mbit

    def bound_mbit(self, rail: DrawnRail) -> float:
        """The rail's clean ring goodput bound (loss not counted)."""
        return self.ring_mbit(rail) * goodput_factor(rail.mtu)

    @property
    def optimum_mbit(self) -> float:
        return sum(self.bound_mbit(r) for r in self.rails)

    def burst_share(self, size: int | None = None) -> float:
        """The share of one iteration's per-hop bytes that the rails' htb buckets, full after
        the idle time between iterations, pass at once (see ``burst_bits``): what the clean
        optimum leaves out, so sizes where it is small are preferred."""
        n = self.hosts
        volume = (size or self.size) * 8 * 2 * (n - 1) / n
        return sum(burst_bits(self.ring_mbit(r) * 1e6, r.mtu) for r in self.rails) / volume

    def iteration_s(self, rate_mbit: float, size: int | None = None) -> float:
        """Seconds for one ring allreduce of ``size`` bytes at a bus bandwidth of ``rate_mbit``."""
        n = self.hosts
        return (size or self.size) * 8 * 2 * (n - 1) / n / (rate_mbit * 1e6)

    @property
    def label(self) -> str:
        """Compact: '8r 25-400M eq ovr loss mtu9k'."""
        rates = [r.mbit for r in self.rails]
        lo, hi = min(rates), max(rates)
        parts = [f"{len(self.rails)}r", f"{lo}M" if lo == hi else f"{lo}-{hi}M"]
        if self.equal:
            parts.append("eq")
        if self.override:
            parts.append("ovr")
        if any(r.loss_pct for r in self.rails):
            parts.append("loss")
        if any(r.mtu == 9000 for r in self.rails):
            parts.append("mtu9k")
        return " ".join(parts)

    def only(self, rail_name: str, size: int) -> Drawn:
        """The same hosts with only one of the rails (to measure that rail's own ring)."""
        rail = next(r for r in self.rails if r.name == rail_name)
        ovr = self.override if self.override and self.override[1] == rail_name else None
        return replace(self, rails=(rail,), override=ovr, size=size)

    def estimate_s(self, run: RunOptions) -> float:
        """A rough wall time for the shape (lossy rails alone, compare, command): what the
        progress line promises. Per run about 8 s of build, analysis and plots."""
        ops = run.iterations + run.warmup
        t_opt = self.iteration_s(self.optimum_mbit)
        t_single = self.iteration_s(self.bound_mbit(self.rails[0]))
        total = 8.0 + ops * (2 * t_opt * (len(run.systems) - 1) + t_single + 0.1)
        lossy = sum(1 for r in self.rails if r.loss_pct)
        total += lossy * (8.0 + (LOSSY_PROBE_ITERATIONS + 1) * LOSSY_PROBE_T_S * 1.3)
        if run.command:
            total += 8.0 + ops * 2 * t_opt
        return total

    def to_yaml(self, run: RunOptions = RunOptions(), systems: Sequence[str] | None = None,
                name: str | None = None, command: str | None = None) -> str:
        """Topology text for the spec loader: the shape and a compare workload (or, with
        ``command``, the user's program as a command workload)."""
        ops = run.iterations + run.warmup
        t_single = self.iteration_s(self.bound_mbit(self.rails[0]))
        # per phase; a hung system must not hang the sweep, a slow one must not be cut short
        timeout = int(max(120.0, 4 * ops * t_single + 60))
        emit = " ".join(filter(None, [f"python -m testbed shapes --emit {self.seed}",
                                      self.options.cli_args(), run.cli_args()]))
        lines = [f"# drawn by: {emit}",
                 "# run it by hand: sudo ./tb run THIS_FILE",
                 f"name: {name or self.name}",
                 (f"description: 'randomized shape, seed {self.seed}: {self.hosts} hosts x "
                  f"{len(self.rails)} rails ({self.label})'"),
                 f"hosts: {self.hosts}",
                 "rails:"]
        for r in self.rails:
            item = [f"name: {r.name}", f"bandwidth: {r.mbit}mbit"]
            if r.mtu != 1500:
                item.append(f"mtu: {r.mtu}")
            if r.loss_pct:
                item.append(f"loss: {r.loss_pct:g}%")
            lines.append("  - {" + ", ".join(item) + "}")
        if self.override:
            host, rail, mbit = self.override
            lines += ["links:", f"  {host}.{rail}: {{bandwidth: {mbit}mbit}}"]
        lines.append("workload:")
        if command is not None:
            lines += ["  kind: command", f"  command: {json.dumps(command)}",
                      f"  timeout: {timeout}s"]
        else:
            lines += ["  kind: compare", f"  sizes: [{format_size(self.size)}]",
                      f"  systems: [{', '.join(systems or run.systems)}]",
                      f"  warmup: {run.warmup}",
                      f"  iterations: {run.iterations}", "  rounds: 1",
                      f"  timeout: {timeout}s"]
        return "\n".join(lines) + "\n"


def goodput_factor(mtu: int) -> float:
    """TCP payload per byte htb counts: MSS / (MTU + Ethernet header), MSS = MTU - 52 with TCP
    timestamps (1448/1514 = 0.956 at 1500, 8948/9014 = 0.993 at 9000). Measured here: the
    single-rail ring reaches 1.006x (MTU 1500) and 1.008x (9000) of this on 100 Mbit/s, 3 hosts
    (htb's burst gives a little extra per transfer)."""
    return (mtu - TCP_IP_HEADERS) / (mtu + ETH_HEADER)


def burst_bits(rate_bps: float, mtu: int) -> float:
    """Goodput bits a rail's hop passes at once when its htb buckets are full: the bucket
    (testbed.kernel.tc.htb_burst: 4 ms at the rate, at least two of the rail's GSO skbs, which
    are 2 ms at its slowest link: 6.4 ms worth at 10 Mbit/s) x the goodput factor. A real NIC
    has no such bucket; the testbed's shaper needs it to hold its rate with GSO (see tc.py)."""
    from testbed.kernel.tc import gso_size, htb_burst
    return htb_burst(int(rate_bps), mtu, gso_size(int(rate_bps), mtu)) * 8 * goodput_factor(mtu)


def _fit_budget(rates: Sequence[float], hosts: int, budget: float) -> list[int]:
    """Rates scaled down by one common factor so that hosts x sum <= budget, none below the
    floor (the floor then takes its share first: bisection on the factor), floored to Mbit/s."""
    def total(s: float) -> float:
        return hosts * sum(max(RATE_MIN_MBIT, r * s) for r in rates)
    s = 1.0
    if total(1.0) > budget:
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
        s = lo
    return [max(RATE_MIN_MBIT, int(r * s)) for r in rates]


def _pick_size(shape: Drawn, rng: random.Random, sizes_mib: Sequence[int]) -> int:
    """A size whose iteration at the optimum takes 0.1-2 s, of those preferably one where
    htb's bucket passes at most 5 % of it at once (else the largest: many slow rails, each
    with a 134 KB bucket, would beat the clean optimum on short iterations), and of those
    one where the single-rail ring takes at most 3 s (else the smallest: 20 iterations of 16
    equal rails on one rail would take 10 minutes). None in 0.1-2 s: the nearest."""
    sizes = [m * MIB for m in sorted(set(sizes_mib))]
    opt, best = shape.optimum_mbit, shape.bound_mbit(shape.rails[0])
    fits = [s for s in sizes if T_OPT_S[0] <= shape.iteration_s(opt, s) <= T_OPT_S[1]]
    if fits:
        clean = [s for s in fits if shape.burst_share(s) <= BURST_SHARE_MAX]
        if not clean:
            return fits[-1]
        quick = [s for s in clean if shape.iteration_s(best, s) <= T_SINGLE_MAX_S]
        return rng.choice(quick) if quick else clean[0]

    def distance(s: int) -> float:
        t = shape.iteration_s(opt, s)
        return math.log(T_OPT_S[0] / t) if t < T_OPT_S[0] else math.log(t / T_OPT_S[1])
    return min(sizes, key=distance)


def check_options(opts: DrawOptions) -> None:
    """Bad ranges are input errors (exit 2), named like the command-line option."""
    if not 2 <= opts.hosts[0] <= opts.hosts[1]:
        raise SpecError("--hosts", f"{_range_text(opts.hosts)}", "a range from 2 hosts up, "
                        "e.g. 2-4")
    if not 1 <= opts.rails[0] <= opts.rails[1] <= 64:
        raise SpecError("--rails", f"{_range_text(opts.rails)}", "a range within 1-64, e.g. 8-16")
    if not opts.sizes_mib or any(s < 1 for s in opts.sizes_mib):
        raise SpecError("--sizes", f"{opts.sizes_mib}", "sizes in MiB, e.g. 1,4,16")
    need = opts.hosts[1] * opts.rails[0] * RATE_MIN_MBIT
    if opts.cpu_budget_mbit < need:
        raise SpecError("--cpu-budget", f"{opts.cpu_budget_mbit:g} Mbit/s cannot hold "
                        f"{opts.hosts[1]} hosts x {opts.rails[0]} rails at {RATE_MIN_MBIT} Mbit/s",
                        f"at least {need} (hosts x rails x {RATE_MIN_MBIT}), or fewer hosts/rails")


def draw(seed: int, opts: DrawOptions = DrawOptions()) -> Drawn:
    """The shape of one seed. Rails are log-uniform 10-1000 Mbit/s, then scaled by one factor
    so that hosts x (sum of rails) fits the CPU budget (Python ranks on few cores move only so
    much: a shape the CPU cannot drive measures the CPU, not the balancer). Sometimes several
    rails are equal, one host's attachment to one rail is slowed to 1/2-1/10 of the rail, one rail
    (never the best) loses 0.5-2 % per link direction, some rails have MTU 9000. Rails are sorted
    by their clean ring bound, best first, and named r0.. in that order."""
    check_options(opts)
    rng = random.Random(seed)
    hosts = rng.randint(*opts.hosts)
    max_rails = int(opts.cpu_budget_mbit // (hosts * RATE_MIN_MBIT))
    n_rails = rng.randint(opts.rails[0], min(opts.rails[1], max_rails))
    lo, hi = math.log(RATE_MIN_MBIT), math.log(RATE_MAX_MBIT)
    rates = [math.exp(rng.uniform(lo, hi)) for _ in range(n_rails)]
    equal = False
    if opts.equal and n_rails >= 2 and rng.random() < P_EQUAL:
        group = rng.sample(range(n_rails), rng.randint(2, n_rails))
        for i in group:
            rates[i] = rates[group[0]]
        equal = True
    mbits = _fit_budget(rates, hosts, opts.cpu_budget_mbit)
    jumbo = opts.jumbo and rng.random() < P_JUMBO      # per shape, then per rail: a label
    mtus = [9000 if jumbo and rng.random() < 0.5 else 1500 for _ in range(n_rails)]
    rails = [DrawnRail(f"x{i}", m, mtu) for i, (m, mtu) in enumerate(zip(mbits, mtus))]
    override = None
    if opts.overrides and rng.random() < P_OVERRIDE:
        fast = [r for r in rails if r.mbit >= 2 * RATE_MIN_MBIT]
        if fast:
            rail = rng.choice(fast)
            host = rng.randrange(hosts)
            divisor = rng.uniform(OVERRIDE_DIVISOR[0],
                                  min(OVERRIDE_DIVISOR[1], rail.mbit / RATE_MIN_MBIT))
            override = (f"h{host + 1}", rail.name, int(rail.mbit / divisor))
    shape = Drawn(seed, hosts, tuple(rails), 0, override, equal, opts)
    order = sorted(rails, key=lambda r: -shape.bound_mbit(r))       # stable: ties keep order
    names = {r.name: f"r{i}" for i, r in enumerate(order)}
    rails = [replace(r, name=names[r.name]) for r in order]
    if override:
        override = (override[0], names[override[1]], override[2])
    if opts.loss and n_rails >= 2 and rng.random() < P_LOSS:
        i = rng.randrange(1, n_rails)                 # r0 stays clean: it is the single ring's
        rails[i] = replace(rails[i], loss_pct=round(rng.uniform(*LOSS_PCT), 1))
    shape = replace(shape, rails=tuple(rails), override=override)
    return replace(shape, size=_pick_size(shape, rng, opts.sizes_mib))


# ------------------------------------------------------------------------------------ optimum
@dataclass(frozen=True)
class RailBound:
    """One rail's ring: its slowest hop, as L2 rate and as TCP goodput."""

    rail: str
    wire_bps: float | None          # the slowest hop's rate (None: a hop is unshaped)
    bottleneck: str                    # the slowest hop, e.g. "h3->h4"
    factor: float                      # goodput per L2 byte at this rail's MTU
    lossy: bool = False
    measured_bps: float | None = None   # lossy rails: its own single-rail ring's busbw
    burst_bits: float = 0.0            # passed at once by the hop's full htb buckets

    @property
    def goodput_bps(self) -> float | None:
        return None if self.wire_bps is None else self.wire_bps * self.factor

    @property
    def achievable_bps(self) -> float | None:
        """The clean bound, or what the rail's own ring measured if that is lower (loss)."""
        g = self.goodput_bps
        if g is not None and self.measured_bps is not None:
            return min(g, self.measured_bps)
        return g

    def to_dict(self) -> dict:
        mb = (lambda v: None if v is None else round(v / 1e6, 3))
        return {"rail": self.rail, "wire_mbps": mb(self.wire_bps), "bottleneck": self.bottleneck,
                "factor": round(self.factor, 5), "goodput_mbps": mb(self.goodput_bps),
                "lossy": self.lossy, "measured_mbps": mb(self.measured_bps),
                "achievable_mbps": mb(self.achievable_bps),
                "burst_kbit": round(self.burst_bits / 1e3, 1)}


@dataclass(frozen=True)
class Optimum:
    rails: tuple[RailBound, ...]

    def _sum(self, attr: str) -> float | None:
        vals = [getattr(r, attr) for r in self.rails]
        return None if any(v is None for v in vals) else float(sum(vals))

    @property
    def wire_sum_bps(self) -> float | None:
        """Sum of the rails' slowest hops, before the goodput factor."""
        return self._sum("wire_bps")

    @property
    def sum_bps(self) -> float | None:
        """The optimum bus bandwidth: sum over rails of what each rail's ring can carry."""
        return self._sum("achievable_bps")

    def rail(self, name: str) -> RailBound:
        return next(r for r in self.rails if r.rail == name)

    def with_burst_bps(self, size: int, hosts: int) -> float | None:
        """The optimum for one ``size`` allreduce when every hop's htb buckets start full (the
        most the shaper can give): T = (per-hop bits - sum of bursts) / sum of rates. None if
        unshaped, or if the buckets alone could carry the whole message."""
        total = self.sum_bps
        if total is None or hosts < 2:
            return None
        volume = size * 8 * 2 * (hosts - 1) / hosts
        t = (volume - sum(r.burst_bits for r in self.rails)) / total
        return volume / t if t > 0 else None


def _direction_rates(topo: Topology, host: str, rail: str) -> tuple[int | None, int | None]:
    """(egress, ingress) rate of a host's link on a rail. The fabric shapes both directions of
    a link with the link's shape (host -> switch on the host's veth, switch -> host on the switch
    port; testbed.fabric.Fabric._configure), overrides included (the spec resolves them into the
    link's shape; with direct wiring onto both hosts' ends of the cable)."""
    shape = topo.link(host, rail).shape
    return shape.rate_bps, shape.rate_bps


def optimum(topo: Topology, measured: Mapping[str, float] | None = None,
            hosts: Sequence[str] | None = None) -> Optimum:
    """Bottleneck-aware optimum of a ring allreduce over all rails. On rail r every hop
    i -> i+1 carries the same bytes, so the ring runs at its slowest hop:
    rate_r = min over hops of min(egress of host i's link, ingress of host i+1's link); its bus
    bandwidth is that hop's TCP goodput (x MSS/(MTU+14)). The optimum is the sum over rails
    (an upper bound: a balancer may rightly leave a very slow rail idle). ``measured``: per
    lossy rail, its own single-rail ring's busbw in bit/s; that rail counts min(bound,
    measured), since no TCP reaches the clean bound through loss. ``hosts``: the ring, in rank
    order (default: every host of the topology)."""
    ring = list(hosts or topo.hosts)
    measured = measured or {}
    out = []
    for rail in topo.rails:
        worst: float | None = math.inf
        where = ""
        for i, a in enumerate(ring):
            b = ring[(i + 1) % len(ring)]
            if a == b:
                continue
            eg, _ = _direction_rates(topo, a, rail.name)
            _, ing = _direction_rates(topo, b, rail.name)
            hop = min(math.inf if eg is None else eg, math.inf if ing is None else ing)
            if worst is not None and hop < worst:
                worst, where = hop, f"{a}->{b}"
        wire = None if worst is None or math.isinf(worst) else float(worst)
        lossy = any(topo.link(h, rail.name).shape.loss > 0 for h in ring)
        burst = burst_bits(wire, rail.mtu) if wire is not None else 0.0
        out.append(RailBound(rail.name, wire, where, goodput_factor(rail.mtu), lossy,
                             measured.get(rail.name), burst))
    return Optimum(tuple(out))


# ------------------------------------------------------------------------------------ judging
def steady_busbw(iterations: Sequence[dict], system: str | None, steady_from: int
                 ) -> tuple[float | None, int]:
    """(median busbw in Mbit/s, count) over one system's complete iterations with index >=
    ``steady_from`` (the worker's index counts every operation from 0, warm-up included): the
    same window for every system, so a system that balances late pays for it and none is
    judged on its first operations. ``system`` None: every row (a command workload)."""
    vals = [r["busbw_mbps"] for r in iterations
            if (system is None or r.get("system") == system) and r.get("complete")
            and isinstance(r.get("iter"), int) and r["iter"] >= steady_from
            and r.get("busbw_mbps")]
    return (statistics.median(vals) if vals else None), len(vals)


def ops_to_balance(iterations: Sequence[dict], system: str, steady_from: int,
                   tolerance: float = TOLERANCE) -> int | None:
    """The first iteration index from which every iteration's time is within ``tolerance`` of
    the steady median time (iterations >= ``steady_from``); None if the last one is not."""
    rows = sorted((r for r in iterations if r.get("system") == system and r.get("complete")
                   and isinstance(r.get("iter"), int) and r.get("latency_ms")),
                  key=lambda r: r["iter"])
    steady = [r["latency_ms"] for r in rows if r["iter"] >= steady_from]
    if not steady:
        return None
    med = statistics.median(steady)
    first = None
    for r in reversed(rows):
        if abs(r["latency_ms"] - med) > tolerance * med:
            break
        first = r["iter"]
    return first


@dataclass
class ShapeRow:
    """One shape's result. busbw in Mbit/s per system (and "command" with --command)."""

    seed: int
    hosts: int
    rails: int
    label: str
    size: int
    yaml: str = ""
    optimum_mbps: float | None = None
    wire_sum_mbps: float | None = None
    optimum_burst_mbps: float | None = None     # the optimum if htb's buckets start full
    rail_bounds: list[dict] = field(default_factory=list)
    busbw_mbps: dict[str, float | None] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)
    ops_to_balance: int | None = None
    pinned_shares: list[float] = field(default_factory=list)   # --pinned: NEZHA_SHARES
    seconds: float = 0.0
    results_dir: str = ""
    error: str | None = None          # the shape did not run (fabric, spec, crash)
    problems: list[str] = field(default_factory=list)   # it ran, but a rank failed or erred

    def ratio(self, num: str, den: str) -> float | None:
        """busbw ratio of two systems; "optimum" as the denominator means the optimum."""
        a = self.busbw_mbps.get(num)
        b = self.optimum_mbps if den == "optimum" else self.busbw_mbps.get(den)
        if a is None or not b:
            return None
        return a / b

    @property
    def ratios(self) -> dict[str, float | None]:
        pairs = [("nezha", "optimum"), ("single", "optimum"), ("mptcp", "optimum"),
                 ("nezha", "single"), ("nezha", "mptcp")]
        if "command" in self.busbw_mbps:
            pairs += [("command", "optimum"), ("command", "nezha")]
        if "stripe" in self.busbw_mbps:
            pairs += [("stripe", "optimum"), ("nezha", "stripe")]
        return {f"{a}/{b}": self.ratio(a, b) for a, b in pairs}

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d["ratios"] = self.ratios
        return d


def _rank_problems(results_dir: Path, systems: Sequence[str]) -> list[str]:
    """Ranks that exited non-zero, by system (phase i of a one-size compare is systems[i])."""
    try:
        ranks = json.loads((results_dir / "ranks.json").read_text())
    except (OSError, ValueError):
        return []
    out = []
    for r in ranks:
        if r.get("exit_code") not in (0, None) and not r.get("killed"):
            phase = r.get("phase", 0)
            system = systems[phase] if isinstance(phase, int) and phase < len(systems) else "?"
            out.append(f"{system} rank {r.get('rank')} on {r.get('host')} exited "
                       f"{r.get('exit_code')}: {(r.get('error') or '')[-200:]}")
    return out


def _run(yaml_text: str, out: Path, log: Callable[[str], None],
         env: Mapping[str, str] | None = None):
    """One run through the testbed's own runner (teardown on any exit, Ctrl-C included);
    ``env``: variables every rank gets (the ranks inherit this process's environment)."""
    import os
    from testbed.model import spec
    from testbed.run.runner import run_topology
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return run_topology(spec.loads(yaml_text), out, say=log)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _pinned_env(bound: "Optimum", run: RunOptions) -> dict[str, str]:
    """NEZHA_SHARES for `stripe` (--pinned): each rail in proportion to what its ring can
    carry on this shape (a rail without a bound, unshaped, gets an equal weight of the rest)."""
    if "stripe" not in run.systems:
        return {}
    rates = [r.achievable_bps or 0.0 for r in bound.rails]
    fill = max(rates) if any(rates) else 1.0
    return {"NEZHA_SHARES": ",".join(f"{(x or fill) / 1e6:.3f}" for x in rates)}


def _probe_size(shape: Drawn, rail: DrawnRail) -> int:
    """A lossy rail's own ring: the largest power-of-two MiB up to the shape's size whose
    iteration takes about LOSSY_PROBE_T_S at the rail's clean bound (at least 1 MiB)."""
    size = MIB
    while size * 2 <= shape.size and \
            shape.iteration_s(shape.bound_mbit(rail), size * 2) <= LOSSY_PROBE_T_S:
        size *= 2
    return size


def measure_lossy(shape: Drawn, out: Path, log: Callable[[str], None]) -> dict[str, float]:
    """busbw (bit/s) of each lossy rail's own single-rail ring, on a copy of the shape holding
    only that rail: median over its timed iterations."""
    measured: dict[str, float] = {}
    for rail in shape.rails:
        if not rail.loss_pct:
            continue
        probe = shape.only(rail.name, _probe_size(shape, rail))
        text = probe.to_yaml(RunOptions(iterations=LOSSY_PROBE_ITERATIONS, warmup=1),
                             systems=("single",), name=f"{shape.name}-{rail.name}-alone")
        outcome = _run(text, out / f"seed-{shape.seed}.lossy-{rail.name}", log)
        bw, _ = steady_busbw(outcome.metrics.detail.get("iterations", []), "single", 1)
        if bw is None:
            raise TestbedError(f"the lossy rail {rail.name} alone completed no iteration")
        measured[rail.name] = bw * 1e6
    return measured


def run_shape(shape: Drawn, run: RunOptions, out: Path, log: Callable[[str], None]) -> ShapeRow:
    """Measure the lossy rails alone, then the compare run (and the user's command) on the
    shape; the row with the optimum, each system's steady busbw and Nezha's ops to balance."""
    from testbed.model import spec
    row = ShapeRow(shape.seed, shape.hosts, len(shape.rails), shape.label, shape.size,
                   yaml=shape.to_yaml(run))
    t0 = time.monotonic()
    seed_dir = out / f"seed-{shape.seed}"
    row.results_dir = str(seed_dir)
    try:
        seed_dir.mkdir(parents=True, exist_ok=True)
        (seed_dir / "shape.yaml").write_text(row.yaml)
        measured = measure_lossy(shape, out, log)
        bound = optimum(spec.loads(row.yaml), measured)
        row.rail_bounds = [r.to_dict() for r in bound.rails]
        row.optimum_mbps = bound.sum_bps / 1e6 if bound.sum_bps else None
        row.wire_sum_mbps = bound.wire_sum_bps / 1e6 if bound.wire_sum_bps else None
        with_burst = bound.with_burst_bps(shape.size, shape.hosts)
        row.optimum_burst_mbps = with_burst / 1e6 if with_burst else None
        outcome = _run(row.yaml, seed_dir, log, _pinned_env(bound, run))
        its = outcome.metrics.detail.get("iterations", [])
        for system in run.systems:
            row.busbw_mbps[system], row.samples[system] = steady_busbw(its, system,
                                                                       run.steady_from)
            if row.busbw_mbps[system] is None:
                row.problems.append(f"{system}: no complete iteration >= {run.steady_from}")
        row.ops_to_balance = ops_to_balance(its, "nezha", run.steady_from)
        row.problems += _rank_problems(seed_dir, run.systems)
        if outcome.metrics["wrong_results"]:
            row.problems.append(f"{outcome.metrics['wrong_results']} wrong results")
        if "stripe" in run.systems:
            row.pinned_shares = [round(r.achievable_bps / 1e6, 3) if r.achievable_bps else 0.0
                                 for r in bound.rails]
        if run.command:
            cmd = expand_command(run.command, shape, run)
            cdir = out / f"seed-{shape.seed}.command"
            c_out = _run(shape.to_yaml(run, command=cmd), cdir, log)
            c_its = c_out.metrics.detail.get("iterations", [])
            row.busbw_mbps["command"], row.samples["command"] = steady_busbw(
                c_its, None, run.steady_from)
            if row.busbw_mbps["command"] is None:
                row.problems.append(f"command: no iteration line with iter >= "
                                    f"{run.steady_from} in NEZHA_RESULTS")
            row.problems += _rank_problems(cdir, ["command"])
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - one broken shape is a row, not the end of a sweep
        row.error = f"{type(e).__name__}: {e}"
        log(traceback.format_exc())
    row.seconds = time.monotonic() - t0
    return row


def expand_command(command: str, shape: Drawn, run: RunOptions) -> str:
    """{bytes}, {iterations}, {warmup} in the user's command become this shape's values."""
    return (command.replace("{bytes}", str(shape.size))
            .replace("{iterations}", str(run.iterations))
            .replace("{warmup}", str(run.warmup)))


# ------------------------------------------------------------------------------------ output
def _f(v: float | None, spec_: str = ".1f", width: int = 7) -> str:
    return f"{'-' if v is None else format(v, spec_):>{width}}"


def header(command: bool = False, pinned: bool = False) -> str:
    h = (f"{'seed':>5} {'h':>2} {'rails':<26} {'size':>6} {'optimum':>7} {'nezha':>7} "
         f"{'single':>7} {'mptcp':>7} {'n/opt':>6} {'n/sgl':>6} {'n/mptcp':>7} {'ops':>4}")
    if command:
        h += f" {'command':>7} {'c/opt':>6}"
    if pinned:
        h += f" {'pinned':>7} {'n/pin':>6}"
    return h + f" {'secs':>5}"


def format_row(row: ShapeRow, command: bool = False, pinned: bool = False) -> str:
    b, r = row.busbw_mbps, row.ratios
    s = (f"{row.seed:>5} {row.hosts:>2} {row.label:<26.26} {format_size(row.size):>6} "
         f"{_f(row.optimum_mbps)} {_f(b.get('nezha'))} {_f(b.get('single'))} "
         f"{_f(b.get('mptcp'))} {_f(r['nezha/optimum'], '.3f', 6)} "
         f"{_f(r['nezha/single'], '.2f', 6)} {_f(r['nezha/mptcp'], '.2f', 7)} "
         f"{_f(row.ops_to_balance, 'd', 4)}")
    if command:
        s += f" {_f(b.get('command'))} {_f(r.get('command/optimum'), '.3f', 6)}"
    if pinned:
        s += f" {_f(b.get('stripe'))} {_f(r.get('nezha/stripe'), '.3f', 6)}"
    s += f" {row.seconds:>5.0f}"
    if row.error:
        s += f"\n      FAILED: {row.error}"
    for p in row.problems:
        s += f"\n      ! {p}"
    return s


def summarize(rows: Sequence[ShapeRow], interrupted: bool = False) -> dict:
    """Median and worst nezha/optimum, where nezha loses to the single rail, the worst seeds."""
    done = [r for r in rows if r.ratio("nezha", "optimum") is not None]

    def med(key: str) -> float | None:
        v = [x.ratios[key] for x in rows if x.ratios.get(key) is not None]
        return statistics.median(v) if v else None
    worst = sorted(done, key=lambda r: r.ratio("nezha", "optimum"))[:5]
    ops = [r.ops_to_balance for r in done if r.ops_to_balance is not None]
    return {
        "shapes": len(rows), "measured": len(done), "interrupted": interrupted,
        "failed_seeds": [r.seed for r in rows if r.error],
        "seeds_with_problems": [r.seed for r in rows if r.problems and not r.error],
        "nezha/optimum": {"median": med("nezha/optimum"),
                          "worst": worst[0].ratio("nezha", "optimum") if worst else None},
        "single/optimum_median": med("single/optimum"),
        "mptcp/optimum_median": med("mptcp/optimum"),
        "nezha/single_median": med("nezha/single"),
        "nezha/mptcp_median": med("nezha/mptcp"),
        "pinned/optimum_median": med("stripe/optimum"),
        "nezha/pinned_median": med("nezha/stripe"),
        "nezha_below_single": [r.seed for r in done
                               if (r.ratio("nezha", "single") or math.inf) < 1],
        "ops_to_balance_median": statistics.median(ops) if ops else None,
        "never_balanced_seeds": [r.seed for r in done if r.ops_to_balance is None],
        "worst_seeds": [{"seed": r.seed, "label": r.label,
                         "nezha/optimum": r.ratio("nezha", "optimum")} for r in worst],
    }


def format_summary(s: dict) -> str:
    f3 = (lambda v: "-" if v is None else f"{v:.3f}")
    lines = [f"== {s['measured']} of {s['shapes']} shapes measured"
             + (" (interrupted)" if s["interrupted"] else "")
             + (f"; failed seeds: {', '.join(map(str, s['failed_seeds']))}"
                if s["failed_seeds"] else "")]
    if s["seeds_with_problems"]:
        lines.append(f"   rank errors or missing systems in seeds "
                     f"{', '.join(map(str, s['seeds_with_problems']))}")
    if s["measured"]:
        lines += [
            (f"   nezha/optimum: median {f3(s['nezha/optimum']['median'])}, "
             f"worst {f3(s['nezha/optimum']['worst'])}   (single/optimum median "
             f"{f3(s['single/optimum_median'])}, mptcp/optimum median "
             f"{f3(s['mptcp/optimum_median'])})"),
            f"   nezha/single median {f3(s['nezha/single_median'])}, nezha/mptcp median "
            f"{f3(s['nezha/mptcp_median'])}; ops to balance median "
            f"{s['ops_to_balance_median'] if s['ops_to_balance_median'] is not None else '-'}"
            + (f", never within {TOLERANCE:.0%}: seeds "
               f"{', '.join(map(str, s['never_balanced_seeds']))}"
               if s["never_balanced_seeds"] else ""),
            *([f"   pinned split (stripe at the optimum's proportions): /optimum median "
               f"{f3(s['pinned/optimum_median'])}; nezha/pinned median "
               f"{f3(s['nezha/pinned_median'])}"] if s.get("pinned/optimum_median") else []),
            f"   nezha < single in {len(s['nezha_below_single'])} shapes"
            + (f": seeds {', '.join(map(str, s['nezha_below_single']))}"
               if s["nezha_below_single"] else ""),
            "   worst seeds: " + ", ".join(f"{w['seed']} ({w['label']}: "
                                           f"{f3(w['nezha/optimum'])})"
                                           for w in s["worst_seeds"])]
    return "\n".join(lines)


def write_json(path: Path, rows: Sequence[ShapeRow], draw_opts: DrawOptions, run: RunOptions,
               interrupted: bool = False) -> None:
    """Every row (the shape's YAML included), the options and the summary; rewritten after
    each shape, so an interrupted sweep keeps what finished."""
    from testbed.model.records import jsonable
    doc = {"draw_options": draw_opts.__dict__, "run_options": run.__dict__,
           "rerun": " ".join(filter(None, ["python -m testbed shapes --emit SEED",
                                           draw_opts.cli_args(), run.cli_args()])),
           "summary": summarize(rows, interrupted), "rows": [r.to_dict() for r in rows]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(jsonable(doc), indent=1))
    tmp.replace(path)


def plot(path: Path, rows: Sequence[ShapeRow]) -> Path | None:
    """Left: CDF over shapes of busbw/optimum per system. Right: every shape, sorted by
    nezha/optimum, with the other systems' ratios on the same shape."""
    measured = [r for r in rows if r.ratio("nezha", "optimum") is not None]
    if not measured:
        return None
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    systems = ["nezha", "single", "mptcp"] + [s for s in ("stripe", "command") if any(
        s in r.busbw_mbps for r in rows)]
    label = {"stripe": "pinned split"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in systems:
        v = sorted(x for x in (r.ratio(s, "optimum") for r in rows) if x is not None)
        if v:
            ax1.step([0.0] + v, [0.0] + [(i + 1) / len(v) for i in range(len(v))],
                     where="post",
                     label=f"{label.get(s, s)} (median {statistics.median(v):.2f})")
    ax1.set_xlabel("busbw / optimum")
    ax1.set_ylabel("fraction of shapes <= x")
    ax1.set_xlim(0, max(1.1, ax1.get_xlim()[1]))
    ax1.set_ylim(0, 1.02)
    ax1.axvline(1.0, color="grey", lw=0.8, ls=":")
    ax1.legend(loc="upper left")
    ax1.set_title(f"{len(measured)} shapes")
    order = sorted(measured, key=lambda r: r.ratio("nezha", "optimum"))
    xs = range(len(order))
    for s, marker in zip(systems, "os^xd"):
        ax2.plot(xs, [r.ratio(s, "optimum") or math.nan for r in order], marker, ms=4,
                 ls="-" if s == "nezha" else "", label=label.get(s, s))
    ax2.set_xticks(list(xs))
    ax2.set_xticklabels([str(r.seed) for r in order], rotation=90,
                        fontsize=7 if len(order) <= 60 else 4)
    ax2.set_xlabel("seed (sorted by nezha / optimum)")
    ax2.set_ylabel("busbw / optimum")
    ax2.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax2.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------ the loop
def sweep(seeds: Sequence[int], draw_opts: DrawOptions, run: RunOptions, out: Path,
          json_path: Path, show: Callable[[str], None] = print,
          note: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)
          ) -> tuple[list[ShapeRow], bool]:
    """Every seed in turn: a row as each shape finishes, JSON after each. Ctrl-C ends the
    sweep (the runner has torn the fabric down by then) and keeps what finished."""
    out.mkdir(parents=True, exist_ok=True)
    rows: list[ShapeRow] = []
    interrupted = False
    show(header(bool(run.command), "stripe" in run.systems))
    try:
        for seed in seeds:
            shape = draw(seed, draw_opts)
            note(f"   seed {seed}: {shape.hosts} hosts x {len(shape.rails)} rails "
                 f"({shape.label}), {format_size(shape.size)}, clean optimum "
                 f"{shape.optimum_mbit:.0f} Mbit/s; about {shape.estimate_s(run):.0f} s if "
                 "the systems run near it")
            with open(out / f"seed-{seed}.log", "a") as logf:
                def log(msg: str, _f=logf) -> None:
                    print(msg, file=_f, flush=True)
                row = run_shape(shape, run, out, log)
            rows.append(row)
            show(format_row(row, bool(run.command), "stripe" in run.systems))
            write_json(json_path, rows, draw_opts, run)
    except KeyboardInterrupt:
        interrupted = True
        note("   interrupted: the fabric was torn down; summary of what finished")
    write_json(json_path, rows, draw_opts, run, interrupted)
    return rows, interrupted


# ------------------------------------------------------------------------------------ CLI
def _range_text(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"


def parse_range(text: str, option: str) -> tuple[int, int]:
    """'2-4' -> (2, 4); '3' -> (3, 3)."""
    try:
        a, sep, b = text.partition("-")
        lo = int(a)
        hi = int(b) if sep else lo
    except ValueError:
        raise SpecError(option, f"{text!r} is not a range", "N or N-M, e.g. 2-4") from None
    if lo > hi:
        raise SpecError(option, f"{text!r} is empty", "N-M with N <= M")
    return lo, hi


def parse_seeds(text: str) -> list[int]:
    """'0-49' or '3,7,12' or a mix ('0-4,9'), in the order given, without repeats."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, hi = parse_range(part, "--seeds")
        if lo < 0:
            raise SpecError("--seeds", f"{part!r}", "non-negative seeds")
        out += [s for s in range(lo, hi + 1) if s not in out]
    if not out:
        raise SpecError("--seeds", f"{text!r}", "seeds such as 0-49 or 3,7,12")
    return out


def parse_sizes(text: str) -> tuple[int, ...]:
    """'1,4,16' or '1MiB,4MiB' -> sizes in MiB."""
    out = []
    for part in text.split(","):
        p = part.strip().lower().removesuffix("mib")
        if not p:
            continue
        try:
            out.append(int(p))
        except ValueError:
            raise SpecError("--sizes", f"{part!r} is not a size in MiB",
                            "whole MiB, e.g. 1,4,16 or 1MiB,16MiB") from None
    return tuple(sorted(set(out)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `shapes` verb's options (registered by testbed.cli)."""
    p.add_argument("--seeds", default="0-9", help="seeds to draw: 0-49, 3,7,12 (default 0-9)")
    p.add_argument("--emit", type=int, metavar="SEED",
                   help="print the topology YAML of one seed and exit (nothing is built)")
    p.add_argument("--hosts", default="2-6", help="host count range (default 2-6)")
    p.add_argument("--rails", default="2-16", help="rail count range (default 2-16)")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES_MIB)),
                   help="message sizes to pick from, MiB (default 1,2,4,8,16,32,64)")
    p.add_argument("--cpu-budget", type=float, default=DEFAULT_CPU_BUDGET_MBIT,
                   metavar="MBIT", help="hosts x (sum of rail rates) at most this, Mbit/s "
                   f"(default {DEFAULT_CPU_BUDGET_MBIT:g}: 2 cores)")
    p.add_argument("--no-loss", action="store_true", help="never draw a lossy rail")
    p.add_argument("--no-override", action="store_true", help="never draw a per-link override")
    p.add_argument("--no-equal", action="store_true", help="never draw equal rails on purpose")
    p.add_argument("--no-jumbo", action="store_true", help="MTU 1500 on every rail")
    p.add_argument("--iterations", type=int, default=20,
                   help="timed iterations per system (default 20)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first (default 1)")
    p.add_argument("--steady-from", type=int, metavar="K",
                   help="steady busbw = median over iterations with index >= K (default 10, or "
                   "half the operations if fewer; index 0 is the first operation, warm-up "
                   "included)")
    p.add_argument("--command", dest="user_command", metavar="CMD",
                   help="also run your program on each shape ({bytes}, {iterations}, {warmup} "
                   "are replaced) and report its busbw next to nezha")
    p.add_argument("--pinned", action="store_true",
                   help="also run `stripe` with the split pinned at the optimum's proportions "
                   "(NEZHA_SHARES): the best static split, next to Nezha's balancer")
    p.add_argument("--results", help="folder (default results/shapes-TIMESTAMP)")
    p.add_argument("--json", help="rows as JSON (default RESULTS/shapes.json)")
    p.add_argument("--plot", help="distribution plot (default RESULTS/shapes.png)")


def options_from(args) -> tuple[DrawOptions, RunOptions]:
    d = DrawOptions(hosts=parse_range(args.hosts, "--hosts"),
                    rails=parse_range(args.rails, "--rails"),
                    sizes_mib=parse_sizes(args.sizes), cpu_budget_mbit=args.cpu_budget,
                    loss=not args.no_loss, overrides=not args.no_override,
                    equal=not args.no_equal, jumbo=not args.no_jumbo)
    check_options(d)
    steady_from = args.steady_from
    if steady_from is None:
        steady_from = min(RunOptions.steady_from, (args.iterations + args.warmup) // 2)
    r = RunOptions(iterations=args.iterations, warmup=args.warmup,
                   steady_from=steady_from, command=args.user_command,
                   systems=SYSTEMS + (("stripe",) if getattr(args, "pinned", False) else ()))
    if r.iterations < 1 or r.warmup < 0:
        raise SpecError("--iterations", f"{r.iterations} (warmup {r.warmup})",
                        "at least 1 iteration and a non-negative warmup")
    if not 0 <= r.steady_from < r.iterations + r.warmup:
        raise SpecError("--steady-from", str(r.steady_from),
                        f"an iteration index from 0 to {r.iterations + r.warmup - 1}")
    return d, r


def main(args) -> int:
    """The `shapes` verb: --emit prints one shape; otherwise the sweep, rows, summary, plot."""
    import os
    draw_opts, run = options_from(args)
    if args.emit is not None:
        sys.stdout.write(draw(args.emit, draw_opts).to_yaml(run))
        return 0
    seeds = parse_seeds(args.seeds)
    if os.geteuid() != 0:
        raise TestbedError("network namespaces need root: run with sudo (or as root)")
    from testbed.kernel.capabilities import probe
    caps = probe()
    if not caps.mptcp:
        run = replace(run, systems=tuple(s for s in run.systems if s != "mptcp"))
        print(f"   no kernel MPTCP here ({caps.details.get('mptcp')}): nezha and single only",
              file=sys.stderr)
    out = Path(args.results or Path("results") / f"shapes-{time.strftime('%Y%m%d-%H%M%S')}")
    json_path = Path(args.json) if args.json else out / "shapes.json"
    print(f"== shapes: seeds {args.seeds} ({len(seeds)} shapes), systems "
          f"{', '.join(run.systems)}{' + command' if run.command else ''}; results in {out}",
          file=sys.stderr, flush=True)
    rows, interrupted = sweep(seeds, draw_opts, run, out, json_path)
    print(format_summary(summarize(rows, interrupted)))
    png = plot(Path(args.plot) if args.plot else out / "shapes.png", rows)
    print(f"   rows: {json_path}" + (f"; plot: {png}" if png else ""))
    emit = " ".join(filter(None, ["python -m testbed shapes --emit SEED", draw_opts.cli_args(),
                                  run.cli_args()]))
    print(f"   rerun one shape: {emit} > shape.yaml && sudo ./tb run shape.yaml")
    if interrupted:
        return 130
    return 1 if any(r.error for r in rows) else 0
