"""What a rail is charged (costs.py): the time its share of a message took to finish, from
when it could start (the message's first header on any rail, or the end of the rail's
previous share) to its last byte; a hedge copy's time goes to the late rail whose share it is.
And hedging itself (engine/hedge.py): a late share is copied onto a finished rail, the late
rail's own copy stays outstanding for the failure detector, and nothing is counted twice."""
from __future__ import annotations

import math

import time

import pytest

from nezha import balance, wire
from nezha.balance import Balancer
from nezha.config import Config
from nezha.engine import Desc, Engine
from nezha.events import Events
from nezha.transport.base import Connection, recv_exact_into


def header(offset: int, length: int, total: int, rail: int = 0, copy_of=None, src=1):
    aux = 0 if copy_of is None else (copy_of + 1) << wire.COPY_SHIFT
    return wire.unpack(wire.Header(wire.DATA, kind=wire.K_ALLREDUCE, rail=rail, src=src,
                                   aux=aux, op_id=7, step=0, offset=offset, length=length,
                                   msg_total=total, op_total=total).pack())


def engine(nrails=2):
    return Engine(0, 2, nrails, Balancer(nrails), Events(0, 2), Config(timeout=5.0))


def test_each_rail_is_charged_from_when_its_share_could_start_to_its_last_byte():
    eng = engine()
    total = 3 << 20
    slot = eng.post_recv(7, 0, 1, memoryview(bytearray(total)), Desc(wire.K_ALLREDUCE, 0, 0, total))
    with eng.cond:
        # rail 0: two frames, idle before (its previous share ended at 9.0): 10.0 -> 10.04
        eng._mark(slot, header(0, 1 << 20, total, rail=0), 10.0, 9.0, 10.02)
        eng._mark(slot, header(1 << 20, 1 << 20, total, rail=0), 10.02, 9.0, 10.04)
        # rail 1: still busy with its previous share until 10.03, then done at 10.05
        eng._mark(slot, header(2 << 20, 1 << 20, total, rail=1), 10.031, 10.03, 10.05)
    assert slot.complete
    costs = dict((r, (nb, s)) for r, nb, s, *_ in eng.costs.take())
    assert costs[0] == (2 << 20, pytest.approx(0.04))
    assert costs[1] == (1 << 20, pytest.approx(0.02))   # not charged for its backlog
    assert eng.costs.take() == []


def test_a_rails_slack_is_how_long_before_its_messages_last_rail_it_was_done():
    """The slack (seconds a rail was done before its message's last rail, over the
    messages' spans) tells the rail that set the pace (0) from one whose share could have
    been larger, whatever its cost per byte says. A message hedge copies completed, or one
    rail alone, tells nothing of it."""
    eng = engine()
    total = 2 << 20
    for step, (end0, end1) in enumerate(((10.02, 10.01), (10.04, 10.03))):
        slot = eng.post_recv(7, step, 1, memoryview(bytearray(total)),
                             Desc(wire.K_ALLREDUCE, 0, 0, total))
        with eng.cond:
            t0 = end0 - 0.02
            eng._mark(slot, header(0, 1 << 20, total, rail=0), t0, 0.0, end0)
            eng._mark(slot, header(1 << 20, 1 << 20, total, rail=1), t0, 0.0, end1)
        assert slot.complete
    slack = {r: sl for r, _, _, _, sl in eng.costs.take()}
    assert slack[0] == pytest.approx((0.0, 0.04))          # it set the pace
    assert slack[1] == pytest.approx((0.02, 0.04))         # done half way through, twice
    slot = eng.post_recv(7, 9, 1, memoryview(bytearray(1 << 20)),
                         Desc(wire.K_ALLREDUCE, 0, 0, 1 << 20))
    with eng.cond:
        eng._mark(slot, header(0, 1 << 20, 1 << 20, rail=0), 11.0, 0.0, 11.01)
    assert [sl for *_, sl in eng.costs.take()] == [(0.0, 0.0)]     # one rail: none


def test_the_tail_is_what_a_rails_last_messages_cost():
    """A rail that sped up during an operation: its whole sample is part slow, its tail (the
    last messages carrying a quarter of its bytes, never all of them) is what it costs now."""
    from types import SimpleNamespace
    from nezha.costs import ShareCosts
    costs = ShareCosts(2)
    t = 10.0
    for took in (0.04, 0.04, 0.04, 0.01, 0.01):         # five 1 MiB messages on rail 0
        costs.add_message(SimpleNamespace(rbytes={0: 1 << 20}, t_first={0: t}, t_prev={0: 0.0},
                                          copied={}, t_last={0: t + took}, pending={}))
        t += took
    (rail, nbytes, seconds, tail, _), = costs.take()
    assert (rail, nbytes, seconds) == (0, 5 << 20, pytest.approx(0.14))
    assert tail == pytest.approx(0.01 / (1 << 20))      # 2 MiB: the first to reach 1.25
    costs.add_message(SimpleNamespace(rbytes={1: 1 << 20}, t_first={1: 0.0}, t_prev={1: 0.0},
                                      copied={}, t_last={1: 0.03}, pending={}))
    assert math.isnan(costs.take()[0][3])               # one message: no tail apart from it


def test_a_hedged_rail_is_charged_with_its_own_deliveries_only():
    """A rescue must not make an overloaded rail look fine: the late rail is charged with the
    bytes it delivered itself (its frames, and its own repeats of the rescued bytes while the
    operation lasts) over the time to its last one; the copies' bytes are not its."""
    eng = engine()
    total = 3 << 20
    slot = eng.post_recv(7, 0, 1, memoryview(bytearray(total)), Desc(wire.K_ALLREDUCE, 0, 0, total))
    with eng.cond:
        eng._mark(slot, header(0, 1 << 20, total, rail=0), 10.0, 9.0, 10.03)
        # rail 1 delivered its first frame by 10.06, then stalled; a copy of its second came
        # on rail 0 at 10.08
        eng._mark(slot, header(1 << 20, 1 << 20, total, rail=1), 10.001, 9.0, 10.06)
        eng._mark(slot, header(2 << 20, 1 << 20, total, rail=0, copy_of=1), 10.07, 10.03, 10.08)
    assert slot.complete
    assert [t[:3] for t in eng.costs.take()] == [(0, 1 << 20, pytest.approx(0.03))]
    with eng.cond:   # rail 1's own repeat of the rescued frame arrives at 10.2
        eng.costs.late_frame(slot, 1, 1 << 20, 10.2)
        eng.costs.op_ended([slot])
    assert [t[:3] for t in eng.costs.take()] == [(1, 2 << 20, pytest.approx(0.2))]
    assert eng.events.rails[0].bytes_recv == 2 << 20    # what came on rail 0
    assert eng.events.rails[1].bytes_recv == 1 << 20

    slot2 = eng.post_recv(8, 0, 1, memoryview(bytearray(total)), Desc(wire.K_ALLREDUCE, 0, 0, total))
    with eng.cond:   # rail 1 delivered nothing of its share before the op ended: no sample
        eng._mark(slot2, header(0, 2 << 20, total, rail=0)._replace(op_id=8), 20.0, 19.0, 20.06)
        eng._mark(slot2, header(2 << 20, 1 << 20, total, rail=0, copy_of=1)._replace(op_id=8),
                  20.07, 20.06, 20.1)
        eng.costs.op_ended([slot2])
    assert [t[:3] for t in eng.costs.take()] == [(0, 2 << 20, pytest.approx(0.06))]


def test_a_late_rail_still_sending_earlier_shares_is_not_charged_that_backlog():
    """An over-loaded rail falls behind: when a message starts it is still sending earlier
    messages' shares, and hedge copies of its share arrive before any frame of its own. Its
    time starts where its own frames of the message could start (the end of its previous
    frame), as for a rail that was not hedged, whether its first own frame comes before the
    message completes or after. Charged from the message's first header, a 304 Mbit/s rail
    over-loaded by a third measured 92-131 Mbit/s, and its share swung from 0.37 to 0.11."""
    eng = engine()
    total = 3 << 20
    slot = eng.post_recv(7, 0, 1, memoryview(bytearray(total)), Desc(wire.K_ALLREDUCE, 0, 0, total))
    with eng.cond:
        eng._mark(slot, header(0, 1 << 20, total, rail=0), 10.0, 9.0, 10.02)
        # a copy of rail 1's second frame comes first; rail 1 is busy until 10.05
        eng._mark(slot, header(2 << 20, 1 << 20, total, rail=0, copy_of=1), 10.02, 10.02, 10.03)
        eng._mark(slot, header(1 << 20, 1 << 20, total, rail=1), 10.051, 10.05, 10.08)
        assert slot.complete
        # its own repeat of the copied frame (Receiving.data_done / data_staged: both)
        eng.costs.late_frame(slot, 1, 1 << 20, 10.11)
        eng._mark(slot, header(2 << 20, 1 << 20, total, rail=1), 10.081, 10.08, 10.11)
        eng.costs.op_ended([slot])
    costs = {r: (nb, s) for r, nb, s, *_ in eng.costs.take()}
    assert costs[1] == (2 << 20, pytest.approx(0.06))      # 10.05 -> 10.11, not 10.0 -> 10.11

    slot2 = eng.post_recv(8, 0, 1, memoryview(bytearray(total)), Desc(wire.K_ALLREDUCE, 0, 0, total))
    with eng.cond:   # all of rail 1's share was copied; its own frame comes after the end
        eng._mark(slot2, header(0, 2 << 20, total, rail=0)._replace(op_id=8), 20.0, 19.0, 20.06)
        eng._mark(slot2, header(2 << 20, 1 << 20, total, rail=0, copy_of=1)._replace(op_id=8),
                  20.06, 20.06, 20.08)
        assert slot2.complete
        own = header(2 << 20, 1 << 20, total, rail=1)._replace(op_id=8)
        eng.costs.late_frame(slot2, 1, 1 << 20, 20.13)     # its previous frame ended at 20.1
        eng._mark(slot2, own, 20.101, 20.1, 20.13)
        eng.costs.op_ended([slot2])
    costs = {r: (nb, s) for r, nb, s, *_ in eng.costs.take()}
    assert costs[1] == (1 << 20, pytest.approx(0.03))      # 20.1 -> 20.13, not 20.0 -> 20.13


class FakeConn:
    """Stands in for a Connection: records what the engine queues on it."""

    def __init__(self, peer, rail):
        self.peer, self.rail = peer, rail
        self.alive = True
        self.unacked = self.orphans = 0
        self.busy_since = 0.0
        self.queued = []
        self.revoked = 0
        self.rx_all = 0           # bytes that came in on it (the engine's op_rx, costs.op_ended)
        self.rx_bytes = 0         # payload bytes of the peer's DATA frames read from it

    def arrived(self):
        return self.rx_all

    def put(self, item):
        self.queued.append(item)

    def revoke(self):
        self.revoked += 1
        return True


def ack(eng, conn, ch):
    h = wire.unpack(wire.Header(wire.ACK, kind=wire.K_ALLREDUCE, rail=conn.rail, src=1,
                                aux=ch.length, op_id=ch.msg.key[0], step=ch.msg.key[1],
                                chunk=ch.idx, offset=ch.offset, msg_total=ch.msg.total).pack())
    eng.on_ack(conn, h)


def test_a_rail_whose_shares_copies_carried_is_charged_what_came_in_on_it_meanwhile():
    """4 hosts x 4 rails of 100 Mbit/s, r3 down to 2 Mbit/s for 3 s: hedge copies carried
    its shares in every operation before any frame of its own came in, so it gave no sample,
    its old cost stayed in use, and every operation of those 3 s took 2.3-2.9x as long. It is
    now charged the bytes that reached us on it (partial frames too) over the operation."""
    eng = engine()
    conns = {r: FakeConn(1, r) for r in range(2)}
    for r, c in conns.items():
        eng.conns[(1, r)] = c
    total = 3 << 20
    eng.op_seq = 6
    op = eng.begin_op()
    t_begin = time.monotonic()
    slot = eng.post_recv(op, 0, 1, memoryview(bytearray(total)), Desc(wire.K_ALLREDUCE, 0, 0, total))
    with eng.cond:
        eng._mark(slot, header(0, 2 << 20, total, rail=0), 10.0, 9.0, 10.06)
        eng._mark(slot, header(2 << 20, 1 << 20, total, rail=0, copy_of=1), 10.06, 10.06, 10.08)
        assert slot.complete
    conns[1].rx_all += 30_000             # part of its frame reached us meanwhile
    time.sleep(0.05)
    eng.end_op(op)
    took = time.monotonic() - t_begin
    costs = {r: (nb, s) for r, nb, s, *_ in eng.costs.take()}
    assert costs[1][0] == 30_000 and 0.05 <= costs[1][1] <= took
    assert costs[0] == (2 << 20, pytest.approx(0.06))    # charged its own frames as before

    # re-dialled during the operation: the new connection's count says nothing
    op = eng.begin_op()
    slot = eng.post_recv(op, 0, 1, memoryview(bytearray(total)), Desc(wire.K_ALLREDUCE, 0, 0, total))
    with eng.cond:
        eng._mark(slot, header(0, 2 << 20, total, rail=0)._replace(op_id=op), 20.0, 19.0, 20.06)
        eng._mark(slot, header(2 << 20, 1 << 20, total, rail=0, copy_of=1)._replace(op_id=op),
                  20.06, 20.06, 20.08)
    eng.conns[(1, 1)] = FakeConn(1, 1)
    eng.end_op(op)
    assert [r for r, *_ in eng.costs.take()] == [0]


def test_a_late_share_is_copied_to_a_finished_rail_once_and_its_own_copy_stays_outstanding():
    eng = engine()
    c0, c1 = FakeConn(1, 0), FakeConn(1, 1)
    eng.conns = {(1, 0): c0, (1, 1): c1}
    op = eng.begin_op()
    view = memoryview(bytearray(1 << 20))
    msg = eng.send(1, op, 0, view, Desc(wire.K_ALLREDUCE, 1, 1, 1 << 20), elem=4)
    by_rail = {r: [ch for ch in msg.chunks if ch.rail == r] for r in (0, 1)}
    assert by_rail[0] and by_rail[1]
    for ch in by_rail[0] + by_rail[1]:                # both rails start sending
        assert eng.before_send(c0 if ch.rail == 0 else c1, ch) is not None
    for ch in by_rail[0]:
        ack(eng, c0, ch)                              # rail 0 finishes, rail 1 does not
    now = time.monotonic()
    eng.hedge(now + 0.001)
    assert len(c0.queued) == len(by_rail[0])          # not late yet
    eng.hedge(now + 0.5)
    copies = c0.queued[len(by_rail[0]):]
    assert copies == by_rail[1]                       # the late share, queued on rail 0
    eng.hedge(now + 1.0)
    assert c0.queued[len(by_rail[0]):] == copies      # ...once
    hdr, _ = eng.before_send(c0, copies[0])
    h = wire.unpack(hdr)
    assert h.rail == 0 and h.aux >> wire.COPY_SHIFT == 2      # names rail 1's share
    assert eng.events.rails[1].hedged_chunks == len(copies)
    for ch in copies:
        ack(eng, c0, ch)                              # the copies win
    assert msg.complete and c0.unacked == 0
    assert c1.unacked == len(by_rail[1])              # rail 1's own copies: still out
    eng.end_op(op)
    assert c1.orphans == len(by_rail[1]) and c1.unacked == len(by_rail[1])
    for ch in by_rail[1]:
        ack(eng, c1, ch)                              # rail 1 delivers late: settled
    assert c1.unacked == 0 and c1.orphans == 0


def test_a_start_up_sample_is_not_taken_while_the_peers_data_came_in_on_the_rail():
    """A small share's time to its acknowledgement, less its bytes' time, is the rail's
    start-up cost a_r, unless the acknowledgement queued behind the peer's own data on that
    rail. Between 2 ranks every rail carries data both ways, and 62 KB shares of a 36
    Mbit/s rail sampled a_r = 38 ms: the rail left the split for seconds at a time (2 hosts
    x 16 rails, seed 32 of ``testbed shapes``)."""
    eng = engine()
    c0, c1 = FakeConn(1, 0), FakeConn(1, 1)
    eng.conns = {(1, 0): c0, (1, 1): c1}
    for r in (0, 1):
        for _ in range(3):
            eng.balancer.est[r].record_b(1 << 20, 0.08)       # ~100 Mbit/s, both rails
    op = eng.begin_op()
    view = memoryview(bytearray(64 << 10))
    msg = eng.send(1, op, 0, view, Desc(wire.K_ALLREDUCE, 1, 1, 1 << 20), elem=4)
    by_rail = {r: [ch for ch in msg.chunks if ch.rail == r] for r in (0, 1)}
    assert by_rail[0] and by_rail[1] and set(msg.idle) == {0, 1}
    t_sent = [time.monotonic()]
    for ch in by_rail[0] + by_rail[1]:
        assert eng.before_send(c0 if ch.rail == 0 else c1, ch) is not None
    t_sent.append(time.monotonic())
    c1.rx_bytes += 256 << 10          # the peer's data on rail 1, ahead of its acknowledgement
    time.sleep(0.02)
    t_acked = [time.monotonic()]
    for ch in by_rail[0] + by_rail[1]:
        ack(eng, c0 if ch.rail == 0 else c1, ch)
    t_acked.append(time.monotonic())
    assert msg.complete
    # rail 0: one sample, its wait for the acknowledgement less its bytes' time
    assert len(eng.balancer.est[0].a_window) == 1
    bytes_time = msg.share[0] * eng.balancer.est[0].b
    assert t_acked[0] - t_sent[1] - bytes_time <= eng.balancer.est[0].fresh_a() \
        <= t_acked[1] - t_sent[0] - bytes_time
    assert len(eng.balancer.est[1].a_window) == 0        # rail 1: none
    eng.end_op(op)


@pytest.fixture
def tcp_conn(loopback_pair):
    """(sending socket, Connection on the receiving end) over loopback; threads not started."""
    a, b = loopback_pair
    return a, Connection(b, peer=1, rail=0, handler=None)


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


def test_a_copy_that_lands_first_revokes_the_late_in_place_read():
    """A late rail's frame may still be arriving in place when another copy of the chunk
    lands: that copy revokes the late read (the rest of it goes to scratch) before it writes,
    so no late byte can land after it; two connections never read the same bytes in place."""
    eng = engine()
    c0, c1 = FakeConn(1, 0), FakeConn(1, 1)
    for c in (c0, c1):
        c.t_hdr = 0.0
    eng.conns = {(1, 0): c0, (1, 1): c1}
    total = 2 << 20
    view = memoryview(bytearray(total))
    eng.post_recv(7, 0, 1, view, Desc(wire.K_ALLREDUCE, 0, 0, total))
    eng.op_seq = 7
    first = header(0, 1 << 20, total, rail=1)
    assert eng.data_target(c1, first, 1.0) is not None        # rail 1 reads in place...
    copy = header(0, 1 << 20, total, rail=0, copy_of=1)
    assert eng.data_target(c0, copy, 1.1) is None             # ...so the copy may not
    eng.data_staged(c0, copy, b"\x07" * (1 << 20))
    assert c1.revoked == 1 and c0.revoked == 0                # the late read is cut off...
    assert bytes(view[:1 << 20]) == b"\x07" * (1 << 20)       # ...before the copy lands
    eng.data_done(c1, first)                                  # the late frame ends (scratch)
    assert bytes(view[:1 << 20]) == b"\x07" * (1 << 20)


def test_end_op_revokes_reads_still_in_place():
    """When an operation ends its caller owns the buffers again: a late copy still being
    read into them finishes into scratch."""
    eng = engine()
    c0, c1 = FakeConn(1, 0), FakeConn(1, 1)
    c1.t_hdr = 0.0
    eng.conns = {(1, 0): c0, (1, 1): c1}
    op = eng.begin_op()
    total = 1 << 20
    eng.post_recv(op, 0, 1, memoryview(bytearray(total)), Desc(wire.K_ALLREDUCE, 0, 0, total))
    assert eng.data_target(c1, header(0, total, total, rail=1)._replace(op_id=op), 1.0) is not None
    eng.end_op(op)
    assert c1.revoked == 1 and c0.revoked == 0


def test_in_hot_a_share_behind_its_siblings_is_copied_only_once_overdue_by_the_model():
    """On a ring whose split is set by a slower hop, a rail finishes first on the faster hops
    every time: in HOT its sibling is copied only once it has been on its rail 1.5x what the
    agreed model says it takes (engine/hedge.py, Hedging._overdue)."""
    eng = engine()
    rs = eng.balancer.rs
    rs.state, rs.used_a = balance.HOT, [1e-4, 1e-4]
    rs.used_b = [2e-7, 2e-7]              # a 0.5 MiB share should take about 105 ms
    c0, c1 = FakeConn(1, 0), FakeConn(1, 1)
    eng.conns = {(1, 0): c0, (1, 1): c1}
    op = eng.begin_op()
    msg = eng.send(1, op, 0, memoryview(bytearray(1 << 20)),
                   Desc(wire.K_ALLREDUCE, 1, 1, 1 << 20), elem=4)
    by_rail = {r: [ch for ch in msg.chunks if ch.rail == r] for r in (0, 1)}
    for ch in by_rail[0] + by_rail[1]:
        eng.before_send(c0 if ch.rail == 0 else c1, ch)
    for ch in by_rail[0]:
        ack(eng, c0, ch)                  # rail 0 done; rail 1 not yet
    expected = rs.used_a[1] + msg.share[1] * rs.used_b[1]
    last = max(msg.done_at.values())
    eng.hedge(last + 0.05)                # its sibling done 50 ms ago, the model not yet due
    assert len(c0.queued) == len(by_rail[0])
    eng.hedge(msg.t0[1] + 1.6 * expected)  # overdue by the model: copied
    assert c0.queued[len(by_rail[0]):] == by_rail[1]
