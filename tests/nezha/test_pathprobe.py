"""Path probes (nezha/pathprobe.py): a rail that answers is alive however slow, a black hole
next to an answering rail is dead, a peer that answers on no rail is slow (no verdict), and a
stranger without the job's key can neither answer for a rail nor disturb a burst."""
from __future__ import annotations

import socket
import time

import pytest

from nezha import pathprobe
from nezha.pathprobe import PathProber


def _two_rail_health(bal, prober, **engine):
    """A Health on rank 0 with rails 0 and 1 live to peer 1, over a stand-in engine with the
    balancer ``bal`` (events dropped); ``engine`` adds what the test's path needs."""
    from types import SimpleNamespace

    from nezha.health import Health
    eng = SimpleNamespace(rank=0, balancer=bal, live_rails=lambda peer, data=True: [0, 1],
                          events=SimpleNamespace(emit=lambda *a, **k: None), **engine)
    return Health(eng, lambda *a: None, ["a", "b"], prober=prober)

KEY = b"k" * 32


def _ports(n: int) -> list[int]:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def pair():
    """Rank 0 and rank 1, two rails each on loopback; ``holes`` black-holes (peer, rail)
    at rank 1 (it neither sends nor answers there)."""
    p0, p1 = _ports(2), _ports(2)
    eps = {0: [("127.0.0.1", p) for p in p0], 1: [("127.0.0.1", p) for p in p1]}
    holes: set = set()
    a = PathProber(0, eps[0], KEY, lambda peer, r: eps[peer][r])
    b = PathProber(1, eps[1], KEY, lambda peer, r: eps[peer][r],
                   blocked=lambda peer, r: (peer, r) in holes)
    a.start()
    b.start()
    yield a, b, holes, eps
    a.close()
    b.close()


def _wait_verdict(prober, peer, rail, ref=None, limit=1.0, least=pathprobe.PROBE_TIMEOUT_MIN):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        v = prober.verdict(peer, rail, time.monotonic(), ref, least)
        if v is not None:
            return v
        time.sleep(0.002)
    return None


def test_an_answering_rail_is_alive(pair):
    a, b, _, _ = pair
    a.ask(1, 0, time.monotonic(), ref=1)
    assert _wait_verdict(a, 1, 0, ref=1) is True
    assert b.answered >= 1


def test_a_black_hole_next_to_an_answering_rail_is_dead(pair):
    a, _, holes, _ = pair
    holes.add((0, 1))
    t0 = time.monotonic()
    a.ask(1, 1, t0, ref=0)
    assert _wait_verdict(a, 1, 1, ref=0) is False
    # the verdict waits for the whole burst and the last probe's timeout
    assert time.monotonic() - t0 >= (pathprobe.PROBE_COUNT - 1) * pathprobe.PROBE_INTERVAL \
        + pathprobe.PROBE_TIMEOUT_MIN


class _FullQueue:
    """A probe socket whose host's queue is full for ``for_s``: sendto fails with ENOBUFS
    (what IP_RECVERR reports for a datagram the local qdisc dropped)."""

    def __init__(self, sock, for_s: float):
        self.sock, self.until = sock, time.monotonic() + for_s

    def sendto(self, data, dest):
        import errno
        if time.monotonic() < self.until:
            raise OSError(errno.ENOBUFS, "No buffer space available")
        return self.sock.sendto(data, dest)

    def __getattr__(self, name):
        return getattr(self.sock, name)


@pytest.mark.timing          # a 15 ms queue against 50 ms of patience, on a shared machine
@pytest.mark.flaky(reruns=1, reruns_delay=2)
def test_answers_our_own_full_queue_dropped_are_sent_again(pair):
    """32 hosts x 10 Mbit/s: a rank that had just written its late share onto a rail dropped
    its answers to the peer's probes there in its own queue (0-62 UDP SndbufErrors per host),
    while its other rail answered, and the rail was failed. The prober sends such a datagram
    again for up to RESEND_FOR: a queue full for 20 ms delays the answer, it does not make
    the rail dead (each probe given 50 ms, as health.py gives a slow rail)."""
    a, b, _, _ = pair
    b.socks[1] = _FullQueue(b.socks[1], 0.015)
    a.ask(1, 1, time.monotonic(), ref=0)
    assert _wait_verdict(a, 1, 1, ref=0, least=0.05) is True
    assert b.resent >= 1


def test_a_peer_that_answers_on_no_rail_gets_no_verdict(pair):
    """Both bursts unanswered: the peer process is too slow (or gone), which says nothing
    about the rail, so there is no verdict and the next ask starts afresh."""
    a, _, holes, _ = pair
    holes.update({(0, 0), (0, 1)})
    a.ask(1, 1, time.monotonic(), ref=0)
    assert _wait_verdict(a, 1, 1, ref=0, limit=0.2) is None
    assert a.inconclusive >= 1


def test_without_a_reference_rail_silence_is_dead(pair):
    a, _, holes, _ = pair
    holes.add((0, 0))
    a.ask(1, 0, time.monotonic())
    assert _wait_verdict(a, 1, 0) is False


def test_a_stranger_cannot_answer_for_a_dead_rail():
    """Rank 1's rail 1 is dead, and a process without the job's key holds its address and
    port there and answers whatever it can read: its answers do not count."""
    pa, (pb0, pb1) = _ports(2), _ports(2)
    eps = {0: [("127.0.0.1", p) for p in pa], 1: [("127.0.0.1", pb0), ("127.0.0.1", pb1)]}
    hold = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    hold.bind(eps[1][0])
    stranger = PathProber(1, eps[1], b"x" * 32, lambda peer, r: eps[peer][r])
    hold.close()
    b = PathProber(1, eps[1], KEY, lambda peer, r: eps[peer][r])
    a = PathProber(0, eps[0], KEY, lambda peer, r: eps[peer][r])
    assert [s is not None for s in stranger.socks] == [False, True]
    assert [s is not None for s in b.socks] == [True, False]
    for p in (a, b, stranger):
        p.start()
    try:
        a.ask(1, 1, time.monotonic(), ref=0)
        assert _wait_verdict(a, 1, 1, ref=0) is False
        assert stranger.answered == 0        # it could not even read a probe
    finally:
        for p in (a, b, stranger):
            p.close()


def test_malformed_and_replayed_datagrams_are_ignored(pair):
    a, b, holes, eps = pair
    junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for data in (b"", b"NZPB", b"x" * pathprobe.SIZE, b"y" * 65000):
            junk.sendto(data, eps[1][0])
        # a genuine answer of an older burst, replayed: another session, not counted
        old = b._datagram(pathprobe.REP, 0, 0, session=12345, seq=1)
        holes.add((0, 0))
        a.ask(1, 0, time.monotonic())
        junk.sendto(old, eps[0][0])
        assert _wait_verdict(a, 1, 0) is False
    finally:
        junk.close()
    holes.clear()
    assert b.thread.is_alive() and a.thread.is_alive()
    a.forget(1, 0)
    a.ask(1, 0, time.monotonic())
    assert _wait_verdict(a, 1, 0) is True


def test_a_rail_without_a_socket_has_no_probe():
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", 0))
    try:
        p = PathProber(0, [taken.getsockname()], KEY, lambda peer, r: ("127.0.0.1", 9))
        assert not p.available(0)
        p.ask(1, 0, time.monotonic())
        assert p.verdict(1, 0, time.monotonic()) is None
        p.close()
    finally:
        taken.close()


def test_a_peer_never_heard_is_remembered_apart(pair):
    """``heard`` holds the peers that ever answered: health.py judges a peer that never did
    (UDP filtered on the way) on its other evidence alone."""
    a, _, holes, _ = pair
    holes.update({(0, 0), (0, 1)})
    a.ask(1, 0, time.monotonic(), ref=1)
    _wait_verdict(a, 1, 0, ref=1, limit=0.1)
    assert 1 not in a.heard
    holes.clear()
    a.forget(1, 0)
    a.ask(1, 0, time.monotonic())
    assert _wait_verdict(a, 1, 0) is True
    assert 1 in a.heard


def test_a_question_about_another_rail_is_answered_as_a_datagram(pair):
    """health.py's 'arrivals?' also goes as a datagram on a rail whose TCP socket holds
    megabytes: the peer's answer comes back on the same rail, with the asker's id."""
    a, b, _, _ = pair
    got = []
    b.on_question = lambda what, peer, rail, window: 1234 if (what, peer, rail) == (1, 0, 1) \
        and abs(window - 0.05) < 1e-6 else 0
    a.on_answer = lambda *answer: got.append(answer)
    a.question(1, 0, 1, 1, 0.05, 77)
    deadline = time.monotonic() + 1.0
    while not got and time.monotonic() < deadline:
        time.sleep(0.002)
    assert got == [(1, 1, 1, 77, 1234)]


def test_a_stranger_gets_no_answer_to_a_question(pair):
    _, b, _, eps = pair
    asked = []
    b.on_question = lambda *q: asked.append(q) or 1
    stranger = PathProber(0, [("127.0.0.1", p) for p in _ports(2)], b"x" * 32,
                          lambda peer, r: eps[peer][r])
    stranger.start()
    try:
        stranger.question(1, 0, 1, 1, 0.05, 5)
        time.sleep(0.1)
        assert asked == []
    finally:
        stranger.close()


def test_a_peer_probed_for_the_first_time_is_slow_before_it_is_deaf():
    """health.py judges a peer that never answered a probe (UDP filtered) on its other
    evidence alone, but only once it had a second to answer: 32 ranks on 2 cores took rails
    for dead 100 ms after their peer's first probes, which it had not yet had the CPU to
    answer. Stand-ins for the engine and the prober: every verdict is "no answer yet"."""
    from types import SimpleNamespace

    from nezha.health import UNHEARD_S, Health
    prober = SimpleNamespace(heard=set(), first_asked={}, available=lambda rail: True,
                             verdict=lambda *a, **k: None)
    prober.ask = lambda peer, rail, now, ref=None: prober.first_asked.setdefault(peer, now)
    eng = SimpleNamespace(rank=0, events=SimpleNamespace(emit=lambda *a, **k: None),
                          balancer=SimpleNamespace(est=[SimpleNamespace(a=0.0, b=1e-8)] * 2,
                                                   rs=SimpleNamespace(used_b=None,
                                                                      b=[float("nan")] * 2)),
                          live_rails=lambda peer, data=True: [0, 1])
    health = Health(eng, lambda *a: None, [], prober=prober)
    failed = []
    conn = SimpleNamespace(peer=1, rail=0, sock=None, tcp_info_ok=False, suspected=False,
                           dead_why="", dead_t=0.0, fail=failed.append)
    t = 1000.0
    health.dead(conn, "nothing received for 265 ms", t)
    assert not health._judge(conn, t + 2 * health.check_timeout) and not failed
    assert health._judge(conn, t + UNHEARD_S + 0.01)
    assert "no path probe was ever answered" in str(failed[0])
    # a peer that did not answer the question behind the evidence either is slow, not a
    # dead rail: no verdict however long it stays deaf (the probes decide once it answers)
    failed.clear()
    health.dead(conn, "nothing received for 100 ms; rank 1 did not say within 100 ms", t + 2,
                answered=False)
    assert not health._judge(conn, t + 2 + 2 * UNHEARD_S) and not failed


def test_a_rank_that_has_not_written_its_share_yet_does_not_blame_the_rail():
    """The receiver hears nothing on a rail whose share is due and asks the sender whether
    its TCP still gets ACKs there. With the share's chunks still in the sender's own queue
    (32 ranks on 2 cores: a rank preempted between its rails' shares for 100+ ms) and every
    byte it did write acknowledged, the path is not the cause: the answer is "moving", where
    it used to be "no ACK" and the rail was failed. A rail held back by the black-hole test
    hook still answers "no ACK"."""
    import socket
    import time
    from types import SimpleNamespace

    from nezha.health import Health
    from nezha.transport.base import Connection
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen()
    ours = socket.create_connection(lst.getsockname())
    theirs, _ = lst.accept()
    try:
        conn = Connection(ours, peer=1, rail=1, handler=SimpleNamespace(silenced=False))
        eng = SimpleNamespace(rank=0, silenced=False, conns={(1, 1): conn},
                              events=SimpleNamespace(emit=lambda *a, **k: None))
        health = Health(eng, lambda *a: None, [])
        conn.unacked, conn.last_ack = 2, time.monotonic() - 5.0   # queued, never written
        assert health.on_acks_question(1, 1, 0.13) == 1
        conn.blackhole = True
        assert health.on_acks_question(1, 1, 0.13) == 0
        conn.blackhole = False
        ours.setblocking(False)
        try:                    # the peer reads nothing: written bytes wait in our queue
            while True:
                ours.send(b"x" * 65536)
        except BlockingIOError:
            pass
        assert conn.written_unacked() > 0
        # (its zero-window probes are answered: TCP gets ACKs, the path is fine)
        assert health.on_acks_question(1, 1, 0.13) == 1
    finally:
        for s in (ours, theirs, lst):
            s.close()


def test_an_icmp_error_is_taken_off_the_socket_not_spun_on():
    """With IP_RECVERR (for the resend above) an ICMP error, e.g. a peer's probe port gone,
    waits on the socket's error queue, and poll reports the socket (POLLERR) until it is
    read. A send reports the error too and clears the socket's pending error, but not the
    queue: then a read sees nothing to read, and a prober that only read on an error from
    recvfrom spun on poll at full CPU."""
    import resource
    ports = _ports(1)
    a = PathProber(0, [("127.0.0.1", ports[0])], KEY, lambda peer, r: ("127.0.0.1", ports[0]))
    try:
        gone = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        gone.bind(("127.0.0.1", 0))
        dead_end = gone.getsockname()
        gone.close()                               # nothing listens there: port unreachable
        a._send(0, dead_end, b"x" * pathprobe.SIZE)
        time.sleep(0.05)                           # the ICMP error is in
        a._send(0, ("127.0.0.1", ports[0]), b"x")  # reports it (tried again): queue left
        a.start()
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):       # the prober took it off the queue
            a.socks[0].recvmsg(64, 512, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        t0 = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(0.5)
        t1 = resource.getrusage(resource.RUSAGE_SELF)
        used = (t1.ru_utime - t0.ru_utime) + (t1.ru_stime - t0.ru_stime)
        assert used < 0.2, f"{used:.2f} s of CPU in 0.5 s of an idle prober"
    finally:
        a.close()


def test_a_slow_rail_keeps_its_limits_while_its_estimate_is_empty_or_flattered():
    """The estimate's window restarts whenever the split moves, and a small share can pass
    in a token bucket's burst; the limits then assumed 80-100 Mbit/s, and 10 Mbit/s rails
    were failed with nothing wrong (4 and 5 hosts x 8-10 rails, seeds 45 and 44 of
    ``testbed shapes``): a stall of 22 ms against a 20 ms watchdog limit, and path probes,
    queued behind the rail's bulk data, unanswered in the 10 ms they were given. A rail is
    judged at no less than the agreed cost in use."""
    from types import SimpleNamespace

    import numpy as np

    from nezha import balance
    bal = balance.Balancer(2, "nezha")
    for _ in range(2):                   # every rank reports 100 and 10 Mbit/s: HOT
        t = np.full((3, 2, balance.TABLE_COLUMNS), np.nan)
        t[:, :, :3] = [(1e-4, 8e-8, 5), (1e-4, 8e-7, 5)]
        bal.agree(t)
    assert bal.rs.state == "hot" and np.isnan(bal.est[1].b)    # no window yet
    asked = []
    prober = SimpleNamespace(heard={1}, first_asked={}, available=lambda rail: True,
                             ask=lambda *a, **k: None,
                             verdict=lambda peer, rail, now, ref=None, least=0.0: asked.append(least))
    health = _two_rail_health(bal, prober)
    window = 64 << 10
    assert health.stall_limit(1) >= 3 * window * 8e-7         # 157 ms, not the 20 ms floor
    assert health.stall_limit(0) == pytest.approx(health.watchdog_min)
    for _ in range(2):              # shares that passed in the bucket's burst: 80 Mbit/s
        bal.est[1].record_b(1 << 20, 0.1)
    assert health.stall_limit(1) >= 3 * window * 8e-7
    conn = SimpleNamespace(peer=1, rail=1, sock=None, tcp_info_ok=False, dead_why="",
                           dead_t=0.0, fail=lambda e: None)
    health.dead(conn, "no progress for 22 ms", 1000.0)
    assert asked and asked[-1] >= 2 * window * 8e-7            # 105 ms for its probes


def test_a_rail_nothing_has_timed_yet_is_not_judged_by_its_silence():
    """COLD's first operation gives a 10 Mbit/s rail of 15 as much as a 91 Mbit/s one, and
    such rails, silent for 101-235 ms in a TCP back-off, were failed from the receiving
    side with nothing wrong (5-6 hosts x 10-15 rails, seeds 6 and 30 of ``testbed
    shapes``). Before any table has timed a rail, its silence is no evidence; once one has,
    the same silence (beyond twice its watchdog's limit) is."""
    from types import SimpleNamespace

    import numpy as np

    from nezha import balance
    bal = balance.Balancer(2, "nezha")
    questions = []
    prober = SimpleNamespace(heard={1}, first_asked={}, available=lambda rail: True,
                             ask=lambda *a, **k: None, question=lambda *a: None)
    t = 1000.0
    quiet = SimpleNamespace(peer=1, rail=1, sock=None, tcp_info_ok=False, dead_why="",
                            rx_check_id=None, rx_ok_t=0.0, rx_due_next=0.0, alive=True,
                            last_rx=t - 0.3)
    busy = SimpleNamespace(peer=1, rail=0, alive=True, last_rx=t - 0.001)
    health = _two_rail_health(bal, prober, conns={(1, 0): busy, (1, 1): quiet},
                              share_due=lambda peer, rail: True,
                              send_control=lambda peer, msg, avoid=None: questions.append(msg))
    assert not health._silent(quiet, t) and not questions       # COLD, nothing measured
    table = np.full((3, 2, balance.TABLE_COLUMNS), np.nan)
    table[:, :, :3] = [(1e-4, 1e-8, 5), (1e-4, 1e-8, 5)]         # 800 Mbit/s each
    bal.agree(table)
    health._silent(quiet, t)
    assert questions and questions[0]["what"] == "acks?"      # 300 ms > 2 x its limit


def test_probes_on_a_rail_nothing_has_timed_yet_are_given_its_deepest_queue():
    """A 10 Mbit/s rail at MTU 9000 queues 20 frames (144 ms) each way, and in the first
    operation its probes came back after up to 157 ms (here: 96): given 27-52 ms, three live
    rails were failed in the first half second of a run (4-5 hosts x 10-11 rails, seeds 1
    and 44 of ``testbed shapes``). Before anything has timed the rail its probes get
    PROBE_TIMEOUT_UNTIMED; once a table has, the same silence is judged as before (a black
    hole is told in tens of ms)."""
    from types import SimpleNamespace

    import numpy as np

    from nezha import balance
    t0, answer_after = 1000.0, 0.096

    def verdict(peer, rail, now, ref=None, least=0.0):
        if now - t0 >= answer_after:                 # the answer that a live rail sends
            return True
        return False if now - t0 >= least else None  # unanswered for ``least``: dead

    bal = balance.Balancer(2, "nezha")
    prober = SimpleNamespace(heard={1}, first_asked={}, available=lambda rail: True,
                             ask=lambda *a, **k: None, verdict=verdict,
                             peer_dropped=lambda *a: False, describe=lambda *a: {})
    health = _two_rail_health(bal, prober)
    failed = []
    conn = SimpleNamespace(peer=1, rail=1, sock=None, tcp_info_ok=False, dead_why="",
                           dead_t=0.0, opened=0.0, fail=failed.append, tcp_moved=0.0, last_ack=0.0,
                           check_ok_t=0.0, rx_ok_t=0.0, last_rx=0.0, check_why="")
    health.dead(conn, "no progress for 28 ms with 1 chunks outstanding", t0)
    assert not health._judge(conn, t0 + 0.06) and not failed     # still waiting for it
    assert not health._judge(conn, t0 + answer_after) and not failed   # it answered
    table = np.full((3, 2, balance.TABLE_COLUMNS), np.nan)
    table[:, :, :3] = [(1e-4, 8e-8, 5), (1e-4, 8e-8, 5)]         # both timed at 100 Mbit/s
    bal.agree(table)
    answer_after = float("inf")                                  # a black hole now
    health.dead(conn, "no progress for 28 ms with 1 chunks outstanding", t0)
    assert health._judge(conn, t0 + 0.06) and failed             # told within 60 ms


def test_a_black_hole_is_found_dead_though_its_probes_wait_longer_than_a_verdict_stands(pair):
    """A slow rail's probes are given two 64 KiB segments at its cost (105 ms at 10 Mbit/s),
    more than PROBE_FRESH. Health asks for a burst on every look (every 10 ms): each ask
    started a new burst before the old one's wait was over, and a black hole on such a rail
    never got a verdict (2 ranks, a rail black-holed in the first operation: it carried its
    shares until the job ended, 4 runs in 40)."""
    a, _, holes, _ = pair
    holes.add((0, 1))
    least = 2 * pathprobe.PROBE_FRESH
    t0 = time.monotonic()
    verdict = None
    while verdict is None and time.monotonic() - t0 < 2.0:
        now = time.monotonic()
        a.ask(1, 1, now, ref=0)
        verdict = a.verdict(1, 1, now, ref=0, least=least)
        time.sleep(0.01)
    assert verdict is False
    assert time.monotonic() - t0 >= least          # its probes were given their wait


def test_a_rail_charged_as_delivering_nothing_is_still_judged_in_time():
    """A rail none of whose own frames came in while hedge copies carried its shares is
    charged about 1 byte over the operation (costs.ShareCosts.op_ended): 0.12 s per byte.
    The watchdog's limit, the receiver's silence limit and the probes' wait all grow with
    the cost, and such a rail was given hours: a black hole was never failed. They wait on
    no rail slower than SLOWEST_BPS."""
    from types import SimpleNamespace

    from nezha import balance
    from nezha import health as health_mod
    bal = balance.Balancer(2, "nezha")
    for _ in range(2):
        bal.est[1].record_b(1, 0.12)
    asked = []

    def verdict(peer, rail, now, ref=None, least=0.0):
        asked.append(least)
    prober = SimpleNamespace(heard={1}, first_asked={}, available=lambda rail: True,
                             ask=lambda *a, **k: None, verdict=verdict)
    health = _two_rail_health(bal, prober)
    slowest = (64 << 10) / health_mod.SLOWEST_BPS          # 0.52 s: 64 KiB at 1 Mbit/s
    assert health.stall_limit(1) <= health_mod.WATCHDOG_FACTOR * (bal.est[1].a + slowest)
    conn = SimpleNamespace(peer=1, rail=1, sock=None, tcp_info_ok=False, dead_why="",
                           dead_t=0.0, fail=lambda e: None)
    health.dead(conn, "no progress", 1000.0)
    assert asked and asked[-1] <= 2 * slowest


def test_bytes_that_hedge_copies_carried_are_still_owed_by_the_silent_rail():
    """The receiver judges a silent rail only while it owes bytes of a message that the
    other rails deliver. Counting the copies' bytes as paid, a rail whose every share was
    rescued by copies (each within 13-70 ms) owed nothing between two looks and was never
    judged, although the sender keeps its own copy outstanding (engine/hedge.py)."""
    import numpy as np

    from nezha.balance import Balancer
    from nezha.config import Config
    from nezha.engine import Engine
    from nezha.engine.messages import Desc, RecvSlot
    from nezha.events import Events
    eng = Engine(0, 2, 2, Balancer(2), Events(0, 2, None), Config())
    eng.conns[(1, 0)], eng.conns[(1, 1)] = object(), object()
    total = 1 << 20
    slot = RecvSlot((5, 0, 1), memoryview(np.zeros(total, "uint8")),
                    Desc(kind=1, op_total=total))
    share1 = sum(n for r, _, n in eng.balancer.split(total, 1, [0, 1], total) if r == 1)
    assert share1 > 0
    slot.rbytes = {0: total - share1, 1: 0}       # rail 0 delivered its share...
    slot.copied = {1: share1 // 2}                # ...and half of rail 1's, as copies
    eng.slots[slot.key] = slot
    assert eng.share_due(1, 1)
    slot.copied = {1: share1}                     # all of it: still rail 1's own debt
    assert eng.share_due(1, 1)
    assert not eng.share_due(1, 0)


def test_probes_on_an_untimed_rail_wait_as_long_as_its_queue_takes_to_drain(monkeypatch):
    """Before anything has timed a rail its probes got PROBE_TIMEOUT_UNTIMED, whatever the
    rail: a black hole 3 s into a job on 4 hosts x 2 rails of 100 Mbit/s (the first
    operations still untimed) was told 260 ms after it began. TCP has measured the rail by
    then: the probes get twice the time its bytes in flight take to drain at that rate, and
    never more than before (a 10 Mbit/s rail at MTU 9000 still gets its 250 ms)."""
    from types import SimpleNamespace

    from nezha import balance
    from nezha import health as health_mod
    from nezha.transport.tcpinfo import TcpInfo
    info = {}
    monkeypatch.setattr(health_mod, "tcp_info", lambda sock: info.get("ti"))
    health = _two_rail_health(balance.Balancer(2, "nezha"), SimpleNamespace())
    conn = SimpleNamespace(peer=1, rail=1, sock=object(), tcp_info_ok=True)

    def ti(unacked, mss, rate, rtt=0.002):
        return TcpInfo(delivered=0, unacked=unacked, rto=0.2, last_ack=0.0, rtt=rtt, cwnd=10,
                       retrans=0, backoff=0, last_data_recv=0.0, mss=mss, delivery_rate=rate)
    info["ti"] = ti(55, 1448, 12.5e6)                 # 100 Mbit/s, 80 KB in flight: 6.4 ms
    assert 2 * 55 * 1448 / 12.5e6 <= health._probe_timeout(conn) <= 0.02
    info["ti"] = ti(20, 8948, 1.25e6)                 # 10 Mbit/s at MTU 9000: 143 ms
    assert health._probe_timeout(conn) == pytest.approx(health_mod.PROBE_TIMEOUT_UNTIMED)
    info["ti"] = ti(55, 1448, 0.0)                    # no rate sample yet
    assert health._probe_timeout(conn) == pytest.approx(health_mod.PROBE_TIMEOUT_UNTIMED)
