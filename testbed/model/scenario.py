"""The scenario sections of a topology file: workload, faults, expect, capture.

Parsed into typed records at validation time, so that a typo in a fault at t=55 s is an error
before the first namespace exists, not a crash a minute into a run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from nezha.kinds import ALL_SYSTEMS as SYSTEMS, DTYPES, OPS
from testbed.errors import SpecError, quote
from testbed.model.train_spec import TRAIN_KEYS, parse_train
from testbed.model.units import (MAX_CAPTURE_MB, MAX_DELAY_S, MAX_FLAP_STEPS,
                                 MAX_PHASES, MAX_ROUNDS, MIN_FLAP_PERIOD_S, format_duration,
                                 format_rate, format_size, parse_choice as _choice,
                                 parse_duration, parse_int as _int, parse_percent,
                                 parse_rate, parse_size)

WORKLOAD_KINDS = ("allreduce", "sweep", "compare", "command", "train", "none")
ENDS = ("host", "switch", "both")
PROTOS = ("tcp", "udp")      # a traffic fault's flows

# action -> (allowed target kinds, keys it takes besides at/action/target)
FAULT_ACTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "link-down": (("link", "rail", "host"), ("for", "end")),
    "link-up":   (("link", "rail", "host"), ("end",)),
    "rate":      (("link", "rail", "host"), ("value", "for")),
    "loss":      (("link", "rail", "host"), ("value", "for")),
    "delay":     (("link", "rail", "host"), ("value", "jitter", "for")),
    "blackhole": (("link", "rail", "host"), ("for",)),
    "flap":      (("link", "rail", "host"), ("period", "for", "end")),
    "kill":      (("host", "rail"), ("signal", "for")),   # rail: its aggregation switch
    "traffic":   (("rail",), ("value", "for", "between", "proto")),
}

# metric -> (unit, what it is); the verdict module computes them, README defines them.
METRICS: dict[str, str] = {
    "failover_ms": "ms from a rail fault to steady traffic on the surviving rails (worst fault)",
    "detection_ms": "ms from a rail fault to Nezha's rail-down event (worst fault)",
    "recovery_ms": "ms from link-up to the rail carrying its share again (worst fault)",
    "wrong_results": "iterations whose result differed from the expected value",
    "iterations_lost": "iterations started but not completed by every rank",
    "iterations": "iterations completed by every rank",
    "busbw_mbps": "median bus bandwidth of the workload, Mbit/s",
    "busbw_vs_single_rail": "Nezha bus bandwidth / single-rail bus bandwidth (compare)",
    "busbw_vs_rail_sum": "bus bandwidth / sum of the rails' nominal rates",
    "aggregation_rejoin_ms": "ms from an aggregation rail's return (a kill's restart, a link's "
                             "return) until Nezha gives its switch a share again (worst fault)",
    "busbw_vs_mptcp": "Nezha bus bandwidth / MPTCP's at the largest size both ran (compare)",
    "rank_errors": "ranks that exited with an error",
    "adaptation_ms": "ms from a rail's change (rate, traffic, return) until Nezha's split is "
                     "within 10 % of the new optimum split (worst change)",
    "step_time_ms": "train: median over the steps after warm-up of the slowest rank's step, ms",
    "samples_per_s": "train: samples of all ranks per second over the steps after warm-up",
    "loss_final": "train: the loss of the last step",
    "loss_matches_reference": "train: every rank's loss at every step equals the other ranks' "
                              "and the reference's (1 true, 0 false)",
}
BOOL_METRICS = ("loss_matches_reference",)   # expect: {loss_matches_reference: true}
SHARE_PREFIX = "rail_share."   # rail_share.r0: {min: 0.7, max: 0.8}
SIZED_PREFIX = "busbw_vs_single_rail."   # busbw_vs_single_rail.16MiB: {min: 1.8} (compare)


@dataclass(frozen=True)
class Fault:
    at: float
    action: str
    target: str
    target_kind: str                 # link | rail | host
    value: Any = None                # rate (bit/s), loss (fraction), delay (s)
    duration: Optional[float] = None  # 'for': the fault's end restores what it changed
    end: str = "both"
    period: Optional[float] = None
    jitter: float = 0.0
    signal: str = "KILL"
    index: int = 0
    between: tuple[str, ...] = ()     # traffic: the hosts whose flows load the rail (a ring)
    proto: str = "tcp"                # traffic: tcp | udp

    @property
    def label(self) -> str:
        if self.action == "traffic":
            hosts = f" between {','.join(self.between)}" if self.between else ""
            return f"traffic {self.target} {format_rate(self.value)} {self.proto}{hosts}"
        v = f" {self.value}" if self.value is not None else ""
        return f"{self.action} {self.target}{v}"


@dataclass(frozen=True)
class Workload:
    kind: str = "allreduce"
    size: int = 16 << 20
    sizes: tuple[int, ...] = ()
    duration: Optional[float] = None
    iterations: Optional[int] = None
    warmup: int = 0           # iterations run and verified first, left out of timings and shares
    rounds: int = 1           # compare: the systems take turns this many times per size
    system: str = "nezha"
    systems: tuple[str, ...] = ()
    dtype: str = "float32"
    op: str = "sum"
    hosts: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    timeout: float = 120.0
    # kind: train (testbed/model/train_spec.py)
    model: str = "mlp"
    params: int = 1_000_000
    steps: int = 20
    batch: int = 8
    backends: tuple[str, ...] = ("nezha",)
    seed: int = 0
    data: str = "synthetic"
    reference: str = "auto"              # auto | none | a path
    reference_losses: tuple[tuple[str, tuple[float, ...]], ...] = ()   # from the path


@dataclass(frozen=True)
class Expectation:
    metric: str
    min: Optional[float] = None
    max: Optional[float] = None

    def holds(self, value: Optional[float]) -> bool:
        if value is None:
            return False
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def describe(self) -> str:
        if self.metric in BOOL_METRICS and self.min == self.max:
            return "true" if self.min else "false"
        if self.min is not None and self.max is not None:
            return f"{self.min:g}" if self.min == self.max else f"{self.min:g}..{self.max:g}"
        return f">= {self.min:g}" if self.min is not None else f"<= {self.max:g}"


@dataclass(frozen=True)
class Scenario:
    workload: Optional[Workload]
    faults: tuple[Fault, ...] = ()
    expect: tuple[Expectation, ...] = ()
    capture: bool = False
    capture_mb: int = 64


def _mapping(value: Any, field_: str, accepted: str) -> dict:
    if not isinstance(value, dict):
        raise SpecError(field_, f"{type(value).__name__} given", accepted)
    return value


def _keys(raw: dict, allowed: tuple[str, ...], field_: str) -> None:
    for k in raw:
        if k not in allowed:
            raise SpecError(f"{field_}.{k}", "unknown key", f"one of: {', '.join(allowed)}")


def _target_kind(topo, target: Any, field_: str) -> str:
    if isinstance(target, str):
        if target in topo.hosts:
            return "host"
        if any(r.name == target for r in topo.rails):
            return "rail"
        host, _, rail = target.partition(".")
        if host in topo.hosts and any(r.name == rail for r in topo.rails):
            return "link"
    raise SpecError(field_, f"{quote(target)} names nothing in this topology",
                    "a link HOST.RAIL (e.g. h2.r1), a rail (e.g. r1) or a host (e.g. h2)")


def _workload_amounts(raw: dict, kind: str, f: str) -> dict[str, Any]:
    """How much the workload does: size(s), duration, iterations, warmup, rounds."""
    kw: dict[str, Any] = {}
    if "size" in raw:
        kw["size"] = parse_size(raw["size"], f"{f}.size")
    if "sizes" in raw:
        if not isinstance(raw["sizes"], list) or not raw["sizes"]:
            raise SpecError(f"{f}.sizes", "not a list", "a list of sizes, e.g. [64KiB, 16MiB]")
        kw["sizes"] = tuple(parse_size(s, f"{f}.sizes[{i}]") for i, s in enumerate(raw["sizes"]))
    if "duration" in raw:
        kw["duration"] = parse_duration(raw["duration"], f"{f}.duration", allow_zero=False)
    if "iterations" in raw:
        kw["iterations"] = _int(raw["iterations"], f"{f}.iterations")
    if "warmup" in raw:
        if kind in ("command", "none"):
            raise SpecError(f"{f}.warmup", f"not used with kind: {kind}",
                            "kind: allreduce, sweep or compare, or no warmup key")
        kw["warmup"] = _int(raw["warmup"], f"{f}.warmup", minimum=0)
    elif kind in ("compare", "sweep"):
        kw["warmup"] = 1          # a fresh process's first op pays for TCP slow start
    if "rounds" in raw:
        if kind not in ("compare", "train"):
            raise SpecError(f"{f}.rounds", f"only used with kind: compare or train (kind is "
                            f"{kind})", "kind: compare, or no rounds key")
        kw["rounds"] = _int(raw["rounds"], f"{f}.rounds", maximum=MAX_ROUNDS)
    return kw


def _workload_setup(raw: dict, topo, f: str) -> dict[str, Any]:
    """What runs where: system(s), dtype, op, hosts, timeout."""
    kw: dict[str, Any] = {}
    if "system" in raw:
        kw["system"] = _choice(raw["system"], SYSTEMS, f"{f}.system")
    if "systems" in raw:
        if not isinstance(raw["systems"], list) or not raw["systems"]:
            raise SpecError(f"{f}.systems", "not a list", f"a list from: {', '.join(SYSTEMS)}")
        kw["systems"] = tuple(_choice(s, SYSTEMS, f"{f}.systems[{i}]")
                              for i, s in enumerate(raw["systems"]))
    if "dtype" in raw:
        kw["dtype"] = _choice(raw["dtype"], DTYPES, f"{f}.dtype")
    if "op" in raw:
        kw["op"] = _choice(raw["op"], OPS, f"{f}.op")
    if "hosts" in raw:
        hosts, known = raw["hosts"], set(topo.hosts)
        if not isinstance(hosts, list) or not hosts \
                or any(not isinstance(h, str) or h not in known for h in hosts):
            raise SpecError(f"{f}.hosts", f"{quote(hosts)} is not a list of this file's hosts",
                            f"a list from: {_listing(topo.hosts)}")
        first: dict[str, int] = {}
        for i, h in enumerate(hosts):    # one rank per host: rank = position in this list
            if h in first:
                raise SpecError(f"{f}.hosts[{i}]", f"{quote(h)} is listed twice (also "
                                f"{f}.hosts[{first[h]}])", "each host at most once")
            first[h] = i
        kw["hosts"] = tuple(hosts)
    if "timeout" in raw:
        kw["timeout"] = parse_duration(raw["timeout"], f"{f}.timeout", allow_zero=False)
    return kw


def _listing(names: tuple[str, ...], shown: int = 8) -> str:
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def _workload_command(raw: dict, kind: str, f: str) -> Optional[tuple[str, ...]]:
    """The argv of a ``kind: command`` workload (a string runs through sh -c)."""
    cmd = raw.get("command")
    if kind != "command":
        if "command" in raw:
            raise SpecError(f"{f}.command", f"only used with kind: command (kind is {kind})",
                            "kind: command, or no command key")
        return None
    if isinstance(cmd, str) and cmd.strip():
        return ("sh", "-c", cmd)
    if isinstance(cmd, list) and cmd and all(isinstance(c, str) for c in cmd):
        return tuple(cmd)
    raise SpecError(f"{f}.command", f"{quote(cmd)} given",
                    "a shell command string or a list of arguments")


def parse_workload(raw: Any, topo) -> Optional[Workload]:
    if raw is None:
        return None
    f = "workload"
    raw = _mapping(raw, f, "a mapping such as {kind: allreduce, size: 16MiB, duration: 10s}")
    _keys(raw, ("kind", "size", "sizes", "duration", "iterations", "warmup", "rounds", "system",
                "systems", "dtype", "op", "hosts", "command", "timeout") + TRAIN_KEYS, f)
    kind = _choice(raw.get("kind", "allreduce"), WORKLOAD_KINDS, f"{f}.kind")
    if kind != "train":
        for k in TRAIN_KEYS:
            if k in raw:
                raise SpecError(f"{f}.{k}", f"only used with kind: train (kind is {kind})",
                                f"kind: train, or no {k} key")
        train: dict[str, Any] = {}
    else:
        train = parse_train(raw, getattr(topo, "source", None), f)
    kw: dict[str, Any] = {"kind": kind, **_workload_amounts(raw, kind, f),
                          **_workload_setup(raw, topo, f), **train}
    command = _workload_command(raw, kind, f)
    if command is not None:
        kw["command"] = command
    if kind == "compare" and "systems" not in kw:
        kw["systems"] = ("nezha", "single", "stripe", "mptcp")
    if kind in ("allreduce", "command") and "duration" not in kw and "iterations" not in kw:
        kw["duration"] = 10.0 if kind == "allreduce" else None
    if kind in ("sweep", "compare"):
        n = len(kw.get("sizes") or (1,)) * len(kw.get("systems") or (1,)) * kw.get("rounds", 1)
        if n > MAX_PHASES:
            raise SpecError(f"{f}.sizes", f"{n} phases (sizes x systems x rounds)",
                            f"at most {MAX_PHASES} phases in one run")
    return Workload(**kw)


def parse_faults(raw: Any, topo) -> tuple[Fault, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError("faults", f"{type(raw).__name__} given",
                        "a list such as [{at: 3s, action: link-down, target: h2.r1}]")
    faults = []
    flap_steps = 0
    for i, item in enumerate(raw):
        f = f"faults[{i}]"
        item = _mapping(item, f, "a mapping such as {at: 3s, action: link-down, target: h2.r1}")
        for req in ("at", "action", "target"):
            if req not in item:
                raise SpecError(f"{f}.{req}", "missing", "at, action and target on every fault")
        action = _choice(item["action"], tuple(FAULT_ACTIONS), f"{f}.action")
        kinds, extra = FAULT_ACTIONS[action]
        _keys(item, ("at", "action", "target") + extra, f)
        kind = _target_kind(topo, item["target"], f"{f}.target")
        if kind not in kinds:
            raise SpecError(f"{f}.target", f"{action} cannot act on a {kind}",
                            f"a {' or '.join(kinds)}")
        kw: dict[str, Any] = {"at": parse_duration(item["at"], f"{f}.at"), "action": action,
                              "target": item["target"], "target_kind": kind, "index": i}
        if "for" in item:
            kw["duration"] = parse_duration(item["for"], f"{f}.for", allow_zero=False)
        if "end" in item:
            kw["end"] = _choice(item["end"], ENDS, f"{f}.end")
        if action in ("rate", "loss", "delay", "traffic"):
            if "value" not in item:
                raise SpecError(f"{f}.value", "missing", f"the new {action} (e.g. "
                                + {"rate": "20mbit", "loss": "20%", "delay": "5ms",
                                   "traffic": "150mbit: the competing flows' offered rate"
                                   }[action] + ")")
            if action == "delay":
                kw["value"] = parse_duration(item["value"], f"{f}.value", maximum=MAX_DELAY_S)
            else:
                parser = {"rate": parse_rate, "loss": parse_percent,
                          "traffic": parse_rate}[action]
                kw["value"] = parser(item["value"], f"{f}.value")
        if action == "delay" and "jitter" in item:
            kw["jitter"] = parse_duration(item["jitter"], f"{f}.jitter", maximum=MAX_DELAY_S)
        if action == "flap":
            if "period" not in item or "for" not in item:
                raise SpecError(f"{f}.period" if "period" not in item else f"{f}.for", "missing",
                                "flap needs period (down+up cycle, e.g. 500ms) and for")
            kw["period"] = _flap_period(item["period"], f"{f}.period")
            flap_steps += _flap_steps(kw["period"], kw["duration"], f"{f}.for", flap_steps)
        if action == "traffic":
            kw.update(_traffic(item, topo, f))
        if action == "kill":
            sig = item.get("signal", "KILL")
            kw["signal"] = _choice(sig, ("KILL", "TERM", "INT", "STOP"), f"{f}.signal")
            _kill_target(item, topo, kind, f)
        faults.append(Fault(**kw))
    return tuple(sorted(faults, key=lambda x: (x.at, x.index)))


def _kill_target(item: dict, topo, kind: str, f: str) -> None:
    """A rail kill stops the rail's aggregation switch (``for``: it is started again, or
    continued after STOP); a host kill signals the rank, which never comes back."""
    if kind == "rail":
        rail = next(r for r in topo.rails if r.name == item["target"])
        if getattr(rail, "protocol", "tcp") != "aggregation":
            raise SpecError(f"{f}.target", f"rail {rail.name} has no aggregation switch to kill",
                            "a host (its rank), or a rail with protocol: aggregation")
    elif "for" in item:
        raise SpecError(f"{f}.for", "a killed rank does not come back",
                        "no for on a host kill (for: only on a rail kill, which restarts the "
                        "rail's aggregation switch)")


def _traffic(item: dict, topo, f: str) -> dict[str, Any]:
    """A traffic fault's ``proto`` and ``between`` (hosts attached to the rail, at least two,
    each once; their flows form a ring in the order given)."""
    kw: dict[str, Any] = {"proto": _choice(item.get("proto", "tcp"), PROTOS, f"{f}.proto")}
    rail = item["target"]
    on_rail = tuple(h for h in topo.hosts if (h, rail) in topo.links)
    if "between" not in item:
        if len(on_rail) < 2:
            raise SpecError(f"{f}.target", f"rail {rail} has {len(on_rail)} host",
                            "a rail with at least two hosts: a flow needs two ends")
        return kw
    hosts = item["between"]
    if not isinstance(hosts, list) or len(hosts) < 2:
        raise SpecError(f"{f}.between", f"{quote(hosts)} is not a list of at least two hosts",
                        f"hosts on rail {rail}, e.g. [{', '.join(on_rail[:2])}]")
    seen: set[str] = set()
    for i, h in enumerate(hosts):
        if not isinstance(h, str) or h not in on_rail:
            raise SpecError(f"{f}.between[{i}]", f"{quote(h)} is not a host on rail {rail}",
                            f"one of: {_listing(on_rail)}")
        if h in seen:
            raise SpecError(f"{f}.between[{i}]", f"{quote(h)} is listed twice",
                            "each host at most once")
        seen.add(h)
    kw["between"] = tuple(hosts)
    return kw


def _flap_period(value: Any, field_: str) -> float:
    period = parse_duration(value, field_, allow_zero=False)
    if period < MIN_FLAP_PERIOD_S:
        least = format_duration(MIN_FLAP_PERIOD_S)
        raise SpecError(field_, f"{quote(value)} is shorter than {least}",
                        f"a period of at least {least} (a link state change takes 1-4 ms to be "
                        "acknowledged)")
    return period


def flap_steps(period: float, duration: float) -> int:
    """How many down/up toggles a flap makes (FaultInjector._plan expands it to these)."""
    return max(0, math.ceil(duration / (period / 2) - 1e-9) - 1)


def _flap_steps(period: float, duration: float, field_: str, before: int) -> int:
    n = flap_steps(period, duration)
    if before + n > MAX_FLAP_STEPS:
        raise SpecError(field_, f"the flaps of this schedule toggle links {before + n} times",
                        f"at most {MAX_FLAP_STEPS} toggles over all flaps: a shorter for, or a "
                        "longer period")
    return n


def sized_metric(nbytes: int) -> str:
    """The per-size ratio's metric name, e.g. busbw_vs_single_rail.16MiB."""
    return SIZED_PREFIX + format_size(nbytes)


def parse_expect(raw: Any, topo, workload: Optional[Workload] = None) -> tuple[Expectation, ...]:
    if raw is None:
        return ()
    raw = _mapping(raw, "expect", "a mapping such as {failover_ms: {max: 200}, wrong_results: 0}")
    rails = [r.name for r in topo.rails]
    sizes = workload.sizes if workload is not None and workload.kind == "compare" else ()
    out = []
    for metric, bound in raw.items():
        f = f"expect.{metric}"
        metric = str(metric)
        known = metric in METRICS or (metric.startswith(SHARE_PREFIX)
                                      and metric[len(SHARE_PREFIX):] in rails)
        if not known and metric.startswith(SIZED_PREFIX):
            valid = ", ".join(sized_metric(n) for n in sizes) or "none: needs a compare workload"
            try:
                n = parse_size(metric[len(SIZED_PREFIX):], f)
            except SpecError:
                n = None
            if n not in sizes:
                raise SpecError(f, "not a message size of this compare workload",
                                f"one of: {valid}")
            metric, known = sized_metric(n), True
        if not known:
            raise SpecError(f, "unknown metric", "one of: " + ", ".join(METRICS)
                            + ", " + ", ".join(SHARE_PREFIX + r for r in rails)
                            + ", " + SIZED_PREFIX + "SIZE (compare)")
        if metric in BOOL_METRICS:
            if not isinstance(bound, bool):
                raise SpecError(f, f"{quote(bound)} is not accepted", "true or false")
            out.append(Expectation(metric, float(bound), float(bound)))
            continue
        if isinstance(bound, (int, float)) and not isinstance(bound, bool):
            if not math.isfinite(float(bound)):
                raise SpecError(f, f"{quote(bound)} is not a finite number",
                                "a finite number (must equal), or {min: X} / {max: Y} / both")
            out.append(Expectation(metric, float(bound), float(bound)))
            continue
        bound = _mapping(bound, f, "a number (must equal) or {min: X} / {max: Y} / both")
        _keys(bound, ("min", "max"), f)
        if not bound:
            raise SpecError(f, "empty bound", "{min: X}, {max: Y} or both")
        vals = {}
        for k, v in bound.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not math.isfinite(float(v)):
                raise SpecError(f"{f}.{k}", f"{quote(v)} is not a number", "a finite number")
            vals[k] = float(v)
        out.append(Expectation(metric, vals.get("min"), vals.get("max")))
    return tuple(out)


def parse_capture(raw: Any) -> tuple[bool, int]:
    if raw is None or raw is False:
        return False, 64
    if raw is True:
        return True, 64
    raw = _mapping(raw, "capture", "true, or {max_mb: 64}")
    _keys(raw, ("max_mb",), "capture")
    return True, _int(raw.get("max_mb", 64), "capture.max_mb", maximum=MAX_CAPTURE_MB)


def build(topo) -> Scenario:
    s = topo.sections
    cap, cap_mb = parse_capture(s.get("capture"))
    workload = parse_workload(s.get("workload"), topo)
    return Scenario(workload=workload, faults=parse_faults(s.get("faults"), topo),
                    expect=parse_expect(s.get("expect"), topo, workload), capture=cap,
                    capture_mb=cap_mb)


def validate(topo) -> None:
    build(topo)


def scheduled_rates(topo) -> dict[str, int]:
    """Per rail, the lowest rate (bit/s) the fault schedule gives any of its links: what the
    fabric sizes the rail's GSO skbs, and with them its htb buckets, for (Fabric._rail_gso),
    so that a rail slowed by a fault is no burstier than one built at that rate."""
    out: dict[str, int] = {}
    for f in parse_faults(topo.sections.get("faults"), topo):
        if f.action != "rate":
            continue
        if f.target_kind == "host":
            rails = [r.name for r in topo.rails]
        else:        # 'r1' or 'h2.r1'
            rails = [f.target if f.target_kind == "rail" else f.target.split(".", 1)[1]]
        for rail in rails:
            out[rail] = min(out.get(rail, f.value), int(f.value))
    return out
