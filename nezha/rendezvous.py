"""Rendezvous and handshake: from a rank number to an authenticated connection per (peer, rail).

1. Meet (``Rendezvous.meet``): through the key-value store (served by rank 0 on the master
   address unless NEZHA_STORE_EXTERNAL=1; every store connection proves the job secret,
   store.py), every rank claims its rank (a second claim aborts the job), rank 0 draws a
   random session token, and every rank publishes its listening endpoints and checks that all
   agree on world size, rail count and system. The rail key is HMAC(secret, session, group).
2. Connect (``Rendezvous.connect``): every rank dials the lower ranks on every rail and
   accepts the higher ones. Every connection starts with this handshake (wire.py's HELLO and
   AUTH frames; auth.py)::

       dialler  -> acceptor  HELLO {rank, rail, world, nonce Nd, auth, rejoin}
       acceptor -> dialler   AUTH  {nonce Na, proof HMAC(K, "acceptor", T), auth}
       dialler  -> acceptor  AUTH  {proof HMAC(K, "dialler", T)}
       acceptor -> dialler   AUTH  {ok: true, token} | {ok: false, reason}

   T = (dialler rank, acceptor rank, rail, world size, Nd, Na), Nd and Na 32 fresh random bytes;
   K = the rail key on the first connect, HMAC(rail key, token) on a rejoin, where token is
   the random value the acceptor sent in the verdict of that pair's first connection on that
   rail (it never goes through the store). Each side checks the other's proof; a socket
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


def _left(deadline: float, least: float = 0.0) -> float:
    return max(least, deadline - time.monotonic())


class Rendezvous:
    """One rank's side of meeting and connecting (see the module docstring). ``secret``: the
    job secret (None: unauthenticated, said once in the log and the event log)."""

    def __init__(self, me: Member, transport, engine, events, secret=None):
        self.me, self.transport, self.engine, self.events = me, transport, engine, events
        self.secret = auth.secret_bytes(secret)
        self.store: Optional[StoreClient] = None
        self.server: Optional[StoreServer] = None   # ours if we serve the store
        self.owned_store: Optional[StoreClient] = None
        self.infos: list = []
        self.session = ""
        self.pre = ""
        self.rail_key = b""
        self.tokens: dict = {}      # (peer, rail) -> token of the pair's first connection there
        self.max_handshakes = 4 * me.world_size * max(1, me.nrails) + 16
        self._handshakes = 0
        self._hs_lock = threading.Lock()
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
                "system": me.system, "host": socket.gethostname(), "pid": os.getpid()}
        store.set(pre + f"info/{me.rank}", json.dumps(info))
        keys = [pre + f"info/{r}" for r in range(me.world_size)]
        self._wait_infos(keys, deadline)
        self.infos = [json.loads(store.get(k, 1.0)) for k in keys]
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
                        deadline: float) -> dict:
        """The dialler's side; returns the acceptor's verdict {"ok": true, ...}. Raises
        AuthenticationError (no proof, secret on one side only), _Refused, or a socket error."""
        me, mine = self.me, bool(self.secret)
        nd = auth.nonce()
        hello = {"rank": me.rank, "rail": rail, "world": me.world_size, "nonce": nd.hex(),
                 "auth": mine, "rejoin": rejoin}
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
        key a dialler must prove (``key(peer, rail, rejoin)``) and takes the proven socket
        (``admit(rail, s, peer)``); either raises to refuse it."""
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
            key = gate.key(peer, rail, m.get("rejoin") is True)
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
            gate.admit(rail, s, peer)
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

    def _install(self, sock, peer, rail, how, greet=None) -> bool:
        """Make ``sock`` the engine's connection to ``peer`` on ``rail``. ``greet`` (the
        acceptor's verdict) is sent first, so it precedes every frame of the Connection.
        Without a job secret a live connection is never replaced (ConnectionError)."""
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
            old.fail(ConnectionError("replaced by a rejoined connection"))
            with eng.cond:
                eng.dead.discard((peer, rail))
        conn.start()
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

    def refuses(self, peer: int) -> bool:
        """Whether ``peer`` refuses a connection on every rail: its listeners (open for the
        Context's whole life) are gone, so its process is. A path that is merely broken
        times out or is unreachable instead, which is not a refusal."""
        for rail, dest in enumerate(self.infos[peer]["rails"]):
            try:
                s = self.transport.connect(rail, dest, 0.3, retry=False)
            except ConnectionRefusedError:
                continue
            except OSError:
                return False
            s.close()
            return False
        return True

    def rejoin(self, peer: int, rail: int) -> None:
        """Reconnect a failed rail to a lower rank (called by the health thread); raises while
        it cannot (the path still broken, or the peer refused)."""
        dest = self.infos[peer]["rails"][rail]
        key = self._rejoin_key(peer, rail)
        s = self.transport.connect(rail, dest, 0.5, retry=False)
        try:
            self._dial_handshake(s, peer, rail, key, True, time.monotonic() + REJOIN_TIMEOUT)
            s.settimeout(None)
        except BaseException:
            s.close()
            raise
        self._install(s, peer, rail, "reconnected")


class _Rejoins:
    """The accepting half of a rejoin: a higher rank re-dialling a rail, with the pair's key."""

    def __init__(self, rdv: Rendezvous):
        self.rdv = rdv

    def key(self, peer: int, rail: int, rejoin: bool) -> bytes:
        me = self.rdv.me
        if not rejoin:
            raise ConnectionError("a first connection after this rank finished connecting")
        if not me.rank < peer < me.world_size:
            raise ConnectionError(f"rank {peer} does not dial rank {me.rank}")
        return self.rdv._rejoin_key(peer, rail)

    def admit(self, rail: int, s, peer: int) -> None:
        rdv = self.rdv
        rdv._install(s, peer, rail, "accepted", greet=lambda: rdv._say(s, rail, {"ok": True}))


class _Admission:
    """The accepting half of the first connect: which (higher rank, rail) pairs may dial us,
    and the sockets gathered so far (the dialled ones are added by Rendezvous.connect)."""

    def __init__(self, rdv: Rendezvous, deadline: float):
        me = rdv.me
        self.rdv, self.deadline = rdv, deadline
        self.expected = {(p, r) for p in range(me.rank + 1, me.world_size)
                         for r in range(me.nrails)}
        self.socks: dict = {}
        self.claimed: set = set()      # proven, verdict being sent
        self.errors: list = []
        self.lock = threading.Lock()

    def key(self, peer: int, rail: int, rejoin: bool) -> bytes:
        if rejoin:
            raise ConnectionError("a rejoin before this rank finished connecting")
        if (peer, rail) not in self.expected:
            raise ConnectionError(f"rank {peer} does not dial rank {self.rdv.me.rank} on rail {rail}")
        with self.lock:
            if (peer, rail) in self.socks or (peer, rail) in self.claimed:
                raise ConnectionError(f"second connection from rank {peer} rail {rail}")
        return self.rdv.rail_key

    def admit(self, rail, s, peer):
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
