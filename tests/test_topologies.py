"""The failover suite: every shipped topology runs end to end and meets the expectations
written in its own file (the same check `python -m testbed run FILE` makes). The exact ones
(no wrong result, no lost iteration, no rank error, the loss of the reference run) never
rerun; the measured ones (times, rates, ratios, shares) are held by a timing test that may
rerun once, with a run of its own. Each topology runs once unless that test reruns."""
from __future__ import annotations

from pathlib import Path

import pytest

from testbed.model import spec
from testbed.model.records import Verdict
from testbed.run.runner import run_topology

pytestmark = [pytest.mark.netns, pytest.mark.slow]
TOPOLOGIES = sorted((Path(__file__).resolve().parent.parent / "topologies").glob("*.yaml"))
# expectations a wrong byte or a lost iteration breaks, not the machine's speed
EXACT = frozenset({"wrong_results", "iterations_lost", "rank_errors", "loss_matches_reference"})


def _run(path: Path, tmp_path):
    """A callable that runs the topology (for the shared_run fixture)."""
    topo = spec.load(path)
    return lambda: run_topology(topo, tmp_path / topo.name, say=lambda m: None)


def _failures(outcome, exact: bool) -> list[str]:
    """The failed expectations of one kind, each naming metric, bound and value."""
    return Verdict([r for r in outcome.verdict.rows if (r.metric in EXACT) == exact]).failures


def _measured(path: Path) -> bool:
    return any(m not in EXACT for m in spec.load(path).sections.get("expect") or {})


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.stem)
def test_shipped_topology_meets_its_exact_expectations(path, tmp_path, shared_run,
                                                       no_leftovers):
    topo = spec.load(path)
    assert topo.sections.get("expect"), f"{path.name} states no expectations"
    outcome = shared_run(path, _run(path, tmp_path))
    failed = _failures(outcome, exact=True)
    assert not failed, f"{path.name}: " + "; ".join(failed)
    assert (outcome.results_dir / "throughput.png").stat().st_size > 0


@pytest.mark.timing
@pytest.mark.flaky(reruns=1, reruns_delay=2)
@pytest.mark.parametrize("path", [p for p in TOPOLOGIES if _measured(p)], ids=lambda p: p.stem)
def test_shipped_topology_meets_its_measured_expectations(path, tmp_path, shared_run, request,
                                                          no_leftovers):
    outcome = shared_run(path, _run(path, tmp_path), request)
    failed = _failures(outcome, exact=False)
    assert not failed, f"{path.name}: " + "; ".join(failed)
