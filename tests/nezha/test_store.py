"""The store and rendezvous: errors arrive as NezhaError subclasses within the timeout."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nezha import Context, errors
from nezha.store import StoreClient, StoreServer
from nezha.testing import free_port, loopback_rails


@pytest.fixture
def store():
    srv = StoreServer("127.0.0.1", 0)
    cli = StoreClient("127.0.0.1", srv.port, timeout=2.0)
    yield srv, cli
    cli.close()
    srv.close()


def test_set_get_add_wait(store):
    srv, c = store
    c.set("k", "v")
    assert c.get("k") == "v"
    assert c.add("n", 2) == 2 and c.add("n", 3) == 5
    assert c.check(["k", "n"]) and not c.check(["k", "nope"])
    t = threading.Timer(0.2, lambda: StoreClient("127.0.0.1", srv.port).set("late", "x"))
    t.start()
    t0 = time.monotonic()
    assert c.get("late", timeout=3) == "x"
    assert 0.1 < time.monotonic() - t0 < 2.0
    t.join()


def test_the_serving_rank_lingers_until_the_clients_left_but_not_past_its_bound(store):
    """The rank serving the store keeps it while other ranks still hold clients (they may
    connect on demand in their last operation), and no longer than it was told."""
    srv, c = store
    other = StoreClient("127.0.0.1", srv.port, timeout=2.0)
    c.close()
    t0 = time.monotonic()
    assert srv.linger(0.3) == 1                    # one client never leaves: the bound
    assert 0.25 < time.monotonic() - t0 < 2.0
    threading.Timer(0.2, other.close).start()
    t0 = time.monotonic()
    assert srv.linger(5.0) == 0                    # it left: the store may close now
    assert 0.1 < time.monotonic() - t0 < 2.0


def test_wait_times_out(store):
    _, c = store
    t0 = time.monotonic()
    with pytest.raises(errors.StoreTimeout):
        c.wait(["never"], timeout=0.3)
    assert time.monotonic() - t0 < 1.5


def test_abort_wakes_waiters(store):
    srv, c = store
    t = threading.Timer(0.2, lambda: StoreClient("127.0.0.1", srv.port).abort("boom"))
    t.start()
    with pytest.raises(errors.RendezvousAborted, match="boom"):
        c.wait(["never"], timeout=5)
    t.join()


def test_unreachable_store_fails_within_timeout():
    t0 = time.monotonic()
    with pytest.raises(errors.StoreTimeout):
        StoreClient("127.0.0.1", free_port(), timeout=0.5)
    assert time.monotonic() - t0 < 2.0


def start(specs, timeout=2.0):
    """specs: list of dicts of Context kwargs; returns list of (result or exception, seconds)."""
    port = free_port()

    def one(kw):
        t0 = time.monotonic()
        try:
            kw = dict(kw)
            ctx = Context(master=f"127.0.0.1:{port}", timeout=timeout,
                          rails=kw.pop("rails", loopback_rails(2)), **kw)
            ctx.barrier()
            ctx.close()
            return "ok", time.monotonic() - t0
        except Exception as e:
            return e, time.monotonic() - t0

    with ThreadPoolExecutor(len(specs)) as ex:
        futs = [ex.submit(one, s) for s in specs]
        return [f.result(timeout=timeout * 4 + 10) for f in futs]


def test_threads_rendezvous_and_barrier_work():
    res = start([dict(rank=r, world_size=3) for r in range(3)])
    assert [r for r, _ in res] == ["ok"] * 3


def test_missing_rank():
    res = start([dict(rank=0, world_size=3), dict(rank=1, world_size=3)])
    assert any(isinstance(e, errors.MissingRankError) for e, _ in res), res
    for e, dt in res:
        assert isinstance(e, errors.RendezvousError), e
        assert "[2]" in str(e)
        assert dt < 4.0


def test_wrong_world_size():
    res = start([dict(rank=0, world_size=2), dict(rank=1, world_size=3)])
    for e, dt in res:
        assert isinstance(e, errors.RendezvousError), e
        assert dt < 4.0
    assert any(isinstance(e, errors.WorldSizeMismatchError) for e, _ in res)


def test_duplicate_rank():
    res = start([dict(rank=0, world_size=3), dict(rank=1, world_size=3), dict(rank=1, world_size=3)])
    kinds = [type(e) for e, _ in res]
    assert errors.DuplicateRankError in kinds, kinds
    for e, dt in res:
        assert isinstance(e, errors.RendezvousError), e
        assert dt < 4.0


def test_unknown_rail_address():
    res = start([dict(rank=0, world_size=2, rails=["127.0.0.1", "198.18.77.77"]),
                 dict(rank=1, world_size=2)])
    e0, dt0 = res[0]
    assert isinstance(e0, errors.RailConfigError) and "198.18.77.77" in str(e0)
    assert dt0 < 1.0
    e1, dt1 = res[1]
    assert isinstance(e1, errors.NezhaError) and dt1 < 4.0


@pytest.mark.parametrize("kw, exc", [
    (dict(rank=3, world_size=2), errors.ConfigError),
    (dict(rank=0, world_size=0), errors.ConfigError),
    (dict(rank=0, world_size=1, system="bogus"), errors.ConfigError),
    (dict(rank=0, world_size=1, rails="no-such-if0"), errors.RailConfigError),
    (dict(rank=0, world_size=1, rails="127.0.0.1,127.0.0.1"), errors.RailConfigError),
])
def test_bad_arguments(kw, exc):
    with pytest.raises(exc):
        Context(master="127.0.0.1:1", **{"rails": "127.0.0.1", **kw})


def test_from_env(monkeypatch):
    port = free_port()
    monkeypatch.setenv("NEZHA_MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("NEZHA_MASTER_PORT", str(port))
    monkeypatch.setenv("NEZHA_RANK", "0")
    monkeypatch.setenv("NEZHA_WORLD_SIZE", "1")
    monkeypatch.setenv("NEZHA_RAILS", "lo")   # an interface name
    import numpy as np
    with Context.from_env() as ctx:
        assert (ctx.rank, ctx.world_size, ctx.rail_addrs) == (0, 1, ["127.0.0.1"])
        a = np.arange(5.0)
        ctx.allreduce(a)
        assert a.tolist() == [0, 1, 2, 3, 4]


def test_gloo_without_torch_is_a_clear_config_error(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "torch", None)        # as if torch were missing
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    from nezha.baselines import make_context
    with pytest.raises(errors.ConfigError, match="torch"):
        make_context("gloo", rank=0, world_size=1, rails="127.0.0.1", master="127.0.0.1:1")
    with pytest.raises(errors.ConfigError):
        make_context("bogus", rank=0, world_size=1, rails="127.0.0.1", master="127.0.0.1:1")
