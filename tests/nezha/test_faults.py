"""Fault tolerance on loopback: a rail breaks in the middle of collectives."""
from nezha.testing import run_ranks
import rankfns


def test_rail_breaks_mid_allreduce_result_stays_exact():
    res = run_ranks(rankfns.kill_rail_mid_op, 2, timeout=60, rail=1, iters=4)
    for r, (ok, v) in res.items():
        assert ok, (r, v)
        bad, rerouted, status = v
        assert bad == [], (r, bad)
    # the side that saw the break moved the unacknowledged chunks to rail 0
    assert any(sum(v[1]) > 0 for _, v in res.values())
    assert any(v[2][1] == "down" for _, v in res.values())
