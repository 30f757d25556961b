"""A failed rail's redial: with back-off while its path stays broken, at once when its link
comes back (health.Health.link_up, redial_soon), and never more often than PROBE_MIN however
often a peer asks. The engine here is a stand-in holding only what Health reads: the failed
pairs, the rank and where CONTROL frames go."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from nezha import wire
from nezha.engine.agreement import Agreement
from nezha.errors import ProtocolError
from nezha.health import PROBE_MAX, PROBE_MIN, Health


class Engine(SimpleNamespace):
    """What Health touches of an engine, recording the CONTROL frames it is asked to send."""

    def __init__(self, rank: int, dead: set):
        super().__init__(rank=rank, dead=set(dead), gone=set(), unreachable=set(), sent=[],
                         events=SimpleNamespace(emit=lambda *a, **k: None))

    def send_control(self, peer, body, avoid=None):
        self.sent.append((peer, body, avoid))
        return True


def broken(peer, rail, dial_s=0.5):
    raise ConnectionError("still broken")


def backed_off(h: Health, key) -> float:
    """Dial ``key`` (a path still broken) until its back-off reaches PROBE_MAX, the last dial
    just now (dials 0.1, 0.2, 0.4 s apart); returns its time."""
    now = time.monotonic() - 0.7
    while h.backoff.get(key, PROBE_MIN) < PROBE_MAX:
        now = max(now, h.next_probe.get(key, 0.0))
        h.probe(now)
    return now


def test_a_link_that_comes_back_is_redialled_at_once_not_after_the_back_off():
    eng = Engine(rank=1, dead={(0, 1), (2, 1)})
    h = Health(eng, broken, [])
    t = backed_off(h, (0, 1))
    eng.dead.add((0, 0))                # another rail, failed later
    backed_off(h, (0, 0))
    assert h.next_probe[(0, 1)] - t >= 0.5                    # the back-off's next step
    h.link_up(1)
    assert h.next_probe[(0, 1)] <= t + PROBE_MIN              # dialled at the next turn
    assert h.backoff[(0, 1)] == PROBE_MIN
    assert h.next_probe[(0, 0)] - t >= 0.5                    # the other rail: unchanged
    # rank 2 dials us on that rail: it is asked to, over another rail
    assert eng.sent == [(2, {"what": "redial", "rail": 1}, 1)]


def test_a_redial_request_is_honoured_only_by_the_pair_s_dialler_and_at_most_every_probe_min():
    eng = Engine(rank=2, dead={(0, 1), (3, 1)})
    h = Health(eng, broken, [])
    backed_off(h, (0, 1))
    h.redial_soon(3, 1)                 # rank 3 dials us, not we it: nothing to do
    assert (3, 1) not in h.next_probe
    h.redial_soon(0, 0)                 # not a failed pair: nothing to do
    assert (0, 0) not in h.next_probe
    t = h.next_probe[(0, 1)]
    h.probe(t)                          # a dial that just failed...
    h.link_up(1)                        # ...and our link, or a peer, asking again and again
    for _ in range(50):
        h.redial_soon(0, 1)
    assert h.next_probe[(0, 1)] == pytest.approx(t + PROBE_MIN)


def test_redial_is_a_control_frame_a_peer_may_send():
    """The CONTROL 'redial' reaches Health through the engine's hook; one naming a rail
    that does not exist is a protocol error, as for every CONTROL frame."""
    got = []
    eng = SimpleNamespace(nrails=2, world=3, on_redial=lambda p, r: got.append((p, r)))
    h = wire.Header(wire.CONTROL, src=2)
    Agreement.on_control(eng, None, h, b'{"what": "redial", "rail": 1}')
    assert got == [(2, 1)]
    with pytest.raises(ProtocolError, match="unknown rail"):
        Agreement.on_control(eng, None, h, b'{"what": "redial", "rail": 7}')


def test_a_redial_waits_briefly_at_first_and_longer_as_its_back_off_grows():
    """A SYN lost to a link that was not up yet is resent only after 1 s: the first redials
    give up after DIAL_MIN and dial afresh; the wait grows with the back-off (a long path
    still connects) up to DIAL_MAX."""
    from nezha.health import DIAL_MAX, DIAL_MIN
    waits = []

    def dial(peer, rail, dial_s):
        waits.append(dial_s)
        raise TimeoutError("timed out")
    eng = Engine(rank=1, dead={(0, 1)})
    h = Health(eng, dial, [])
    backed_off(h, (0, 1))
    assert waits == [DIAL_MIN, 0.2, 0.4, DIAL_MAX] and DIAL_MIN < 0.2 and DIAL_MAX < 0.8
