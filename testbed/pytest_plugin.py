"""pytest plugin (entry point ``nezha_testbed``): failover tests for your own transport in a few
lines.

    @pytest.mark.topology("topologies/default.yaml")      # or an inline YAML string / dict
    def test_survives(fabric):
        fabric.target("h2.r1").set_state(False)           # the fault API: links, rails, hosts
        ping = fabric.hosts["h1"].run(["ping", "-c1", "-W1", "198.18.1.2"])  # as subprocess.run
        assert ping.returncode != 0                       # (check=True would raise instead)
        ...

    def test_verdict(testbed_run):
        outcome = testbed_run("topologies/rail-outage.yaml")
        assert outcome.passed, outcome.verdict.failures

Markers: ``needs_root``, ``needs_netns``, ``needs_netem``: the test is skipped with the reason
when the machine lacks it (never silently passed). Fabrics are always torn down.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Callable, Union

import pytest
import yaml

TopologyArg = Union[str, Path, dict]


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "topology(src): the topology the `fabric` fixture builds "
                            "(a file path, an inline YAML string, or a dict)")
    config.addinivalue_line("markers", "needs_root: skip unless running as root")
    config.addinivalue_line("markers", "needs_netns: skip unless network namespaces work")
    config.addinivalue_line("markers", "needs_netem: skip unless the kernel has sch_netem")


def _missing(marker: str) -> str | None:
    if marker in ("needs_root", "needs_netns", "needs_netem") and os.geteuid() != 0:
        return "needs root (network namespaces and tc): run pytest with sudo"
    if marker in ("needs_netns", "needs_netem"):
        try:
            subprocess.run(["ip", "netns", "list"], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:
            return f"network namespaces unusable: {e}"
    if marker == "needs_netem":
        from testbed.kernel.capabilities import probe
        caps = probe()
        if not caps.netem:
            return "kernel lacks sch_netem (delay/jitter cannot be emulated): " + \
                caps.details.get("netem", "")
    return None


def pytest_runtest_setup(item) -> None:
    for marker in ("needs_root", "needs_netns", "needs_netem"):
        if item.get_closest_marker(marker):
            reason = _missing(marker)
            if reason:
                pytest.skip(reason)


def load_topology(src: TopologyArg, base: Path | None = None):
    """A Topology from a path, an inline YAML string, or an already-loaded mapping."""
    from testbed.model.spec import load, parse
    if isinstance(src, dict):
        return parse(src)
    if isinstance(src, Path) or (isinstance(src, str) and "\n" not in src
                                 and src.endswith((".yaml", ".yml"))):
        path = Path(src)
        if not path.is_absolute() and base is not None and (base / path).exists():
            path = base / path
        return load(path)
    return parse(yaml.safe_load(src))


@pytest.fixture
def fabric_factory(request) -> Callable[[TopologyArg], Any]:
    """Build fabrics on demand; each is torn down when the test ends, whatever happens."""
    from testbed.fabric import Fabric
    built: list[Fabric] = []
    reason = _missing("needs_netns")
    if reason:
        pytest.skip(reason)

    def make(src: TopologyArg) -> Fabric:
        fab = Fabric(load_topology(src, Path(str(request.config.rootpath))))
        fab.build()
        built.append(fab)
        return fab

    yield make
    for fab in built:
        fab.teardown()


@pytest.fixture
def fabric(request, fabric_factory):
    """The fabric of the test's ``@pytest.mark.topology(...)``: hosts, rails, links, faults."""
    marker = request.node.get_closest_marker("topology")
    if marker is None:
        pytest.fail("the `fabric` fixture needs @pytest.mark.topology(FILE_OR_YAML)")
    return fabric_factory(marker.args[0])


@pytest.fixture
def testbed_run(tmp_path, request) -> Callable[..., Any]:
    """Run a whole scenario (workload, faults, metrics, verdict) and return its outcome:
    ``.passed``, ``.metrics``, ``.verdict.failures``, ``.results_dir``."""
    from testbed.run.runner import run_topology
    reason = _missing("needs_netns")
    if reason:
        pytest.skip(reason)

    def run(src: TopologyArg, results_dir: Path | None = None, quiet: bool = True):
        topo = load_topology(src, Path(str(request.config.rootpath)))
        say = (lambda m: None) if quiet else print
        return run_topology(topo, results_dir or tmp_path / topo.name, say=say)

    return run
