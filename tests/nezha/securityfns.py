"""Rank functions and attack tools for test_security.py (importable by spawned children).

The attacker is a stranger that knows everything about the job except its secret: the store's
address, rank 0's rail endpoints, the session token and the group name (it gets them from
rank 1's Context, as if it had read an unauthenticated store or sniffed them)."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time
import zlib

import numpy as np

from nezha import auth, wire
from nezha.errors import AuthenticationError, NezhaError
from nezha.store import StoreClient
from rankfns import data, make_ctx, reference

SECRET = "securityfns-0123456789abcdef"
N = 1024          # float32 elements per allreduce (the finding: 512 of 1024 came back wrong)


# ---------------------------------------------------------------------------- tools
def exact_allreduces(ctx, rank, world, its, pause=0.0) -> list[bool]:
    """One allreduce per iteration number in ``its``: whether each came back exact."""
    oks = []
    for it in its:
        a = data(rank, it, N, "float32")
        ctx.allreduce(a)
        oks.append(bool(np.array_equal(a, reference(world, it, N, "float32", "sum"))))
        time.sleep(pause)
    return oks


def drain(s, limit: float = 2.0):
    """Everything ``s`` receives until it is closed or ``limit`` s pass: (bytes, closed)."""
    out = bytearray()
    end = time.monotonic() + limit
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return bytes(out), False
            s.settimeout(left)
            b = s.recv(65536)
            if not b:
                return bytes(out), True
            out += b
    except socket.timeout:
        return bytes(out), False
    except OSError:
        return bytes(out), True
    finally:
        s.close()


def accepted(reply: bytes) -> bool:
    """Did a handshake reply contain a positive verdict?"""
    return b'"ok": true' in reply


def data_frames(src: int = 1, rail: int = 0, ops=range(0, 40)) -> bytes:
    """DATA frames of a 2-rank allreduce of N float32 (step 0, the first half), one per op,
    with a payload that would make the result wrong if it were ever taken."""
    half = N * 4 // 2
    payload = np.full(N // 2, 1e6, dtype=np.float32).tobytes()
    return b"".join(wire.frame(wire.DATA, payload, kind=wire.K_ALLREDUCE, dtype=1, redop=1,
                               rail=rail, src=src, op_id=op, step=0, chunk=0, offset=0,
                               msg_total=half, op_total=N * 4) for op in ops)


def hello(rank: int, rail: int, world: int = 2, rejoin: bool = True, auth_flag: bool = True) -> bytes:
    body = {"rank": rank, "rail": rail, "world": world, "nonce": auth.nonce().hex(),
            "auth": auth_flag, "rejoin": rejoin}
    return wire.frame(wire.HELLO, json.dumps(body).encode(), rail=rail, src=rank)


def v1_hello(rank: int, rail: int, session: str, world: int = 2) -> bytes:
    """The HELLO of the wire format before the job secret (version 1), as in the finding."""
    body = json.dumps({"rank": rank, "rail": rail, "session": session, "world": world}).encode()
    head = wire._BODY.pack(wire.MAGIC, 1, wire.HELLO, 0, 0, 0, rail, rank, 0, 0, 0, 0, 0,
                           len(body), 0, 0)
    return head + struct.pack("!I", zlib.crc32(head)) + body


def read_frame(s, timeout: float = 2.0):
    s.settimeout(timeout)
    hb = b""
    while len(hb) < wire.HEADER_SIZE:
        b = s.recv(wire.HEADER_SIZE - len(hb))
        if not b:
            raise ConnectionError("closed")
        hb += b
    h = wire.unpack(hb)
    body = b""
    while len(body) < h.length:
        b = s.recv(h.length - len(body))
        if not b:
            raise ConnectionError("closed")
        body += b
    return h, json.loads(body)


def attack(store, endpoints, session: str, group: str = "nezha", world: int = 2) -> dict:
    """Everything a stranger without the secret tries, as rank 1 towards rank 0. Returns what
    it got: for the rails, whether any handshake ended in a positive verdict."""
    out: dict = {"rails": {}}
    host, port = store
    for rail, ep in enumerate(endpoints):
        ep = tuple(ep)
        tries = {
            # the finding: an old-style HELLO with the session token, then DATA at once
            "v1_hello_then_data": v1_hello(1, rail, session, world) + data_frames(rail=rail),
            # the new HELLO, as a rejoin and as a first connection, then DATA without waiting
            "rejoin_hello_then_data": hello(1, rail, world) + data_frames(rail=rail),
            "first_hello_then_data": hello(1, rail, world, rejoin=False) + data_frames(rail=rail),
            "unauthenticated_hello": hello(1, rail, world, auth_flag=False) + data_frames(rail=rail),
        }
        for name, raw in tries.items():
            s = socket.create_connection(ep, timeout=2)
            s.sendall(raw)
            reply, closed = drain(s)
            out["rails"][(rail, name)] = (accepted(reply), closed)
        # answer the challenge with the best guess without the secret: the key an
        # unauthenticated job would use, and random bytes
        for name in ("guessed_key", "random_proof"):
            s = socket.create_connection(ep, timeout=2)
            nd = auth.nonce()
            body = {"rank": 1, "rail": rail, "world": world, "nonce": nd.hex(), "auth": True,
                    "rejoin": True}
            s.sendall(wire.frame(wire.HELLO, json.dumps(body).encode(), rail=rail, src=1))
            try:
                _, m = read_frame(s)
                na = bytes.fromhex(m["nonce"])
                key = auth.mac(b"", b"nezha-rail-key", session.encode(), group.encode())
                t = (struct.pack("!IIII", 1, 0, rail, world), nd, na)
                proof = (auth.mac(key, b"nezha-rail-dialler", *t) if name == "guessed_key"
                         else auth.nonce())
                s.sendall(wire.frame(wire.AUTH, json.dumps({"proof": proof.hex()}).encode(),
                                     rail=rail, src=1) + data_frames(rail=rail))
                reply, closed = drain(s)
            except (OSError, ConnectionError, KeyError, ValueError, NezhaError):
                reply, closed = b"", True
            out["rails"][(rail, name)] = (accepted(reply), closed)
    # the store: without a secret, with a wrong one, and the old protocol's plain request
    for name, secret in (("no_secret", None), ("wrong_secret", "not-the-secret-0123456789")):
        try:
            c = StoreClient(host, port, timeout=2.0, secret=secret)
            out[f"store_{name}"] = "read " + c.get(f"{group}/session", 1.0)
            c.close()
        except AuthenticationError as e:
            out[f"store_{name}"] = f"refused: {e}"
        except NezhaError as e:
            out[f"store_{name}"] = f"{type(e).__name__}: {e}"
    req = json.dumps({"cmd": "get", "key": f"{group}/session", "timeout": 1}).encode()
    s = socket.create_connection((host, port), timeout=2)
    s.sendall(struct.pack("!I", len(req)) + req)
    reply, _ = drain(s, 1.0)
    out["store_plain_leak"] = session.encode() in reply
    return out


def events_of(path: str) -> list:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------------------- rank functions
def stray_job(rank, world, port, secret=None, events=None, iters=25):
    """Allreduces of N float32 while a stranger (in rank 1's process, with rank 1's knowledge
    but not the secret) attacks rank 0's store and rails. Returns per-iteration exactness,
    what the stranger got, and whether rank 0's connections are still the original ones."""
    ev = f"{events}.{rank}"
    res = {"attack": {}}
    with make_ctx(rank, world, port, 2, timeout=10.0, events=ev, secret=secret) as ctx:
        before = {k: id(c) for k, c in ctx._engine.conns.items()}
        th = None
        if rank == 1:
            rdv = ctx._rdv
            store = (rdv.owned_store.host, rdv.owned_store.port)
            th = threading.Thread(target=lambda: res["attack"].update(
                attack(store, rdv.infos[0]["rails"], rdv.session, world=world)), daemon=True)
            th.start()
        oks = exact_allreduces(ctx, rank, world, range(iters), pause=0.05)
        if th is not None:
            th.join(30)
        ctx.barrier()
        oks += exact_allreduces(ctx, rank, world, range(iters, iters + 5))
        res["same_conns"] = before == {k: id(c) for k, c in ctx._engine.conns.items()}
    res["oks"] = oks
    res["events"] = events_of(ev)
    return res


class RecordingProxy:
    """A TCP forwarder that records what the client sends (the recorded handshake)."""

    def __init__(self, target):
        self.target = tuple(target)
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = self.ls.getsockname()[:2]
        self.c2s = bytearray()
        self.s2c = bytearray()
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def _pump(a, b, rec):
        try:
            while True:
                x = a.recv(65536)
                if not x:
                    break
                rec += x
                b.sendall(x)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _run(self):
        c, _ = self.ls.accept()
        u = socket.create_connection(self.target)
        threading.Thread(target=self._pump, args=(c, u, self.c2s), daemon=True).start()
        self._pump(u, c, self.s2c)


def replay_job(rank, world, port, secret=SECRET, events=None):
    """Rank 1 rejoins rail 0 through a recording proxy (a legitimate handshake, which the
    secret lets replace the live connection), then replays the recorded bytes straight to
    rank 0's listener: the replay must be refused, and the job stays exact."""
    ev = f"{events}.{rank}"
    out = {}
    with make_ctx(rank, world, port, 2, timeout=10.0, events=ev, secret=secret) as ctx:
        oks = exact_allreduces(ctx, rank, world, [0])
        ctx.barrier()
        if rank == 1:
            rdv = ctx._rdv
            real = list(rdv.infos[0]["rails"][0])
            proxy = RecordingProxy(real)
            rdv.infos[0]["rails"][0] = [proxy.host, proxy.port]
            try:
                rdv.rejoin(0, 0)
            finally:
                rdv.infos[0]["rails"][0] = real
            out["legit_accepted"] = accepted(bytes(proxy.s2c))
            recorded = bytes(proxy.c2s)
            out["recorded_bytes"] = len(recorded)
            s = socket.create_connection(tuple(real), timeout=2)
            s.sendall(recorded)
            reply, closed = drain(s, 3.0)
            out["replay_accepted"], out["replay_closed"] = accepted(reply), closed
        time.sleep(0.5)
        ctx.barrier()
        oks += exact_allreduces(ctx, rank, world, range(1, 6))
        ctx.barrier()
    out["oks"] = oks
    out["events"] = events_of(ev)
    return out


def live_rejoin(rank, world, port, secret=None, events=None, install_delay=0.0):
    """Rank 1 (a member, with the pair's rejoin token) re-dials rail 0 while the connection
    is alive. Without a secret this must be refused (only a failed connection is replaced);
    with one it is accepted. Either way the job stays exact. ``install_delay``: rank 1
    installs the new connection that long after rank 0 has closed the old one, so its health
    thread sees the old one fail meanwhile (it must not dial again over the fresh one)."""
    ev = f"{events}.{rank}"
    out = {}
    with make_ctx(rank, world, port, 2, timeout=10.0, events=ev, secret=secret) as ctx:
        ctx.barrier()
        if rank == 1:
            rdv = ctx._rdv
            install = rdv._install

            def late(*a, **kw):
                time.sleep(install_delay)
                return install(*a, **kw)
            rdv._install = late
            try:
                rdv.rejoin(0, 0)
                out["rejoin"] = "accepted"
            except Exception as e:
                out["rejoin"] = f"{type(e).__name__}: {e}"
            finally:
                rdv._install = install
        time.sleep(0.5)
        ctx.barrier()
        oks = exact_allreduces(ctx, rank, world, range(4))
        ctx.barrier()
    out["oks"] = oks
    out["events"] = events_of(ev)
    return out


def control_before_first_op(rank, world, port, events=None, secret=None):
    """A rail breaks before any collective: its reports (CONTROL, op_seq still -1) must reach
    every rank, the rail rejoins, and the collectives that follow are exact."""
    ev = f"{events}.{rank}"
    with make_ctx(rank, world, port, 2, timeout=10.0, events=ev, secret=secret) as ctx:
        if rank == 1:
            ctx._debug_kill_rail(0, 1)
        time.sleep(2.0)
        oks = exact_allreduces(ctx, rank, world, range(3))
        ctx.barrier()
    return oks, events_of(ev)


def plain(rank, world, port, secret=None, events=None, timeout=10.0):
    """One exact allreduce (for secret mismatch and warning tests)."""
    ev = f"{events}.{rank}" if events else None
    with make_ctx(rank, world, port, 2, timeout=timeout, events=ev, secret=secret) as ctx:
        a = data(rank, 0, N, "float32")
        ctx.allreduce(a)
        ok = bool(np.array_equal(a, reference(world, 0, N, "float32", "sum")))
    return ok, events_of(ev) if ev else []
