"""The failover suite: every shipped topology runs end to end and meets the expectations
written in its own file (the same check `python -m testbed run FILE` makes)."""
from __future__ import annotations

from pathlib import Path

import pytest

from testbed.model import spec
from testbed.run.runner import run_topology

pytestmark = [pytest.mark.netns, pytest.mark.slow]
TOPOLOGIES = sorted((Path(__file__).resolve().parent.parent / "topologies").glob("*.yaml"))


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.stem)
def test_shipped_topology_meets_its_expectations(path, tmp_path, no_leftovers):
    topo = spec.load(path)
    assert topo.sections.get("expect"), f"{path.name} states no expectations"
    outcome = run_topology(topo, tmp_path / topo.name, say=lambda m: None)
    assert outcome.passed, f"{path.name}: " + "; ".join(outcome.verdict.failures)
    assert (tmp_path / topo.name / "throughput.png").stat().st_size > 0
