"""Time-per-byte samples count the bytes that *arrived* during a share, not the bytes the reader
thread got round to: bytes that waited in the socket while the thread was busy would otherwise
look free and make a fast rail look faster than it is (measured here: up to 25 %)."""
from __future__ import annotations

import socket
import time

import pytest

from nezha import wire
from nezha.config import Config
from nezha.engine import Desc, Engine
from nezha.events import Events
from nezha.transport.base import Connection, recv_exact_into


class Recorder:
    """Stands in for the balancer: remembers the samples it is given."""

    def __init__(self):
        self.b: list[tuple[int, int, float]] = []

    def record_b(self, rail, nbytes, seconds):
        self.b.append((rail, nbytes, seconds))

    def record_a(self, rail, seconds):
        pass


def header(step: int, offset: int, length: int, total: int, rail: int = 0):
    return wire.unpack(wire.Header(wire.DATA, kind=wire.K_ALLREDUCE, rail=rail, src=1, op_id=7,
                                   step=step, offset=offset, length=length, msg_total=total,
                                   op_total=total).pack())


def test_sample_is_arrivals_over_the_share_time():
    rec = Recorder()
    eng = Engine(0, 2, 2, rec, Events(0, 2), Config(timeout=5.0))
    total = 1 << 20
    buf = memoryview(bytearray(total))
    slot = eng.post_recv(7, 0, 1, buf, Desc(wire.K_ALLREDUCE, 0, 0, total))
    half = total // 2
    # the first header is read at t=10.0, when 400 KiB of the share were already queued
    # (arrived = 400 KiB + header); the whole share is in by t=10.05, plus 100 KiB of what follows
    with eng.cond:
        eng._mark(slot, header(0, 0, half, total), 10.0, 10.02, 400 << 10, 700 << 10)
        eng._mark(slot, header(0, half, half, total), 10.02, 10.05, 700 << 10,
                  (1 << 20) + (100 << 10))
    assert slot.complete
    (rail, nbytes, seconds), = rec.b
    assert rail == 0 and seconds == pytest.approx(0.05)
    # bytes that reached the socket in [10.0, 10.05]: not the 1 MiB read, which would claim
    # 20 MiB/s although only 14 MiB/s arrived
    assert nbytes == (1 << 20) + (100 << 10) - (400 << 10)


def test_a_share_that_was_all_queued_gives_no_sample():
    rec = Recorder()
    eng = Engine(0, 2, 2, rec, Events(0, 2), Config(timeout=5.0))
    total = 1 << 20
    slot = eng.post_recv(7, 0, 1, memoryview(bytearray(total)), Desc(wire.K_ALLREDUCE, 0, 0, total))
    with eng.cond:
        eng._mark(slot, header(0, 0, total, total), 10.0, 10.001, total, total + 1000)
    assert slot.complete and rec.b == []     # it says nothing about the rail's speed


@pytest.fixture
def tcp_conn():
    """(sending socket, Connection on the receiving end) over loopback; threads not started."""
    lst = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    lst.close()
    try:
        yield a, Connection(b, peer=1, rail=0, handler=None)
    finally:
        a.close()
        b.close()


def test_connection_counts_queued_bytes_as_arrived(tcp_conn):
    a, conn = tcp_conn
    a.sendall(b"x" * 5000)
    deadline = time.monotonic() + 2
    while conn.arrived() < 5000 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert conn.arrived() == 5000        # nothing read yet: all of it waits in the queue
    assert recv_exact_into(conn.sock, memoryview(bytearray(3000)), "payload", conn)
    assert conn.rx_all == 3000            # the reader counts as it reads...
    assert conn.arrived() == 5000        # ...so reading only moves bytes from queue to rx_all


def test_arrivals_within_a_window_come_from_the_health_samples(tcp_conn):
    _, conn = tcp_conn
    now = time.monotonic()
    conn.rx_all = 5000
    conn.arrivals.extend([(now - 0.30, 1000), (now - 0.20, 3000), (now - 0.10, 5000)])
    assert conn.arrived_within(0.05) == 0          # nothing since the last sample
    assert conn.arrived_within(0.15) == 2000       # since the sample 0.2 s ago
    assert conn.arrived_within(10.0) == 4000       # history shorter: the oldest sample
