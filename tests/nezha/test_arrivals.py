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


def test_the_answer_can_be_read_while_health_ticks_append(loopback_pair):
    """The reader thread answers the peer's question while the health thread appends a tick's
    sample: 32 hosts on 2 cores once ended a job with "deque mutated during iteration" there
    (an internal error is fatal: every rank exited)."""
    import sys
    import threading
    _, b = loopback_pair
    conn = Connection(b, peer=0, rail=0, handler=None)
    stop = threading.Event()

    def tick():
        n = 0
        while not stop.is_set():
            n += 1
            conn.arrivals.append((time.monotonic(), n))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)       # switch threads as often as the interpreter can
    t = threading.Thread(target=tick)
    t.start()
    try:
        end = time.monotonic() + 1.0  # the old code failed ~15 times a second here
        while time.monotonic() < end:
            conn.arrived_within(1e3)  # all of the history: the longest iteration
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
