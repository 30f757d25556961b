"""Shared fixtures. Tests that need root and namespaces are marked `netns`; where those are not
available they are skipped with the reason shown (CI runs as root, so there they run)."""
from __future__ import annotations

import os
import subprocess

import pytest

from testbed.kernel import netns
from testbed.fabric import state


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces (run: sudo ./tb test)"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"network namespaces unusable here: {e}"
    return None


def rerun_policy_violations(config, items) -> list[str]:
    """The rerun rule (pyproject.toml): only a test marked ``timing`` may carry ``flaky``, and no
    run reruns every test. Returns what breaks it, one line each."""
    bad = [f"{item.nodeid}: @pytest.mark.flaky without @pytest.mark.timing (reruns are only "
           f"for timing-sensitive tests, never for a correctness check)"
           for item in items
           if item.get_closest_marker("flaky") and not item.get_closest_marker("timing")]
    if (getattr(config.option, "reruns", 0) or 0) > 0:
        bad.append(f"--reruns {config.option.reruns} reruns every test, correctness checks "
                   f"included; timing-sensitive tests carry their own flaky marker")
    return bad


def pytest_collection_modifyitems(config, items):
    bad = rerun_policy_violations(config, items)
    if bad:
        raise pytest.UsageError("rerun policy:\n  " + "\n  ".join(bad))
    reason = _netns_unavailable()
    if reason is None:
        return
    for item in items:
        if "netns" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


def root_snapshot() -> dict:
    """The root namespace's links, addresses and routes, to prove we never touch them."""
    def out(*argv):
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    links = sorted(line.split()[1] for line in out("ip", "-o", "link").splitlines())
    return {"links": links, "addrs": out("ip", "-o", "addr"), "routes": out("ip", "route")}


@pytest.fixture
def no_leftovers():
    """Asserts that a test leaves no namespace of ours and an unchanged root namespace.
    Namespaces of runs that another live process owns (a concurrent test session on a shared
    machine) are not this test's and do not count."""
    before_ns = set(netns.listing())
    before_root = root_snapshot()
    yield
    after_ns = set(netns.listing())   # first: a run's state file outlives its namespaces
    foreign = {ns for r in state.runs() if r.owner_alive and r.pid != os.getpid()
               for ns in r.namespaces}
    ours = [n for n in after_ns - before_ns - foreign if state.RUN_NS_RE.match(n)]
    assert not ours, f"namespaces left behind: {ours}"
    assert root_snapshot() == before_root, "the root namespace changed"


@pytest.fixture(scope="session")
def shared_run():
    """One run for an exact test and a timing test of the same thing: ``shared_run(key,
    make, request)`` returns ``make()``'s result, made once per ``key``. The exact test never
    reruns; when the timing test reruns (``request`` of a second execution) the run is made
    afresh, so a rerun measures a new run and never the one that failed."""
    runs: dict = {}

    def get(key, make, request=None):
        rerun = request is not None and getattr(request.node, "execution_count", 1) > 1
        if rerun or key not in runs:
            runs[key] = make()
        return runs[key]
    return get
