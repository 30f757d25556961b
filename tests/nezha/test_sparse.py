"""Connections on demand (issue 13): a job holds its ring neighbours' connections only, and
any other pair connects on its first message, authenticated like a first connection."""
import pytest

import sparsefns
from nezha.config import Config
from nezha.errors import ConfigError
from nezha.rendezvous import start_peers
from nezha.testing import run_ranks

WORLD = 6


def neighbours(r, n=WORLD):
    return {(r - 1) % n, (r + 1) % n}


def test_start_peers():
    assert start_peers(0, 6) == {5, 1}
    assert start_peers(3, 6, "full") == {0, 1, 2, 4, 5}
    assert start_peers(1, 4) == {0, 2, 3}          # up to 4 ranks the ring is every pair
    assert start_peers(0, 2) == {1} and start_peers(0, 1) == set()


def test_connect_knob():
    assert Config.from_env({}).connect == "ring"
    assert Config.from_env({"NEZHA_CONNECT": "full"}).connect == "full"
    with pytest.raises(ConfigError, match="NEZHA_CONNECT"):
        Config.from_env({"NEZHA_CONNECT": "mesh"})


def test_a_ring_job_holds_neighbours_only_and_reaches_others_on_first_use():
    res = run_ranks(sparsefns.on_demand, WORLD, timeout=120)
    for r, (ok, v) in res.items():
        assert ok, (r, v)
        assert v["ok"], r
        two_rails = {p: 2 for p in neighbours(r)}
        assert v["init"] == two_rails, (r, v["init"])
        assert v["allreduce"] == two_rails, (r, v["allreduce"])   # ring: no new connection
        # the star broadcast from rank 0: rank 0 reaches everyone, the others only rank 0
        star = {p: 2 for p in range(WORLD) if p != r} if r == 0 else {**two_rails, 0: 2}
        assert v["star"] == star, (r, v["star"])
        assert v["chain"] == star, (r, v["chain"])     # a chain goes round the ring
        # a small allreduce is one direct round (up to 8 ranks): every pair connects
        assert v["direct"] == {p: 2 for p in range(WORLD) if p != r}, (r, v["direct"])
        # the store's records: rank 0's (the agreement check), our own and the neighbours'
        # at init (not all n: n^2 of them through one link stalled 64 hosts at 1 Mbit/s),
        # then each peer's as it connects, whichever end dialled
        assert v["records_init"] == sorted({0, r} | neighbours(r)), (r, v["records_init"])
        assert v["records_end"] == list(range(WORLD)), (r, v["records_end"])


def test_connect_full_is_the_old_mesh():
    res = run_ranks(sparsefns.on_demand, WORLD, timeout=120, connect="full")
    for r, (ok, v) in res.items():
        assert ok, (r, v)
        assert v["ok"] and v["init"] == {p: 2 for p in range(WORLD) if p != r}, (r, v)
        assert v["records_init"] == list(range(WORLD)), (r, v["records_init"])


def test_crossing_dials_leave_one_connection_per_pair_and_rail(tmp_path):
    res = run_ranks(sparsefns.crossing, WORLD, timeout=120, events=str(tmp_path / "ev"))
    ids = {}
    for r, (ok, v) in res.items():
        assert ok, (r, v)
        assert v["errs"] == [] and v["ok"] and v["dead"] == [], (r, v)
        assert len(v["idents"]) == 2 * (WORLD - 1), (r, v["idents"])
        ids[r] = v["idents"]
    for r in ids:          # both ends hold the same TCP connection
        for key, (local, remote) in ids[r].items():
            p, rail = map(int, key.split(","))
            assert ids[p][f"{r},{rail}"] == [remote, local], (r, key)


def test_a_rail_failing_mid_allreduce_is_agreed_by_every_rank(tmp_path):
    res = run_ranks(sparsefns.rail_fails, WORLD, timeout=120, events=str(tmp_path / "ev"))
    for r, (ok, v) in res.items():
        assert ok, (r, v)
        bad, _moved, names = v
        assert bad == [], (r, bad)
        # the non-neighbours of ranks 0 and 1 heard it through the ring's relays
        assert names.count("rail_agreed") >= 2, (r, names)   # down, and up after the rejoin
    assert any(sum(v[1]) > 0 for _, v in res.values())


def test_a_stranger_cannot_open_a_connection_on_demand(tmp_path):
    res = run_ranks(sparsefns.stranger, WORLD, timeout=120, events=str(tmp_path / "ev"))
    for r, (ok, v) in res.items():
        assert ok, (r, v)
        assert v["ok"], r
    v0 = res[0][1]
    assert v0["guessed_key"] is False and v0["random_proof"] is False
    assert v0["no_auth"] is False
    v3 = res[3][1]
    assert 0 not in v3["before"], v3["before"]       # nothing came of the stranger's tries
    assert v3["after"].get(0) == 1                   # the real rank 0 got through
    assert v3["events"].count("stray_connection") >= 3, v3["events"]


def test_a_connection_made_on_demand_rejoins_like_any_other(tmp_path):
    res = run_ranks(sparsefns.lazy_rejoin, WORLD, timeout=120, events=str(tmp_path / "ev"))
    for r, (ok, v) in res.items():
        assert ok, (r, v)
        assert v["ok"], r
        assert v["events"].count("rail_agreed") >= 2, (r, v["events"])   # down, then up
    assert "rail_up" in res[3][1]["events"]          # the higher rank re-dialled
    assert res[3][1]["conns"].get(0) == 2 and res[0][1]["conns"].get(3) == 2
