"""A connection whose other end failed while the path was down: every link of a host went
down, the host dropped its connections, and its peers, which heard nothing of it, kept their
ends. Once the links are back the peers learn it from the host's answers (a path probe's
answer, or the answer to "arrivals?" / "acks?") and fail their stale ends at once, even the
last rail to the host, instead of waiting for their TCP's back-off to retransmit into the
host's RST, seconds later (3 hosts x 2 rails, every rail of h2 down for 5 s: the job stood
still 0.5-2.6 s after the links' return, beyond 2 s in one CI run)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from test_pathprobe import KEY, _ports, _wait_verdict

from nezha import wire
from nezha.engine.agreement import Agreement
from nezha.engine.failover import Failover
from nezha.errors import PeerClosedError
from nezha.health import Health
from nezha.pathprobe import PathProber


def _engine(dead=(), conns=None, live=(0, 1)):
    """What Health and Agreement read of an engine: rank 0, the failed pairs, the
    connections, the live rails to every peer and the rails' estimates (events dropped)."""
    nan = float("nan")
    eng = SimpleNamespace(rank=0, dead=set(dead), conns=dict(conns or {}), silenced=False,
                          live_rails=lambda peer, data=True: list(live),
                          events=SimpleNamespace(emit=lambda *a, **k: None),
                          balancer=SimpleNamespace(est=[SimpleNamespace(a=0.0, b=1e-8)] * 2,
                                                   rs=SimpleNamespace(used_b=None, b=[nan] * 2)))
    eng.dropped = lambda peer, rail: Failover.dropped(eng, peer, rail)
    return eng


def _conn(failed: list, rail: int = 0, alive: bool = True):
    return SimpleNamespace(peer=1, rail=rail, alive=alive, sock=None, tcp_info_ok=False,
                           opened=time.monotonic(), last_rx=0.0, dead_why="", dead_t=0.0,
                           check_id=None, rx_check_id=None, suspected=False, check_why="",
                           fail=failed.append, arrived_within=lambda window: 5000)


def test_a_rank_whose_end_failed_says_so_in_its_answers_and_only_then():
    ours = _conn([], alive=False)
    eng = _engine(dead={(1, 0)}, conns={(1, 0): ours, (1, 1): _conn([], rail=1)})
    health = Health(eng, lambda *a: None, [])
    assert Agreement.arrivals_within(eng, 1, 0, 0.1) == wire.NO_CONNECTION
    assert health.on_acks_question(1, 0, 0.1) == wire.NO_CONNECTION
    # a live connection answers with what arrived; no connection ever (a peer we never
    # connected to on that rail) is not a dropped one
    assert Agreement.arrivals_within(eng, 1, 1, 0.1) == 5000
    assert Agreement.arrivals_within(eng, 2, 0, 0.1) == 0
    assert health.on_acks_question(2, 0, 0.1) == 0
    # a byte count never reads as the flag, however much arrived
    eng.conns[(1, 1)].arrived_within = lambda window: 1 << 40
    assert Agreement.arrivals_within(eng, 1, 1, 0.1) == wire.NO_CONNECTION - 1


def test_an_answer_that_the_peer_dropped_its_end_fails_ours_even_as_the_last_rail():
    """The peer's word, not a suspicion: the rule that the last rail to a peer is never
    failed on suspicion does not hold it (it would stay stale until TCP found out)."""
    for question, answer in (("check_id", Health.on_arrivals), ("rx_check_id", Health.on_acks)):
        failed = []
        conn = _conn(failed)
        eng = _engine(conns={(1, 0): conn}, live=(0,))
        health = Health(eng, lambda *a: None, [])
        setattr(conn, question, 7)
        conn.check_why = conn.rx_check_why = "quiet"
        answer(health, 1, 0, 7, wire.NO_CONNECTION)
        assert len(failed) == 1 and isinstance(failed[0], PeerClosedError), (question, failed)
        assert "its end of the connection failed" in str(failed[0])


def test_a_probe_answer_tells_whether_the_peer_dropped_its_end_of_our_connection():
    """Every answer to a path probe says whether the answering rank's end of the pair's
    connection on that rail failed; only an answer to a burst started since our connection
    opened speaks of it."""
    p0, p1 = _ports(2), _ports(2)
    eps = {0: [("127.0.0.1", p) for p in p0], 1: [("127.0.0.1", p) for p in p1]}
    a = PathProber(0, eps[0], KEY, lambda peer, r: eps[peer][r])
    b = PathProber(1, eps[1], KEY, lambda peer, r: eps[peer][r],
                   dropped=lambda peer, r: (peer, r) == (0, 0))
    a.start()
    b.start()
    try:
        opened = time.monotonic()
        a.ask(1, 0, time.monotonic(), ref=1)
        assert _wait_verdict(a, 1, 0, ref=1) is True
        assert _wait_verdict(a, 1, 1, ref=0) is True
        assert a.peer_dropped(1, 0, opened)
        assert not a.peer_dropped(1, 1, opened)
        assert not a.peer_dropped(1, 0, time.monotonic())     # a connection opened since
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("dropped", [True, False])
def test_health_fails_a_connection_whose_probes_say_the_peer_dropped_it(dropped):
    """Silence on every rail to a peer is a slow peer, not dead rails, while its probes go
    unanswered; once they are answered with "dropped", the connection is failed, and one
    answered without it stays (slow, not dead)."""
    failed = []
    conn = _conn(failed)
    prober = SimpleNamespace(available=lambda rail: True, heard={1}, first_asked={},
                             ask=lambda *a, **k: None, verdict=lambda *a, **k: True,
                             peer_dropped=lambda peer, rail, since: dropped,
                             describe=lambda *a: {})
    eng = _engine(conns={(1, 0): conn}, live=(0,))
    health = Health(eng, lambda *a: None, [], prober=prober)
    health.dead(conn, "nothing received for 1600 ms", time.monotonic(), answered=False)
    assert bool(failed) is dropped, failed
