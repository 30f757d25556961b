import math

import numpy as np
import pytest

from nezha import balance
from nezha.balance import Balancer, cost_split, equal_split


def finish_times(split, a, b):
    return [a[r] + s * b[r] for r, s in enumerate(split) if s > 0]


def test_equal_rails_split_evenly():
    s = cost_split(1 << 20, [1e-4, 1e-4], [1e-8, 1e-8], 4)
    assert s == [1 << 19, 1 << 19]


def test_unequal_rates_give_proportional_shares():
    # 300 vs 100 Mbit/s -> 75 / 25
    b = [8 / 300e6, 8 / 100e6]
    s = cost_split(64 << 20, [1e-4, 1e-4], b, 4)
    assert sum(s) == 64 << 20
    assert abs(s[0] / sum(s) - 0.75) < 0.001
    t = finish_times(s, [1e-4, 1e-4], b)
    assert max(t) - min(t) < 1e-5


def test_all_used_rails_finish_together_with_different_startup():
    a, b = [1e-4, 2e-3, 5e-4], [1e-8, 5e-9, 2e-8]
    S = 10 << 20
    s = cost_split(S, a, b, 8)
    assert sum(s) == S and all(x % 8 == 0 for x in s)
    t = finish_times(s, a, b)
    assert max(t) - min(t) < 1e-6 * 10
    T = (S + sum(a[r] / b[r] for r in range(3))) / sum(1 / b[r] for r in range(3))
    assert max(t) == pytest.approx(T, rel=1e-3)


def test_small_message_rides_the_lowest_latency_rail():
    a, b = [5e-4, 1e-4], [1e-9, 4e-9]
    # a_0 >= T for a small message: rail 0 gets nothing
    s = cost_split(4096, a, b, 4)
    assert s == [0, 4096]


def test_overhead_keeps_small_messages_on_one_rail():
    a, b = [1e-4, 1e-4], [1e-8, 1e-8]
    assert cost_split(2000, a, b, 4, overhead=0.0).count(0) == 0
    assert cost_split(2000, a, b, 4, overhead=5e-5).count(0) == 1
    assert cost_split(8 << 20, a, b, 4, overhead=5e-5).count(0) == 0


@pytest.mark.parametrize("nbytes, elem", [(0, 4), (4, 4), (12, 4), (1001 * 8, 8), (7 * 2, 2),
                                          ((1 << 20) + 3, 1)])
def test_rounding_to_elements(nbytes, elem):
    a, b = [1e-5, 2e-5, 3e-5], [1e-9, 2e-9, 3e-9]
    s = cost_split(nbytes, a, b, elem)
    assert sum(s) == nbytes
    assert all(x % elem == 0 for x in s)
    e = equal_split(nbytes, [0, 2], 3, elem)
    assert sum(e) == nbytes and e[1] == 0 and all(x % elem == 0 for x in e)


def test_unusable_rail_gets_nothing():
    s = cost_split(1 << 20, [1e-4, 1e-4], [1e-8, float("nan")], 4)
    assert s == [1 << 20, 0]
    with pytest.raises(ValueError):
        cost_split(10, [0.0], [float("nan")], 1)


def test_split_plan_covers_the_message_contiguously():
    bal = Balancer(2, "stripe", chunk_bytes=1000)
    plan = bal.split(10_004, 4)
    assert [(r, o) for r, o, _ in plan] == [(0, 0), (1, 5004)]
    assert sum(n for _, _, n in plan) == 10_004
    assert Balancer(2, "single").split(1 << 20, 4) == [(0, 0, 1 << 20)]
    assert Balancer(2, "nezha").split(0, 4) == [(0, 0, 0)]


def agreed(bal, bs, counts=5, a=(1e-4, 1e-4), world=3):
    t = np.zeros((world, len(bs), 3))
    for r, b in enumerate(bs):
        t[:, r] = (a[r], b, counts)
    return bal.agree(t)


def test_cold_to_hot_once_every_rail_has_an_estimate_then_shares_follow_rates():
    bal = Balancer(2, "nezha")
    assert bal.rs.state == "cold"
    # cold: small messages on one rail, large ones split equally
    assert len(bal.split(4096, 4)) == 1
    assert [n for _, _, n in bal.split(8 << 20, 4)] == [4 << 20, 4 << 20]
    evs = agreed(bal, [1.05e-8, 3e-8])
    assert ("state", {"state": "hot", "reason": "estimates for every rail"}) in evs
    assert bal.rs.state == "hot"
    sizes = [n for _, _, n in bal.split(16 << 20, 4)]
    want = (1 / 1.05e-8) / (1 / 1.05e-8 + 1 / 3e-8)
    assert abs(sizes[0] / sum(sizes) - want) < 0.001


def test_not_enough_samples_stays_cold():
    bal = Balancer(2, "nezha")
    for _ in range(5):
        agreed(bal, [1e-8, 1e-8], counts=1)
    assert bal.rs.state == "cold"
    bal = Balancer(2, "nezha")
    t = np.zeros((3, 2, 3))
    t[:, 0] = (1e-4, 1e-8, 5)
    t[:, 1] = (1e-4, 1e-8, 5)
    t[2, 1] = (1e-4, np.nan, 5)          # one rank sent on rail 1 but has no estimate yet
    bal.agree(t)
    assert bal.rs.state == "cold"


def test_a_ring_rail_costs_what_its_slowest_hop_costs():
    """Every rank measures the hop into it; a ring moves at its slowest hop, so the agreed
    cost is the largest, not the median (one slow attachment slows the whole rail)."""
    bal = Balancer(2, "nezha")
    t = np.zeros((4, 2, 3))
    t[:, 0] = (1e-4, 1e-8, 5)
    t[:, 1] = (1e-4, 2e-8, 5)
    t[3, 0] = (1e-4, 5e-8, 5)            # rank 3's link to rail 0 is 5x slower
    t[1, 1] = (1e-4, np.nan, 0)          # rank 1 sent nothing on rail 1: not asked
    bal.agree(t)
    assert bal.rs.b == [5e-8, 2e-8]
    assert bal.rs.shares()[0] == pytest.approx(2 / 7, abs=1e-3)


def test_hot_moves_half_way_with_hysteresis_and_never_falls_back_to_equal_shares():
    bal = Balancer(2, "nezha")
    agreed(bal, [1e-8, 1e-8])
    assert bal.rs.state == "hot"
    used = list(bal.rs.used_b)
    assert agreed(bal, [1.01e-8, 1e-8]) == []        # within hysteresis: model kept
    assert bal.rs.used_b == used
    evs = agreed(bal, [1.2e-8, 1e-8])                  # shares move > 1 %: new weights
    # damped: half way from the model in use towards the new estimate
    assert [e for e, _ in evs] == ["weights"] and bal.rs.used_b[0] == pytest.approx(1.1e-8)
    evs = agreed(bal, [4e-8, 1e-8])                    # a rail 4x slower: followed, still hot
    assert bal.rs.state == "hot" and [e for e, _ in evs] == ["weights"]
    assert bal.rs.shares()[0] < 0.4
    # a table with a rail missing (windows restart after every move) keeps the model
    before = list(bal.rs.used_b)
    assert agreed(bal, [4e-8, 1e-8], counts=0) == [] and bal.rs.used_b == before
    assert bal.rs.state == "hot" and bal.rs.b[0] == pytest.approx(4e-8)


def test_rail_set_change_restarts_cold():
    bal = Balancer(2, "nezha")
    agreed(bal, [1e-8, 1e-8])
    agreed(bal, [1e-8, 1e-8])
    assert bal.rs.state == "hot"
    evs = bal.set_live([0])
    assert bal.rs.state == "cold" and evs[0][1]["reason"] == "rail set changed"
    assert bal.split(8 << 20, 4) == [(0, 0, 8 << 20)]
    bal.set_live([0, 1])
    assert bal.rs.state == "cold"
    assert len(bal.split(8 << 20, 4)) == 2


def test_exchange_schedule_is_deterministic():
    bal = Balancer(2, "nezha")
    assert not bal.want_exchange(1 << 20)         # nothing measured yet
    bal.note_op()
    assert bal.want_exchange(1 << 20)
    assert not bal.want_exchange(100)             # small ops do not pay for an exchange
    assert not Balancer(2, "stripe").want_exchange(1 << 30)
    assert not Balancer(1, "nezha").want_exchange(1 << 30)


def test_estimator_is_total_time_over_total_bytes_once_it_spans_enough():
    e = balance.RailEstimator()
    assert math.isnan(e.b)
    e.record_b(1 << 20, 0.030)
    assert math.isnan(e.b)                          # one sample is not an estimate
    e.record_b(0, 0.010)                            # delivered nothing: time all the same
    assert e.b == pytest.approx(0.040 / (1 << 20))
    e2 = balance.RailEstimator()
    e2.record_b(64 << 10, 0.004)
    e2.record_b(64 << 10, 0.004)
    assert math.isnan(e2.b)                         # 8 ms of time: too little to trust
    for t in (0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.25):
        e2.record_b(1 << 20, t)
    # a stall is part of the cost (diluted over the window, never dropped as an outlier)
    assert len(e2.b_window) == balance.WINDOW
    assert e2.b == pytest.approx(0.32 / (8 << 20))
    e.record_b(0, 0.0)                              # nothing at all: no sample
    assert len(e.b_window) == 2
    e3 = balance.RailEstimator()
    e3.record_b(0, 0.02)
    e3.record_b(0, 0.02)
    assert e3.b == 1.0                              # never delivered: as costly as can be
    assert e.a == balance.A_NOMINAL
    for t in (3e-4, 2e-4, 9e-3):                   # inflated samples do not move it
        e.record_a(t)
    assert e.a == pytest.approx(2e-4)


def test_small_messages_pick_the_rail_that_finishes_first():
    bal = Balancer(2, "nezha")
    # rail 1 starts a little faster but is 3x slower per byte
    t = np.zeros((2, 2, 3))
    t[:, 0] = (3e-4, 1e-8, 1)
    t[:, 1] = (2e-4, 3e-8, 1)
    bal.agree(t)                # one sample each: still cold, but the rates are known
    assert bal.rs.state == "cold"
    assert bal.split(1000, 4) == [(1, 0, 1000)]          # start-up dominates
    assert bal.split(60000, 4) == [(0, 0, 60000)]        # bytes dominate


def test_missing_startup_estimate_is_filled_from_measured_rails():
    bal = Balancer(2, "nezha")
    t = np.zeros((2, 2, 3))
    t[:, 0] = (3e-4, 1e-8, 5)
    t[:, 1] = (np.nan, 3e-8, 5)
    bal.agree(t)
    assert bal.rs.a == [3e-4, 3e-4]


def test_a_rail_left_out_keeps_its_cost_and_is_probed_after_three_silent_tables():
    bal = Balancer(3, "nezha")
    agreed(bal, [1e-8, 1e-8, 1e-5], a=(1e-4,) * 3)          # rail 2: 1000x slower
    assert bal.rs.state == "hot" and bal.split(4 << 20, 4)[-1][0] != 2   # left out
    t = np.zeros((3, 3, 3))
    t[:, 0] = (1e-4, 1.2e-8, 5)
    t[:, 1] = (1e-4, 1e-8, 5)
    t[:, 2] = (1e-4, np.nan, 0)                               # no news of rail 2
    bal.agree(t)
    assert all(x == x for x in bal.rs.used_b)                 # never nan
    assert bal.rs.used_b[2] == pytest.approx(1e-5)
    for _ in range(3):
        t[:, 0, 1] *= 1.3                                     # keep the model moving
        bal.agree(t)
    assert bal.rs.used_b[2] < 1e-5                            # probed: a small share again
    assert any(r == 2 for r, _, n in bal.split(16 << 20, 4) if n > 0)


def test_cold_goes_hot_without_a_rail_that_never_reports_and_probes_it():
    bal = Balancer(3, "nezha")
    t = np.zeros((3, 3, 3))
    t[:, 0] = (1e-4, 1e-8, 5)
    t[:, 1] = (1e-4, 3e-8, 5)
    t[:, 2] = (1e-4, np.nan, 0)       # its shares are always rescued: no news of its own
    for _ in range(2):
        bal.agree(t)
        assert bal.rs.state == "cold"
    evs = bal.agree(t)
    assert bal.rs.state == "hot" and evs[0][0] == "state"
    assert bal.rs.used_b[2] == pytest.approx(balance.PROBE_RATIO * 1e-8)
    assert 0 < bal.rs.shares()[2] < 0.05                   # a small probing share


def test_exchanges_come_soon_after_the_split_moved_and_back_off_while_it_holds():
    bal = Balancer(2, "nezha")
    seen = []
    for i in range(80):
        bal.note_op()
        if bal.want_exchange(1 << 20):
            seen.append(i)
            # the first 4 tables move the split (then the rates hold still)
            agreed(bal, [1e-8 * (1 + 0.5 * min(len(seen), 4)), 1e-8])
    gaps = [b - a for a, b in zip(seen, seen[1:])]
    assert gaps[:4] == [2, 2, 2, 2]            # fresh samples of each new split, quickly
    assert gaps[4:8] == [2, 4, 8, 16]          # then backing off...
    assert set(gaps[8:]) == {16}               # ...to every HOT_INTERVAL ops
