"""Rendezvous and handshake: from a rank number to a connection per (peer, rail).

1. Meet (``Rendezvous.meet``): through the key-value store (served by rank 0 unless
   NEZHA_STORE_EXTERNAL=1), every rank claims its rank (a second claim aborts the job),
   rank 0 draws a random session token, and every rank publishes its listening endpoints
   and checks that all agree on world size, rail count and system.
2. Connect (``Rendezvous.connect``): every rank dials the lower ranks on every rail and
   accepts the higher ones. Every connection starts with a HELLO (wire.py) carrying rank,
   rail and session; an accepted connection whose HELLO is wrong, late (HELLO_TIMEOUT) or
   too large (MAX_HELLO) is closed and logged (``stray_connection``), each in a thread of
   its own, so a stranger holding a half-sent HELLO cannot stall the real ranks.
3. Rejoin: the listeners stay open. The higher rank of a failed pair re-dials
   (``rejoin``, called by health.py) and the lower rank admits it with the same checks; the
   new connection replaces the old one in the engine (``rail_up``).
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from . import wire
from .config import Config
from .errors import (ConfigError, DuplicateRankError, MissingRankError, NezhaError,
                     RendezvousAborted, RendezvousError, StoreError, StoreTimeout,
                     WorldSizeMismatchError)
from .store import StoreClient, StoreServer
from .transport import Connection
from .transport.base import recv_exact_into, send_vec

HELLO_TIMEOUT = 5.0       # s a connecting peer has to send its HELLO
MAX_HELLO = 64 << 10      # bytes of HELLO body accepted


def parse_master(master, config: Config) -> tuple[str, int]:
    """'HOST:PORT' or (host, port); None: NEZHA_MASTER_ADDR and NEZHA_MASTER_PORT."""
    if master is None:
        addr, port = config.master_addr, config.master_port
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


@dataclass(frozen=True)
class Member:
    """This rank, as it introduces itself to the others."""
    rank: int
    world_size: int
    nrails: int
    system: str
    rail_addrs: tuple
    timeout: float


def _left(deadline: float, least: float = 0.0) -> float:
    return max(least, deadline - time.monotonic())


class Rendezvous:
    """One rank's side of meeting and connecting (see the module docstring)."""

    def __init__(self, me: Member, transport, engine, events):
        self.me, self.transport, self.engine, self.events = me, transport, engine, events
        self.store: Optional[StoreClient] = None
        self.server: Optional[StoreServer] = None   # ours if we serve the store
        self.owned_store: Optional[StoreClient] = None
        self.infos: list = []
        self.session = ""
        self.pre = ""

    # ------------------------------------------------------------------ 1. meet
    def open_store(self, store, master, serve_store: Optional[bool], config: Config) -> None:
        """Use the given store client, or connect to (and maybe serve) the one at ``master``."""
        if store is None:
            host, port = parse_master(master, config)
            if serve_store is None:
                serve_store = self.me.rank == 0 and not config.store_external
            if serve_store:
                self.server = StoreServer("0.0.0.0", port)
            store = self.owned_store = StoreClient(host, port, timeout=self.me.timeout)
        self.store = store

    def meet(self, group: str, endpoints, deadline: float) -> None:
        me, store = self.me, self.store
        self.pre = pre = f"{group}/"
        n = store.add(pre + f"claim/{me.rank}", 1)
        if n > 1:
            msg = f"rank {me.rank} was claimed by {n} processes"
            store.abort(msg)
            raise DuplicateRankError(msg)
        if me.rank == 0:
            store.set(pre + "session", secrets.token_hex(8))
        info = {"world": me.world_size, "rails": endpoints, "nrails": me.nrails,
                "system": me.system, "host": socket.gethostname(), "pid": os.getpid()}
        store.set(pre + f"info/{me.rank}", json.dumps(info))
        keys = [pre + f"info/{r}" for r in range(me.world_size)]
        self._wait_infos(keys, deadline)
        self.infos = [json.loads(store.get(k, 1.0)) for k in keys]
        self._check_infos()
        self.session = store.get(pre + "session", _left(deadline, 0.1))

    def _wait_infos(self, keys, deadline: float) -> None:
        me, store = self.me, self.store
        try:
            store.wait(keys, _left(deadline))
        except StoreTimeout:
            missing = [r for r in range(me.world_size) if not store.check([self.pre + f"info/{r}"])]
            raise MissingRankError(f"rank {me.rank}: ranks {missing} did not join within "
                                   f"{me.timeout:g} s (world size {me.world_size})") from None
        except RendezvousAborted as e:
            raise RendezvousAborted(f"rank {me.rank}: rendezvous aborted by another rank: {e}") from None
        except StoreError as e:
            raise RendezvousError(f"rank {me.rank}: the store failed during rendezvous "
                                  f"(did the rank serving it give up?): {e}") from None

    def _check_infos(self) -> None:
        me = self.me
        for r, inf in enumerate(self.infos):
            bad = None
            if inf["world"] != me.world_size:
                bad = f"rank {r} has world size {inf['world']}, rank {me.rank} has {me.world_size}"
            elif inf["nrails"] != me.nrails or inf["system"] != me.system:
                bad = (f"rank {r} has {inf['nrails']} rails / system {inf['system']}, rank "
                       f"{me.rank} has {me.nrails} / {me.system}")
            if bad:
                self.store.abort(bad)
                raise WorldSizeMismatchError(bad)

    def all_connected(self, deadline: float) -> None:
        """Store barrier: every rank has all its connections."""
        me, store = self.me, self.store
        store.set(self.pre + f"connected/{me.rank}", "1")
        try:
            store.wait([self.pre + f"connected/{r}" for r in range(me.world_size)], _left(deadline))
        except StoreTimeout:
            raise RendezvousError(f"rank {me.rank}: not every rank finished connecting within "
                                  f"{me.timeout:g} s") from None

    def abort_store(self, why: str) -> None:
        """We serve the store and fail: tell the ranks still waiting on it why, first."""
        if self.server is not None and self.owned_store is not None:
            self.owned_store.abort(why)
            time.sleep(0.3)

    def close(self) -> None:
        if self.owned_store is not None:
            self.owned_store.close()
        if self.server is not None:
            self.server.close()

    # ------------------------------------------------------------------ 2. connect
    def connect(self, deadline: float) -> None:
        """Dial the lower ranks, accept the higher ones (every rail), hand the sockets to the
        engine as Connections, then keep accepting rejoins."""
        me = self.me
        admission = _Admission(self, deadline)
        threads = [threading.Thread(target=admission.accept_loop, args=(r, ls), daemon=True)
                   for r, ls in enumerate(self.transport.listeners)] if admission.expected else []
        for t in threads:
            t.start()
        try:
            for p in range(me.rank):
                for r in range(me.nrails):
                    admission.socks[(p, r)] = self._dial(p, r, deadline)
        finally:
            for t in threads:
                t.join(_left(deadline) + 0.5)
        socks = admission.result()
        eng = self.engine
        for (p, r), s in socks.items():
            eng.conns[(p, r)] = Connection(s, p, r, eng)
        for c in eng.conns.values():
            c.start()
        # listeners stay open: a failed rail's higher rank reconnects through them
        for r, ls in enumerate(self.transport.listeners):
            threading.Thread(target=self._rejoin_acceptor, args=(r, ls), daemon=True,
                             name=f"nz-accept-r{r}").start()

    def _dial(self, peer: int, rail: int, deadline: float) -> socket.socket:
        dest = self.infos[peer]["rails"][rail]
        try:
            s = self.transport.connect(rail, dest, _left(deadline, 0.1))
            send_vec(s, [self._hello(rail)])
        except OSError as e:
            raise RendezvousError(f"rank {self.me.rank} cannot connect to rank {peer} on rail "
                                  f"{rail} ({self.me.rail_addrs[rail]} -> {dest[0]}:{dest[1]}): "
                                  f"{e.strerror or e}") from e
        return s

    # ------------------------------------------------------------------ HELLO
    def _hello(self, rail: int) -> bytes:
        body = json.dumps({"rank": self.me.rank, "rail": rail, "session": self.session,
                           "world": self.me.world_size}).encode()
        return wire.frame(wire.HELLO, body, rail=rail, src=self.me.rank)

    @staticmethod
    def _read_hello(s, timeout: float) -> dict:
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

    def start_handshake(self, rail: int, s, addr, admit: Callable, timeout: float) -> None:
        """Read the HELLO of an accepted connection and hand it to ``admit(rail, s, hello)``
        (which raises to refuse it), in a thread of its own: a peer that sends half a HELLO
        and holds the socket must not keep the real ranks waiting at accept()."""
        def run():
            try:
                m = self._read_hello(s, timeout)
                self.transport.tune(s)
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

    # ------------------------------------------------------------------ 3. rejoin
    def _install(self, sock, peer, rail, how) -> bool:
        eng = self.engine
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
        while not self.engine.closing:
            try:
                lsock.settimeout(0.5)
                s, addr = lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.start_handshake(rail, s, addr, self._admit_rejoin, 2.0)

    def _admit_rejoin(self, rail, s, m):
        peer = int(m["rank"])
        if (m["session"] != self.session or m["rail"] != rail or
                not self.me.rank < peer < self.me.world_size):
            raise ConnectionError(f"unexpected HELLO {m}")
        self._install(s, peer, rail, "accepted")

    def rejoin(self, peer: int, rail: int) -> None:
        """Reconnect a failed rail to a lower rank (called by the health thread)."""
        dest = self.infos[peer]["rails"][rail]
        s = self.transport.connect(rail, dest, 0.5, retry=False)
        try:
            send_vec(s, [self._hello(rail)])
        except OSError:
            s.close()
            raise
        self._install(s, peer, rail, "reconnected")


class _Admission:
    """The accepting half of the first connect: which (higher rank, rail) pairs may dial us,
    and the sockets gathered so far (the dialled ones are added by Rendezvous.connect)."""

    def __init__(self, rdv: Rendezvous, deadline: float):
        me = rdv.me
        self.rdv, self.deadline = rdv, deadline
        self.expected = {(p, r) for p in range(me.rank + 1, me.world_size)
                         for r in range(me.nrails)}
        self.socks: dict = {}
        self.errors: list = []
        self.lock = threading.Lock()

    def admit(self, rail, s, m):
        if (m["session"] != self.rdv.session or m["rail"] != rail
                or (m["rank"], rail) not in self.expected):
            raise ConnectionError(f"unexpected HELLO {m}")
        with self.lock:
            if (m["rank"], rail) in self.socks:
                raise ConnectionError(f"second connection from rank {m['rank']} rail {rail}")
            self.socks[(m["rank"], rail)] = s

    def accept_loop(self, rail, lsock):
        while True:
            with self.lock:
                done = all((p, rail) in self.socks for p, r in self.expected if r == rail)
                if done or self.errors:
                    return
            left = self.deadline - time.monotonic()
            if left <= 0:
                return
            lsock.settimeout(min(left, 0.5))
            try:
                s, addr = lsock.accept()
            except socket.timeout:
                continue
            except OSError as e:
                self.errors.append(e)
                return
            self.rdv.start_handshake(rail, s, addr, self.admit,
                                     max(0.1, min(HELLO_TIMEOUT, self.deadline - time.monotonic())))

    def result(self) -> dict:
        """Every expected socket, or RendezvousError (closing what we have)."""
        missing = sorted(k for k in self.expected if k not in self.socks)
        if missing or self.errors:
            for s in self.socks.values():
                s.close()
            me = self.rdv.me
            raise RendezvousError(f"rank {me.rank}: no connection from (rank, rail) {missing} "
                                  f"within {me.timeout:g} s {self.errors or ''}")
        return self.socks
