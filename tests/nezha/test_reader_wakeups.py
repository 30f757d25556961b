"""A Connection's reader over a rail that delivers a few segments at a time (a shaped rail):
it must wake for batches of a payload, not for every segment (SO_RCVLOWAT), see the payload's
end as soon as its last byte is in, and then wake for a frame of any size again. On 5 ranks
x 15 shaped rails on 2 cores the wake-ups per segment were where the CPU went; and a low-water
mark left set after a payload once held a 64-byte ACK behind it until the job timed out."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from nezha import wire
from nezha.transport import base
from nezha.transport.base import Connection

PAYLOAD = 192 << 10
PIECE = 2 << 10          # the sender trickles the payload: 96 pieces...
GAP_S = 0.002            # ...2 ms apart, about 190 ms in all


class _Handler:
    """The engine's side of a connection, as far as its reader needs one."""
    silenced = False
    rank = 1

    def __init__(self, target: memoryview):
        self.target = target
        self.done_at: float | None = None
        self.ack_at: float | None = None
        self.acked = threading.Event()
        self.failure: BaseException | None = None

    def data_target(self, conn, h, now):
        return self.target

    def data_done(self, conn, h):
        self.done_at = time.monotonic()

    def on_ack(self, conn, h):
        self.ack_at = time.monotonic()
        self.acked.set()

    def release_target(self, conn):
        pass

    def on_failed(self, conn, exc, protocol):
        self.failure = exc
        self.acked.set()

    def on_closed(self, conn):
        pass


def _voluntary_switches(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc")


def _trickle(pair, monkeypatch, size: int = PAYLOAD, piece: int = PIECE,
             gap_s: float = GAP_S, poll_ms: int = 500) -> dict:
    """Send one DATA frame of ``size`` bytes in ``piece``-byte pieces ``gap_s`` apart, then an
    ACK frame once the payload is in; what the reader made of it. The wait's first timeout is
    ``poll_ms``: made long (0.5 s) by default, so that an end seen only at a timeout shows."""
    monkeypatch.setattr(base, "RCVLOWAT_POLL_MS", poll_ms)
    a, b = pair
    a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)    # each piece its own segment
    payload = bytes(range(256)) * (size // 256)
    target = memoryview(bytearray(size))
    handler = _Handler(target)
    conn = Connection(b, peer=0, rail=0, handler=handler)
    conn.reader.start()
    time.sleep(0.05)                       # the reader waits for a header
    before = _voluntary_switches(conn.reader.native_id)
    a.sendall(wire.pack(type=wire.DATA, src=0, length=size, msg_total=size, op_total=size))
    for i in range(0, size, piece):
        a.sendall(payload[i:i + piece])
        time.sleep(gap_s)
    last_byte_at = time.monotonic()
    deadline = last_byte_at + 2.0
    while handler.done_at is None:
        assert time.monotonic() < deadline, "the payload's end was never seen"
        time.sleep(0.001)
    wakeups = _voluntary_switches(conn.reader.native_id) - before
    sent_ack_at = time.monotonic()
    a.sendall(wire.pack(type=wire.ACK, src=0))
    acked = handler.acked.wait(2.0)
    return {"payload_ok": bytes(target) == payload, "failure": handler.failure,
            "acked": acked, "wakeups": wakeups, "end_late_s": handler.done_at - last_byte_at,
            "ack_late_s": (handler.ack_at or 1e9) - sent_ack_at}


def test_a_trickled_payload_arrives_whole_and_the_frame_after_it_is_read(loopback_pair,
                                                                         monkeypatch):
    got = _trickle(loopback_pair, monkeypatch)
    assert got["failure"] is None
    assert got["payload_ok"]
    assert got["acked"], "a 64-byte frame after the payload was never read"


@pytest.mark.timing             # wake-ups and latencies of a thread on a shared 2-core machine
@pytest.mark.flaky(reruns=1, reruns_delay=2)
def test_the_reader_wakes_in_batches_and_sees_the_end_at_once(loopback_pair, monkeypatch):
    got = _trickle(loopback_pair, monkeypatch)
    # the end is seen when the last byte is in, not at the wait's next timeout (0.5 s)
    assert got["end_late_s"] < 0.1
    assert got["ack_late_s"] < 0.1
    # 96 pieces: a wake-up each before; now one per 128 KiB (RCVLOWAT_MAX) or timeout
    assert got["wakeups"] <= 24, f"the reader woke {got['wakeups']} times for 96 pieces"


def _slow_trickle(pair, monkeypatch) -> dict:
    """64 KiB over 1.3 s (0.4 Mbit/s, slower than the 1 Mbit/s rails of 64 hosts here), with
    the wait's real first timeout (20 ms): it runs out many times within the payload."""
    return _trickle(pair, monkeypatch, size=64 << 10, piece=1 << 10, gap_s=0.02,
                    poll_ms=base.RCVLOWAT_POLL_MS)


def test_a_payload_read_across_many_timed_out_waits_arrives_whole(loopback_pair, monkeypatch):
    got = _slow_trickle(loopback_pair, monkeypatch)
    assert got["failure"] is None
    assert got["payload_ok"]
    assert got["acked"], "a 64-byte frame after the payload was never read"


@pytest.mark.timing             # wake-ups of a thread on a shared 2-core machine
@pytest.mark.flaky(reruns=1, reruns_delay=2)
def test_a_slow_rail_does_not_wake_the_reader_every_20_ms(loopback_pair, monkeypatch):
    """The wait's timeout doubles each time it runs out (20, 40, ... 320 ms), so the reader
    wakes about 9 times in 1.3 s, not 64, and still sees the end when the last byte is in."""
    got = _slow_trickle(loopback_pair, monkeypatch)
    assert got["end_late_s"] < 0.1
    assert got["wakeups"] <= 20, f"the reader woke {got['wakeups']} times in 1.3 s"


@pytest.mark.parametrize("fixed_buffer", [False, True])
def test_the_mark_never_exceeds_what_the_receive_buffer_can_hold(loopback_pair, fixed_buffer):
    """What lets the waits grow to 320 ms: a mark above what the receive buffer holds would
    close the sender's window before it is reached, and only a timed-out wait would open it.
    The kernel (tcp_set_rcvlowat) grows a buffer it sizes itself to twice the mark, and keeps
    the mark within half of one fixed by SO_RCVBUF (NEZHA_SOCKBUF)."""
    _, b = loopback_pair
    if fixed_buffer:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
    conn = Connection(b, peer=0, rail=0, handler=_Handler(memoryview(bytearray(1))))
    conn._set_lowat(base.RCVLOWAT_MAX)
    mark = b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
    buffer = b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    assert 0 < mark <= buffer // 2, (mark, buffer)
    if not fixed_buffer:
        assert mark == base.RCVLOWAT_MAX, mark
