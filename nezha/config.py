"""Every NEZHA_* environment variable, read once, in one place.

``Config.from_env()`` reads the library's variables (a frozen record the Context hands to the
transport, engine, rendezvous and health, and from which it takes the event log and the
collectives' pipeline block); ``Workload.from_env()`` reads those that only the launchers
``python -m nezha.worker`` / ``python -m nezha.bench`` use. Nothing else in nezha/ looks at
the environment, so a value cannot differ between two modules, and a bad value is refused
once, naming its variable. An empty value counts as unset. Arguments
given to ``Context(...)`` (or on a launcher's command line) win over the environment.

==========================  =======  ==============  ===============================================
variable                    type     default         meaning
==========================  =======  ==============  ===============================================
NEZHA_RANK                  int      (none; -1)      this process's rank
NEZHA_WORLD_SIZE            int      (none; 0)       number of ranks
NEZHA_RAILS                 list     (none)          rails: IPv4 addresses or interface names, a,b
NEZHA_MASTER_ADDR           str      (none)          store host (with NEZHA_MASTER_PORT)
NEZHA_MASTER_PORT           int      (none)          store port
NEZHA_MASTER                str      (none)          HOST:PORT of the store (worker and bench only;
                                                     the worker also takes ADDR + PORT)
NEZHA_SYSTEM                str      nezha           nezha|single|stripe|mptcp (gloo: worker)
NEZHA_TIMEOUT               float    30              s for rendezvous and for each collective wait
NEZHA_EVENT_LOG             path     (none)          JSON-lines event log (nezha/events.py)
NEZHA_LOG_OPS               flag     0               1: call / op_start / op_end / exchange events
NEZHA_STORE_EXTERNAL        flag     0               1: rank 0 does not serve the store
NEZHA_JOB_SECRET            str      (none)          shared secret of the job's ranks (>= 16
                                                     characters): authenticates every store
                                                     request and rail connection; unset: none
NEZHA_STORE_MAX_CLIENTS     int      4 x world + 16  connections the store serves at once
NEZHA_SOCKBUF               int      (autotuning)    SO_SNDBUF/SO_RCVBUF bytes; 0 = autotuning
NEZHA_TCP_USER_TIMEOUT_MS   int      the timeout     TCP_USER_TIMEOUT; 0 = the context timeout
NEZHA_NOTSENT_LOWAT         int      262144          TCP_NOTSENT_LOWAT bytes (256 KiB); 0 = off
NEZHA_TCP_CONGESTION        str      (host default)  per-socket congestion control, e.g. cubic
NEZHA_TCP_RTO_MIN_MS        float    5               per-socket least retransmission timeout
                                                     (TCP_RTO_MIN_US, Linux >= 6.15); 0 = the
                                                     kernel's (200 ms); a route's rto_min wins
NEZHA_STAGING_LIMIT         int      1073741824      bytes staged before their receive; 0 = 1 GiB
NEZHA_PIPE_BLOCK            int      2097152         ring pipeline block bytes (2 MiB)
NEZHA_DIRECT_MAX            int      262144          nezha, up to 8 ranks: one-round allreduce
                                                     while size x (world - 1) <= this (256 KiB;
                                                     collectives.use_direct); 0 = always the ring
NEZHA_RAIL_CPU_US           float    300             CPU us one more rail costs a message (balance.py)
NEZHA_WATCHDOG_MS           float    20              least stall before the watchdog checks a rail
NEZHA_CHECK_TIMEOUT_MS      float    100             wait for the peer's "bytes arrive?" answer
NEZHA_HEARTBEAT_MS          float    250             idle time after which a HEARTBEAT is sent
NEZHA_HEARTBEAT_TIMEOUT_MS  float    1500            silence after which a connection fails
NEZHA_LINK_EVENTS           flag     1               0: no netlink link-event watcher
NEZHA_DEBUG_SAMPLES         flag     off             any non-empty value: b_sample and
                                                     a_sample events
NEZHA_HEDGE                 flag     1               0: never copy a late share onto a finished
                                                     rail (engine/hedge.py)
NEZHA_SHARES                list     (equal)         stripe: the split pinned, one proportion per
                                                     rail (3,1: 75 % / 25 %)
NEZHA_TRACE                 flag     off             any non-empty value: tx / rx event per chunk
NEZHA_CONNECT               str      ring            ring: connect ring neighbours at start, other
                                                     peers on first use; full: every pair
NEZHA_SIZE                  size     16M             worker: bytes per allreduce (16M, 4096...)
NEZHA_ITERATIONS            int      10 [#]_         worker: timed iterations
NEZHA_DURATION              float    (none)          worker: s to run (with ITERATIONS: both)
NEZHA_WARMUP                int      0               worker: untimed iterations first
NEZHA_DTYPE                 str      float32         worker: element type
NEZHA_OP                    str      sum             worker: reduction op
NEZHA_RESULTS               path     (none)          worker: JSON-lines results
NEZHA_RAIL_NAMES            list     -               set by the testbed; nezha ignores it
NEZHA_AGGREGATORS           list     (none)          aggregation switches, RAIL=ADDR:PORT,...
                                                     (set by the testbed for aggregation rails)
==========================  =======  ==============  ===============================================

.. [#] only when NEZHA_DURATION is not given either.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, TypeVar

from .auth import MIN_SECRET
from .errors import ConfigError

T = TypeVar("T")


class _Env:
    """Typed reads of one environment mapping; a bad value names its variable."""

    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ

    def str(self, name: str, default: Optional[str] = None) -> Optional[str]:
        v = self.environ.get(name)
        return v if v not in (None, "") else default

    def _typed(self, name: str, conv: Callable[[str], T], what: str, default):
        v = self.str(name)
        if v is None:
            return default
        try:
            return conv(v)
        except ValueError:
            raise ConfigError(f"{name}={v!r} is not {what}") from None

    def int(self, name: str, default=None):
        return self._typed(name, int, "an integer", default)

    def float(self, name: str, default=None):
        v = self._typed(name, float, "a number", default)
        if v is not None and not math.isfinite(v):
            raise ConfigError(f"{name}={self.str(name)!r} is not a finite number")
        return v

    def nonneg_int(self, name: str, default: int) -> int:
        v = self.int(name, default)
        if v < 0:
            raise ConfigError(f"{name}={self.str(name)!r}: must be 0 or more")
        return v

    def nonneg_float(self, name: str, default: float) -> float:
        v = self.float(name, default)
        if v < 0:
            raise ConfigError(f"{name}={self.str(name)!r}: must be 0 or more")
        return v

    def rto_min_ms(self, name: str, default: float) -> float:
        v = self.nonneg_float(name, default)
        if v > 200:
            raise ConfigError(f"{name}={self.str(name)!r}: must be 0 (the kernel's) or at most "
                              f"200 ms (the kernel's own minimum RTO; TCP_RTO_MIN_US refuses more)")
        return v

    def choice(self, name: str, allowed: tuple[str, ...], default: str) -> str:
        v = self.str(name, default)
        if v not in allowed:
            raise ConfigError(f"{name}={v!r} is not one of {', '.join(allowed)}")
        return v

    def shares(self, name: str) -> Optional[tuple[float, ...]]:
        """Non-negative proportions, one per rail, not all zero (``3,1``: 75 % / 25 %)."""
        v = self.str(name)
        if v is None:
            return None
        try:
            out = tuple(float(x) for x in v.split(","))
        except ValueError:
            out = ()
        if not out or not all(math.isfinite(x) and x >= 0 for x in out) or not any(out):
            raise ConfigError(f"{name}={v!r} is not a list of non-negative numbers, one per "
                              f"rail, not all zero (e.g. 3,1)")
        return out

    def aggregators(self, name: str) -> tuple[tuple[str, str, int], ...]:
        """``r1=198.18.1.254:29400,r2=...``: (rail, address, port) of each aggregation switch."""
        out = []
        for item in filter(None, (self.str(name) or "").split(",")):
            rail, _, endpoint = item.partition("=")
            addr, _, port = endpoint.rpartition(":")
            if not rail or not addr or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"{name}={self.str(name)!r}: expected RAIL=ADDR:PORT[,...] "
                                  "(e.g. r1=198.18.1.254:29400)")
            out.append((rail, addr, int(port)))
        return tuple(out)

    def secret(self, name: str) -> Optional[str]:
        v = self.str(name)
        if v is not None and len(v.encode()) < MIN_SECRET:
            raise ConfigError(f"{name} is shorter than {MIN_SECRET} characters (e.g. python -c "
                              f"'import secrets; print(secrets.token_hex(16))')")
        return v


@dataclass(frozen=True)
class Config:
    """The library's settings (see the table above). Build one with ``from_env``."""
    rank: Optional[int] = None
    world_size: Optional[int] = None
    rails: Optional[str] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    system: str = "nezha"
    timeout: float = 30.0
    event_log: Optional[str] = None
    log_ops: bool = False
    store_external: bool = False
    job_secret: Optional[str] = field(default=None, repr=False)   # never in a repr or log
    store_max_clients: int = 0        # 0: 4 x world size + 16
    sockbuf: Optional[int] = None
    tcp_user_timeout_ms: Optional[int] = None
    notsent_lowat: int = 256 << 10
    tcp_congestion: str = ""
    tcp_rto_min_ms: float = 5.0       # transport.base.set_rto_min
    staging_limit: int = 1 << 30
    pipe_block: int = 2 << 20
    direct_max: int = 256 << 10       # collectives.use_direct
    rail_cpu_us: float = 300.0        # CPU per rail per message (balance.RAIL_CPU_S, measured)
    watchdog_ms: float = 20.0
    check_timeout_ms: float = 100.0
    heartbeat_ms: float = 250.0
    heartbeat_timeout_ms: float = 1500.0
    link_events: bool = True
    debug_samples: bool = False
    hedge: bool = True
    trace: bool = False
    connect: str = "ring"             # ring | full (rendezvous.py)
    shares: Optional[tuple[float, ...]] = None   # stripe: pinned proportions per rail
    aggregators: tuple[tuple[str, str, int], ...] = ()   # (rail, address, port) per switch

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Config":
        e = _Env(os.environ if environ is None else environ)
        d = cls()
        return cls(
            rank=e.int("NEZHA_RANK"), world_size=e.int("NEZHA_WORLD_SIZE"),
            rails=e.str("NEZHA_RAILS"),
            master_addr=e.str("NEZHA_MASTER_ADDR"), master_port=e.int("NEZHA_MASTER_PORT"),
            system=e.str("NEZHA_SYSTEM", d.system), timeout=e.float("NEZHA_TIMEOUT", d.timeout),
            event_log=e.str("NEZHA_EVENT_LOG"),
            log_ops=e.str("NEZHA_LOG_OPS", "0") == "1",
            store_external=e.str("NEZHA_STORE_EXTERNAL", "0") == "1",
            job_secret=e.secret("NEZHA_JOB_SECRET"),
            store_max_clients=e.int("NEZHA_STORE_MAX_CLIENTS", 0),
            sockbuf=e.int("NEZHA_SOCKBUF") or None,
            tcp_user_timeout_ms=e.int("NEZHA_TCP_USER_TIMEOUT_MS") or None,
            notsent_lowat=e.int("NEZHA_NOTSENT_LOWAT", d.notsent_lowat),
            tcp_congestion=e.str("NEZHA_TCP_CONGESTION", ""),
            tcp_rto_min_ms=e.rto_min_ms("NEZHA_TCP_RTO_MIN_MS", d.tcp_rto_min_ms),
            staging_limit=e.int("NEZHA_STAGING_LIMIT") or d.staging_limit,
            pipe_block=e.int("NEZHA_PIPE_BLOCK", d.pipe_block),
            direct_max=e.nonneg_int("NEZHA_DIRECT_MAX", d.direct_max),
            rail_cpu_us=e.nonneg_float("NEZHA_RAIL_CPU_US", d.rail_cpu_us),
            watchdog_ms=e.float("NEZHA_WATCHDOG_MS", d.watchdog_ms),
            check_timeout_ms=e.float("NEZHA_CHECK_TIMEOUT_MS", d.check_timeout_ms),
            heartbeat_ms=e.float("NEZHA_HEARTBEAT_MS", d.heartbeat_ms),
            heartbeat_timeout_ms=e.float("NEZHA_HEARTBEAT_TIMEOUT_MS", d.heartbeat_timeout_ms),
            link_events=e.str("NEZHA_LINK_EVENTS", "1") != "0",
            debug_samples=e.str("NEZHA_DEBUG_SAMPLES") is not None,
            hedge=e.str("NEZHA_HEDGE", "1") != "0",
            trace=e.str("NEZHA_TRACE") is not None,
            connect=e.choice("NEZHA_CONNECT", ("ring", "full"), d.connect),
            shares=e.shares("NEZHA_SHARES"),
            aggregators=e.aggregators("NEZHA_AGGREGATORS"),
        )


@dataclass(frozen=True)
class Workload:
    """The launchers' own variables (worker and bench): the job, not the library.
    Kept as the strings the command lines take (argparse converts them)."""
    master: Optional[str] = None
    size: str = "16M"
    iterations: Optional[str] = None
    duration: Optional[str] = None
    warmup: str = "0"
    dtype: str = "float32"
    op: str = "sum"
    results: Optional[str] = None

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Workload":
        e = _Env(os.environ if environ is None else environ)
        d = cls()
        return cls(master=e.str("NEZHA_MASTER"), size=e.str("NEZHA_SIZE", d.size),
                   iterations=e.str("NEZHA_ITERATIONS"), duration=e.str("NEZHA_DURATION"),
                   warmup=e.str("NEZHA_WARMUP", d.warmup), dtype=e.str("NEZHA_DTYPE", d.dtype),
                   op=e.str("NEZHA_OP", d.op), results=e.str("NEZHA_RESULTS"))
