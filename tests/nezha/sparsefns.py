"""Rank functions for test_sparse.py (connections on demand; importable by spawned children)."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time

import numpy as np

from nezha import auth, wire
from nezha.config import Config
from nezha.errors import NezhaError
from rankfns import data, make_ctx, reference
from securityfns import SECRET, accepted, drain, events_of, read_frame


def peers_of(ctx) -> dict:
    """{peer: number of connections} as ctx.stats() shows them (checked against the engine)."""
    out = ctx.stats()["connections"]
    assert sum(out.values()) == len(ctx._engine.conns)
    return out


def settled(ctx, quiet: float = 0.2, limit: float = 5.0) -> dict:
    """peers_of(ctx) once it has not changed for ``quiet`` s (at most ``limit`` s)."""
    last, since = peers_of(ctx), time.monotonic()
    deadline = since + limit
    while time.monotonic() < deadline and time.monotonic() - since < quiet:
        time.sleep(0.01)
        now = peers_of(ctx)
        if now != last:
            last, since = now, time.monotonic()
    return last


def idents(ctx) -> dict:
    """(peer, rail) -> the connection's (local port, remote port), to match both ends."""
    return {f"{p},{r}": list(c.ident) for (p, r), c in list(ctx._engine.conns.items())}


def records(ctx, want: int = 0, limit: float = 5.0) -> list:
    """The ranks whose rendezvous records this rank has read (waiting up to ``limit`` s
    for ``want`` of them: an accepted connection's record is read just after it is in)."""
    deadline = time.monotonic() + limit
    while len(ctx._rdv.infos.known()) < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return sorted(ctx._rdv.infos.known())


def on_demand(rank, world, port, connect="ring", count=1001):
    """Connections after init, after allreduces above the direct limit (ring: neighbours
    only), after a small broadcast from rank 0 (a star: rank 0 reaches everyone), a chain
    broadcast, and a small allreduce (one direct round: every rank reaches every other);
    and the ranks whose records were read from the store at init and at the end."""
    out = {}
    cfg = Config(connect=connect)
    with make_ctx(rank, world, port, 2, config=cfg, secret=SECRET) as ctx:
        out["init"] = peers_of(ctx)
        out["records_init"] = records(ctx)
        ok = True
        ring = cfg.direct_max // 4 // (world - 1) + 1      # float32s: just above the limit
        for it in range(3):
            a = data(rank, it, ring, "float32")
            ctx.allreduce(a)
            ok &= bool(np.array_equal(a, reference(world, it, ring, "float32", "sum")))
        out["allreduce"] = peers_of(ctx)
        # rank 0 dials everyone for the star broadcast as soon as its own allreduce is over,
        # which may be before ours: nobody goes on before every rank has counted
        ctx.barrier()
        b = data(0, 9, count, "int64") if rank == 0 else np.zeros(count, "int64")
        ctx.broadcast(b, root=0)
        ok &= bool(np.array_equal(b, data(0, 9, count, "int64")))
        # rank 0 dialled each rail before it sent, but our end installs what it accepts on
        # the acceptor's thread: the rail the broadcast did not use may land a moment later
        out["star"] = settled(ctx)
        big = 1 << 18   # 1 MiB of float32: a pipelined chain
        c = data(2, 3, big, "float32") if rank == 2 else np.zeros(big, "float32")
        ctx.broadcast(c, root=2)
        ok &= bool(np.array_equal(c, data(2, 3, big, "float32")))
        out["chain"] = peers_of(ctx)
        ctx.barrier()
        d = data(rank, 5, count, "float32")
        ctx.allreduce(d)
        ok &= bool(np.array_equal(d, reference(world, 5, count, "float32", "sum")))
        ctx.barrier()
        out["direct"] = settled(ctx)
        out["records_end"] = records(ctx, world)
        out["ok"] = ok
    return out


def crossing(rank, world, port, events=None):
    """Every rank reaches every other at the same moment (all dials cross): each pair ends
    with exactly one connection per rail, the same one at both ends, and it carries data."""
    ev = f"{events}.{rank}" if events else None
    with make_ctx(rank, world, port, 2, secret=SECRET, events=ev) as ctx:
        ctx.barrier()
        eng = ctx._engine
        errs = []

        def go(p):
            try:
                eng.reach(p)
            except Exception as e:      # reported, not raised in a thread
                errs.append(repr(e))
        ts = [threading.Thread(target=go, args=(p,)) for p in range(world) if p != rank]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        time.sleep(0.3)       # the acceptor side installs after its verdict
        ctx.barrier()
        b = data(3, 1, 257, "int32") if rank == 3 else np.zeros(257, "int32")
        ctx.broadcast(b, root=3)
        ok = bool(np.array_equal(b, data(3, 1, 257, "int32")))
        # before the last barrier: after it, the peers close theirs
        out = {"errs": errs, "idents": idents(ctx), "ok": ok,
               "dead": sorted(k for k, c in ctx._engine.conns.items() if not c.alive)}
        ctx.barrier()
    out["events"] = [e for e in events_of(ev) if e["event"] not in ("state", "weights")]
    return out


def rail_fails(rank, world, port, events, count=4 << 20, iters=4):
    """Rank 0 breaks rail 1 to its neighbour rank 1 mid-allreduce: every rank agrees the
    rail down (the report reaches the non-neighbours through the ring) and back up."""
    from rankfns import kill_rail_mid_op
    return kill_rail_mid_op(rank, world, port, rail=1, count=count, iters=iters,
                            events=events, settle=1.5)


def stranger(rank, world, port, events):
    """A stranger without the secret, as rank 0 towards rank 3 (not its neighbour: a
    connection on demand between them is legitimate), tries a lazy HELLO with a guessed key,
    a random proof and no authentication. Then rank 0 really reaches rank 3."""
    ev = f"{events}.{rank}"
    out = {}
    with make_ctx(rank, world, port, 1, secret=SECRET, events=ev) as ctx:
        if rank == 0:
            ep = tuple(ctx._rdv.infos[3]["rails"][0])
            session = ctx._rdv.session
            for name in ("guessed_key", "random_proof", "no_auth"):
                s = socket.create_connection(ep, timeout=2)
                nd = auth.nonce()
                body = {"rank": 0, "rail": 0, "world": world, "nonce": nd.hex(),
                        "auth": name != "no_auth", "rejoin": False, "lazy": True}
                s.sendall(wire.frame(wire.HELLO, json.dumps(body).encode(), rail=0, src=0))
                try:
                    _, m = read_frame(s)
                    if name == "no_auth":
                        reply, _ = drain(s, 1.0)
                        out[name] = accepted(json.dumps(m).encode() + reply)
                        continue
                    na = bytes.fromhex(m["nonce"])
                    key = auth.mac(b"", b"nezha-rail-key", session.encode(), b"nezha")
                    t = (struct.pack("!IIII", 0, 3, 0, world), nd, na)
                    proof = (auth.mac(key, b"nezha-rail-dialler", *t) if name == "guessed_key"
                             else auth.nonce())
                    s.sendall(wire.frame(wire.AUTH, json.dumps({"proof": proof.hex()}).encode(),
                                         rail=0, src=0))
                    reply, _ = drain(s, 1.0)
                    out[name] = accepted(reply)
                except (OSError, ConnectionError, KeyError, ValueError, NezhaError):
                    out[name] = False
        ctx.barrier()
        out["before"] = peers_of(ctx)
        # rank 0 leaves a ring barrier before the others may: without this second one, its
        # broadcast dialled rank 3 (the real connection) before rank 3 had looked
        ctx.barrier()
        b = np.arange(64, dtype="int64") if rank == 0 else np.zeros(64, "int64")
        ctx.broadcast(b, root=0)
        out["ok"] = bool(np.array_equal(b, np.arange(64, dtype="int64")))
        out["after"] = peers_of(ctx)
        ctx.barrier()
    out["events"] = [e["event"] for e in events_of(ev)]
    return out


def lazy_rejoin(rank, world, port, events, count=257):
    """A connection made on demand (rank 0 -> rank 3, by a star broadcast) breaks: the higher
    rank re-dials it like any other, every rank agrees the rail down and up, and the star
    broadcasts on either side of it are exact."""
    ev = f"{events}.{rank}"
    ok = True
    with make_ctx(rank, world, port, 2, secret=SECRET, events=ev) as ctx:
        for it in range(2):
            b = data(0, it, count, "int64") if rank == 0 else np.zeros(count, "int64")
            ctx.broadcast(b, root=0)
            ok &= bool(np.array_equal(b, data(0, it, count, "int64")))
            if it == 0:
                ctx.barrier()
                if rank == 0:
                    ctx._debug_kill_rail(3, 1)
                time.sleep(1.5)           # detected, reported, re-dialled by rank 3
                ctx.barrier()
        a = data(rank, 5, count, "float32")
        ctx.allreduce(a)
        ok &= bool(np.array_equal(a, reference(world, 5, count, "float32", "sum")))
        conns = peers_of(ctx)
        ctx.barrier()
    return {"ok": ok, "conns": conns, "events": [e["event"] for e in events_of(ev)]}
