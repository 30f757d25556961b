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


def test_cold_to_hot_after_stable_estimates_then_shares_follow_rates():
    bal = Balancer(2, "nezha")
    assert bal.rs.state == "cold"
    # cold: small messages on one rail, large ones split equally
    assert len(bal.split(4096, 4)) == 1
    assert [n for _, _, n in bal.split(8 << 20, 4)] == [4 << 20, 4 << 20]
    assert agreed(bal, [1e-8, 3e-8]) == []          # first table: nothing to compare yet
    evs = agreed(bal, [1.05e-8, 3e-8])             # stable -> hot
    assert ("state", {"state": "hot", "reason": "stable estimates"}) in evs
    assert bal.rs.state == "hot"
    sizes = [n for _, _, n in bal.split(16 << 20, 4)]
    want = (1 / 1.05e-8) / (1 / 1.05e-8 + 1 / 3e-8)
    assert abs(sizes[0] / sum(sizes) - want) < 0.001


def test_not_enough_samples_stays_cold():
    bal = Balancer(2, "nezha")
    for _ in range(5):
        agreed(bal, [1e-8, 1e-8], counts=1)
    assert bal.rs.state == "cold"


def test_unstable_estimates_stay_cold():
    bal = Balancer(2, "nezha")
    for i in range(6):
        agreed(bal, [1e-8 * (1 + i % 2), 1e-8])
    assert bal.rs.state == "cold"


def test_hysteresis_and_drift():
    bal = Balancer(2, "nezha")
    agreed(bal, [1e-8, 1e-8])
    agreed(bal, [1e-8, 1e-8])
    assert bal.rs.state == "hot"
    used = list(bal.rs.used_b)
    assert agreed(bal, [1.01e-8, 1e-8]) == []        # within hysteresis: model kept
    assert bal.rs.used_b == used
    evs = agreed(bal, [1.2e-8, 1e-8])                  # shares move > 2 %: new weights
    # smoothed: half way from the model in use towards the new estimate
    assert [e for e, _ in evs] == ["weights"] and bal.rs.used_b[0] == pytest.approx(1.1e-8)
    evs = agreed(bal, [4e-8, 1e-8])                    # rate drift: back to cold
    assert bal.rs.state == "cold" and evs[0][1]["reason"].startswith("rate drift")


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


def test_estimator_median_and_ewma():
    e = balance.RailEstimator()
    assert math.isnan(e.b)
    for t in (1.0, 1.1, 1.2, 50.0, 0.01, 0.02, 30.0, 1.3):
        e.record_b(1 << 20, t * (1 << 20) * 1e-9)
    assert e.b == pytest.approx(1.15e-9)            # outer quarters dropped, mean of the rest
    e2 = balance.RailEstimator()
    e2.record_b(1 << 20, 1e-3)
    e2.record_b(4 << 20, 2e-3)                      # large shares weigh more
    assert e2.b == pytest.approx(3e-3 / (5 << 20))
    e.record_b(10, 1.0)                            # too small to tell a rate: ignored
    assert len(e.b_window) == 8
    assert e.a == balance.A_NOMINAL
    for t in (3e-4, 2e-4, 9e-3):                   # inflated samples do not move it
        e.record_a(t)
    assert e.a == pytest.approx(2e-4)


def test_small_messages_pick_the_rail_that_finishes_first():
    bal = Balancer(2, "nezha")
    # rail 1 starts a little faster but is 3x slower per byte
    t = np.zeros((2, 2, 3))
    t[:, 0] = (3e-4, 1e-8, 5)
    t[:, 1] = (2e-4, 3e-8, 5)
    bal.agree(t)
    assert bal.split(1000, 4) == [(1, 0, 1000)]          # start-up dominates
    assert bal.split(60000, 4) == [(0, 0, 60000)]        # bytes dominate


def test_missing_startup_estimate_is_filled_from_measured_rails():
    bal = Balancer(2, "nezha")
    t = np.zeros((2, 2, 3))
    t[:, 0] = (3e-4, 1e-8, 5)
    t[:, 1] = (np.nan, 3e-8, 5)
    bal.agree(t)
    assert bal.rs.a == [3e-4, 3e-4]


def test_cold_exchanges_back_off_while_estimates_stay_noisy():
    bal = Balancer(2, "nezha")
    seen = []
    for i in range(40):
        bal.note_op()
        if bal.want_exchange(1 << 20):
            seen.append(i)
            agreed(bal, [1e-8 * (1 + len(seen) % 2), 1e-8])   # never stable
    gaps = [b - a for a, b in zip(seen, seen[1:])]
    assert gaps[:4] == [2, 4, 8, 16] and max(gaps) == 16, gaps
    assert bal.rs.state == "cold"
    bal.set_live([0])                                   # rail set changed: eager again
    bal.note_op()
    assert bal.want_exchange(1 << 20)
