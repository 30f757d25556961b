"""Functions run inside rank processes by the nezha tests (importable by spawned children)."""
import hashlib
import os
import time

import numpy as np

from nezha import Config, Context
from nezha.testing import loopback_rails

REDUCE = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def make_ctx(rank, world, port, nrails=2, system="nezha", timeout=10.0, **kw):
    return Context(rank, world, rails=loopback_rails(nrails), master=f"127.0.0.1:{port}",
                   timeout=timeout, system=system, **kw)


def data(rank, it, count, dtype, op="sum"):
    """Small integers so every reduction is exact in every dtype (even float16)."""
    i = np.arange(count, dtype=np.int64)
    if op == "prod":
        v = np.array([1, 2, -1])[(i * 3 + rank + it) % 3]
    else:
        v = (i * 7 + rank * 13 + it * 5) % 11 - 5
    return v.astype(dtype)


def reference(world, it, count, dtype, op):
    return REDUCE[op].reduce(np.stack([data(r, it, count, dtype, op) for r in range(world)]),
                             axis=0).astype(dtype)


def digest(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def matrix(rank, world, port, dtypes, ops, counts, nrails=2, system="nezha", others=True,
           pipe_block=None):
    """Every (dtype, op, count) allreduce against numpy; plus the other collectives.
    Returns (failures, digests) so the parent can check identical bits on all ranks."""
    if pipe_block:
        os.environ["NEZHA_PIPE_BLOCK"] = str(pipe_block)
    fails, digests = [], []
    with make_ctx(rank, world, port, nrails, system) as ctx:
        it = 0
        for dt in dtypes:
            for op in ops:
                for count in counts:
                    a = data(rank, it, count, dt, op)
                    ctx.allreduce(a, op=op)
                    ref = reference(world, it, count, dt, op)
                    if a.dtype != np.dtype(dt) or not np.array_equal(a, ref):
                        fails.append(("allreduce", dt, op, count, int((a != ref).sum())))
                    digests.append(digest(a))
                    it += 1
        if others:
            for dt in dtypes:
                for count in counts:
                    # broadcast from every root in turn
                    root = it % world
                    b = data(rank, it, count, dt) if rank == root else np.full(count, 99, dt)
                    ctx.broadcast(b, root=root)
                    if not np.array_equal(b, data(root, it, count, dt)):
                        fails.append(("broadcast", dt, root, count))
                    # allgather
                    m = count
                    out = np.full(world * m, 77, dtype=dt)
                    ctx.allgather(data(rank, it, m, dt), out)
                    ref = np.concatenate([data(r, it, m, dt) for r in range(world)])
                    if not np.array_equal(out, ref):
                        fails.append(("allgather", dt, count))
                    # reduce_scatter: inbuf world*m, outbuf m
                    inb = data(rank, it, world * m, dt)
                    keep = inb.copy()
                    outb = np.zeros(m, dtype=dt)
                    ctx.reduce_scatter(inb, outb, op="sum")
                    full = reference(world, it, world * m, dt, "sum")
                    if not np.array_equal(outb, full[rank * m:(rank + 1) * m]) or not np.array_equal(inb, keep):
                        fails.append(("reduce_scatter", dt, count))
                    ctx.barrier()
                    it += 1
    return fails, digests


def _floats(seed, count, dtype):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(count) * 10 ** rng.uniform(-3, 3, count)).astype(dtype)


def random_floats(rank, world, port, count, iters=3, dtype="float32", system="nezha"):
    """Inexact float sums: every rank must still hold identical bits."""
    out = []
    with make_ctx(rank, world, port, 2, system) as ctx:
        for it in range(iters):
            a = _floats(1000 * it + rank, count, dtype)
            ctx.allreduce(a)
            ref = np.sum(np.stack([_floats(1000 * it + r, count, dtype)
                                   for r in range(world)]).astype(np.float64), axis=0)
            out.append((digest(a), bool(np.allclose(a, ref, rtol=1e-3, atol=1e-2 * np.abs(ref).max()))))
    return out


def buffer_protocol(rank, world, port):
    import array
    with make_ctx(rank, world, port) as ctx:
        a = array.array("d", [rank + 0.5] * 13)
        ctx.allreduce(a)
        b = bytearray(np.arange(10, dtype=np.int32).tobytes())
        ctx.allreduce(b, dtype="int32", op="max")
        m2 = np.arange(24, dtype=np.float64).reshape(2, 3, 4) * (rank + 1)
        ctx.allreduce(m2)
        return list(a), list(np.frombuffer(b, dtype=np.int32)), m2.tolist()


def interleaved(rank, world, port, iters=20):
    """Different collectives and sizes back to back, with no barrier between them."""
    bad = []
    with make_ctx(rank, world, port) as ctx:
        for it in range(iters):
            count = [0, 1, 5, 300, 70001][it % 5]
            a = data(rank, it, count, "float64")
            ctx.allreduce(a)
            if not np.array_equal(a, reference(world, it, count, "float64", "sum")):
                bad.append(("allreduce", it))
            b = np.zeros(count, dtype="int32") if rank else data(0, it, count, "int32")
            ctx.broadcast(b, root=0)
            if not np.array_equal(b, data(0, it, count, "int32")):
                bad.append(("broadcast", it))
            if it % 7 == 0:
                ctx.barrier()
    return bad


def length_of(rank, world, port, counts, dtypes=None, ops=None, roots=None, kind="allreduce",
              nrails=2, timeout=5.0):
    """Call one collective with per-rank arguments; used to provoke mismatches."""
    count = counts[rank]
    dt = (dtypes or ["float32"] * world)[rank]
    op = (ops or ["sum"] * world)[rank]
    with make_ctx(rank, world, port, nrails, timeout=timeout) as ctx:
        a = np.ones(count, dtype=dt)
        t0 = time.monotonic()
        try:
            if kind == "allreduce":
                ctx.allreduce(a, op=op)
            else:
                ctx.broadcast(a, root=(roots or [0] * world)[rank])
                # a receiver whose own view was consistent may finish the broadcast itself;
                # it must learn of the others' failure at its next collective
                ctx.barrier()
        finally:
            elapsed = time.monotonic() - t0
    return elapsed


def inject(rank, world, port, what, victim=0, attacker=1, nrails=1, timeout=5.0):
    """Rank ``attacker`` sends something bad to ``victim``; every rank then tries an allreduce."""
    with make_ctx(rank, world, port, nrails, timeout=timeout) as ctx:
        ctx.barrier()
        if rank == attacker:
            from nezha import wire
            if what == "garbage":
                ctx._debug_send_raw(victim, 0, os.urandom(64) + b"x" * 100)
            elif what == "badcrc":
                h = bytearray(wire.Header(wire.DATA, kind=1, dtype=1, redop=1, src=attacker, op_id=1,
                                          length=4, msg_total=4, op_total=16).pack())
                h[20] ^= 0xFF
                ctx._debug_send_raw(victim, 0, bytes(h) + b"abcd")
            elif what == "overflow":
                # a well-formed header whose chunk lies outside the posted buffer
                ctx._debug_send_raw(victim, 0, wire.Header(
                    wire.DATA, kind=1, dtype=1, redop=1, src=attacker, op_id=1, offset=1 << 40,
                    length=8, msg_total=(1 << 40) + 8, op_total=64).pack() + b"12345678")
            elif what == "truncated":
                ctx._debug_send_raw(victim, 0, wire.Header(
                    wire.DATA, kind=1, dtype=1, redop=1, src=attacker, op_id=1, length=1000,
                    msg_total=4096, op_total=4096).pack() + b"short")
                time.sleep(0.2)
                ctx._debug_kill_rail(victim, 0)
        a = np.ones(1024, dtype=np.float32)
        ctx.allreduce(a)
        # a rank whose part of that allreduce was already done may legitimately return from
        # it (with the right result); it must fail at its next collective
        ctx.barrier()
        return a[:4].tolist()


def die_mid_op(rank, world, port, victim=1, nrails=2, timeout=5.0):
    """Rank ``victim`` exits abruptly in the middle of a large allreduce."""
    with make_ctx(rank, world, port, nrails, timeout=timeout) as ctx:
        ctx.barrier()
        if rank == victim:
            import threading
            threading.Timer(0.05, lambda: os._exit(17)).start()
        a = np.ones(16 << 20, dtype=np.float32)
        t0 = time.monotonic()
        try:
            for _ in range(50):
                ctx.allreduce(a)
        finally:
            if rank != victim:
                print("elapsed", time.monotonic() - t0)
        return "finished"


def unacked_out(eng, peer: int, rails) -> bool:
    """Some chunk to ``peer`` is out on one of ``rails`` and not yet acknowledged (call
    under ``eng.cond``)."""
    return any(not ch.acked and any(r in ch.out for r in rails)
               for m in eng.sends.values() if m.dst == peer and not m.complete
               for ch in m.chunks)


def kill_rail_mid_op(rank, world, port, rail=1, count=4 << 20, iters=4, system="nezha",
                     events=None, how="kill", settle=0.0, rail_cpu_us=None):
    """A rail's connections break (or go silent; ``how="kill-all"``: every rail to rank 1
    breaks) during a large allreduce: the result must stay exact. Returns (bad iterations, chunks moved off each rail by failover or hedging,
    event names)."""
    bad = []
    ev = f"{events}.{rank}" if events else None
    if rail_cpu_us is not None:
        os.environ["NEZHA_RAIL_CPU_US"] = str(rail_cpu_us)
    with make_ctx(rank, world, port, 2, system, timeout=10.0, events=ev) as ctx:
        inputs = [data(rank, it, count, "float32") for it in range(iters)]
        ctx.barrier()
        if rank == 0:
            import threading

            def watch():   # break the rail while chunks are in flight on it
                c = ctx.events.rails[rail]
                eng = ctx._engine
                rails = range(2) if how == "kill-all" else [rail]
                start = c.chunks_sent
                while c.chunks_sent < start + 3:
                    time.sleep(0.0005)
                # under the engine's lock, so no acknowledgement is taken between the check
                # and the break: a chunk is out and unacknowledged on the rail at that moment
                # (three chunks sent is not enough: on a loaded machine all three may be
                # acknowledged while the ring waits on its other neighbour)
                while True:
                    with eng.cond:
                        if unacked_out(eng, 1, rails):
                            for r in rails:
                                if how in ("kill", "kill-all"):
                                    ctx._debug_kill_rail(1, r)
                                else:
                                    ctx._debug_blackhole(1, r)
                            return
                    time.sleep(0.0002)
            threading.Thread(target=watch, daemon=True).start()
        for it in range(iters):
            a = inputs[it]
            ctx.allreduce(a)
            if not np.array_equal(a, reference(world, it, count, "float32", "sum")):
                bad.append(it)
        time.sleep(settle)
        ctx.barrier()
        st = ctx.stats()
    names = []
    if ev:
        import json
        names = [json.loads(l)["event"] for l in open(ev)]
    return bad, [r["rerouted_chunks"] + r["hedged_chunks"] for r in st["rails"]], names


def gloo_allreduce(rank, world, port):
    from nezha.baselines import make_context
    ctx = make_context("gloo", rank=rank, world_size=world, rails="127.0.0.1",
                       master=f"127.0.0.1:{port}", timeout=20)
    try:
        a = data(rank, 0, 1001, "float32")
        ctx.allreduce(a)
        ok = bool(np.array_equal(a, reference(world, 0, 1001, "float32", "sum")))
        b = np.zeros(7, "int64") if rank else data(0, 1, 7, "int64")
        ctx.broadcast(b, root=0)
        ok &= bool(np.array_equal(b, data(0, 1, 7, "int64")))
        ctx.barrier()
        return ok
    finally:
        ctx.close()


def silent_peer(rank, world, port, victim=1, timeout=3.0):
    """Every rail of rank ``victim`` goes silent (no socket error): every rank must fail
    within about the collective timeout, none may hang or return."""
    with make_ctx(rank, world, port, 2, timeout=timeout) as ctx:
        ctx.barrier()
        if rank == victim:
            ctx._debug_silence()
        a = np.ones(1 << 18, dtype=np.float32)
        t0 = time.monotonic()
        try:
            ctx.allreduce(a)
            ctx.barrier()
        finally:
            print("elapsed", time.monotonic() - t0)
        return "finished"


def agreed_split(rank, world, port, iters=8, count=1 << 20):
    """After some large allreduces every rank must hold the same balancing state and make
    the same split decisions (they only exchange estimates, never splits)."""
    with make_ctx(rank, world, port, 2) as ctx:
        for it in range(iters):
            a = data(rank, it, count, "float32")
            ctx.allreduce(a)
        bal = ctx.balancer
        return (bal.rs.state, bal.rs.used_a, bal.rs.used_b, bal.rs.a, bal.rs.b,
                [bal.split(n, 4) for n in (100, 40_000, 1 << 20, 16 << 20)],
                ctx.stats()["rails"][0]["bytes_sent"] > 0)


def congestion_of_sockets(rank, world, port, cc):
    """Every data socket's TCP congestion control, with NEZHA_TCP_CONGESTION=cc."""
    import socket
    os.environ["NEZHA_TCP_CONGESTION"] = cc
    with make_ctx(rank, world, port) as ctx:
        names = sorted({c.sock.getsockopt(socket.IPPROTO_TCP, 13, 16).rstrip(b"\0").decode()
                        for c in ctx._engine.conns.values()})
        ctx.barrier()
    return names


def rto_of_sockets(rank, world, port, rto_ms):
    """(what the Context says it set, every data socket's retransmission timeout in ms from
    TCP_INFO after an allreduce), with NEZHA_TCP_RTO_MIN_MS=rto_ms (None: unset)."""
    from nezha.transport.tcpinfo import tcp_info
    if rto_ms is not None:
        os.environ["NEZHA_TCP_RTO_MIN_MS"] = rto_ms
    with make_ctx(rank, world, port) as ctx:
        ctx.allreduce(data(rank, 0, 1 << 18, "float32"))
        rtos = sorted({round(tcp_info(c.sock).rto * 1e3) for c in ctx._engine.conns.values()})
        ctx.barrier()
        return ctx._transport.rto_min_ms, rtos


def stopped_peer(rank, world, port, events_dir, stop_s=2.5):
    """Rank 1's process is stopped (SIGSTOP) for ``stop_s``, longer than the heartbeat
    timeout, while the job idles between two allreduces (a rank starved of the CPU). Returns
    whether the second allreduce was exact, and this rank's rail_suspected / rail_down
    events."""
    import json
    import signal
    import subprocess
    ev = os.path.join(events_dir, f"r{rank}.jsonl")
    count = 1 << 16
    with make_ctx(rank, world, port, events=ev) as ctx:
        ctx.allreduce(data(rank, 0, count, "float32"))
        if rank == 1:
            subprocess.Popen(["sh", "-c", f"sleep {stop_s}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(stop_s + 0.5)
        b = data(rank, 1, count, "float32")
        ctx.allreduce(b)
        exact = bool(np.array_equal(b, reference(world, 1, count, "float32", "sum")))
    with open(ev) as f:
        kinds = [json.loads(line)["event"] for line in f]
    return exact, [k for k in kinds if k in ("rail_suspected", "rail_down")]


def bytes_per_allreduce(rank, world, port, count, direct_max=None, nrails=2):
    """Bytes this rank sends on each rail for one allreduce of ``count`` float32 (after a
    warm-up), and whether the results were exact in 5 calls."""
    if direct_max is not None:
        os.environ["NEZHA_DIRECT_MAX"] = str(direct_max)
    with make_ctx(rank, world, port, nrails) as ctx:
        exact = True
        for it in range(5):
            a = data(rank, it, count, "float32")
            before = [c.bytes_sent for c in ctx.events.rails]
            ctx.allreduce(a)
            sent = [c.bytes_sent - b for c, b in zip(ctx.events.rails, before)]
            exact &= bool(np.array_equal(a, reference(world, it, count, "float32", "sum")))
        ctx.barrier()
    return sent, exact


def bytes_counted_when_the_writer_lags(rank, world, port, count):
    """Bytes on each rail's counters right after an allreduce returns, when every DATA frame
    leaves from the writer thread and that thread stalls 0.3 s after each write (as a writer
    preempted between its write and what follows): the peer's ACK completes the operation
    first."""
    from nezha.transport import base
    real = base.send_vec

    def defer(sock, bufs):
        return [memoryview(b).cast("B") for b in bufs if len(b)]

    def write_then_stall(sock, bufs):
        real(sock, bufs)
        if sum(len(b) for b in bufs) > 4096:
            time.sleep(0.3)

    base.send_vec_now, base.send_vec = defer, write_then_stall
    with make_ctx(rank, world, port) as ctx:
        a = data(rank, 0, count, "float32")
        ctx.allreduce(a)
        sent = [c.bytes_sent for c in ctx.events.rails]
        exact = bool(np.array_equal(a, reference(world, 0, count, "float32", "sum")))
        ctx.barrier()
    return sent, exact


def ring_sizes_up_and_down(rank, world, port):
    """Ring allreduces and reduce-scatters whose sizes and dtypes grow and shrink from one
    operation to the next: the ring's receive buffer is kept between operations
    (buffers.Scratch), so what a larger one left in it must never reach a smaller one."""
    bad = []
    plan = [(300_001, "float64"), (5, "int32"), (70_001, "float32"), (1_000_003, "int64"),
            (2, "float16"), (40_000, "float64"), (700_001, "float32")]
    with make_ctx(rank, world, port, config=Config(direct_max=0, pipe_block=65536)) as ctx:
        for it, (count, dtype) in enumerate(plan):
            a = data(rank, it, count, dtype)
            ctx.allreduce(a)
            if not np.array_equal(a, reference(world, it, count, dtype, "sum")):
                bad.append(("allreduce", count, dtype))
            m = count // world + 1
            full = data(rank, it, m * world, dtype, "max")
            out = np.zeros(m, dtype=dtype)
            ctx.reduce_scatter(full, out, op="max")
            want = reference(world, it, m * world, dtype, "max")[rank * m:(rank + 1) * m]
            if not np.array_equal(out, want):
                bad.append(("reduce_scatter", count, dtype))
        if ctx._engine.scratch.kept < 1_000_003 * 8:
            bad.append(("the ring's buffer was not kept", ctx._engine.scratch.kept))
    if ctx._engine.scratch.kept:
        bad.append(("close() left the ring's buffer held", ctx._engine.scratch.kept))
    return bad


def broadcasts(rank, world, port, roots, count=64):
    """A broadcast from each of ``roots`` in turn, the job's last operations; whether every
    rank got every root's array."""
    exact = True
    with make_ctx(rank, world, port) as ctx:
        for root in roots:
            b = data(root, root, count, "float64")
            got = b.copy() if rank == root else np.zeros(count)
            ctx.broadcast(got, root=root)
            exact &= bool(np.array_equal(got, b))
    return exact


def acks_held_back(rank, world, port, delay_s=0.6, count=4096):
    """Rank 1 holds back every acknowledgement it sends by ``delay_s`` (a peer whose threads
    wait for the CPU). Returns, per small allreduce, whether it was exact and how long it
    took, and how many of this rank's messages were still unacknowledged right after the
    last one and ``delay_s`` + 0.4 s later."""
    import threading
    with make_ctx(rank, world, port) as ctx:
        eng = ctx._engine
        if rank == 1:
            real = eng._ack
            eng._ack = lambda conn, h, delayed: threading.Timer(
                delay_s, real, (conn, h, delayed)).start()
        out = []
        for it in range(3):
            a = data(rank, it, count, "float32")
            t0 = time.monotonic()
            ctx.allreduce(a)
            out.append((bool(np.array_equal(a, reference(world, it, count, "float32", "sum"))),
                        time.monotonic() - t0))
        left = len(eng.sends)
        time.sleep(delay_s + 0.4)
        later = len(eng.sends)
        if rank == 1:
            eng._ack = real
        ctx.barrier()
    return out, left, later
