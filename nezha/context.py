"""The public API: a Context is one rank's membership in a communicator.

    ctx = Context(rank, world_size, rails=["10.0.0.1", "10.1.0.1"], master="10.0.0.1:29500")
    ctx.allreduce(buf, op="sum")        # in place; numpy array or any writable buffer
    ctx.close()

or ``Context.from_env()`` with NEZHA_RANK, NEZHA_WORLD_SIZE, NEZHA_RAILS, NEZHA_MASTER_ADDR,
NEZHA_MASTER_PORT (and optionally NEZHA_SYSTEM, NEZHA_TIMEOUT, NEZHA_EVENT_LOG).

Other knobs (environment): NEZHA_STORE_EXTERNAL=1 (rank 0 does not serve the store),
NEZHA_SOCKBUF (SO_SNDBUF/SO_RCVBUF bytes; default: kernel autotuning),
NEZHA_TCP_USER_TIMEOUT_MS (default: the context timeout), NEZHA_NOTSENT_LOWAT (256 KiB),
NEZHA_STAGING_LIMIT (1 GiB), NEZHA_PIPE_BLOCK (2 MiB), NEZHA_WATCHDOG_MS (60),
NEZHA_CHECK_TIMEOUT_MS (100), NEZHA_HEARTBEAT_MS (100), NEZHA_HEARTBEAT_TIMEOUT_MS (1500),
NEZHA_LINK_EVENTS=0 (no netlink watcher), NEZHA_TCP_CONGESTION (per-socket congestion
control, e.g. cubic), NEZHA_LOG_OPS=1, NEZHA_DEBUG_SAMPLES=1, NEZHA_TRACE=1 (tx/rx per chunk).

Semantics: collectives are called in the same order with matching arguments on every rank
(a mismatch is detected and raised on every rank, at the latest at the next collective);
any failure makes the Context unusable (every later call raises the same error).

Systems: ``nezha`` (cost-balanced multi-rail), ``single`` (ring on the first rail only),
``stripe`` (static equal striping over all rails), ``mptcp`` (ring over one MPTCP connection
per peer). ``gloo`` (torch.distributed) is provided by ``nezha.baselines.GlooContext``;
``make_context(system="gloo", ...)`` returns one.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time

import numpy as np

from . import collectives, wire
from .balance import Balancer
from .engine import Engine
from .errors import (ConfigError, DuplicateRankError, MissingRankError, NezhaError,
                     RendezvousError, StoreError, StoreTimeout, WorldSizeMismatchError, RendezvousAborted)
from .events import Events
from .rails import parse_rails
from .store import StoreClient, StoreServer
from .transport import Connection, make_transport
from .transport.base import recv_exact_into, send_vec

SYSTEMS = ("nezha", "single", "stripe", "mptcp")
DTYPES = ("float32", "float64", "float16", "int32", "int64")
OPS = tuple(collectives.UFUNCS)
HELLO_TIMEOUT = 5.0       # s a connecting peer has to send its HELLO
MAX_HELLO = 64 << 10      # bytes of HELLO body accepted
_FORMATS = {"f": "float32", "d": "float64", "e": "float16", "i": "int32", "q": "int64",
            "l": "int64", "b": "int8", "B": "uint8"}


def _env(name, default=None):
    v = os.environ.get(name)
    return v if v not in (None, "") else default


def parse_master(master):
    if master is None:
        addr, port = _env("NEZHA_MASTER_ADDR"), _env("NEZHA_MASTER_PORT")
        if addr is None or port is None:
            raise ConfigError("no store address: pass master='HOST:PORT' or set "
                              "NEZHA_MASTER_ADDR and NEZHA_MASTER_PORT")
        return addr, int(port)
    if isinstance(master, (tuple, list)):
        return str(master[0]), int(master[1])
    host, _, port = str(master).rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"bad master address {master!r} (expected HOST:PORT)")
    return host, int(port)


def as_array(buf, dtype=None):
    """-> (1-D contiguous writable ndarray sharing memory with buf, write-back or None)."""
    if isinstance(buf, np.ndarray):
        if dtype is not None and np.dtype(dtype) != buf.dtype:
            raise ConfigError(f"dtype {dtype} given for an array of {buf.dtype}")
        if not buf.flags.writeable:
            raise ConfigError("buffer is read-only")
        if buf.flags.c_contiguous:
            arr = buf.reshape(-1)
            wb = None
        else:
            arr = np.ascontiguousarray(buf).reshape(-1)

            def wb():
                buf[...] = arr.reshape(buf.shape)
    else:
        try:
            mv = memoryview(buf)
        except TypeError:
            raise ConfigError(f"{type(buf).__name__} supports neither numpy nor the buffer protocol")
        if mv.readonly:
            raise ConfigError("buffer is read-only")
        if not mv.c_contiguous:
            raise ConfigError("buffer is not contiguous")
        if dtype is None:
            dtype = _FORMATS.get(mv.format)
            if dtype is None or dtype not in DTYPES:
                raise ConfigError(f"cannot infer a dtype from buffer format {mv.format!r}: pass dtype=")
        dt = np.dtype(dtype)
        raw = mv.cast("B")
        if len(raw) % dt.itemsize:
            raise ConfigError(f"buffer of {len(raw)} bytes is not a whole number of {dt.name}")
        arr = np.frombuffer(raw, dtype=dt)
        wb = None
    if arr.dtype.name not in DTYPES:
        raise ConfigError(f"unsupported dtype {arr.dtype.name} (supported: {', '.join(DTYPES)})")
    return arr, wb


class Context:
    def __init__(self, rank=None, world_size=None, rails=None, master=None, *, store=None,
                 timeout: float | None = None, system: str | None = None,
                 chunk_bytes: int = 512 << 10, events: str | None = None,
                 serve_store: bool | None = None, group: str = "nezha",
                 sockbuf: int | None = None, log_ops: bool = False):
        self.rank = int(rank if rank is not None else _env("NEZHA_RANK", -1))
        self.world_size = int(world_size if world_size is not None else _env("NEZHA_WORLD_SIZE", 0))
        self.system = system or _env("NEZHA_SYSTEM", "nezha")
        self.timeout = float(timeout if timeout is not None else _env("NEZHA_TIMEOUT", 30.0))
        if self.system not in SYSTEMS:
            raise ConfigError(f"unknown system {self.system!r} (one of {', '.join(SYSTEMS)}; "
                              f"'gloo' via nezha.baselines.make_context)")
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        self.rail_addrs = parse_rails(rails if rails is not None else _env("NEZHA_RAILS"))
        if self.system == "single":
            self.rail_addrs = self.rail_addrs[:1]
        self._closed = False
        self._health = None
        self._server = None
        self._store = None
        self._transport = None
        self._lock = threading.Lock()
        mode = {"nezha": "nezha", "stripe": "stripe", "single": "single", "mptcp": "single"}[self.system]
        self._transport = make_transport("mptcp" if self.system == "mptcp" else "tcp",
                                         self.rail_addrs, sockbuf=sockbuf or _int_env("NEZHA_SOCKBUF"),
                                         user_timeout_ms=_int_env("NEZHA_TCP_USER_TIMEOUT_MS")
                                         or int(self.timeout * 1000))
        self.nrails = self._transport.nrails
        self.events = Events(self.rank, self.nrails, events,
                             log_ops or _env("NEZHA_LOG_OPS", "0") == "1")
        self.balancer = Balancer(self.nrails, mode, chunk_bytes)
        self._engine = Engine(self.rank, self.world_size, self.nrails, self.balancer,
                              self.events, self.timeout,
                              staging_limit=_int_env("NEZHA_STAGING_LIMIT") or (1 << 30))
        self.events.emit("init", system=self.system, world=self.world_size, rails=self.rail_addrs)
        try:
            endpoints = self._transport.listen()
            self._rendezvous(store, master, serve_store, group, endpoints)
        except BaseException as e:
            if self._server is not None and self._store is not None:
                # tell ranks still waiting on our store why, before it goes away
                self._store.abort(f"rank {self.rank} (store host) failed: {e}")
                time.sleep(0.3)
            self._teardown()
            raise
        self.events.emit("connected", peers=self.world_size - 1, rails=self.nrails)
        self.events.emit("state", state="cold", reason="start", live=list(range(self.nrails)))

    @classmethod
    def from_env(cls, **kw):
        return cls(**kw)

    # ------------------------------------------------------------------ set-up
    def _rendezvous(self, store, master, serve_store, group, endpoints):
        deadline = time.monotonic() + self.timeout
        if store is None:
            host, port = parse_master(master)
            if serve_store is None:
                serve_store = self.rank == 0 and _env("NEZHA_STORE_EXTERNAL", "0") != "1"
            if serve_store:
                bind = "0.0.0.0"
                self._server = StoreServer(bind, port)
            store = StoreClient(host, port, timeout=self.timeout)
            self._store = store
        else:
            self._owned_store = False
        pre = f"{group}/"
        n = store.add(pre + f"claim/{self.rank}", 1)
        if n > 1:
            msg = f"rank {self.rank} was claimed by {n} processes"
            store.abort(msg)
            raise DuplicateRankError(msg)
        if self.rank == 0:
            store.set(pre + "session", secrets.token_hex(8))
        info = {"world": self.world_size, "rails": endpoints, "nrails": self.nrails,
                "system": self.system, "host": socket.gethostname(), "pid": os.getpid()}
        store.set(pre + f"info/{self.rank}", json.dumps(info))
        keys = [pre + f"info/{r}" for r in range(self.world_size)]
        try:
            store.wait(keys, max(0.0, deadline - time.monotonic()))
        except StoreTimeout:
            missing = [r for r in range(self.world_size) if not store.check([pre + f"info/{r}"])]
            raise MissingRankError(f"rank {self.rank}: ranks {missing} did not join within "
                                   f"{self.timeout:g} s (world size {self.world_size})") from None
        except RendezvousAborted as e:
            raise RendezvousAborted(f"rank {self.rank}: rendezvous aborted by another rank: {e}") from None
        except StoreError as e:
            raise RendezvousError(f"rank {self.rank}: the store failed during rendezvous "
                                  f"(did the rank serving it give up?): {e}") from None
        infos = [json.loads(store.get(k, 1.0)) for k in keys]
        for r, inf in enumerate(infos):
            bad = None
            if inf["world"] != self.world_size:
                bad = f"rank {r} has world size {inf['world']}, rank {self.rank} has {self.world_size}"
            elif inf["nrails"] != self.nrails or inf["system"] != self.system:
                bad = (f"rank {r} has {inf['nrails']} rails / system {inf['system']}, rank "
                       f"{self.rank} has {self.nrails} / {self.system}")
            if bad:
                store.abort(bad)
                raise WorldSizeMismatchError(bad)
        session = store.get(pre + "session", max(0.1, deadline - time.monotonic()))
        self._connect(infos, session, deadline)
        store.set(pre + f"connected/{self.rank}", "1")
        try:
            store.wait([pre + f"connected/{r}" for r in range(self.world_size)],
                       max(0.0, deadline - time.monotonic()))
        except StoreTimeout:
            raise RendezvousError(f"rank {self.rank}: not every rank finished connecting within "
                                  f"{self.timeout:g} s") from None

    def _hello(self, rail, session):
        body = json.dumps({"rank": self.rank, "rail": rail, "session": session,
                           "world": self.world_size}).encode()
        return wire.pack(wire.HELLO, 0, 0, 0, rail, self.rank, 0, 0, 0, 0, 0, len(body), 0, 0) + body

    def _connect(self, infos, session, deadline):
        tr = self._transport
        expected = {(p, r) for p in range(self.rank + 1, self.world_size) for r in range(self.nrails)}
        socks: dict = {}
        errors: list = []
        lock = threading.Lock()

        def admit(rail, s, m):
            if m["session"] != session or m["rail"] != rail or (m["rank"], rail) not in expected:
                raise ConnectionError(f"unexpected HELLO {m}")
            with lock:
                if (m["rank"], rail) in socks:
                    raise ConnectionError(f"second connection from rank {m['rank']} rail {rail}")
                socks[(m["rank"], rail)] = s

        def accept_loop(rail, lsock):
            while True:
                with lock:
                    if all((p, rail) in socks for p, r in expected if r == rail) or errors:
                        return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                lsock.settimeout(min(left, 0.5))
                try:
                    s, addr = lsock.accept()
                except socket.timeout:
                    continue
                except OSError as e:
                    errors.append(e)
                    return
                self._start_handshake(rail, s, addr, admit,
                                      max(0.1, min(HELLO_TIMEOUT, deadline - time.monotonic())))

        threads = [threading.Thread(target=accept_loop, args=(r, ls), daemon=True)
                   for r, ls in enumerate(tr.listeners)] if expected else []
        for t in threads:
            t.start()
        try:
            for p in range(self.rank):
                for r in range(self.nrails):
                    dest = infos[p]["rails"][r]
                    try:
                        s = tr.connect(r, dest, max(0.1, deadline - time.monotonic()))
                        send_vec(s, [self._hello(r, session)])
                    except OSError as e:
                        raise RendezvousError(f"rank {self.rank} cannot connect to rank {p} on rail "
                                              f"{r} ({self.rail_addrs[r]} -> {dest[0]}:{dest[1]}): "
                                              f"{e.strerror or e}") from e
                    socks[(p, r)] = s
        finally:
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()) + 0.5)
        missing = sorted(k for k in expected if k not in socks)
        if missing or errors:
            for s in socks.values():
                s.close()
            raise RendezvousError(f"rank {self.rank}: no connection from (rank, rail) {missing} "
                                  f"within {self.timeout:g} s {errors or ''}")
        eng = self._engine
        for (p, r), s in socks.items():
            eng.conns[(p, r)] = Connection(s, p, r, eng)
        for c in eng.conns.values():
            c.start()
        self._infos, self._session = infos, session
        # listeners stay open: a failed rail's higher rank reconnects through them
        for r, ls in enumerate(tr.listeners):
            threading.Thread(target=self._rejoin_acceptor, args=(r, ls), daemon=True,
                             name=f"nz-accept-r{r}").start()
        from .health import Health
        self._health = Health(self)
        self._health.start()

    def _read_hello(self, s, timeout):
        s.settimeout(timeout)
        hb = bytearray(wire.HEADER_SIZE)
        if not recv_exact_into(s, memoryview(hb), "hello"):
            raise ConnectionError("closed before HELLO")
        h = wire.unpack(hb)
        if h.type != wire.HELLO:
            raise ConnectionError(f"first frame is {wire.TYPE_NAMES.get(h.type, h.type)}, not HELLO")
        if h.length > MAX_HELLO:
            raise ConnectionError(f"HELLO of {h.length} bytes (at most {MAX_HELLO})")
        body = bytearray(h.length)
        recv_exact_into(s, memoryview(body), "hello")
        s.settimeout(None)
        m = json.loads(body)
        if not isinstance(m, dict):
            raise ConnectionError("HELLO body is not a JSON object")
        return m

    def _start_handshake(self, rail, s, addr, admit, timeout: float) -> None:
        """Read the HELLO of an accepted connection and hand it to ``admit(rail, s, hello)``
        (which raises to refuse it), in a thread of its own: a peer that sends half a HELLO
        and holds the socket must not keep the real ranks waiting at accept()."""
        def run():
            try:
                m = self._read_hello(s, timeout)
                self._transport.tune(s)
                admit(rail, s, m)
            except (OSError, ValueError, KeyError, TypeError, NezhaError, ConnectionError) as e:
                self._reject(s, rail, addr, e)
        threading.Thread(target=run, daemon=True, name=f"nz-hello-r{rail}").start()

    def _reject(self, s, rail, addr, why):
        """Close a connection that is not one of ours, and say so in the event log."""
        try:
            s.close()
        finally:
            self.events.emit("stray_connection", rail=rail,
                             peer=f"{addr[0]}:{addr[1]}" if addr else None,
                             reason=f"{type(why).__name__}: {why}"[:300])

    def _install(self, sock, peer, rail, how):
        eng = self._engine
        conn = Connection(sock, peer, rail, eng)
        with eng.cond:
            if eng.closing or eng.error is not None or peer in eng.gone:
                sock.close()
                return False
            old = eng.conns.get((peer, rail))
            eng.conns[(peer, rail)] = conn
            eng.dead.discard((peer, rail))
        if old is not None and old.alive:
            old.fail(ConnectionError("replaced by a rejoined connection"))
            with eng.cond:
                eng.dead.discard((peer, rail))
        conn.start()
        self.events.emit("rail_up", peer=peer, rail=rail, how=how)
        eng.report_rail("up", rail, peer)
        return True

    def _rejoin_acceptor(self, rail, lsock):
        eng = self._engine
        while not eng.closing:
            try:
                lsock.settimeout(0.5)
                s, addr = lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self._start_handshake(rail, s, addr, self._admit_rejoin, 2.0)

    def _admit_rejoin(self, rail, s, m):
        peer = int(m["rank"])
        if (m["session"] != self._session or m["rail"] != rail or
                not self.rank < peer < self.world_size):
            raise ConnectionError(f"unexpected HELLO {m}")
        self._install(s, peer, rail, "accepted")

    def _rejoin(self, peer, rail):
        """Reconnect a failed rail to a lower rank (called by the health thread)."""
        dest = self._infos[peer]["rails"][rail]
        s = self._transport.connect(rail, dest, 0.5, retry=False)
        try:
            send_vec(s, [self._hello(rail, self._session)])
        except OSError:
            s.close()
            raise
        self._install(s, peer, rail, "reconnected")

    # ------------------------------------------------------------------ collectives
    def _prepare(self, buf, dtype, op=None):
        if self._closed:
            raise ConfigError("the context is closed")
        if op is not None and op not in OPS:
            raise ConfigError(f"unknown reduction op {op!r} (one of {', '.join(OPS)})")
        return as_array(buf, dtype)

    def _maybe_exchange(self, nbytes):
        if not self.balancer.want_exchange(nbytes):
            return
        eng = self._engine
        table = self.balancer.local_table()
        live = np.ones((self.nrails, 1))
        for p in range(self.world_size):
            if p != self.rank:
                for r in range(self.nrails):
                    if (p, r) in eng.dead:
                        live[r] = 0.0
        mine = np.concatenate([table, live], axis=1).reshape(-1)
        out = np.zeros(self.world_size * mine.size, dtype=np.float64)
        out[self.rank * mine.size:(self.rank + 1) * mine.size] = mine
        op_id = eng.begin_op()
        try:
            collectives.ring_allgather(eng, op_id, out, mine.size, kind=wire.K_CONTROL)
        finally:
            eng.end_op(op_id)
        tables = out.reshape(self.world_size, self.nrails, 4)
        evs = []
        agreed_live = [r for r in range(self.nrails) if tables[:, r, 3].min() > 0]
        if agreed_live:
            evs += self.balancer.set_live(agreed_live)
        evs += self.balancer.agree(tables[:, :, :3])
        for name, fields in evs:
            if name == "state":
                self.events.state = fields["state"]
            if name == "weights":
                self.events.weights = fields["shares"]
            self.events.emit(name, **fields)

    def _run(self, kind_name, nbytes, fn):
        with self._lock:
            if self.events.log_ops:
                self.events.emit("call", kind=kind_name, bytes=nbytes)
            self._maybe_exchange(nbytes)
            eng = self._engine
            op_id = eng.begin_op()
            if self.events.log_ops:
                self.events.emit("op_start", op=op_id, kind=kind_name, bytes=nbytes)
            try:
                fn(eng, op_id)
            finally:
                eng.end_op(op_id)
            if self.events.log_ops:
                self.events.emit("op_end", op=op_id, kind=kind_name, bytes=nbytes)

    def allreduce(self, buf, op: str = "sum", dtype=None):
        """Reduce ``buf`` over all ranks, in place. Returns ``buf``."""
        arr, wb = self._prepare(buf, dtype, op)
        self._run("allreduce", arr.nbytes,
                  lambda eng, op_id: collectives.ring_allreduce(eng, op_id, arr, op))
        if wb:
            wb()
        return buf

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

        def fn(eng, op_id):
            collectives.ring_allreduce(eng, op_id, work, op, kind=wire.K_REDUCE_SCATTER,
                                       shift=-1, rs_only=True)
        self._run("reduce_scatter", arr.nbytes, fn)
        out[:] = work[self.rank * m:(self.rank + 1) * m]
        if wb:
            wb()
        return outbuf

    def allgather(self, inbuf, outbuf, dtype=None):
        """``outbuf`` (world_size * len(inbuf) elements) gets every rank's ``inbuf`` in rank order."""
        arr, _ = self._prepare(inbuf, dtype)
        out, wb = self._prepare(outbuf, dtype)
        m, n = len(arr), self.world_size
        if out.dtype != arr.dtype or len(out) != n * m:
            raise ConfigError(f"allgather: outbuf must have world_size * len(inbuf) = {n * m} "
                              f"elements of {arr.dtype}, got {len(out)} of {out.dtype}")
        out[self.rank * m:(self.rank + 1) * m] = arr
        self._run("allgather", arr.nbytes,
                  lambda eng, op_id: collectives.ring_allgather(eng, op_id, out, m))
        if wb:
            wb()
        return outbuf

    def broadcast(self, buf, root: int = 0, dtype=None):
        arr, wb = self._prepare(buf, dtype)
        if not 0 <= root < self.world_size:
            raise ConfigError(f"root {root} is outside 0..{self.world_size - 1}")
        self._run("broadcast", arr.nbytes,
                  lambda eng, op_id: collectives.broadcast(eng, op_id, arr, root))
        if wb:
            wb()
        return buf

    def barrier(self):
        arr = np.zeros(1, dtype=np.int32)
        self._run("barrier", 0, lambda eng, op_id: collectives.ring_allreduce(
            eng, op_id, arr, "sum", kind=wire.K_BARRIER))

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

    # ------------------------------------------------------------------ teardown
    def _teardown(self):
        eng = self._engine
        eng.closing = True
        if getattr(self, "_health", None) is not None:
            self._health.close()
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
        if self._store is not None:
            self._store.close()
        if self._server is not None:
            self._server.close()
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


def _int_env(name):
    v = _env(name)
    return int(v) if v is not None else None
