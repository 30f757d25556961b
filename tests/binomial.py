"""Statistical bounds for loss measured by counting probes: n independent probes, each lost with
probability p, lose a fraction within ``sigmas`` standard deviations sqrt(p (1 - p) / n) of p.
At 4.5 sigma a correct shaper fails such a check about once in 150 000 runs (normal tails), so
the check is a correctness check and is never rerun; and for p > 0 the lower bound is above 0,
so a shaper that drops nothing fails it."""
from __future__ import annotations

import math

SIGMAS = 4.5


def bound(p: float, n: int, sigmas: float = SIGMAS) -> tuple[float, float]:
    """(low, high) for the lost fraction of n probes at loss probability p."""
    half = sigmas * math.sqrt(p * (1 - p) / n)
    return max(0.0, p - half), min(1.0, p + half)


def assert_loss(lost: float, p: float, n: int, what: str = "") -> None:
    lo, hi = bound(p, n)
    assert p == 0 or lo > 0, f"{n} probes cannot tell {p:.2%} loss from none: send more"
    assert lo <= lost <= hi, (f"{what}: lost {lost:.4%} of {n} probes, set {p:.2%}: outside "
                              f"[{lo:.4%}, {hi:.4%}] ({SIGMAS} sigma)")
