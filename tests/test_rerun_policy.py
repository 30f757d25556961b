"""The rerun rule: a test may run a second time only if it is marked ``timing`` (it asserts a
measured duration, rate or ratio) and says so with its own ``flaky`` marker; a correctness check
(exact results, nothing lost, clean-up, errors, parsing) fails on its first failure. With
``--reruns 1`` on every test, a race that gives a wrong result 30 % of the time passed ~91 % of
CI runs (issue 12)."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parent.parent


def test_no_global_reruns_and_the_timing_marker_is_registered():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--reruns" not in ini.get("addopts", ""), ini["addopts"]
    assert "--only-rerun" not in ini.get("addopts", "")
    assert any(m.startswith("timing:") and "never a correctness check" in m
               for m in ini["markers"]), ini["markers"]


def test_every_flaky_test_in_the_suite_is_marked_timing():
    """Collects the whole suite (nothing runs): tests/conftest.py refuses a flaky test without
    the timing marker at collection, so a clean collection proves the rule for every test."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", str(ROOT / "tests")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "rerun policy" not in r.stdout + r.stderr


def test_timing_tests_exist_and_each_is_flaky_once():
    """The rule is not vacuous: the timing tests are found in the sources, and each reruns once."""
    found = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.resolve() == Path(__file__).resolve():   # its examples are not suite tests
            continue
        text = path.read_text()
        for m in re.finditer(r"((?:^[@#][^\n]*\n)+)def (test_\w+)",
                             text, flags=re.M):
            if "@pytest.mark.timing" in m.group(1):
                found[f"{path.relative_to(ROOT)}::{m.group(2)}"] = m.group(1)
    assert len(found) >= 5, found
    for name, decorators in found.items():
        assert "flaky(reruns=1, reruns_delay=2" in decorators, name


def _conftest_run(pytester, monkeypatch, body: str, *args: str):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    timing: timing-sensitive\n    netns: netns\n")
    pytester.makepyfile(test_example=body)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)


def test_conftest_refuses_a_flaky_correctness_test(pytester, monkeypatch):
    result = _conftest_run(pytester, monkeypatch, """
import pytest

@pytest.mark.flaky(reruns=1)
def test_exact_result():
    assert 1 + 1 == 2
""")
    assert result.ret != 0
    text = result.stdout.str() + result.stderr.str()
    assert "rerun policy" in text and "test_exact_result" in text and "timing" in text, text


def test_conftest_refuses_reruns_for_every_test(pytester, monkeypatch):
    result = _conftest_run(pytester, monkeypatch, "def test_exact_result():\n    pass\n",
                           "--reruns", "1")
    assert result.ret != 0
    assert "--reruns 1 reruns every test" in result.stdout.str() + result.stderr.str()


def test_conftest_reruns_a_timing_test_once_and_a_correctness_test_never(pytester, monkeypatch):
    result = _conftest_run(pytester, monkeypatch, """
import pytest

@pytest.mark.timing
@pytest.mark.flaky(reruns=1, reruns_delay=0)
def test_rate():
    assert False, "measured too slow"

def test_exact_result():
    assert False, "wrong result"
""")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 2 and outcomes.get("rerun") == 1, outcomes
    assert result.stdout.str().count("test_example.py::test_rate") >= 1


def test_a_shared_run_serves_both_tests_once_and_a_rerun_afresh(pytester, monkeypatch):
    """tests/test_failover.py and tests/test_topologies.py hold one run's exact results and
    its times in two tests (conftest ``shared_run``): the run is made once for both, and a
    rerun of the timing test makes a new one, never judging the run that failed again."""
    result = _conftest_run(pytester, monkeypatch, """
import pytest

made = []

def make():
    made.append(1)
    return len(made)

def test_exact(shared_run):
    assert shared_run("k", make) == 1

@pytest.mark.timing
@pytest.mark.flaky(reruns=1, reruns_delay=0)
def test_timed(shared_run, request):
    assert shared_run("k", make, request) == 2     # run 1 is shared; its rerun makes run 2
""")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 2 and outcomes.get("rerun") == 1, outcomes
