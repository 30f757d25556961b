"""Rendezvous and handshake: from a rank number to an authenticated connection per (peer, rail).

1. Meet (``Rendezvous.meet``): through the key-value store (served by rank 0 on the master
   address unless NEZHA_STORE_EXTERNAL=1; every store connection proves the job secret,
   store.py), every rank claims its rank (a second claim aborts the job), rank 0 draws a
   random session token, and every rank publishes its listening endpoints and checks that it
   agrees with rank 0 on world size, rail count and system (so all agree, or one aborts the
   job). The rail key is HMAC(secret, session, group). A rank reads the records of rank 0
   and of its start peers only, another peer's when it first connects to it (``PeerInfos``).
2. Connect (``Rendezvous.connect``): every rank dials its lower *start peers* on every rail
   and accepts the higher ones. The start peers are the ring neighbours r-1 and r+1 (every
   collective's data goes round the ring, and the control plane is relayed round it,
   engine/agreement.py), or every rank with NEZHA_CONNECT=full or up to FULL_MESH_MAX ranks:
   a full mesh of 64 ranks x 2 rails held 126 connections (252 threads) per rank, and on a
   2-core host idle ones missed heartbeats. Any other pair connects *on demand*
   (``Rendezvous.reach``, called by the engine before the first message to a peer it has no
   connection to), with the same handshake and key as a first connection (HELLO "lazy"):
   either side may dial; when both do at once the higher rank wins (it refuses the lower
   rank's dial, ``CROSSING``, and the lower rank waits for its connection). Every connection
   starts with this handshake (wire.py's HELLO and AUTH frames; auth.py)::

       dialler  -> acceptor  HELLO {rank, rail, world, nonce Nd, auth, rejoin, lazy}
       acceptor -> dialler   AUTH  {nonce Na, proof HMAC(K, "acceptor", T), auth}
       dialler  -> acceptor  AUTH  {proof HMAC(K, "dialler", T)}
       acceptor -> dialler   AUTH  {ok: true, token} | {ok: false, reason}

   T = (dialler rank, acceptor rank, rail, world size, Nd, Na), Nd and Na 32 fresh random bytes;
   K = the rail key on the first connect (at start or on demand), HMAC(rail key, token) on a
   rejoin, where token is the random value the acceptor sent in the verdict of that pair's
   first connection on that rail (it never goes through the store). Each side checks the other's proof; a socket
   becomes a Connection only after the verdict, so no frame is taken from a peer that has not
   proven K, and a recorded handshake replayed later fails on the new Na / Nd. An accepted
   connection whose handshake is wrong, late (HELLO_TIMEOUT for all of it), too large
   (MAX_HELLO) or beyond the cap of handshakes in progress is closed and logged
   (``stray_connection``), each in a thread of its own, so a stranger holding a half-sent
   HELLO cannot stall the real ranks.
3. Rejoin: the listeners stay open. The higher rank of a failed pair re-dials (``rejoin``,
   called by health.py) and the lower rank admits it with the same handshake; the new
   connection replaces the old one in the engine (``rail_up``). With a job secret it may
   replace one the acceptor still thinks alive (the dialler saw it fail first); without one,
   only a connection the engine already considers failed (the acceptor waits up to REJOIN_WAIT
   for the dialler's "down" report): whatever a stranger learns from an unauthenticated store,
   it cannot take over a live connection.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Optional

from . import auth, wire
from .config import Config
from .errors import (AuthenticationError, ConfigError, DuplicateRankError, MissingRankError,
                     NezhaError, RendezvousAborted, RendezvousError, StoreError, StoreTimeout,
                     WorldSizeMismatchError)
from .store import StoreClient, StoreServer
from .transport import Connection
from .transport.base import send_vec

HELLO_TIMEOUT = 5.0       # s an accepted connection has for its whole handshake
REJOIN_TIMEOUT = 2.5      # s the dialler of a rejoin waits for the handshake
REJOIN_ACCEPT = 3.0       # s the acceptor of a rejoin gives it
REJOIN_WAIT = 1.0         # s an unauthenticated rejoin waits for the old connection to fail
MAX_HELLO = 4 << 10       # bytes of HELLO / AUTH body accepted
FULL_MESH_MAX = 4         # up to this many ranks the ring neighbours are every peer anyway
CROSSING = "crossing dials: the higher rank's connection is kept"
RECORD_WAIT_MAX = 10.0    # s a record read may wait (+5 s for its reply to start arriving): the
                          # record is known to be there, but 64 hosts' replies on a 1 Mbit/s
                          # rail took more than the 1 + 5 s a read had before

_ACCEPTOR, _DIALLER = b"nezha-rail-acceptor", b"nezha-rail-dialler"
_T = struct.Struct("!IIII")


class _Refused(ConnectionError):
    """The other side of a handshake said no, and why."""


def _no_constants(name):
    raise ValueError(f"{name} in a handshake")


def _recv_by(s, view, deadline: float, what: str) -> None:
    """Fill ``view`` by ``deadline`` (the whole read, not each recv: a peer dribbling bytes
    cannot stretch it)."""
    got = 0
    while got < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"{what}: not complete in time")
        s.settimeout(left)
        k = s.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"closed during {what}")
        got += k


def _read_frame(s, want: int, src: Optional[int], deadline: float, what: str):
    """One handshake frame of type ``want`` (from ``src``): (header, JSON object)."""
    hb = bytearray(wire.HEADER_SIZE)
    _recv_by(s, memoryview(hb), deadline, what)
    h = wire.unpack(hb)
    if h.type != want:
        raise ConnectionError(f"{wire.TYPE_NAMES.get(h.type, h.type)} frame instead of "
                              f"{wire.TYPE_NAMES[want]} ({what})")
    if src is not None and h.src != src:
        raise ConnectionError(f"{what} claims rank {h.src}, expected rank {src}")
    if h.length > MAX_HELLO:
        raise ConnectionError(f"{wire.TYPE_NAMES[want]} of {h.length} bytes (at most {MAX_HELLO})")
    body = bytearray(h.length)
    _recv_by(s, memoryview(body), deadline, what)
    m = json.loads(body, parse_constant=_no_constants)
    if not isinstance(m, dict):
        raise ConnectionError(f"{wire.TYPE_NAMES[want]} body is not a JSON object")
    return h, m


def _hex(m: dict, name: str, n: int) -> bytes:
    v = m.get(name)
    if not isinstance(v, str) or len(v) != 2 * n:
        raise ConnectionError(f"handshake without a valid {name}")
    return bytes.fromhex(v)


def _int(m: dict, name: str) -> int:
    v = m.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConnectionError(f"handshake without a valid {name}")
    return v


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
    plan: tuple = ()     # settings that choose algorithms and step ids: equal on every rank


def _left(deadline: float, least: float = 0.0) -> float:
    return max(least, deadline - time.monotonic())


def start_peers(rank: int, world: int, mode: str = "ring") -> set[int]:
    """The peers connected at start: the ring neighbours (``mode`` "ring"), or every rank
    ("full", or a world of at most FULL_MESH_MAX where the two are the same)."""
    if mode == "full" or world <= FULL_MESH_MAX:
        return set(range(world)) - {rank}
    return {(rank - 1) % world, (rank + 1) % world}


class PeerInfos:
    """The ranks' published records (endpoints per rail, world, system, ...), read from the
    store when first needed: at the meeting rank 0's and the start peers', another peer's
    when this rank first connects to it. Why: every rank reading all n records moved n^2 of
    them through the store host's first rail; 64 hosts on 1 Mbit/s rails made 4096 requests
    and ~1.3 MB of replies there, and ranks timed out in the middle of the rendezvous."""

    def __init__(self, store: StoreClient, pre: str, timeout: float):
        self._store, self._pre, self._timeout = store, pre, timeout
        self._known: dict[int, dict] = {}
        self._lock = threading.Lock()

    def cached(self, rank: int) -> dict | None:
        """``rank``'s record if it was read, else None (never waits on the store)."""
        with self._lock:
            return self._known.get(rank)

    def read(self, ranks) -> None:
        """Read the records of ``ranks`` that are not read yet."""
        for r in sorted(ranks):
            self[r]

    def __getitem__(self, rank: int) -> dict:
        info = self.cached(rank)
        if info is None:
            got = json.loads(self._store.get(self._pre + f"info/{rank}", self._timeout))
            if not isinstance(got, dict) or not isinstance(got.get("rails"), list):
                raise RendezvousError(f"rank {rank}'s record in the store is not a rank's "
                                      f"record: {str(got)[:80]}")
            with self._lock:
                info = self._known.setdefault(rank, got)
        return info

    def known(self) -> dict[int, dict]:
        """The records read so far, by rank."""
        with self._lock:
            return dict(self._known)

    def endpoint(self, rank: int, rail: int) -> tuple | None:
        """``rank``'s endpoint on ``rail`` if its record was read, else None: for the path
        prober's thread, which must not wait on the store (a peer's record is read when the
        first connection to it is made)."""
        info = self.cached(rank)
        return None if info is None else tuple(info["rails"][rail])


class Rendezvous:
    """One rank's side of meeting and connecting (see the module docstring). ``secret``: the
    job secret (None: unauthenticated, said once in the log and the event log)."""

    def __init__(self, me: Member, transport, engine, events, secret=None,
                 connect: str = "ring"):
        self.me, self.transport, self.engine, self.events = me, transport, engine, events
        self.peers = start_peers(me.rank, me.world_size, connect)
        self.secret = auth.secret_bytes(secret)
        self.store: Optional[StoreClient] = None
        self.server: Optional[StoreServer] = None   # ours if we serve the store
        self.owned_store: Optional[StoreClient] = None
        self.infos: PeerInfos | None = None
        self.session = ""
        self.pre = ""
        self.rail_key = b""
        self.tokens: dict = {}      # (peer, rail) -> token of the pair's first connection there
        self.max_handshakes = 4 * me.world_size * max(1, me.nrails) + 16
        self._handshakes = 0
        self._hs_lock = threading.Lock()
        # connections on demand in progress: (peer, rail) we dial / whose dial we admit
        self._dialling: set = set()
        self._accepting: set = set()
        self._lazy_lock = threading.Lock()
        self._peer_locks: dict = {}
        self._rejoin_lock = threading.Lock()   # one re-dial at a time (rejoin, redial)
        if not self.secret:
            auth.warn(events, f"rank {me.rank}")

    # ------------------------------------------------------------------ 1. meet
    def open_store(self, store, master, serve_store: Optional[bool], config: Config) -> None:
        """Use the given store client, or connect to (and maybe serve) the one at ``master``.
        The store binds the master address only (not every interface)."""
        if store is None:
            host, port = parse_master(master, config)
            if serve_store is None:
                serve_store = self.me.rank == 0 and not config.store_external
            if serve_store:
                cap = config.store_max_clients or 4 * self.me.world_size + 16
                self.server = StoreServer(host, port, secret=self.secret, max_clients=cap,
                                          events=self.events)
            store = self.owned_store = StoreClient(host, port, timeout=self.me.timeout,
                                                   secret=self.secret)
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
            store.set(pre + "session", secrets.token_hex(16))
        info = {"world": me.world_size, "rails": endpoints, "nrails": me.nrails,
                "system": me.system, "plan": list(me.plan), "host": socket.gethostname(),
                "pid": os.getpid()}
        store.set(pre + f"info/{me.rank}", json.dumps(info))
        keys = [pre + f"info/{r}" for r in range(me.world_size)]
        self._wait_infos(keys, deadline)
        self.infos = PeerInfos(store, pre, max(1.0, min(me.timeout, RECORD_WAIT_MAX)))
        self.infos.read({0, me.rank} | self.peers)
        self._check_infos()
        self.session = store.get(pre + "session", _left(deadline, 0.1))
        self.rail_key = auth.mac(self.secret, b"nezha-rail-key", self.session.encode(),
                                 group.encode())

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
        for r, inf in sorted(self.infos.known().items()):
            bad = None
            if inf["world"] != me.world_size:
                bad = f"rank {r} has world size {inf['world']}, rank {me.rank} has {me.world_size}"
            elif inf["nrails"] != me.nrails or inf["system"] != me.system:
                bad = (f"rank {r} has {inf['nrails']} rails / system {inf['system']}, rank "
                       f"{me.rank} has {me.nrails} / {me.system}")
            elif inf.get("plan") != list(me.plan):
                bad = (f"rank {r} has NEZHA_PIPE_BLOCK, NEZHA_DIRECT_MAX = {inf.get('plan')}, "
                       f"rank {me.rank} has {list(me.plan)}: every rank must use the same "
                       f"(they choose the algorithm and its message ids)")
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

    def close(self, linger_s: float = 0.0) -> None:
        """Close the store client, and the store if this rank serves it: once the other ranks
        closed theirs (StoreServer.linger), at most ``linger_s`` s later."""
        if self.owned_store is not None:
            self.owned_store.close()
        if self.server is not None:
            t0 = time.monotonic()
            left = self.server.linger(linger_s) if linger_s > 0 else 0
            if left:
                self.events.emit("store_closed_early", clients=left,
                                 waited_s=round(time.monotonic() - t0, 3))
            self.server.close()

    # ------------------------------------------------------------------ 2. connect
    def connect(self, deadline: float) -> None:
        """Dial the lower start peers, accept the higher ones (every rail), hand the sockets to
        the engine as Connections, then keep accepting rejoins and connections on demand."""
        me = self.me
        admission = _Admission(self, deadline)
        threads = [threading.Thread(target=admission.accept_loop, args=(r, ls), daemon=True)
                   for r, ls in enumerate(self.transport.listeners)] if admission.expected else []
        for t in threads:
            t.start()
        try:
            for p in sorted(q for q in self.peers if q < me.rank):
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
        eng.reach_peer = self.reach
        # listeners stay open: a failed rail's higher rank reconnects through them
        rejoins = _Rejoins(self)
        for r, ls in enumerate(self.transport.listeners):
            threading.Thread(target=self._rejoin_acceptor, args=(r, ls, rejoins), daemon=True,
                             name=f"nz-accept-r{r}").start()

    def _dial(self, peer: int, rail: int, deadline: float) -> socket.socket:
        """A connection to ``peer`` on ``rail`` through the handshake. A connection closed
        before the verdict (the peer not listening yet, or at its cap of handshakes) is tried
        again until ``deadline``; a refusal or a failed proof is final."""
        dest = self.infos[peer]["rails"][rail]
        where = (f"rank {self.me.rank} -> rank {peer} on rail {rail} "
                 f"({self.me.rail_addrs[rail]} -> {dest[0]}:{dest[1]})")
        while True:
            try:
                s = self.transport.connect(rail, dest, _left(deadline, 0.1))
            except OSError as e:
                raise RendezvousError(f"{where}: cannot connect: {e.strerror or e}") from e
            try:
                verdict = self._dial_handshake(s, peer, rail, self.rail_key, False, deadline)
                self.tokens[(peer, rail)] = _hex(verdict, "token", auth.NONCE_BYTES)
                s.settimeout(None)
                return s
            except AuthenticationError as e:
                s.close()
                raise AuthenticationError(f"{where}: {e}") from None
            except _Refused as e:
                s.close()
                raise RendezvousError(f"{where}: refused: {e}") from None
            except (OSError, ConnectionError, ValueError, NezhaError) as e:
                s.close()
                if time.monotonic() >= deadline - 0.05:
                    raise RendezvousError(f"{where}: no handshake within {self.me.timeout:g} s: "
                                          f"{type(e).__name__}: {e}") from None
                time.sleep(0.05)

    # ------------------------------------------------------------------ handshake
    def _transcript(self, dialler: int, acceptor: int, rail: int, nd: bytes, na: bytes):
        return (_T.pack(dialler, acceptor, rail, self.me.world_size), nd, na)

    def _say(self, s, rail: int, body: dict) -> None:
        """Send one AUTH frame (small: it never waits on a full socket buffer for long)."""
        s.settimeout(1.0)
        send_vec(s, [wire.frame(wire.AUTH, json.dumps(body).encode(), rail=rail,
                                src=self.me.rank)])
        s.settimeout(None)

    def _dial_handshake(self, s, peer: int, rail: int, key: bytes, rejoin: bool,
                        deadline: float, lazy: bool = False) -> dict:
        """The dialler's side; returns the acceptor's verdict {"ok": true, ...}. Raises
        AuthenticationError (no proof, secret on one side only), _Refused, or a socket error."""
        me, mine = self.me, bool(self.secret)
        nd = auth.nonce()
        hello = {"rank": me.rank, "rail": rail, "world": me.world_size, "nonce": nd.hex(),
                 "auth": mine, "rejoin": rejoin, "lazy": lazy}
        s.settimeout(max(0.01, deadline - time.monotonic()))
        send_vec(s, [wire.frame(wire.HELLO, json.dumps(hello).encode(), rail=rail, src=me.rank)])
        _, m = _read_frame(s, wire.AUTH, peer, deadline, f"the challenge of rank {peer}")
        if "auth" in m and bool(m["auth"]) != mine:
            raise AuthenticationError(
                f"rank {peer} has {'a' if m['auth'] else 'no'} job secret, this rank has "
                f"{'one' if mine else 'none'} (NEZHA_JOB_SECRET must be the same on every rank)")
        if m.get("ok") is False:
            raise _Refused(str(m.get("reason"))[:300])
        na = _hex(m, "nonce", auth.NONCE_BYTES)
        t = self._transcript(me.rank, peer, rail, nd, na)
        if not auth.same(_hex(m, "proof", auth.TAG_BYTES), auth.mac(key, _ACCEPTOR, *t)):
            raise AuthenticationError(f"rank {peer} did not prove the job secret")
        self._say(s, rail, {"proof": auth.mac(key, _DIALLER, *t).hex()})
        _, v = _read_frame(s, wire.AUTH, peer, deadline, f"the verdict of rank {peer}")
        if v.get("ok") is not True:
            raise _Refused(str(v.get("reason"))[:300])
        return v

    def start_handshake(self, rail: int, s, addr, gate, timeout: float) -> None:
        """Run the acceptor's side of the handshake of an accepted connection in a thread of
        its own (a peer that sends half a HELLO and holds the socket must not keep the real
        ranks waiting at accept()), at most ``max_handshakes`` at once. ``gate`` says which
        key a dialler must prove (``key(peer, rail, rejoin, lazy)``) and takes the proven
        socket (``admit(rail, s, peer, lazy)``); either raises to refuse it."""
        with self._hs_lock:
            busy = self._handshakes >= self.max_handshakes
            if not busy:
                self._handshakes += 1
        if busy:
            self._reject(s, rail, addr, ConnectionError(
                f"{self.max_handshakes} handshakes already in progress"))
            return

        def run():
            try:
                self._accept_handshake(rail, s, gate, time.monotonic() + timeout)
            except (OSError, ValueError, KeyError, TypeError, NezhaError, ConnectionError) as e:
                if str(e) == CROSSING:      # a member's dial that lost the race: not a stray
                    s.close()
                else:
                    self._reject(s, rail, addr, e)
            finally:
                with self._hs_lock:
                    self._handshakes -= 1
        threading.Thread(target=run, daemon=True, name=f"nz-hello-r{rail}").start()

    def _accept_handshake(self, rail: int, s, gate, deadline: float) -> None:
        me, mine = self.me, bool(self.secret)
        h, m = _read_frame(s, wire.HELLO, None, deadline, "HELLO")
        peer = _int(m, "rank")
        if h.src != peer or m.get("rail") != rail or m.get("world") != me.world_size:
            raise ConnectionError(f"unexpected HELLO (src {h.src}, rail {rail}): "
                                  f"{json.dumps(m)[:200]}")
        nd = _hex(m, "nonce", auth.NONCE_BYTES)
        if bool(m.get("auth")) != mine:
            why = (f"this job has {'a' if mine else 'no'} job secret, the dialler "
                   f"{'has one' if m.get('auth') else 'has none'}")
            self._refuse(s, rail, why)
            raise AuthenticationError(why)
        try:
            lazy = m.get("lazy") is True
            key = gate.key(peer, rail, m.get("rejoin") is True, lazy)
        except ConnectionError as e:
            self._refuse(s, rail, str(e))
            raise
        na = auth.nonce()
        t = self._transcript(peer, me.rank, rail, nd, na)
        self._say(s, rail, {"nonce": na.hex(), "proof": auth.mac(key, _ACCEPTOR, *t).hex(),
                            "auth": mine})
        _, p = _read_frame(s, wire.AUTH, peer, deadline, f"the proof of rank {peer}")
        if not auth.same(_hex(p, "proof", auth.TAG_BYTES), auth.mac(key, _DIALLER, *t)):
            self._refuse(s, rail, "no proof of the job secret")
            raise AuthenticationError(f"a connection claiming rank {peer} did not prove the "
                                      f"job secret")
        self.transport.tune(s)
        s.settimeout(None)
        try:
            gate.admit(rail, s, peer, lazy)
        except ConnectionError as e:
            self._refuse(s, rail, str(e))
            raise

    def _refuse(self, s, rail: int, why: str) -> None:
        """Tell the dialler why (best effort: it may not be listening)."""
        try:
            self._say(s, rail, {"ok": False, "auth": bool(self.secret), "reason": why[:300]})
        except OSError:
            pass

    def _reject(self, s, rail, addr, why):
        """Close a connection that is not one of ours, and say so in the event log."""
        try:
            s.close()
        finally:
            self.events.emit("stray_connection", rail=rail,
                             peer=f"{addr[0]}:{addr[1]}" if addr else None,
                             reason=f"{type(why).__name__}: {why}"[:300])

    # ------------------------------------------------------------------ 3. rejoin
    def _rejoin_key(self, peer: int, rail: int) -> bytes:
        token = self.tokens.get((peer, rail))
        if token is None:
            raise ConnectionError(f"no first connection with rank {peer} on rail {rail}")
        return auth.mac(self.rail_key, b"nezha-rejoin", token)

    def _install(self, sock, peer, rail, how, greet=None, lazy: bool = False) -> bool:
        """Make ``sock`` the engine's connection to ``peer`` on ``rail``. ``greet`` (the
        acceptor's verdict) is sent first, so it precedes every frame of the Connection.
        Without a job secret a live connection is never replaced (ConnectionError). A
        connection on demand (``lazy``) is a first one: no rail comes back, nothing to report."""
        eng = self.engine
        conn = Connection(sock, peer, rail, eng)
        with eng.cond:
            old = eng.conns.get((peer, rail))
            if not self.secret and old is not None:
                end = time.monotonic() + REJOIN_WAIT
                while old.alive and (peer, rail) not in eng.dead and not eng.closing:
                    left = end - time.monotonic()
                    if left <= 0:
                        raise ConnectionError(
                            f"rank {peer} is still connected on rail {rail}: without a job "
                            f"secret only a failed connection is replaced")
                    eng.cond.wait(min(left, 0.05))
            if eng.closing or eng.error is not None or peer in eng.gone:
                sock.close()
                return False
            if greet is not None:
                greet()
            eng.conns[(peer, rail)] = conn
            eng.dead.discard((peer, rail))
        if old is not None and old.alive:
            # not the rail's failure (failover.Failover._replaced): it stays up
            old.fail(ConnectionError("replaced by a rejoined connection"))
        conn.start()
        if lazy:
            self.events.emit("peer_connected", peer=peer, rail=rail, how=how)
            return True
        self.events.emit("rail_up", peer=peer, rail=rail, how=how)
        eng.rail_restored(peer, rail)
        eng.report_rail("up", rail, peer)
        return True

    def _rejoin_acceptor(self, rail, lsock, gate):
        while not self.engine.closing:
            try:
                lsock.settimeout(0.5)
                s, addr = lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.start_handshake(rail, s, addr, gate, REJOIN_ACCEPT)

    # ------------------------------------------------------------------ 4. on demand
    def reach(self, peer: int) -> None:
        """Connect to ``peer`` on every rail it has no connection on yet (the engine's first
        message to a peer that is not a start peer). Returns once at least one rail is up;
        raises RendezvousError (or AuthenticationError) when none came up by the timeout."""
        with self._lazy_lock:
            lock = self._peer_locks.setdefault(peer, threading.Lock())
        with lock:
            eng = self.engine
            deadline = time.monotonic() + self.me.timeout
            errors = []
            for rail in range(self.me.nrails):
                if (peer, rail) in eng.conns:
                    continue
                try:
                    self._reach_rail(peer, rail, deadline)
                except AuthenticationError:
                    raise
                except (OSError, ConnectionError, ValueError, NezhaError) as e:
                    errors.append(f"rail {rail}: {type(e).__name__}: {e}")
            if not any((peer, r) in eng.conns for r in range(self.me.nrails)):
                raise RendezvousError(f"rank {self.me.rank}: no connection to rank {peer} on "
                                      f"demand within {self.me.timeout:g} s: {errors}")

    def _reach_rail(self, peer: int, rail: int, deadline: float) -> None:
        """One rail of ``reach``: dial, or wait while the peer's dial to us is admitted. A
        dial refused (CROSSING: the higher rank dials us meanwhile) or not answered is tried
        again until ``deadline``; a failed proof is final."""
        eng = self.engine
        dest = self.infos[peer]["rails"][rail]
        last: Optional[BaseException] = None
        while (peer, rail) not in eng.conns:
            if eng.closing or eng.error is not None:
                raise RendezvousError(f"closing while connecting to rank {peer}")
            if time.monotonic() >= deadline:
                raise RendezvousError(f"rail {rail}: {type(last).__name__}: {last}")
            with self._lazy_lock:
                busy = (peer, rail) in self._accepting or (peer, rail) in eng.conns
                if not busy:
                    self._dialling.add((peer, rail))
            if busy:
                time.sleep(0.01)
                continue
            s = None
            try:
                s = self.transport.connect(rail, dest, min(1.0, _left(deadline, 0.1)),
                                           retry=False)
                v = self._dial_handshake(s, peer, rail, self.rail_key, False,
                                         min(deadline, time.monotonic() + HELLO_TIMEOUT),
                                         lazy=True)
                self.tokens[(peer, rail)] = _hex(v, "token", auth.NONCE_BYTES)
                s.settimeout(None)
                self._install(s, peer, rail, "dialled", lazy=True)
                return
            except AuthenticationError:
                if s is not None:
                    s.close()
                raise
            except (OSError, ConnectionError, ValueError, NezhaError) as e:
                if s is not None:
                    s.close()
                last = e
                time.sleep(0.01 if isinstance(e, _Refused) and CROSSING in str(e) else 0.05)
            finally:
                with self._lazy_lock:
                    self._dialling.discard((peer, rail))

    def learn(self, peer: int) -> None:
        """Read the record of a peer that connected to us on demand (this thread is the
        handshake's own), so that path probes to it need not wait on the store."""
        try:
            self.infos[peer]
        except (NezhaError, OSError, ValueError) as e:
            self.events.emit("peer_record_unread", peer=peer, error=f"{type(e).__name__}: {e}")

    def refuses(self, peer: int) -> bool:
        """Whether ``peer`` refuses a connection on every rail: its listeners (open for the
        Context's whole life) are gone, so its process is. A path that is merely broken
        times out or is unreachable instead, which is not a refusal."""
        info = self.infos.cached(peer)
        if info is None:          # never connected to it: nothing to judge by
            return False
        for rail, dest in enumerate(info["rails"]):
            try:
                s = self.transport.connect(rail, dest, 0.3, retry=False)
            except ConnectionRefusedError:
                continue
            except OSError:
                return False
            s.close()
            return False
        return True

    def redial(self, peer: int, rail: int, dial_s: float = 0.5) -> None:
        """The health thread's rejoin: reconnect a failed rail to a lower rank, unless it is
        no longer failed. Another rejoin (a member's own, which replaces a live connection)
        may have restored it since the health thread read it as down, and dialling again
        would replace a fresh connection for nothing (a second rail_up at every peer)."""
        with self._rejoin_lock:
            eng = self.engine
            with eng.cond:
                conn = eng.conns.get((peer, rail))
                if conn is not None and conn.alive and (peer, rail) not in eng.dead:
                    return
            self._rejoin(peer, rail, dial_s)

    def rejoin(self, peer: int, rail: int, dial_s: float = 0.5) -> None:
        """Reconnect to a lower rank on ``rail``, replacing its connection there (alive or
        not; without a job secret the peer refuses to replace a live one), waiting up to
        ``dial_s`` for the connection; raises while it cannot (the path still broken, or the
        peer refused)."""
        with self._rejoin_lock:
            self._rejoin(peer, rail, dial_s)

    def _rejoin(self, peer: int, rail: int, dial_s: float) -> None:
        dest = self.infos[peer]["rails"][rail]
        key = self._rejoin_key(peer, rail)
        s = self.transport.connect(rail, dest, dial_s, retry=False)
        try:
            self._dial_handshake(s, peer, rail, key, True, time.monotonic() + REJOIN_TIMEOUT)
            s.settimeout(None)
        except BaseException:
            s.close()
            raise
        self._install(s, peer, rail, "reconnected")


class _Rejoins:
    """The accepting half once connected: a higher rank re-dialling a rail, with the pair's
    key, or any rank's first connection on demand ("lazy"), with the rail key."""

    def __init__(self, rdv: Rendezvous):
        self.rdv = rdv

    def key(self, peer: int, rail: int, rejoin: bool, lazy: bool = False) -> bytes:
        me = self.rdv.me
        if lazy and not rejoin:
            if not 0 <= peer < me.world_size or peer == me.rank:
                raise ConnectionError(f"rank {peer} is not a peer of rank {me.rank}")
            self._claim(peer, rail, dry=True)
            return self.rdv.rail_key
        if not rejoin:
            raise ConnectionError("a first connection after this rank finished connecting")
        if not me.rank < peer < me.world_size:
            raise ConnectionError(f"rank {peer} does not dial rank {me.rank}")
        return self.rdv._rejoin_key(peer, rail)

    def _claim(self, peer: int, rail: int, dry: bool = False) -> None:
        """May ``peer``'s dial on demand become our connection on ``rail``? Not over a live
        one, and not while we dial it too and are the higher rank (CROSSING: ours wins; the
        lower rank's dial loses wherever the two cross, so exactly one survives)."""
        rdv, eng = self.rdv, self.rdv.engine
        with rdv._lazy_lock:
            c = eng.conns.get((peer, rail))
            if c is not None and c.alive and (peer, rail) not in eng.dead:
                raise ConnectionError(f"rank {peer} is already connected on rail {rail}")
            if (peer, rail) in rdv._accepting:
                raise ConnectionError(f"second connection from rank {peer} rail {rail}")
            if (peer, rail) in rdv._dialling and rdv.me.rank > peer:
                raise ConnectionError(CROSSING)
            if not dry:
                rdv._accepting.add((peer, rail))

    def admit(self, rail: int, s, peer: int, lazy: bool = False) -> None:
        rdv = self.rdv
        if not lazy:
            rdv._install(s, peer, rail, "accepted",
                         greet=lambda: rdv._say(s, rail, {"ok": True}))
            return
        self._claim(peer, rail)
        try:
            token = auth.nonce()
            rdv.tokens[(peer, rail)] = token
            rdv._install(s, peer, rail, "accepted",
                         greet=lambda: rdv._say(s, rail, {"ok": True, "token": token.hex()}),
                         lazy=True)
            rdv.learn(peer)
        finally:
            with rdv._lazy_lock:
                rdv._accepting.discard((peer, rail))


class _Admission:
    """The accepting half of the first connect: which (higher rank, rail) pairs may dial us,
    and the sockets gathered so far (the dialled ones are added by Rendezvous.connect)."""

    def __init__(self, rdv: Rendezvous, deadline: float):
        me = rdv.me
        self.rdv, self.deadline = rdv, deadline
        self.expected = {(p, r) for p in rdv.peers if p > me.rank for r in range(me.nrails)}
        self.socks: dict = {}
        self.claimed: set = set()      # proven, verdict being sent
        self.errors: list = []
        self.lock = threading.Lock()

    def key(self, peer: int, rail: int, rejoin: bool, lazy: bool = False) -> bytes:
        if rejoin or lazy:
            raise ConnectionError("a rejoin or connection on demand before this rank "
                                  "finished connecting")
        if (peer, rail) not in self.expected:
            raise ConnectionError(f"rank {peer} does not dial rank {self.rdv.me.rank} on rail {rail}")
        with self.lock:
            if (peer, rail) in self.socks or (peer, rail) in self.claimed:
                raise ConnectionError(f"second connection from rank {peer} rail {rail}")
        return self.rdv.rail_key

    def admit(self, rail, s, peer, lazy: bool = False):
        with self.lock:
            if (peer, rail) in self.socks or (peer, rail) in self.claimed:
                raise ConnectionError(f"second connection from rank {peer} rail {rail}")
            self.claimed.add((peer, rail))
        token = auth.nonce()
        try:
            # the verdict goes out before the socket counts as gathered: connect() starts the
            # Connections (and their frames) as soon as every socket is there
            self.rdv._say(s, rail, {"ok": True, "token": token.hex()})
        except OSError:
            with self.lock:
                self.claimed.discard((peer, rail))
            raise
        self.rdv.tokens[(peer, rail)] = token
        with self.lock:
            self.socks[(peer, rail)] = s

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
            self.rdv.start_handshake(rail, s, addr, self,
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
