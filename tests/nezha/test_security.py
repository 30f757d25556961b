"""Trust and bounds: the job secret (store and rails), a bounded store, CONTROL before the
first collective. See README "Security"."""
from __future__ import annotations

import socket
import struct
import threading
import time
import tracemalloc

import pytest

import securityfns as sf
from nezha import auth, errors
from nezha.config import Config
from nezha.store import MAX_MESSAGE, StoreClient, StoreServer
from nezha.testing import run_ranks

SECRET = sf.SECRET


class Log:
    """An Events stand-in for a StoreServer: the refusals it logs."""

    def __init__(self):
        self.lines = []

    def emit(self, event, **fields):
        self.lines.append(dict(event=event, **fields))


def wait_until(pred, limit=3.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


# ---------------------------------------------------------------------------- the attack
def check_job(res, world=2):
    """Every rank finished with exact results (a NezhaError on every rank would be acceptable
    in principle; with these attacks the job must simply not notice)."""
    for r, (ok, v) in sorted(res.items()):
        assert ok, (r, v)
        assert all(v["oks"]), (r, v["oks"])


def test_stray_without_the_secret_can_neither_read_the_store_nor_take_a_rail(tmp_path):
    res = run_ranks(sf.stray_job, 2, timeout=90, secret=SECRET, events=str(tmp_path / "ev"))
    check_job(res)
    got = res[1][1]["attack"]
    assert got["store_no_secret"].startswith("refused"), got
    assert "NEZHA_JOB_SECRET" in got["store_no_secret"], got
    assert got["store_wrong_secret"].startswith("refused"), got
    assert got["store_plain_leak"] is False
    assert len(got["rails"]) == 2 * 6
    for k, (acc, closed) in got["rails"].items():
        assert not acc and closed, (k, acc, closed)
    assert res[0][1]["same_conns"] and res[1][1]["same_conns"]
    ev0 = res[0][1]["events"]
    strays = [e for e in ev0 if e["event"] == "stray_connection"]
    assert len(strays) >= 2 * 6, [e["reason"] for e in strays]
    assert any("did not prove" in e["reason"] for e in strays), strays
    refused = [e for e in ev0 if e["event"] == "store_refused"]
    assert len(refused) >= 3, refused
    assert not any(e["event"] == "unauthenticated" for e in ev0)


def test_unauthenticated_job_keeps_its_live_connections_from_a_stray(tmp_path):
    """No secret: the stray reads the store (session, endpoints) like in the finding, but
    still cannot replace a live connection or splice a frame into the job."""
    res = run_ranks(sf.stray_job, 2, timeout=90, secret=None, events=str(tmp_path / "ev"))
    check_job(res)
    got = res[1][1]["attack"]
    assert got["store_no_secret"].startswith("read "), got      # unauthenticated: readable
    for k, (acc, closed) in got["rails"].items():
        assert not acc and closed, (k, acc, closed)
    assert res[0][1]["same_conns"] and res[1][1]["same_conns"]
    ev0 = res[0][1]["events"]
    assert sum(e["event"] == "unauthenticated" for e in ev0) == 1
    assert sum(e["event"] == "stray_connection" for e in ev0) >= 2 * 6


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_rejoin_replaces_a_live_connection_only_when_authenticated(tmp_path, secret):
    res = run_ranks(sf.live_rejoin, 2, timeout=60, secret=secret, events=str(tmp_path / "ev"))
    check_job(res)
    verdict = res[1][1]["rejoin"]
    if secret:
        assert verdict == "accepted", verdict
    else:
        assert "still connected" in verdict, verdict
        assert any(e["event"] == "stray_connection" and "still connected" in e["reason"]
                   for e in res[0][1]["events"])


def test_a_rejoin_slow_to_install_is_not_dialled_over_by_the_health_thread(tmp_path):
    res = run_ranks(sf.live_rejoin, 2, timeout=60, secret=SECRET, install_delay=0.3,
                    events=str(tmp_path / "ev"))
    check_job(res)
    assert res[1][1]["rejoin"] == "accepted", res[1][1]["rejoin"]
    ev1 = res[1][1]["events"]
    # the window is real: rank 1 saw its old connection fail before the new one was in
    assert any(e["event"] == "rail_down" and e.get("rail") == 0 for e in ev1), ev1
    ups = [e for e in res[0][1]["events"] if e["event"] == "rail_up"]
    assert len(ups) == 1, ups                  # the member's rejoin, not a redial after it


def test_replayed_rail_handshake_is_refused(tmp_path):
    res = run_ranks(sf.replay_job, 2, timeout=60, events=str(tmp_path / "ev"))
    check_job(res)
    r1 = res[1][1]
    assert r1["legit_accepted"] and r1["recorded_bytes"] > 0, r1
    assert not r1["replay_accepted"] and r1["replay_closed"], r1
    strays = [e for e in res[0][1]["events"] if e["event"] == "stray_connection"]
    assert any("did not prove" in e["reason"] for e in strays), strays
    ups = [e for e in res[0][1]["events"] if e["event"] == "rail_up"]
    # every connection rank 0 took is one that rank 1 made (the legitimate rejoin, and any
    # redial of rank 1's health thread): the replay was not installed
    dials = [e for e in res[1][1]["events"] if e["event"] == "rail_up"]
    assert ups and len(ups) == len(dials), (ups, dials)


def test_mismatched_secrets_fail_every_rank_with_a_clear_error():
    res = run_ranks(sf.plain, 2, timeout=40, per_rank={
        0: {"secret": SECRET, "timeout": 2.0}, 1: {"secret": SECRET[::-1], "timeout": 2.0}})
    for r, (ok, v) in res.items():
        assert not ok and not isinstance(v, str), (r, v)
        assert v.isa("NezhaError"), (r, v)
    assert res[1][1].isa("AuthenticationError"), res[1][1]


def test_secret_on_one_side_only_is_named():
    res = run_ranks(sf.plain, 2, timeout=40, per_rank={
        0: {"secret": SECRET, "timeout": 2.0}, 1: {"secret": None, "timeout": 2.0}})
    assert res[1][1].isa("AuthenticationError") and "NEZHA_JOB_SECRET" in res[1][1].message


def test_with_the_secret_every_collective_is_exact(tmp_path):
    res = run_ranks(sf.plain, 3, timeout=60, secret=SECRET, events=str(tmp_path / "ev"))
    for r, (ok, v) in res.items():
        assert ok and v[0], (r, v)
        assert not any(e["event"] == "unauthenticated" for e in v[1])


# ---------------------------------------------------------------------------- CONTROL
def test_control_before_the_first_collective_reaches_every_rank(tmp_path):
    res = run_ranks(sf.control_before_first_op, 3, timeout=60, events=str(tmp_path / "ev"))
    for r, (ok, v) in res.items():
        assert ok, (r, v)
        assert all(v[0]), (r, v[0])
    ev2 = res[2][1][1]
    agreed = [(e["state"], e["by"]) for e in ev2 if e["event"] == "rail_agreed" and e["rail"] == 1]
    assert agreed and agreed[0][0] == "down", ev2      # a report from rank 0 or 1 arrived
    assert agreed[-1][0] == "up", agreed                # ...and the rejoin's
    for r, (ok, v) in res.items():
        assert not any(e["event"] == "error" for e in v[1]), (r, v[1])


# ---------------------------------------------------------------------------- the store
@pytest.fixture
def served():
    log = Log()
    srv = StoreServer("127.0.0.1", 0, secret=SECRET, max_clients=6, events=log,
                      max_value=1000, max_total=5000, handshake_timeout=0.5, read_timeout=0.5)
    yield srv, log
    srv.close()


def client(srv, **kw):
    return StoreClient("127.0.0.1", srv.port, timeout=kw.pop("timeout", 2.0),
                       secret=kw.pop("secret", SECRET), **kw)


def test_store_refuses_strangers_and_answers_members(served):
    srv, log = served
    c = client(srv)
    c.set("k", "v")
    assert c.get("k") == "v" and c.add("n", 2) == 2
    with pytest.raises(errors.AuthenticationError, match="NEZHA_JOB_SECRET"):
        client(srv, secret=None)
    with pytest.raises(errors.AuthenticationError, match="refused"):
        client(srv, secret="x" * 20)
    open_srv = StoreServer("127.0.0.1", 0)
    try:       # a rank with a secret does not trust a store without one
        with pytest.raises(errors.AuthenticationError, match="no job secret"):
            client(open_srv)
    finally:
        open_srv.close()
    assert wait_until(lambda: srv.refused >= 2)
    assert all(e["event"] == "store_refused" for e in log.lines)
    c.close()


def test_store_replayed_session_is_refused(served):
    """A recorded client session (handshake, then a set) replayed later does nothing."""
    srv, log = served
    proxy = sf.RecordingProxy(("127.0.0.1", srv.port))
    c = StoreClient(proxy.host, proxy.port, timeout=2.0, secret=SECRET)
    c.set("k", "first")
    c.close()
    recorded = bytes(proxy.c2s)
    client(srv).set("k", "second")
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=2)
    s.sendall(recorded)
    reply, closed = sf.drain(s, 2.0)
    assert closed and reply[38:39] != b"\x00", reply      # verdict: refused
    assert client(srv).get("k") == "second"
    assert any("did not prove" in e["reason"] for e in log.lines), log.lines


def raw_member(srv):
    """An authenticated connection, for sending what a StoreClient would refuse to."""
    c = client(srv)
    return c, c._ch


def test_store_huge_length_prefix_is_refused_before_allocating(served):
    srv, log = served
    c, ch = raw_member(srv)
    ch.sock.sendall(struct.pack("!I", 0xFFFFFFF0))
    assert sf.drain(ch.sock, 2.0)[1]                        # closed by the server
    assert any("announced" in e["reason"] for e in log.lines), log.lines
    # under the bound, buffers grow only as bytes arrive: 4 clients announcing the maximum
    # and sending 1 KiB each cost nowhere near 4 x MAX_MESSAGE
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        held = []
        for _ in range(4):
            c2, ch2 = raw_member(srv)
            ch2.sock.sendall(struct.pack("!I", MAX_MESSAGE) + b"x" * 1024)
            held.append(c2)
        time.sleep(0.2)
        grown = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert grown < 1 << 20, grown
    # ...and a request that stops half way is cut off after read_timeout
    assert wait_until(lambda: srv.clients == 0, 3.0), srv.clients
    assert any("timed out" in e["reason"] for e in log.lines), log.lines
    for c2 in held:
        c2.close()


def test_store_connection_cap_and_pruning(served):
    srv, log = served
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(40)]
    assert wait_until(lambda: srv.clients == 6)
    assert threading.active_count() - before <= 6 + 1
    with pytest.raises(errors.StoreTimeout, match="connection limit"):
        client(srv, timeout=0.3)
    assert any("too many connections" in e["reason"] for e in log.lines)
    # idle strangers never finish the handshake: cut off after handshake_timeout, pruned
    assert wait_until(lambda: srv.clients == 0, 3.0), srv.clients
    c = client(srv)
    assert c.add("n") == 1
    c.close()
    assert wait_until(lambda: srv.clients == 0)
    for s in idle:
        s.close()


def test_store_size_limits_and_quota(served):
    srv, log = served
    c = client(srv)
    with pytest.raises(errors.StoreError, match="at most 1000"):
        c.set("big", "x" * 1001)
    with pytest.raises(errors.StoreError, match="key of"):
        c.set("k" * 2000, "v")
    for i in range(4):
        c.set(f"v{i}", "x" * 1000)
    with pytest.raises(errors.StoreError, match="store full"):
        c.set("v4", "x" * 1000)
    c.delete("v0")
    c.set("v4", "x" * 1000)                                 # room again
    assert c.get("v4") == "x" * 1000
    assert sum("store full" in e["reason"] for e in log.lines) == 1
    c.close()


def test_store_refuses_infinite_and_nan_timeouts(served):
    srv, log = served
    c = client(srv)
    with pytest.raises(errors.ConfigError):
        c.get("k", timeout=float("inf"))
    with pytest.raises(errors.ConfigError):
        StoreClient("127.0.0.1", srv.port, timeout=float("nan"), secret=SECRET)
    # sent anyway (JSON Infinity, and 1e999 which parses to inf): refused at once
    c2, ch = raw_member(srv)
    t0 = time.monotonic()
    body = b'{"cmd": "get", "key": "k", "timeout": 1e999}'
    ch.sock.sendall(struct.pack("!I", len(body)) + body
                    + auth.mac(ch.key, ch.send_label, struct.pack("!Q", ch.tx), body))
    ch.tx += 1
    rep = ch.recv(time.monotonic() + 2, 2)
    assert "finite" in rep["error"] and time.monotonic() - t0 < 1.0, rep
    body = b'{"cmd": "wait", "keys": ["k"], "timeout": Infinity}'
    ch.sock.sendall(struct.pack("!I", len(body)) + body
                    + auth.mac(ch.key, ch.send_label, struct.pack("!Q", ch.tx), body))
    assert sf.drain(ch.sock, 2.0)[1]
    assert time.monotonic() - t0 < 2.0
    assert sum(e["event"] == "store_refused" for e in log.lines) >= 2
    c.close()


def test_store_unauthenticated_mode_still_works():
    srv = StoreServer("127.0.0.1", 0)
    try:
        c = StoreClient("127.0.0.1", srv.port, timeout=2.0)
        c.set("k", b"\x00\xffbytes")
        assert c.get("k") == b"\x00\xffbytes".decode("latin-1")
        c.close()
    finally:
        srv.close()
    guarded = StoreServer("127.0.0.1", 0, secret=SECRET)
    try:
        with pytest.raises(errors.AuthenticationError, match="requires the job secret"):
            StoreClient("127.0.0.1", guarded.port, timeout=1)
    finally:
        guarded.close()


# ---------------------------------------------------------------------------- configuration
def test_secret_from_the_environment_is_checked_and_never_shown():
    c = Config.from_env({"NEZHA_JOB_SECRET": SECRET, "NEZHA_STORE_MAX_CLIENTS": "9"})
    assert c.job_secret == SECRET and c.store_max_clients == 9
    assert SECRET not in repr(c)
    with pytest.raises(errors.ConfigError, match="NEZHA_JOB_SECRET"):
        Config.from_env({"NEZHA_JOB_SECRET": "short"})
    with pytest.raises(errors.ConfigError, match="NEZHA_TIMEOUT"):
        Config.from_env({"NEZHA_TIMEOUT": "inf"})
    with pytest.raises(errors.ConfigError, match="at least 16"):
        auth.secret_bytes("short")
    assert auth.secret_bytes(None) == b"" and auth.secret_bytes(SECRET) == SECRET.encode()


def test_the_testbed_gives_every_rank_of_a_run_one_secret(tmp_path):
    from types import SimpleNamespace

    from testbed.run.workload import Phase, WorkloadRunner
    rails = [SimpleNamespace(name="r0")]
    topo = SimpleNamespace(hosts=["h1", "h2"], rails=rails, tcp_rails=rails,
                           address=lambda host, rail: f"198.18.0.{host[1:]}")
    fabric = SimpleNamespace(topo=topo, caps=SimpleNamespace(congestion_control=lambda t: ""))
    w = SimpleNamespace(hosts=None, system="nezha", kind="command")
    phase = Phase("command", 0, None, None, "command")

    def secrets_of(runner):
        return {runner.env_for(h, r, 29500, phase, tmp_path / "e", tmp_path / "r")["NEZHA_JOB_SECRET"]
                for r, h in enumerate(topo.hosts)}

    one, other = secrets_of(WorkloadRunner(fabric, w, tmp_path)), \
        secrets_of(WorkloadRunner(fabric, w, tmp_path))
    assert len(one) == 1 and len(next(iter(one))) == 32       # one secret for every rank
    assert one != other                                        # drawn afresh per run
