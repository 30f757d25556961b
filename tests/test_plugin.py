"""The pytest plugin, used from a separate test file exactly as a user would (pytester runs
pytest in a subprocess on a file of its own), and the shipped example suite."""
from __future__ import annotations

from pathlib import Path

import pytest

from testbed.kernel.capabilities import probe

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parent.parent

USER_TESTS = '''
import pytest
from testbed.run import probes

TOPO = """
name: user
hosts: 2
rails: [{name: r0, bandwidth: 100mbit}, {name: r1, bandwidth: 100mbit}]
"""

@pytest.mark.needs_netns
@pytest.mark.topology(TOPO)
def test_fault_api(fabric):
    assert sorted(fabric.hosts) == ["h1", "h2"] and sorted(fabric.rails) == ["r0", "r1"]
    t = fabric.target("r1").set_state(False)
    assert t > 0
    assert not probes.reachable(fabric, "h1", "h2", "r1")
    assert probes.reachable(fabric, "h1", "h2", "r0")

@pytest.mark.needs_netns
def test_verdict(testbed_run):
    out = testbed_run(TOPO + "workload: {kind: allreduce, size: 1MiB, iterations: 3}\\n"
                      "expect: {wrong_results: 0, iterations: 3}\\n")
    assert out.passed, out.verdict.failures
    assert out.metrics["iterations"] == 3

@pytest.mark.needs_netns
def test_failing_verdict_is_visible(testbed_run):
    out = testbed_run(TOPO + "workload: {kind: allreduce, size: 1MiB, iterations: 2}\\n"
                      "expect: {busbw_mbps: {min: 100000}}\\n")
    assert not out.passed
    assert "busbw_mbps" in out.verdict.failures[0]

@pytest.mark.needs_netem
@pytest.mark.topology(TOPO.replace("100mbit}", "100mbit, delay: 1ms}"))
def test_netem(fabric):
    assert fabric.links["h1.r0"].shape.delay_s == 0.001

def test_fabric_without_topology_marker_fails_clearly(fabric):
    pass
'''


@pytest.mark.netns
def test_plugin_from_a_user_test_file(pytester, no_leftovers):
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "nezha_testbed", "-rs", timeout=600)
    netem = probe().netem
    result.assert_outcomes(passed=4 if netem else 3, skipped=0 if netem else 1, errors=1)
    out = result.stdout.str()
    assert "@pytest.mark.topology" in out          # the misuse is explained
    if not netem:
        assert "sch_netem" in out                  # the skip says why


def test_needs_markers_give_a_reason_for_non_root(monkeypatch):
    from testbed import pytest_plugin
    monkeypatch.setattr(pytest_plugin.os, "geteuid", lambda: 1000)
    for marker in ("needs_root", "needs_netns", "needs_netem"):
        reason = pytest_plugin._missing(marker)
        assert reason and "root" in reason and "sudo" in reason


@pytest.mark.netns
@pytest.mark.slow
def test_the_shipped_example_suite(pytester):
    example = (ROOT / "examples" / "test_my_transport.py").read_text()
    pytester.makepyfile(test_example=example)
    result = pytester.runpytest_subprocess("-p", "nezha_testbed", "-rs", timeout=600)
    netem = probe().netem
    result.assert_outcomes(passed=3 if netem else 2, skipped=0 if netem else 1)
