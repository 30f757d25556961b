"""The torch.distributed backend "nezha" (nezha/torch/): every collective, dtype and op
against a reference computed from every rank's known inputs, async handles, errors, object
collectives, groups of one, and DDP training against a single-process reference and gloo.

Three multi-process runs (one group each, shared by the tests through module fixtures) keep
the torch start-up, the dearest part, to a minimum. The rank code is in torchfns.py."""
from datetime import timedelta

import numpy as np
import pytest
import torch.distributed as dist
import torchfns

import nezha.torch as nt
from nezha import errors
from nezha.testing import free_port, run_ranks
from nezha.torch.store import C10dStore


def ok_results(res: dict) -> dict:
    bad = {r: v for r, (ok, v) in res.items() if not ok}
    assert not bad, {r: (v, getattr(v, "tb", "")) for r, v in bad.items()}
    return {r: v for r, (ok, v) in res.items()}


@pytest.fixture(scope="module")
def three_ranks() -> dict:
    return ok_results(run_ranks(torchfns.collectives, 3, timeout=60))


@pytest.fixture(scope="module")
def ddp_two() -> dict:
    """Two ranks; trained twice on nezha (two groups, two Contexts)."""
    return ok_results(run_ranks(torchfns.ddp_job, 2, timeout=60, port2=free_port()))


@pytest.fixture(scope="module")
def ddp_three() -> dict:
    """Three ranks; trained on nezha, then the same job on gloo."""
    return ok_results(run_ranks(torchfns.ddp_job, 3, timeout=60, port2=free_port(),
                                second="gloo"))


def fails_of(results: dict, section: str) -> dict:
    return {r: v["fails"][section] for r, v in results.items() if v["fails"][section]}


def test_backend_is_registered():
    assert "nezha" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["nezha"] == ["cpu"]
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"   # not taken over


def test_allreduce_every_dtype_and_op_exact_and_identical_on_all_ranks(three_ranks):
    assert not fails_of(three_ranks, "allreduce")
    assert not fails_of(three_ranks, "random")
    digests = [v["digests"] for v in three_ranks.values()]
    assert len(digests[0]) > 40 and all(d == digests[0] for d in digests)


@pytest.mark.parametrize("section", [
    "movement",      # broadcast, gathers, reduce-scatters, barrier
    "objects",       # the object collectives
    "async",         # Work handles and futures
    "coalesced",     # torch's coalescing manager
    "unsupported",   # unsupported calls raise, naming the call
    "errors",        # errors propagate through wait() and the future
])
def test_each_section_of_the_three_rank_job_passes(three_ranks, section):
    assert not fails_of(three_ranks, section)


def test_ddp_two_ranks_bit_identical_to_single_process_reference(ddp_two):
    """With two ranks the ring's sum g0/2 + g1/2 has one order only, so DDP on nezha must
    give exactly the reference's losses and weights."""
    ref_losses, ref_params = torchfns.reference_training(2)
    for r, v in ddp_two.items():
        losses, _, params = v["first"]
        assert losses == ref_losses[r]
        assert all(np.array_equal(a, b) for a, b in zip(params, ref_params))


def test_ddp_ranks_agree_and_runs_repeat_bit_for_bit(ddp_two, ddp_three):
    for results in (ddp_two, ddp_three):
        first = [v["first"] for v in results.values()]
        means = [m for _, m, _ in first]
        assert all(m == means[0] for m in means)
        for _, _, params in first[1:]:
            assert all(np.array_equal(a, b) for a, b in zip(params, first[0][2]))
    for v in ddp_two.values():                  # the same job on a new group: the same bits
        assert v["first"][0] == v["second"][0] and v["first"][1] == v["second"][1]
        assert all(np.array_equal(a, b) for a, b in zip(v["first"][2], v["second"][2]))


def test_ddp_three_ranks_matches_reference_and_gloo(ddp_three):
    """Three ranks: the ring's summation order differs from the reference's (and gloo's), so
    the results agree to rounding, not to the bit."""
    ref_losses, ref_params = torchfns.reference_training(3)
    for r, v in ddp_three.items():
        losses, means, params = v["first"]
        gloo_losses, gloo_means, gloo_params = v["second"]
        assert np.allclose(losses, ref_losses[r], rtol=1e-5, atol=0)
        assert np.allclose(losses, gloo_losses, rtol=1e-5, atol=0)
        assert np.allclose(means, gloo_means, rtol=1e-5, atol=0)
        for a, b, c in zip(params, ref_params, gloo_params):
            assert np.allclose(a, b, rtol=1e-4, atol=1e-6) and np.allclose(a, c, rtol=1e-4, atol=1e-6)


def test_ddp_compression_hooks_agree_across_ranks(ddp_two, ddp_three):
    for results in (ddp_two, ddp_three):
        hooked = [v["hooked"] for v in results.values()]
        assert len(hooked[0]) == 1 and all(h == hooked[0] for h in hooked)


def test_groups_of_one(ddp_two, ddp_three):
    for results in (ddp_two, ddp_three):
        assert all(v["fails"] == [] for v in results.values())


def test_c10d_store_adapter():
    """The rendezvous's store interface over a torch store: values, counters, waits that
    time out, and an abort that ends a wait early."""
    s = C10dStore(dist.HashStore(), timeout=5.0)
    s.set("k", "v")
    assert s.get("k", 1.0) == "v" and s.check(["k"]) and not s.check(["k", "missing"])
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5
    with pytest.raises(errors.StoreTimeout):
        s.wait(["missing"], 0.05)
    s.abort("rank 3 failed")
    with pytest.raises(errors.RendezvousAborted, match="rank 3 failed"):
        s.wait(["missing"], 5.0)


def test_creator_needs_rails(monkeypatch):
    """Without NEZHA_RAILS the group is refused with the variable's name."""
    monkeypatch.delenv("NEZHA_RAILS", raising=False)
    with pytest.raises(errors.ConfigError, match="NEZHA_RAILS"):
        nt.NezhaProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=2))


def test_example_runs_under_torchrun(tmp_path):
    """examples/train_ddp.py under torchrun (its agent serves the c10d store), unchanged."""
    import os
    import subprocess
    import sys
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env = dict(os.environ, NEZHA_RAILS="127.0.0.1,127.0.0.2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), os.path.join(root, "examples", "train_ddp.py"),
           "--backend", "nezha", "--steps", "3", "--width", "64", "--layers", "2"]
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("loss") == 3 and "nezha: 2 ranks" in out.stdout
