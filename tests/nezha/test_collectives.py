"""Correctness of every collective on loopback rails, one process per rank."""
import numpy as np
import pytest

from nezha.testing import run_ranks
import rankfns

ALL_DTYPES = ["float32", "float64", "float16", "int32", "int64"]
ALL_OPS = ["sum", "max", "min", "prod"]


def ok_results(res):
    bad = {r: v for r, (ok, v) in res.items() if not ok}
    assert not bad, bad
    return {r: v for r, (ok, v) in res.items()}


def check_matrix(res):
    out = ok_results(res)
    for r, (fails, _) in out.items():
        assert fails == [], (r, fails)
    digests = [d for _, d in out.values()]
    assert all(d == digests[0] for d in digests), "ranks disagree on result bits"
    assert len(digests[0]) > 0


@pytest.mark.parametrize("world", [2, 3, 4])
def test_full_matrix(world):
    counts = [0, 1, world - 1, 7, 1000, 40_001]
    res = run_ranks(rankfns.matrix, world, timeout=90, dtypes=ALL_DTYPES, ops=ALL_OPS,
                    counts=counts)
    check_matrix(res)


@pytest.mark.parametrize("world", [5, 8])
def test_large_worlds(world):
    res = run_ranks(rankfns.matrix, world, timeout=90, dtypes=["float32", "int64"],
                    ops=["sum", "max"], counts=[0, 3, world + 1, 100_003], others=(world == 5))
    check_matrix(res)


@pytest.mark.parametrize("system", ["single", "stripe", "mptcp"])
def test_baseline_systems(system):
    if system == "mptcp":
        import socket
        try:
            socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262).close()
        except OSError:
            pytest.skip("no MPTCP in this kernel")
    res = run_ranks(rankfns.matrix, 3, timeout=60, dtypes=["float32", "int32"], ops=["sum", "min"],
                    counts=[0, 5, (3 << 20) // 4 + 1], system=system, nrails=3)
    check_matrix(res)


@pytest.mark.parametrize("world", [3, 4])
def test_large_broadcast_is_a_pipelined_chain_from_every_root(world):
    """6 MiB + 12 bytes: the chain path (>= 256 KiB on 3+ ranks), 12 blocks of odd length;
    the root differs between the calls, so ranks take different places in the chain."""
    res = run_ranks(rankfns.matrix, world, timeout=90, dtypes=["float32", "int64"], ops=["sum"],
                    counts=[(6 << 20) // 8 + 3], nrails=2)
    check_matrix(res)


def test_three_rails_large_message_bits_identical():
    res = run_ranks(rankfns.matrix, 2, timeout=60, dtypes=["float64"], ops=["sum"],
                    counts=[(8 << 20) // 8 + 3], nrails=3, others=False)
    check_matrix(res)


def test_inexact_float_sums_are_bit_identical_on_all_ranks():
    res = ok_results(run_ranks(rankfns.random_floats, 4, timeout=60, count=300_001))
    per_iter = list(zip(*res.values()))
    for it in per_iter:
        assert len({d for d, _ in it}) == 1, "different bits on different ranks"
        assert all(close for _, close in it)


def test_buffer_protocol_objects():
    res = ok_results(run_ranks(rankfns.buffer_protocol, 3, timeout=60))
    for a, b, m in res.values():
        assert a == [0.5 + 1.5 + 2.5] * 13
        assert b == list(range(10))
        assert m[1][2][3] == 23 * 6


def test_repeated_interleaved_calls():
    res = ok_results(run_ranks(rankfns.interleaved, 3, timeout=60))
    assert all(v == [] for v in res.values()), res


def test_ring_results_stay_exact_when_sizes_and_dtypes_change_between_operations():
    res = ok_results(run_ranks(rankfns.ring_sizes_up_and_down, 3, timeout=90))
    assert all(v == [] for v in res.values()), res


def test_scratch_is_kept_up_to_its_bound_and_let_go_on_release():
    """A Context holds its largest ring buffer (README, the Python API) up to keep_max; a
    larger operation's buffer is its own, and release() holds nothing."""
    from nezha.buffers import Scratch
    s = Scratch(keep_max=1 << 20)
    a = s.take(4096, np.float32)
    assert a.dtype == np.float32 and len(a) == 1024
    b = s.take(1 << 20, np.float64)
    assert len(b) == 1 << 17 and s.kept == 1 << 20
    assert np.shares_memory(s.take(4096, np.uint8), b)     # the kept buffer, not a new one
    big = s.take(2 << 20, np.uint8)
    assert len(big) == 2 << 20 and not np.shares_memory(big, b) and s.kept == 1 << 20
    s.release()
    assert s.kept == 0 and not np.shares_memory(s.take(4096, np.uint8), b)


def test_pipelined_blocks():
    """Tiny pipeline blocks: many blocks per segment, forwarded one by one, odd sizes."""
    import nezha.collectives as c
    assert c.nblocks(100_003, 3, 4) == 1
    res = run_ranks(rankfns.matrix, 3, timeout=60, dtypes=["float32", "int64"], ops=["sum", "max"],
                    counts=[2, 1000, 40_001], pipe_block=4096, others=False)
    check_matrix(res)


def test_gloo_baseline():
    # torch is a dependency: a missing torch fails here instead of skipping
    res = ok_results(run_ranks(rankfns.gloo_allreduce, 2, timeout=90))
    assert all(res.values()), res


def test_all_ranks_agree_on_state_and_splits():
    res = ok_results(run_ranks(rankfns.agreed_split, 3, timeout=60))
    states = list(res.values())
    same = [repr(s) for s in states]     # repr: nan (a rail not measured yet) equals nan
    assert all(s == same[0] for s in same), states
    assert states[0][-1]


def test_a_small_allreduce_returns_once_the_copies_are_in_not_when_ours_are_acknowledged():
    """A direct allreduce's own copy is a private buffer: the call returns when the peers'
    copies are in and ours are written, and the copy stays with the engine (rerouted if a
    rail fails) until acknowledged. Rank 1 holds its ACKs back 0.6 s: rank 0's allreduces
    still take a fraction of that, are exact, and its copies are let go once acknowledged.
    (Waiting for the ACKs was the last millisecond of a 2 ms 64 KiB allreduce on 3 hosts.)"""
    res = ok_results(run_ranks(rankfns.acks_held_back, 2, timeout=60))
    ops, left, later = res[0]
    assert all(exact for exact, _ in ops), ops
    assert max(t for _, t in ops[1:]) < 0.3, ops      # the first one connects
    assert left >= 1 and later == 0, (left, later)


def test_a_job_ending_on_broadcasts_from_other_roots_ends_cleanly_on_nine_ranks():
    """A small broadcast is a star: the root connects to every peer on demand, and reads
    each one's record from the store as it does. Rank 0, which serves the store, got its
    copy and closed while root 5 was still connecting to rank 3: every rank failed with
    "no connection to rank 3 on demand ... store ... Broken pipe". The serving rank now
    keeps the store until the others closed theirs."""
    res = ok_results(run_ranks(rankfns.broadcasts, 9, timeout=90, roots=[2, 5]))
    assert all(res.values()), res


@pytest.mark.parametrize("world", [2, 3, 5])
def test_a_small_allreduce_goes_in_one_direct_round_spread_over_the_rails(world):
    """Below NEZHA_DIRECT_MAX (size x (world - 1), 256 KiB) every rank sends its whole array
    to every peer, the copies spread over the rails; above it, and with NEZHA_DIRECT_MAX=0,
    the ring's 2(n-1)/n x size on one rail (small ring steps ride the best rail)."""
    count = 4096                                     # 16 KiB
    direct = ok_results(run_ranks(rankfns.bytes_per_allreduce, world, timeout=60, count=count))
    for r, (sent, exact) in direct.items():
        assert exact, r
        # (+ the estimate exchange's few hundred bytes when one falls on this call)
        assert 0 <= sum(sent) - (world - 1) * count * 4 < 4096, (r, sent)
        assert world == 2 or min(sent) > 0, (r, sent)     # two copies or more: both rails
    ring = ok_results(run_ranks(rankfns.bytes_per_allreduce, world, timeout=60, count=count,
                                direct_max=0))
    for r, (sent, exact) in ring.items():
        assert exact, r
        ring_bytes = 2 * (world - 1) * count * 4 / world
        assert abs(sum(sent) - ring_bytes) < 4096, (r, sent)


def test_bytes_are_counted_by_the_time_the_collective_returns():
    """A rail's byte counter includes a frame as soon as it is handed to the rail: counted
    after the write, a writer preempted in between left the counters at 0 for an allreduce
    that had already returned (seen once in a full suite)."""
    count = 4096                                     # 16 KiB, one direct round
    res = ok_results(run_ranks(rankfns.bytes_counted_when_the_writer_lags, 2, timeout=60,
                               count=count))
    for r, (sent, exact) in res.items():
        assert exact, r
        assert sum(sent) >= count * 4, (r, sent)


def test_a_message_above_the_direct_limit_takes_the_ring():
    count = (256 << 10) // 4                         # 256 KiB x 2 peers > 256 KiB
    res = ok_results(run_ranks(rankfns.bytes_per_allreduce, 3, timeout=60, count=count))
    for r, (sent, exact) in res.items():
        assert exact, r
        assert abs(sum(sent) - 2 * 2 * count * 4 / 3) < 4096, (r, sent)


def test_ranks_that_would_choose_different_algorithms_refuse_to_start():
    """NEZHA_DIRECT_MAX chooses the algorithm: ranks that disagree would wait for messages
    the others never send, so the rendezvous refuses, naming the setting."""
    res = run_ranks(rankfns.bytes_per_allreduce, 2, timeout=60, count=16,
                    per_rank={1: {"direct_max": 0}})
    for r, (ok, v) in res.items():
        assert not ok and v != "hung", (r, v)
        assert "NEZHA_DIRECT_MAX" in v.message, (r, v.message)
