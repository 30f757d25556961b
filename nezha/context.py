"""The public API: a Context is one rank's membership in a communicator.

    ctx = Context(rank, world_size, rails=["10.0.0.1", "10.1.0.1"], master="10.0.0.1:29500")
    ctx.allreduce(buf, op="sum")        # in place; numpy array or any writable buffer
    ctx.close()

or ``Context.from_env()`` with NEZHA_RANK, NEZHA_WORLD_SIZE, NEZHA_RAILS, NEZHA_MASTER_ADDR,
NEZHA_MASTER_PORT (and optionally NEZHA_SYSTEM, NEZHA_TIMEOUT, NEZHA_EVENT_LOG). Every
NEZHA_* variable (the other knobs included) is read once, by ``nezha.config.Config``, and
documented there; arguments win over the environment; ``config=Config(...)`` replaces it.
``secret=`` (or NEZHA_JOB_SECRET), the same on every rank, authenticates every store request
and rail connection (auth.py, rendezvous.py); without one the job is unauthenticated.

Semantics: collectives are called in the same order with matching arguments on every rank
(a mismatch is detected and raised on every rank, at the latest at the next collective);
any failure makes the Context unusable (every later call raises the same error).

Systems: ``nezha`` (cost-balanced multi-rail), ``single`` (ring on the first rail only),
``stripe`` (static equal striping over all rails), ``mptcp`` (ring over one MPTCP connection
per peer). ``gloo`` (torch.distributed) is provided by ``nezha.baselines.GlooContext``;
``make_context(system="gloo", ...)`` returns one.
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace

import numpy as np

from . import collectives, wire
from .balance import Balancer
from .buffers import as_array, written_back
from .config import Config
from .engine import Engine
from .errors import ConfigError
from .events import Events
from .exchange import maybe_exchange
from .health import Health
from .pathprobe import PathProber
from .hybrid import HybridAllreduce
from .kinds import OPS, SYSTEMS
from .costs import gives_samples
from .rails import parse_rails
from .rendezvous import Member, Rendezvous
from .transport import make_transport

_MODES = {"nezha": "nezha", "stripe": "stripe", "single": "single", "mptcp": "single"}
CLOSE_LINGER_S = 5.0    # close() waits at most this long (or the timeout) for what others
                        # may still need: our detached copies, the store we serve


def _settings(config: Config, **given) -> Config:
    """``config`` with every argument the caller gave in place of its variable."""
    return replace(config, **{k: v for k, v in given.items() if v is not None})


class Context:
    def __init__(self, rank=None, world_size=None, rails=None, master=None, *, store=None,
                 timeout: float | None = None, system: str | None = None,
                 chunk_bytes: int = 512 << 10, events: str | None = None,
                 serve_store: bool | None = None, group: str = "nezha",
                 sockbuf: int | None = None, log_ops: bool = False,
                 config: Config | None = None, secret: str | bytes | None = None):
        cfg = _settings(config if config is not None else Config.from_env(),
                        rank=rank, world_size=world_size, rails=rails, event_log=events,
                        job_secret=secret or None,
                        timeout=None if timeout is None else float(timeout),
                        system=system or None, sockbuf=sockbuf or None, log_ops=log_ops or None)
        self._config = cfg
        self.rank = int(cfg.rank if cfg.rank is not None else -1)
        self.world_size = int(cfg.world_size if cfg.world_size is not None else 0)
        self.system, self.timeout = cfg.system, cfg.timeout
        self._check_membership()
        self.rail_addrs = parse_rails(cfg.rails)
        if self.system == "single":
            self.rail_addrs = self.rail_addrs[:1]
        if self.system == "stripe" and cfg.shares is not None and \
                len(cfg.shares) != len(self.rail_addrs):
            raise ConfigError(f"NEZHA_SHARES has {len(cfg.shares)} proportions for "
                              f"{len(self.rail_addrs)} rails: give one per rail")
        self._closed = False
        self._health = None
        self._prober = None
        self._rdv = None
        self._lock = threading.RLock()    # a hybrid allreduce is several ops under it
        self._hybrid: HybridAllreduce | None = None
        self._transport = make_transport("mptcp" if self.system == "mptcp" else "tcp",
                                         self.rail_addrs, cfg)
        self.nrails = self._transport.nrails
        self.events = Events(self.rank, self.nrails, cfg.event_log, cfg.log_ops)
        self.balancer = Balancer(self.nrails, _MODES[self.system], chunk_bytes,
                                 cfg.shares if self.system == "stripe" else None,
                                 rail_cpu_s=cfg.rail_cpu_us * 1e-6)
        self._engine = Engine(self.rank, self.world_size, self.nrails, self.balancer,
                              self.events, cfg)
        self.events.emit("init", system=self.system, world=self.world_size, rails=self.rail_addrs,
                         tcp_rto_min_ms=self._transport.rto_min_ms)
        try:
            self._join(store, master, serve_store, group)
        except BaseException as e:
            if self._rdv is not None:
                self._rdv.abort_store(f"rank {self.rank} (store host) failed: {e}")
            self._teardown()
            raise
        self.events.emit("connected", peers=self.world_size - 1, rails=self.nrails)
        if self.system == "nezha" and cfg.aggregators and self.world_size > 1:
            # the aggregation rails are another protocol, not more TCP rails: NEZHA_RAILS
            # must not list them (the testbed gives nezha its TCP rails only)
            self._hybrid = HybridAllreduce(self.rank, self.world_size, self.nrails,
                                           cfg.aggregators, cfg.job_secret, group,
                                           self.timeout, self.events, cfg.tcp_congestion,
                                           cfg.tcp_rto_min_ms)
        self.events.emit("state", state="cold", reason="start", live=list(range(self.nrails)))

    @classmethod
    def from_env(cls, **kw):
        return cls(**kw)

    # ------------------------------------------------------------------ set-up
    def _check_membership(self):
        if self.system not in SYSTEMS:
            raise ConfigError(f"unknown system {self.system!r} (one of {', '.join(SYSTEMS)}; "
                              f"'gloo' via nezha.baselines.make_context)")
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside 0..{self.world_size - 1}")

    def _join(self, store, master, serve_store, group):
        """Rendezvous, connections, health monitoring (rendezvous.py has the details)."""
        me = Member(self.rank, self.world_size, self.nrails, self.system,
                    tuple(self.rail_addrs), self.timeout,
                    (self._config.pipe_block, self._config.direct_max))
        self._rdv = rdv = Rendezvous(me, self._transport, self._engine, self.events,
                                     secret=self._config.job_secret,
                                     connect=self._config.connect)
        endpoints = self._transport.listen()
        deadline = time.monotonic() + self.timeout
        rdv.open_store(store, master, serve_store, self._config)
        rdv.meet(group, endpoints, deadline)
        rdv.connect(deadline)
        self._prober = PathProber(self.rank, endpoints, rdv.rail_key,
                                  rdv.infos.endpoint,
                                  blocked=self._probe_blocked,
                                  dropped=self._engine.dropped)
        self._prober.start()
        # heartbeats start before the last barrier: a slow rank must not look dead; no rail
        # link events for MPTCP, whose one connection outlives any rail (transport/mptcp.py)
        links = self.rail_addrs if self._transport.link_events else []
        self._health = Health(self._engine, rdv.redial, links, self._config,
                              refuses=rdv.refuses, prober=self._prober)
        self._health.start()
        rdv.all_connected(deadline)

    # ------------------------------------------------------------------ collectives
    def _prepare(self, buf, dtype, op=None):
        if self._closed:
            raise ConfigError("the context is closed")
        if op is not None and op not in OPS:
            raise ConfigError(f"unknown reduction op {op!r} (one of {', '.join(OPS)})")
        return as_array(buf, dtype)

    def _run(self, kind_name, nbytes, fn):
        """One collective: the estimate exchange if due, then ``fn(call)`` as one op."""
        with self._lock:
            if self.events.log_ops:
                self.events.emit("call", kind=kind_name, bytes=nbytes)
            eng = self._engine
            maybe_exchange(eng, self.balancer, self.events, nbytes)
            metered = self._metered(nbytes)
            if metered:
                with eng.cond:
                    eng.costs.take()         # drop what smaller ops left: not this op's
            op_id = eng.begin_op()
            if self.events.log_ops:
                self.events.emit("op_start", op=op_id, kind=kind_name, bytes=nbytes)
            t0 = time.monotonic()
            try:
                fn(collectives.Call(eng, op_id, self._config.pipe_block))
            finally:
                eng.end_op(op_id)
            self.balancer.note_op(nbytes, time.monotonic() - t0 if metered else float("nan"))
            if metered:
                self._record_costs(op_id)
            if self.events.log_ops:
                self.events.emit("op_end", op=op_id, kind=kind_name, bytes=nbytes)

    def _metered(self, nbytes: int) -> bool:
        """Only operations large enough to tell (a small one's share times are mostly
        thread wake-ups), and only where the split depends on them."""
        return gives_samples(nbytes) and self.balancer.mode == "nezha" and self.nrails > 1

    def _record_costs(self, op_id: int) -> None:
        """The operation's per-rail cost samples (costs.py) go to the balancer."""
        with self._engine.cond:
            samples = self._engine.costs.take()
        for rail, nbytes, seconds, tail, slack in samples:
            self.balancer.record_b(rail, nbytes, seconds, tail, slack)
            if self._config.debug_samples:
                self.events.emit("b_sample", rail=rail, bytes=nbytes, seconds=seconds, op=op_id)

    def allreduce(self, buf, op: str = "sum", dtype=None):
        """Reduce ``buf`` over all ranks, in place. Returns ``buf``."""
        arr, wb = self._prepare(buf, dtype, op)
        if self._hybrid is not None and self._hybrid.applies(arr.nbytes, op):
            with self._lock:
                self._hybrid.allreduce(
                    arr, op, lambda nbytes, fn: self._run("allreduce", nbytes, fn),
                    self._control_op)
        else:
            algo = self._allreduce_algorithm(arr.nbytes)
            self._run("allreduce", arr.nbytes, lambda call: algo(call, arr, op))
        return written_back(buf, wb)

    def _allreduce_algorithm(self, nbytes: int):
        """nezha: small messages in one direct round (collectives.use_direct); the
        baselines are the ring at every size, as their names say."""
        if self.system == "nezha" and collectives.use_direct(nbytes, self.world_size,
                                                             self._config.direct_max):
            return collectives.direct_allreduce
        return collectives.ring_allreduce

    def _control_op(self, fn) -> None:
        """``fn(call)`` as one more operation of the current collective (a hybrid
        allreduce's vote and recompute): same op ids on every rank, no balancing."""
        eng = self._engine
        op_id = eng.begin_op()
        try:
            fn(collectives.Call(eng, op_id, self._config.pipe_block))
        finally:
            eng.end_op(op_id)

    def reduce_scatter(self, inbuf, outbuf, op: str = "sum", dtype=None):
        """``inbuf`` has world_size * m elements; rank r gets the reduction of block r in
        ``outbuf`` (m elements). ``inbuf`` is not modified."""
        arr, _ = self._prepare(inbuf, dtype, op)
        out, wb = self._prepare(outbuf, dtype)
        n = self.world_size
        if out.dtype != arr.dtype or len(arr) != n * len(out):
            raise ConfigError(f"reduce_scatter: inbuf must have world_size * len(outbuf) = "
                              f"{n * len(out)} elements of {out.dtype}, got {len(arr)} of {arr.dtype}")
        work = arr.copy()
        m = len(out)
        self._run("reduce_scatter", arr.nbytes,
                  lambda call: collectives.ring_reduce_scatter(call, work, op))
        out[:] = work[self.rank * m:(self.rank + 1) * m]
        return written_back(outbuf, wb)

    def allgather(self, inbuf, outbuf, dtype=None):
        """``outbuf`` (world_size * len(inbuf) elements) gets every rank's ``inbuf`` in rank order."""
        arr, _ = self._prepare(inbuf, dtype)
        out, wb = self._prepare(outbuf, dtype)
        m, n = len(arr), self.world_size
        if out.dtype != arr.dtype or len(out) != n * m:
            raise ConfigError(f"allgather: outbuf must have world_size * len(inbuf) = {n * m} "
                              f"elements of {arr.dtype}, got {len(out)} of {out.dtype}")
        out[self.rank * m:(self.rank + 1) * m] = arr
        self._run("allgather", arr.nbytes, lambda call: collectives.ring_allgather(call, out, m))
        return written_back(outbuf, wb)

    def broadcast(self, buf, root: int = 0, dtype=None):
        arr, wb = self._prepare(buf, dtype)
        if not 0 <= root < self.world_size:
            raise ConfigError(f"root {root} is outside 0..{self.world_size - 1}")
        self._run("broadcast", arr.nbytes, lambda call: collectives.broadcast(call, arr, root))
        return written_back(buf, wb)

    def barrier(self):
        arr = np.zeros(1, dtype=np.int32)
        self._run("barrier", 0, lambda call: collectives.ring_allreduce(
            call, arr, "sum", kind=wire.K_BARRIER))

    # ------------------------------------------------------------------ observability
    def rail_bytes(self) -> dict:
        return self.events.rail_bytes()

    def stats(self) -> dict:
        s = self.events.snapshot()
        s["system"] = self.system
        s["rails_addr"] = self.rail_addrs
        s["a"] = self.balancer.rs.a
        s["b"] = self.balancer.rs.b
        s["shares"] = self.balancer.rs.shares()
        # connections held, per peer (NEZHA_CONNECT=ring: the ring neighbours and the peers
        # reached on demand, rendezvous.py)
        conns: dict = {}
        for p, _ in list(self._engine.conns):
            conns[p] = conns.get(p, 0) + 1
        s["connections"] = dict(sorted(conns.items()))
        if self._hybrid is not None:
            s["hybrid"] = self._hybrid.stats()
        return s

    # ------------------------------------------------------------------ test hooks
    def _debug_send_raw(self, peer: int, rail: int, data: bytes):
        """Test hook: queue raw bytes on the connection to ``peer`` on ``rail``."""
        self._engine.conns[(peer, rail)].put(bytes(data))

    def _debug_kill_rail(self, peer: int, rail: int):
        """Test hook: break the connection to ``peer`` on ``rail`` (as a failing link would)."""
        c = self._engine.conns[(peer, rail)]
        try:
            c.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _debug_blackhole(self, peer: int, rail: int):
        """Test hook: the connection to ``peer`` on ``rail`` silently stops moving data in
        both directions (like a link that drops everything), without any socket error."""
        self._engine.conns[(peer, rail)].blackhole = True

    def _probe_blocked(self, peer: int, rail: int) -> bool:
        """The test hooks above stop path probes too (a black hole drops every packet)."""
        c = self._engine.conns.get((peer, rail))
        return self._engine.silenced or (c is not None and c.blackhole)

    def _debug_silence(self):
        """Test hook: this rank stops moving bytes on every connection, present and future,
        without any socket error (a hung host). A per-connection black hole is undone by
        the re-probe's fresh connection, which is right for one rail but not for a rank that
        went silent as a whole."""
        self._engine.silenced = True

    # ------------------------------------------------------------------ teardown
    def _teardown(self):
        eng = self._engine
        linger = min(self.timeout, CLOSE_LINGER_S) if eng.error is None else 0.0
        if self._rdv is not None:
            eng.settle_detached(linger)
        eng.closing = True
        if getattr(self, "_hybrid", None) is not None:
            self._hybrid.close()
        if getattr(self, "_health", None) is not None:
            self._health.close()
        if getattr(self, "_prober", None) is not None:
            self._prober.close()
        if self._transport is not None:
            self._transport.close()
        conns = list(eng.conns.values())
        for c in conns:
            if c.alive:
                c.send_bye(self.rank)
                c.q.put(None)
        for c in conns:
            c.writer.join(2.0) if c.writer.is_alive() else None
        end = time.monotonic() + 2.0
        for c in conns:
            if c.reader.is_alive():
                c.reader.join(max(0.0, end - time.monotonic()))
        for c in conns:
            c.alive = False
            try:
                c.sock.close()
            except OSError:
                pass
        if self._transport is not None:
            self._transport.close()
        if self._rdv is not None:
            # a job that failed needs no store; one that ends well keeps it for the ranks
            # still finishing their last operation (they may connect on demand)
            self._rdv.close(linger if eng.error is None else 0.0)
        eng.scratch.release()
        self.events.emit("close")
        self.events.close()

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._teardown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

