"""The answer to a peer's "do my bytes still arrive on this rail?" (health.py's check): it
must cover the window asked for, not the health tick before it. The samples are 10 ms apart,
and a question 20-30 ms into a black hole was answered with the bytes that arrived just before
the fault: the rail was failed one watchdog limit later (75 ms instead of 45)."""
from __future__ import annotations

import time

from nezha.transport.base import Connection


def test_bytes_that_arrived_before_the_window_are_not_counted_in_it(loopback_pair):
    a, b = loopback_pair
    conn = Connection(b, peer=0, rail=0, handler=None)   # not started: bytes stay queued
    conn.arrivals.append((time.monotonic(), conn.arrived()))   # a health tick, then data
    a.sendall(b"x" * (64 << 10))
    deadline = time.monotonic() + 2.0
    while conn.arrived() < 64 << 10:
        assert time.monotonic() < deadline, "the bytes never arrived"
        time.sleep(0.001)
    time.sleep(0.06)
    assert conn.arrived_within(0.2) == 64 << 10       # they did arrive in the last 200 ms...
    assert conn.arrived_within(0.03) == 0             # ...but not in the last 30
