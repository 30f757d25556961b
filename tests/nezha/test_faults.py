"""Fault tolerance on loopback: a rail breaks or goes silent in the middle of collectives."""
import pytest

from nezha.testing import run_ranks
import rankfns


@pytest.mark.parametrize("how", ["kill", "blackhole"])
def test_rail_fails_mid_allreduce_result_stays_exact_and_rail_rejoins(tmp_path, how):
    res = run_ranks(rankfns.kill_rail_mid_op, 2, timeout=60, rail=1, iters=4, how=how,
                    events=str(tmp_path / "ev"), settle=1.0)
    for r, (ok, v) in res.items():
        assert ok, (r, v)
        bad, rerouted, names = v
        assert bad == [], (r, bad)
    # somebody moved the unacknowledged chunks of the failed rail to rail 0 (failover, or a
    # hedge: a black-holed share falls behind and is copied before the rail is declared down)
    assert any(sum(v[1]) > 0 for _, v in res.values())
    for _, (ok, (bad, rerouted, names)) in res.items():
        assert "rail_down" in names or "rail_agreed" in names, names
        assert "rail_up" in names, names          # re-probed and rejoined
    if how == "blackhole":
        assert any("rail_suspected" in v[2] for _, v in res.values())


def test_silent_peer_fails_every_rank_within_timeout():
    import time
    t0 = time.monotonic()
    res = run_ranks(rankfns.silent_peer, 3, timeout=30, victim=1)
    for r, (ok, v) in res.items():
        assert not ok and not isinstance(v, str), (r, v)
        assert v.isa("CommError"), (r, v)
    assert time.monotonic() - t0 < 15
