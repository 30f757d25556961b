"""The README is a manual whose commands and examples run as written."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    """The README's fenced code blocks of one language ("" for blocks without one)."""
    out, current, fence_lang = [], None, None
    for line in README.splitlines():
        if line.startswith("```"):
            if current is None:
                current, fence_lang = [], line[3:].strip()
            else:
                if fence_lang == lang:
                    out.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return out


def test_quick_start_commands_and_ci_agree():
    quick = blocks("sh")[0]
    assert "sudo ./tb run" in quick and "sudo ./tb test" in quick
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec \./tb test\s*$", ci, flags=re.M), ci   # the README's command
    assert "/install.sh" in (ROOT / "tb").read_text()
    assert "./install.sh" in (ROOT / "Vagrantfile").read_text()


def test_vagrantfile_is_valid_ruby():
    ruby = subprocess.run(["sh", "-c", "command -v ruby"], capture_output=True, text=True)
    if ruby.returncode != 0:
        pytest.skip("ruby is not installed here: the Vagrantfile syntax check needs it "
                    "(.ci/run installs it)")
    r = subprocess.run(["ruby", "-c", str(ROOT / "Vagrantfile")], capture_output=True, text=True)
    assert r.returncode == 0 and "Syntax OK" in r.stdout, r.stderr


def _tb(line: str) -> subprocess.CompletedProcess:
    argv = line.split("#")[0].split()
    assert argv[:2] == ["sudo", "./tb"], line
    return subprocess.run([sys.executable, "-m", "testbed", *argv[2:]], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


@pytest.mark.netns
def test_cli_walkthrough_runs_as_written(no_leftovers):
    block = next(b for b in blocks("sh") if "./tb up topologies/dual-rail.yaml" in b)
    lines = [l for l in block.splitlines() if l.strip()]
    try:
        for line in lines:
            r = _tb(line)
            assert r.returncode == 0, (line, r.stdout, r.stderr)
            if " exec " in line:
                assert "1 received" in r.stdout
            if " status " in line:
                assert "h2.r1" in r.stdout and "200mbit" in r.stdout
    finally:
        subprocess.run([sys.executable, "-m", "testbed", "down", "dual-rail"], cwd=ROOT,
                       capture_output=True)


def test_validation_messages_are_the_documented_ones(tmp_path):
    block = next(b for b in blocks("") if "validate bad.yaml" in b)
    documented = [l for l in block.splitlines() if l.startswith("error: rails[1].bandwidth")][0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts: 2\nrails: [{name: r0, bandwidth: 1mbit}, {name: r1, bandwidth: 100mbps}]\n")
    r = subprocess.run([sys.executable, "-m", "testbed", "validate", str(bad)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == documented


@pytest.mark.netns
def test_python_api_example_runs(no_leftovers):
    code = next(b for b in blocks("python") if "from testbed.runner import run_topology" in b)
    code = code.replace("rail-outage.yaml", "dual-rail.yaml")   # same API, quicker scenario
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].split()[0] in ("True", "False")


@pytest.mark.netns
def test_plugin_example_runs_as_a_user_file(pytester):
    code = next(b for b in blocks("python") if "def test_allreduce_survives" in b)
    pytester.makepyfile(test_readme_example=code)
    result = pytester.runpytest_subprocess("-p", "nezha_testbed", timeout=600)
    result.assert_outcomes(passed=1)


def test_public_import_paths_keep_working():
    """The paths users and the README import from survive any move inside the packages."""
    code = ("from testbed import load, loads, Topology, SpecError\n"
            "from testbed.fabric import Fabric, Host, Intf, Link, Rail\n"
            "from testbed.runner import run_topology, run_file, RunOutcome\n"
            "from testbed.run.runner import run_topology as inner\n"
            "from nezha import Context, Config, SYSTEMS, NezhaError\n"
            "assert run_topology is inner\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
