"""Bad input from the application or from a peer: a clear error on every rank, no hang,
never a wrong result."""
import time

import pytest

from nezha.testing import run_ranks
import rankfns

TIMEOUT = 5.0


def all_failed(res, *names):
    for r, (ok, v) in res.items():
        assert not ok, f"rank {r} returned {v!r} instead of failing"
        assert v != "hung", f"rank {r} hung"
        assert not isinstance(v, str), f"rank {r}: {v}"
        assert v.isa("NezhaError"), (r, v)
        if names:
            assert any(v.isa(n) or n in v.message for n in names), (r, v)


@pytest.mark.parametrize("kw, word", [
    (dict(counts=[1000, 1001]), "mismatch"),
    (dict(counts=[0, 8]), "mismatch"),
    (dict(counts=[64, 64], dtypes=["float32", "float64"]), "mismatch"),
    (dict(counts=[64, 64], ops=["sum", "max"]), "mismatch"),
])
def test_mismatched_arguments(kw, word):
    t0 = time.monotonic()
    res = run_ranks(rankfns.length_of, 2, timeout=TIMEOUT * 3, **kw)
    all_failed(res, "MismatchError")
    for ok, v in res.values():
        assert word in v.message.lower()
    assert time.monotonic() - t0 < TIMEOUT * 2


def test_mismatched_broadcast_root():
    res = run_ranks(rankfns.length_of, 3, timeout=TIMEOUT * 3, counts=[100] * 3,
                    roots=[0, 1, 0], kind="broadcast")
    all_failed(res)


@pytest.mark.parametrize("what", ["garbage", "badcrc", "overflow"])
def test_bad_frames_from_a_peer(what):
    t0 = time.monotonic()
    res = run_ranks(rankfns.inject, 3, timeout=TIMEOUT * 3, what=what, victim=0, attacker=1)
    all_failed(res)
    if what == "overflow":     # well-formed header, but not a chunk of anything posted
        assert res[0][1].isa("ProtocolError") or res[0][1].isa("MismatchError"), res[0][1]
    else:
        assert res[0][1].isa("ProtocolError"), res[0][1]
    assert time.monotonic() - t0 < TIMEOUT * 2.5


def test_a_frame_cut_short_by_its_connection_closing_is_ridden_through():
    """A frame that ends early because its connection closes is what a link failure in the
    middle of a frame looks like (not a protocol violation): the rail's only connection
    fails, the peer is unreachable for a moment, the rail is re-dialled and every rank gets
    the exact result."""
    res = run_ranks(rankfns.inject, 3, timeout=TIMEOUT * 3, what="truncated", victim=0,
                    attacker=1)
    assert {r: v for r, v in res.items()} == {r: (True, [3.0] * 4) for r in range(3)}, res


def test_peer_dies_mid_operation():
    t0 = time.monotonic()
    res = run_ranks(rankfns.die_mid_op, 3, timeout=TIMEOUT * 3, victim=1)
    assert res[1] == (False, "exited with code 17") or res[1][1] == "hung" or not res[1][0]
    for r in (0, 2):
        ok, v = res[r]
        assert not ok and not isinstance(v, str), (r, v)
        assert v.isa("CommError"), v
        # told apart from a broken path (which is waited out to the timeout): the dead
        # process refuses a new connection on every rail (health.Health.check_unreachable)
        assert "rank 1 exited" in v.message and "refuses new connections" in v.message, v
    assert time.monotonic() - t0 < TIMEOUT * 2.5


def test_congestion_control_is_set_per_socket():
    """NEZHA_TCP_CONGESTION: every data socket uses it, whatever the host's default."""
    avail = open("/proc/sys/net/ipv4/tcp_available_congestion_control").read().split()
    cc = "reno" if "reno" in avail else avail[0]
    res = run_ranks(rankfns.congestion_of_sockets, 2, timeout=TIMEOUT * 3, cc=cc)
    assert all(ok for ok, _ in res.values()), res
    assert all(v == [cc] for _, v in res.values()), res
    bad = run_ranks(rankfns.congestion_of_sockets, 2, timeout=TIMEOUT * 3, cc="nosuchcc")
    assert all(not ok for ok, _ in bad.values())
    assert "NEZHA_TCP_CONGESTION" in bad[0][1].message


def _kernel_rto_min() -> float:
    import socket
    from nezha.transport.base import set_rto_min
    with socket.socket() as s:
        return set_rto_min(s, 5.0)


def test_data_sockets_retransmit_after_the_configured_minimum_not_200_ms():
    """NEZHA_TCP_RTO_MIN_MS (default 5 ms): a lost tail segment of a share costs that, not
    the kernel's 200 ms, without root or route changes; 0 gives the kernel's own back."""
    took = _kernel_rto_min()
    if not took:
        pytest.skip("this kernel has no per-socket TCP_RTO_MIN_US (Linux < 6.15): Nezha keeps "
                    "the kernel's / route's minimum there")
    res = run_ranks(rankfns.rto_of_sockets, 2, timeout=TIMEOUT * 3, rto_ms=None)
    assert all(ok for ok, _ in res.values()), res
    for _, (said, rtos) in res.values():
        # RTO = smoothed RTT + max(4 x its variance, the minimum): tens of ms at most here
        assert said == took and rtos and max(rtos) < 100, (took, res)
    res = run_ranks(rankfns.rto_of_sockets, 2, timeout=TIMEOUT * 3, rto_ms="0")
    assert all(ok for ok, _ in res.values()), res
    for _, (said, rtos) in res.values():
        assert said == 0.0 and min(rtos) >= 200, res

