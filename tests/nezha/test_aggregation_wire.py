"""The aggregation switch and its client on loopback (no namespaces): reductions, the codec's
bounds, and that no malformed, foreign or duplicate contribution ever changes a result."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from nezha import aggwire, auth
from nezha.errors import (AggregationRefused, AggregatorTimeout, AggregatorUnavailable,
                          ProtocolError)
from nezha.transport.aggregation import AggregationChannel
from testbed.aggregation.pacing import TokenBucket
from testbed.aggregation.service import Service
from testbed.aggregation.table import Limits

from asyncloop import cancel_the_rest

SECRET = "s3cret-of-the-job-0123456789"


class Running:
    """A Service on 127.0.0.1 in a thread of its own (its own event loop)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self.call(service.start("127.0.0.1", 0))

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def stats(self) -> tuple[int, int]:
        async def read():
            return len(self.service.table.entries), self.service.table.pending_bytes
        return self.call(read())

    def stop(self) -> None:
        self.call(self.service.stop())
        self.call(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def switch(request):
    limits = getattr(request, "param", Limits(key_timeout=2.0))
    r = Running(Service(auth.secret_bytes(SECRET), limits))
    yield r
    r.stop()


def channels(switch: Running, world: int, secret=SECRET, **kw) -> list[AggregationChannel]:
    return [AggregationChannel("127.0.0.1", switch.port, rank, world, secret, job="t", **kw)
            for rank in range(world)]


def run_all(chs, fn):
    with ThreadPoolExecutor(len(chs)) as ex:
        return list(ex.map(fn, range(len(chs)), chs))


def inputs(world: int, n: int, dtype) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(-50, 50, n).astype(dtype) if np.dtype(dtype).kind in "if"
            else rng.integers(0, 50, n).astype(dtype) for _ in range(world)]


@pytest.mark.parametrize("world,dtype,op", [(2, "float32", "sum"), (3, "float64", "sum"),
                                            (4, "int32", "sum"), (4, "int64", "max"),
                                            (3, "float16", "min"), (2, "uint8", "max")])
def test_reduction_is_exact_on_every_rank(switch, world, dtype, op):
    xs = inputs(world, 5000, dtype)
    want = {"sum": np.sum, "max": np.max, "min": np.min}[op](np.stack(xs), axis=0)
    chs = channels(switch, world)
    got = run_all(chs, lambda r, ch: ch.allreduce_chunk(9, 0, xs[r], op))
    for g in got:
        assert g.dtype == np.dtype(dtype) and np.array_equal(g, want.astype(dtype))
    for ch in chs:
        ch.close()
    assert switch.stats() == (0, 0)


def test_pipelined_allreduce_in_place_of_a_range(switch):
    """A byte range of a bigger buffer, in place, many chunks, a small window."""
    world, n = 3, 300_000
    bufs = [np.arange(n, dtype=np.float32) * (r + 1) for r in range(world)]
    chs = channels(switch, world, chunk_bytes=64 << 10, window=256 << 10)
    lo, hi = 1000, 250_000

    def go(r, ch):
        view = bufs[r][lo:hi]
        return ch.allreduce(5, view, out=view, first_chunk=100)
    run_all(chs, go)
    want = np.arange(n, dtype=np.float32) * 6
    for r in range(world):
        assert np.array_equal(bufs[r][lo:hi], want[lo:hi])
        assert np.array_equal(bufs[r][:lo], np.arange(lo, dtype=np.float32) * (r + 1))
    for ch in chs:
        ch.close()


def test_wrong_secret_is_refused_and_changes_nothing(switch):
    with pytest.raises(AggregatorUnavailable, match="secret"):
        AggregationChannel("127.0.0.1", switch.port, 1, 2, "another-secret-0123456789", job="t")
    with pytest.raises(AggregatorUnavailable, match="secret"):
        AggregationChannel("127.0.0.1", switch.port, 1, 2, None, job="t")
    a, b = channels(switch, 2)
    x = np.ones(10, np.float32)
    got = run_all([a, b], lambda r, ch: ch.allreduce_chunk(1, 0, x * (r + 1)))
    assert all(np.array_equal(g, x * 3) for g in got)


def raw_rank(port: int, rank: int, world: int, secret: str = SECRET) -> socket.socket:
    """A hand-driven authenticated connection (for frames the client never sends)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    nr = auth.nonce()
    s.sendall(aggwire.control(aggwire.HELLO, {"job": "t", "rank": rank, "world": world,
                                              "nonce": nr.hex()}))
    ch = read_frame(s)[1]
    t = aggwire.transcript(nr, bytes.fromhex(json.loads(ch)["nonce"]), "t", rank, world)
    s.sendall(aggwire.control(aggwire.PROOF, {"proof": auth.mac(
        auth.secret_bytes(secret), aggwire.RANK_LABEL, *t).hex()}))
    assert read_frame(s)[0].type == aggwire.WELCOME
    return s


read_frame = aggwire.read_frame


def contrib(rank: int, world: int, x: np.ndarray, **over) -> bytes:
    fields = dict(type=aggwire.CONTRIB, dtype=aggwire.dtype_code(x.dtype), redop=1, rank=rank,
                  world=world, count=x.size, op_id=1, chunk=0, length=x.nbytes)
    fields.update(over)
    return aggwire.header(**fields) + x.tobytes()


def test_duplicate_mismatched_and_impersonating_contributions_change_nothing(switch):
    x = np.full(8, 2.0, np.float32)
    s0 = raw_rank(switch.port, 0, 2)
    s0.sendall(contrib(0, 2, x))
    s0.sendall(contrib(0, 2, x * 100))                       # duplicate
    h, why = read_frame(s0)
    assert (h.type, h.code) == (aggwire.ERROR, aggwire.E_DUPLICATE), why
    s0.sendall(contrib(1, 2, x * 100))                       # as another rank
    assert read_frame(s0)[0].code == aggwire.E_AUTH
    s0.sendall(contrib(0, 2, np.full(9, 2.0, np.float32)))   # another size, same key
    assert read_frame(s0)[0].code == aggwire.E_MISMATCH
    b = AggregationChannel("127.0.0.1", switch.port, 1, 2, SECRET, job="t")
    assert np.array_equal(b.allreduce_chunk(1, 0, x), x * 2)
    h, payload = read_frame(s0)
    assert h.type == aggwire.RESULT and np.array_equal(np.frombuffer(payload, np.float32), x * 2)


@pytest.mark.parametrize("bad", [
    dict(version=2), dict(length=aggwire.MAX_CHUNK + 4), dict(world=aggwire.MAX_WORLD + 1),
    dict(count=3), dict(dtype=99), dict(redop=4), dict(crc=1), dict(truncate=20)])
def test_malformed_frame_closes_the_connection_and_changes_nothing(switch, bad):
    x = np.full(4, 1.0, np.float32)
    s = raw_rank(switch.port, 0, 2)
    over = {k: v for k, v in bad.items() if k not in ("version", "crc", "truncate")}
    frame = bytearray(contrib(over.pop("rank", 0), over.pop("world", 2), x, **over))
    if "version" in bad:
        frame[4] = bad["version"]
    if "crc" in bad:
        frame[44] ^= 0xFF
    if "truncate" in bad:
        frame = frame[:bad["truncate"]]
    s.sendall(bytes(frame))
    if "truncate" in bad:
        s.shutdown(socket.SHUT_WR)               # the rest never comes
    h, why = read_frame(s)
    assert (h.type, h.code) == (aggwire.ERROR, aggwire.E_PROTOCOL), why
    s.settimeout(5)
    assert s.recv(100) == b""                                # closed by the switch
    assert switch.stats() == (0, 0)                          # nothing was kept
    a, b = channels(switch, 2)
    got = run_all([a, b], lambda r, ch: ch.allreduce_chunk(1, 0, x))
    assert all(np.array_equal(g, x * 2) for g in got)


def test_codec_checks_lengths_before_payload():
    h = aggwire.header(type=aggwire.CONTRIB, dtype=1, redop=1, rank=0, world=2, count=4,
                       length=16)
    assert aggwire.unpack(h).count == 4
    with pytest.raises(ProtocolError, match="truncated"):
        aggwire.unpack(h[:47])
    with pytest.raises(ProtocolError, match="at most 8"):
        aggwire.unpack(h, max_chunk=8)
    with pytest.raises(ProtocolError, match="rank 2 outside"):
        aggwire.unpack(aggwire.header(type=aggwire.CONTRIB, dtype=1, redop=1, rank=2, world=2,
                                      count=4, length=16))
    with pytest.raises(ProtocolError, match="payload"):
        aggwire.unpack(aggwire.header(type=aggwire.HELLO, length=aggwire.MAX_CONTROL + 1))


def test_missing_rank_times_out_and_frees_the_key():
    r = Running(Service(auth.secret_bytes(SECRET), Limits(key_timeout=0.3)))
    try:
        chs = channels(r, 3)
        t0 = time.monotonic()
        errs = run_all(chs[:2], lambda i, ch: _refusal(ch, np.ones(1000, np.float32)))
        took = time.monotonic() - t0
        assert all(e.code == "timeout" and "ranks 2 did not" in str(e) for e in errs)
        assert 0.3 <= took < 1.5
        assert r.stats() == (0, 0)
        # the channels are still usable, and the late rank's contribution opens a new key
        got = run_all(chs, lambda i, ch: ch.allreduce_chunk(2, 0, np.ones(4, np.float32)))
        assert all(np.array_equal(g, np.full(4, 3, np.float32)) for g in got)
    finally:
        r.stop()


def _refusal(ch: AggregationChannel, x: np.ndarray, chunk: int = 0) -> AggregationRefused:
    with pytest.raises(AggregationRefused) as e:
        ch.allreduce_chunk(1, chunk, x, timeout=5)
    return e.value


def test_memory_bound_refuses_instead_of_buffering():
    r = Running(Service(auth.secret_bytes(SECRET), Limits(max_keys=2, max_bytes=10_000)))
    try:
        a = AggregationChannel("127.0.0.1", r.port, 0, 2, SECRET, job="t")
        x = np.ones(1000, np.float32)
        p1, p2 = a.submit(1, 0, x), a.submit(1, 1, x)
        e = _refusal(a, x, chunk=2)             # a third key: refused, not held
        assert e.code == "busy" and "holds 2 keys" in str(e)
        assert r.stats() == (2, 8000)
        b = AggregationChannel("127.0.0.1", r.port, 0, 2, SECRET, job="u")
        e = _refusal(b, np.ones(3000, np.float32))   # 12 000 bytes > the job's 10 000
        assert e.code == "busy" and "holds 0 keys" in str(e)
        assert r.stats() == (2, 8000)
        c = AggregationChannel("127.0.0.1", r.port, 1, 2, SECRET, job="t")
        for i, p in enumerate((p1, p2)):
            assert np.array_equal(c.allreduce_chunk(1, i, x), x * 2)
            assert np.array_equal(p.wait(5), x * 2)
        assert r.stats() == (0, 0)
    finally:
        r.stop()


def test_ping_needs_no_secret_and_tells_nothing_else(switch):
    s = socket.create_connection(("127.0.0.1", switch.port), timeout=5)
    s.sendall(aggwire.header(type=aggwire.PING))
    h, payload = read_frame(s)
    assert h.type == aggwire.PONG and json.loads(payload) == {"version": 1, "keys": 0, "bytes": 0}
    assert s.recv(10) == b""


def test_switch_gone_fails_every_chunk_in_flight():
    r = Running(Service(auth.secret_bytes(SECRET)))
    a = AggregationChannel("127.0.0.1", r.port, 0, 2, SECRET, job="t", timeout=5)
    b = AggregationChannel("127.0.0.1", r.port, 0, 2, SECRET, job="t", timeout=5)
    p = a.submit(1, 0, np.ones(10, np.float32))
    a._sock.shutdown(socket.SHUT_RDWR)         # the connection breaks
    with pytest.raises(AggregatorUnavailable):
        p.wait(5)
    with pytest.raises(AggregatorUnavailable):
        a.submit(1, 1, np.ones(10, np.float32))
    q = b.submit(2, 0, np.ones(10, np.float32))
    t0 = time.monotonic()
    r.stop()                                   # the switch dies with a chunk in flight
    with pytest.raises(AggregatorUnavailable, match="closed the connection"):
        q.wait(5)
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(AggregatorUnavailable):
        AggregationChannel("127.0.0.1", r.port, 0, 2, SECRET, connect_timeout=1)


def test_a_switch_that_resets_is_a_switch_that_closed(switch):
    """A switch that exits with a contribution unread resets the connection instead of
    closing it (the race the test above can meet): in flight, the chunk fails the same way.
    A relay between the channel and the switch resets its side on demand (SO_LINGER 0)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    relayed: list = []

    def relay():
        front, _ = lsock.accept()
        back = socket.create_connection(("127.0.0.1", switch.port))
        inward = threading.Thread(target=_pump, args=(front, back), daemon=True)
        threading.Thread(target=_pump, args=(back, front), daemon=True).start()
        inward.start()
        relayed.append((front, inward))

    threading.Thread(target=relay, daemon=True).start()
    ch = AggregationChannel("127.0.0.1", lsock.getsockname()[1], 0, 2, SECRET, timeout=5)
    p = ch.submit(3, 0, np.ones(10, np.float32))       # rank 1 never sends: stays in flight
    front, inward = relayed[0]
    front.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
    front.shutdown(socket.SHUT_RD)      # ends the relay's read (a socket another thread is
    inward.join(5)                      # reading is not released by close), sends no FIN...
    front.close()                       # ...and the close with linger 0 resets
    with pytest.raises(AggregatorUnavailable, match=r"closed the connection \(reset\)"):
        p.wait(5)
    lsock.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass


def test_no_result_is_a_timeout(switch):
    a = channels(switch, 2)[0]
    with pytest.raises(AggregatorTimeout):
        a.allreduce_chunk(1, 0, np.ones(4, np.float32), timeout=0.2)


def test_token_bucket_paces_results(monkeypatch):
    """On a fake clock: 1 MB through a 10 MB/s bucket sleeps exactly 0.09 s (its 100 KB
    burst, 10 ms of rate, is free), in debts of one result at a time."""
    from testbed.aggregation import pacing
    now, slept = [0.0], []

    async def fake_sleep(d: float) -> None:
        slept.append(d)
        now[0] += d
    monkeypatch.setattr(pacing.asyncio, "sleep", fake_sleep)

    async def go() -> None:
        b = TokenBucket(80_000_000, clock=lambda: now[0])
        for _ in range(10):
            await b.take(100_000)
    asyncio.run(go())
    assert sum(slept) == pytest.approx(0.09) and len(slept) == 9


def test_aggregation_rate_paces_the_switch():
    """4 MiB of results at 160 Mbit/s (20 MB/s) take at least 0.2 s; unpaced, far less."""
    r = Running(Service(auth.secret_bytes(SECRET), rate_bps=160_000_000))
    try:
        chs = channels(r, 2, chunk_bytes=256 << 10, window=1 << 20)
        x = np.ones(1 << 20, np.float32)
        t0 = time.monotonic()
        got = run_all(chs, lambda i, ch: ch.allreduce(1, x))
        took = time.monotonic() - t0
        assert all(np.array_equal(g, x * 2) for g in got)
        assert took >= (4 << 20) / 20e6 - 0.011        # the 10 ms burst is free
    finally:
        r.stop()


def test_a_failed_allreduce_never_writes_its_range_afterwards(switch):
    """Rank 0 gives up (timeout); rank 1 then completes the keys: the late results are read
    and dropped, rank 0's buffer keeps what it had, and the channel stays usable."""
    a, b = channels(switch, 2, chunk_bytes=16 << 10, window=1 << 20)
    buf = np.arange(40_000, dtype=np.float32)
    with pytest.raises(AggregatorTimeout):
        a.allreduce(1, buf, out=buf, timeout=0.2)
    assert np.array_equal(b.allreduce(1, np.ones(40_000, np.float32)),
                          np.arange(40_000, dtype=np.float32) + 1)
    x = np.ones(10, np.float32)
    got = run_all([a, b], lambda r, ch: ch.allreduce_chunk(2, 0, x))
    assert all(np.array_equal(g, x * 2) for g in got)
    assert np.array_equal(buf, np.arange(40_000, dtype=np.float32))
    assert a._pending == {} and a._inflight == 0


def test_aggregator_addresses_and_service_arguments_are_checked():
    from nezha.config import Config
    from nezha.errors import ConfigError
    from testbed.aggregation.service import _args, _config
    from testbed.errors import SpecError
    assert Config.from_env({"NEZHA_AGGREGATORS": "r1=198.18.1.254:29400,r2=10.0.0.1:1"}
                           ).aggregators == (("r1", "198.18.1.254", 29400), ("r2", "10.0.0.1", 1))
    with pytest.raises(ConfigError, match="NEZHA_AGGREGATORS"):
        Config.from_env({"NEZHA_AGGREGATORS": "r1=198.18.1.254"})
    host, port, limits, rate = _config(_args(["--listen", "1.2.3.4:9", "--rate", "1gbit",
                                              "--key-timeout", "0.5"]))
    assert (host, port, limits.key_timeout, rate) == ("1.2.3.4", 9, 0.5, 10 ** 9)
    with pytest.raises(ConfigError, match="--listen"):
        _config(_args(["--listen", "1.2.3.4"]))
    with pytest.raises(ConfigError, match="--max-keys"):
        _config(_args(["--listen", "1.2.3.4:9", "--max-keys", "0"]))
    with pytest.raises(SpecError, match="--rate"):
        _config(_args(["--listen", "1.2.3.4:9", "--rate", "100"]))


def _congestion(sock) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()


def test_both_ends_of_a_switch_connection_use_the_jobs_congestion_control():
    """The switch half under the host's default (bbr here) and the ring under the job's cubic
    ran the switch at 0.8 of its wire: both ends take the job's (reno: built into every
    kernel, and not this machine's default)."""
    from nezha.errors import ConfigError
    from testbed.aggregation.service import _args, _config
    default = open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    want = "reno" if default != "reno" else "cubic"
    r = Running(Service(auth.secret_bytes(SECRET), Limits(key_timeout=2.0), congestion=want))
    try:
        chs = channels(r, 2, congestion=want)
        x = inputs(2, 1000, "float32")
        outs = run_all(chs, lambda i, ch: ch.allreduce(1, x[i], "sum"))
        assert all(np.array_equal(o, x[0] + x[1]) for o in outs)
        assert [_congestion(ch._sock) for ch in chs] == [want, want]
        served = [w.get_extra_info("socket") for w in list(r.service._handlers.values())]
        assert len(served) == 2 and {_congestion(s) for s in served} == {want}
        for ch in chs:
            ch.close()
        with pytest.raises(ConfigError, match="NEZHA_TCP_CONGESTION='no-such-cc'"):
            AggregationChannel("127.0.0.1", r.port, 0, 2, SECRET, congestion="no-such-cc")
    finally:
        r.stop()
    with pytest.raises(ConfigError, match="--congestion='no-such-cc'"):
        _config(_args(["--listen", "1.2.3.4:9", "--congestion", "no-such-cc"]))


def test_jobs_and_bytes_in_the_middle_of_a_read_are_bounded():
    from testbed.aggregation.service import ByteBudget
    r = Running(Service(auth.secret_bytes(SECRET), Limits(max_jobs=1)))
    try:
        t = AggregationChannel("127.0.0.1", r.port, 0, 2, SECRET, job="t")
        u = AggregationChannel("127.0.0.1", r.port, 0, 2, SECRET, job="u")
        t.submit(1, 0, np.ones(4, np.float32))
        assert _refusal(u, np.ones(4, np.float32)).code == "busy"
        assert r.stats() == (1, 16)
    finally:
        r.stop()

    async def budget() -> list[str]:
        b, order = ByteBudget(100), []

        async def reader(name: str, n: int) -> None:
            await b.take(n)
            order.append(name)
        await b.take(60)
        waiting = asyncio.create_task(reader("second", 50))
        await asyncio.sleep(0.01)
        order.append("gave")
        await b.give(60)
        await waiting
        return order
    assert asyncio.run(budget()) == ["gave", "second"]


def test_both_ends_of_a_switch_connection_take_the_jobs_least_rto():
    """A switch connection's lost last segment must cost what a TCP rail's does (the job's
    least RTO), not the kernel's 200 ms."""
    from nezha.errors import ConfigError
    from nezha.transport.base import TCP_RTO_MIN_US, set_rto_min
    from testbed.aggregation.service import _args, _config
    with socket.socket() as probe:
        took = set_rto_min(probe, 5.0)
    if not took:
        pytest.skip("this kernel has no per-socket TCP_RTO_MIN_US (Linux < 6.15)")
    r = Running(Service(auth.secret_bytes(SECRET), Limits(key_timeout=2.0), rto_min_ms=5.0))
    try:
        chs = channels(r, 2, rto_min_ms=5.0)
        x = inputs(2, 1000, "float32")
        outs = run_all(chs, lambda i, ch: ch.allreduce(1, x[i], "sum"))
        assert all(np.array_equal(o, x[0] + x[1]) for o in outs)
        mins = [ch._sock.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US) for ch in chs]
        served = [w.get_extra_info("socket") for w in list(r.service._handlers.values())]
        mins += [s.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US) for s in served]
        assert len(mins) == 4 and set(mins) == {int(took * 1000)}, mins
        for ch in chs:
            ch.close()
    finally:
        r.stop()
    assert _args(["--listen", "1.2.3.4:9"]).rto_min_ms == 5.0    # Nezha's default
    with pytest.raises(ConfigError, match="--rto-min-ms"):
        _config(_args(["--listen", "1.2.3.4:9", "--rto-min-ms", "500"]))
