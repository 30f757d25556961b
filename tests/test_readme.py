"""The README is a manual whose commands and examples run as written."""
from __future__ import annotations

import json
import os
import re
import shutil
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


def test_vagrantfile_passes_vagrant_validate():
    if shutil.which("vagrant") is None:
        pytest.skip("vagrant is not installed here (a Linux machine needs no VM, and this one "
                    "has no hypervisor for one), so `vagrant validate` cannot run; "
                    "test_vagrantfile_is_valid_ruby (ruby -c) and "
                    "test_vm_keeps_its_environment_outside_the_synced_folder (the Vagrantfile "
                    "evaluated by ruby against a recording stand-in for Vagrant.configure) "
                    "check it instead")
    env = dict(os.environ, VAGRANT_CWD=str(ROOT))
    # provider plugins (libvirt, vmware) need not be installed to validate the rest
    r = subprocess.run(["vagrant", "validate", "--ignore-provider"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ignore-provider" in r.stdout + r.stderr:   # before Vagrant 2.2
        r = subprocess.run(["vagrant", "validate"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


# Evaluates the Vagrantfile as Vagrant would, recording what it configures.
_VAGRANT_STAND_IN = r"""
require "json"
$seen = {"synced_folders" => [], "provisioners" => []}
class Recorder
  def synced_folder(src, dst, **opts)
    $seen["synced_folders"] << [src, dst]
  end
  def provision(kind, **opts)
    $seen["provisioners"] << opts.merge(:kind => kind)
  end
  def method_missing(name, *args)
    yield Recorder.new if block_given?
    Recorder.new
  end
  def respond_to_missing?(*)
    true
  end
end
module Vagrant
  def self.configure(version)
    yield Recorder.new
  end
end
load ARGV[0]
puts JSON.generate($seen)
"""


def test_vm_keeps_its_environment_outside_the_synced_folder(tmp_path):
    """VirtualBox shared folders refuse the symlinks a venv is made of: the VM's provisioner
    gives install.sh a NEZHA_VENV outside /nezha, and keeps it for later logins and sudo."""
    if shutil.which("ruby") is None:
        pytest.skip("ruby is not installed here: evaluating the Vagrantfile needs it "
                    "(install.sh installs it)")
    stand_in = tmp_path / "stand_in.rb"
    stand_in.write_text(_VAGRANT_STAND_IN)
    r = subprocess.run(["ruby", str(stand_in), str(ROOT / "Vagrantfile")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    [(_, synced)] = [f for f in seen["synced_folders"] if f[0] == "."]
    [shell] = [p for p in seen["provisioners"]
               if p["kind"] == "shell" and "./install.sh" in p.get("inline", "")]
    venv = shell.get("env", {}).get("NEZHA_VENV", "")
    assert venv.startswith("/") and not (venv + "/").startswith(synced.rstrip("/") + "/"), \
        f"the provisioner's NEZHA_VENV {venv!r} must be an absolute path outside {synced}"
    script = shell["inline"]
    # later sessions find it too: every login (/etc/environment) and sudo (env_keep)
    assert re.search(rf"NEZHA_VENV={re.escape(venv)}.*>>\s*/etc/environment", script), script
    assert re.search(r"env_keep\s*\+=\s*\"NEZHA_VENV\"", script), script
    assert script.index("/etc/environment") < script.index("./install.sh")


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def test_install_and_tb_put_the_environment_where_NEZHA_VENV_says(tmp_path):
    """install.sh makes the environment in $NEZHA_VENV (not .venv in the checkout), and ./tb
    runs it from there: a copy of both scripts, with stand-ins for apt, dpkg and python."""
    repo, stubs, venv = tmp_path / "checkout", tmp_path / "stubs", tmp_path / "vm" / "venv"
    repo.mkdir()
    stubs.mkdir()
    for name in ("tb", "install.sh", "pyproject.toml"):
        shutil.copy2(ROOT / name, repo / name)
    calls = tmp_path / "calls.log"
    _stub(stubs, "id", "echo 0")                                   # install.sh's root check
    _stub(stubs, "dpkg-query", "echo 'install ok installed'")      # every package present
    _stub(stubs, "apt-get", "echo 'apt-get must not run' >&2; exit 1")
    _stub(stubs, "modprobe", "exit 0")
    # `python3 -m venv DIR` makes DIR/bin/python: a stand-in that logs how it is called
    _stub(stubs, "fake-python3", '[ "$1 $2" = "-m venv" ] || exit 9\nmkdir -p "$3/bin"\n'
          f'printf \'#!/bin/sh\\necho "$0 $*" >> {calls}\\n\' > "$3/bin/python"\n'
          'chmod +x "$3/bin/python"')
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}",
               PYTHON=str(stubs / "fake-python3"), NEZHA_VENV=str(venv))
    r = subprocess.run([str(repo / "tb"), "doctor", "--json"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    py = venv / "bin" / "python"
    assert not (repo / ".venv").exists(), "install.sh made .venv in the checkout"
    assert calls.read_text().splitlines() == [f"{py} -m pip install -q --upgrade pip",
                                              f"{py} -m pip install -q -e .",
                                              f"{py} -m testbed doctor --json"]
    assert (venv / ".installed").is_file()
    # installed once: the next ./tb goes straight to it
    r = subprocess.run([str(repo / "tb"), "test", "-x"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert calls.read_text().splitlines()[3:] == [f"{py} -m pytest -x"]
    # and `python3 -m testbed` with a bare python re-runs itself there too (the VM's sudo)
    r = subprocess.run([str(_bare_python(tmp_path)), "-m", "testbed", "status"], cwd=ROOT,
                       env=_env_without_reexec(NEZHA_VENV=str(venv)), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert calls.read_text().splitlines()[4:] == [f"{py} -m testbed status"]


def _bare_python(tmp_path: Path) -> Path:
    """An interpreter like a fresh machine's python3: the standard library, none of our
    packages (a venv of this one's base, without its site-packages)."""
    bare = tmp_path / "bare-python"
    if not bare.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True,
                       capture_output=True, timeout=120)
    py = bare / "bin" / "python"
    assert subprocess.run([str(py), "-c", "import pyroute2"], capture_output=True).returncode
    return py


def _env_without_reexec(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NEZHA_TESTBED_REEXEC", "NEZHA_VENV")}
    env.update(extra)
    return env


def test_system_python3_runs_the_testbed_from_the_repository_root(tmp_path):
    """`sudo python3 -m testbed ...` with a python that lacks our packages runs the command in
    the project's environment: same output, same exit status; never twice; and where it cannot,
    one line says what to run."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("the suite runs outside a virtual environment (./tb test runs it in one): "
                    "there is no project environment to re-run in")
    py = _bare_python(tmp_path)
    env = _env_without_reexec(NEZHA_VENV=sys.prefix)     # the environment running this test

    def testbed(*args, python=py, cwd=ROOT, env=env):
        return subprocess.run([str(python), "-m", "testbed", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=120)

    direct = testbed("validate", "topologies/default.yaml", python=sys.executable)
    r = testbed("validate", "topologies/default.yaml")
    assert (r.returncode, r.stdout, r.stderr) == (0, direct.stdout, ""), r.stderr
    # the exit status is the command's own (2: bad input), with its own message only
    block = next(b for b in blocks("") if "validate bad.yaml" in b)
    documented = [l for l in block.splitlines() if l.startswith("error: rails[1].bandwidth")][0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts: 2\nrails: [{name: r0, bandwidth: 1mbit}, "
                   "{name: r1, bandwidth: 100mbps}]\n")
    r = testbed("validate", str(bad))
    assert (r.returncode, r.stderr.strip()) == (2, documented)
    # re-executed and still lacking a package: one line, no second re-execution
    r = testbed("validate", "topologies/default.yaml", env=dict(env, NEZHA_TESTBED_REEXEC="1"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "install.sh --force" in r.stderr
    # a copy of the package with no install.sh and no environment next to it: what to run
    alone = tmp_path / "alone"
    shutil.copytree(ROOT / "testbed", alone / "testbed",
                    ignore=shutil.ignore_patterns("__pycache__"))
    r = testbed("validate", str(ROOT / "topologies/default.yaml"), cwd=alone,
                env=_env_without_reexec())
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "pip install" in r.stderr, r.stderr
    assert not (alone / ".venv").exists()
    # the project's own python never loads the fallback
    r = subprocess.run([sys.executable, "-c",
                        "import sys, testbed.cli; assert 'testbed._bootstrap' not in sys.modules"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


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
    out = r.stdout.strip().splitlines()
    # the ping over h2's r1 succeeded (returncode 0, as subprocess.run prints it) ...
    assert out[0].startswith("0 PING"), r.stdout
    # ... and the run gives the verdict the README promises for a shipped topology: passed (the
    # README's own topologies are expected to pass: test_topologies). dual-rail has no fault,
    # so there is no failover time to print.
    assert out[-1] == "True None", r.stdout


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
