"""A late copy of a chunk must never write into a buffer once another copy of the chunk is in
(engine/hedge.py, failover.py): the sender may reuse its buffer as soon as that copy is
acknowledged, so the late copy's remaining bytes may differ. On a real socket: a frame being
read in place when it is revoked finishes into scratch. It used to write through (hedging then
gave wrong results under loss bursts and collapsed rails)."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from nezha import wire
from nezha.transport.base import Connection

PAYLOAD = 4 << 20      # far more than the small socket buffers below hold


class OneFrame:
    """Stands in for the engine: takes one DATA frame in place into ``target``."""
    rank = 0
    silenced = False
    error = None

    def __init__(self, target):
        self.target = target
        self.done = threading.Event()
        self.hdr = wire.Header(wire.DATA, kind=wire.K_ALLREDUCE, src=0, op_id=1,
                               length=PAYLOAD, msg_total=PAYLOAD, op_total=PAYLOAD).pack()

    def data_target(self, conn, h, now):
        return self.target

    def data_done(self, conn, h):
        self.done.set()

    def release_target(self, conn):
        pass

    def on_failed(self, conn, exc, protocol):
        pass

    def on_closed(self, conn):
        pass


@pytest.fixture
def pair(loopback_pair):
    """(plain socket, its peer socket) over loopback with small buffers."""
    for s in loopback_pair:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
    return loopback_pair


def wait_for(pred, what, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_a_revoked_in_place_read_finishes_into_scratch(pair):
    a, b = pair
    target = memoryview(bytearray(PAYLOAD))
    handler = OneFrame(target)
    conn = Connection(b, peer=0, rail=0, handler=handler)
    conn.start()
    half = PAYLOAD // 2
    a.sendall(handler.hdr + b"\x01" * half)
    wait_for(lambda: conn.rx_all >= wire.HEADER_SIZE + half, "half the payload read in place")
    assert bytes(target[:half]) == b"\x01" * half
    assert conn.revoke()             # another copy of the chunk landed
    target[:] = b"\x07" * PAYLOAD    # ...and wrote the chunk
    a.sendall(b"\x02" * (PAYLOAD - half))
    assert handler.done.wait(5)
    assert bytes(target) == b"\x07" * PAYLOAD      # not one late byte landed
    assert not conn.revoke()         # nothing is being read in place any more
