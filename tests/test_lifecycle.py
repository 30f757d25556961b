"""Lifecycle through the CLI as a user types it: up / status / exec / down, Ctrl-C during up,
SIGKILL then clean. Afterwards nothing of ours remains and the root namespace is untouched."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.kernel import netns
from testbed.fabric import state

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parent.parent


def tb(*args, check=True, timeout=120) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "testbed", *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"testbed {' '.join(args)} exited {r.returncode}: {r.stderr}")
    return r


def ours(run_ids=None) -> list[str]:
    """Our run namespaces (of the given runs only, when named)."""
    out = []
    for n in netns.listing():
        m = state.RUN_NS_RE.match(n)
        if m and (run_ids is None or m.group(1) in run_ids):
            out.append(n)
    return out


def state_ids() -> set[str]:
    return {p.stem for p in state.STATE_DIR.glob("*.json")} if state.STATE_DIR.is_dir() else set()


def topology_file(tmp_path: Path, name: str, hosts: int, rails: str) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"name: {name}\nhosts: {hosts}\nrails: [{rails}]\n")
    return p


@pytest.fixture
def small(tmp_path) -> Path:
    return topology_file(tmp_path, "small", 2, "{name: r0, bandwidth: 100mbit}, "
                         "{name: r1, bandwidth: 50mbit, loss: 1%}")


@pytest.fixture
def big(tmp_path) -> Path:
    """A fabric whose build takes long enough to be interrupted in the middle: 64 x 4 (24 x 3
    builds in 0.3 s since the build stopped forking, and was up before the signal landed)."""
    return topology_file(tmp_path, "big", 64, ", ".join(
        f"{{name: r{k}, bandwidth: 100mbit}}" for k in range(4)))


def run_id_of(up_output: str) -> str:
    m = re.search(r"run id ([0-9a-f]{4})", up_output)
    assert m, up_output
    return m.group(1)


def test_up_status_exec_down(small, no_leftovers):
    r = tb("up", str(small))
    assert "is up" in r.stdout
    first = run_id_of(r.stdout)
    st = tb("status", first)
    assert "h1.r1" in st.stdout and "50mbit" in st.stdout and "loss 1%" in st.stdout
    ex = tb("exec", "h1", "--run", first, "--", "ip", "-o", "-4", "addr", "show", "dev", "r1")
    assert "198.18.1.1/24" in ex.stdout
    ping = tb("exec", "h1", "--run", first, "--", "ping", "-c", "1", "-W", "2", "198.18.0.2")
    assert ping.returncode == 0
    second = run_id_of(tb("up", str(small)).stdout)   # a second fabric of the same file coexists
    amb = tb("down", "small", check=False)
    assert amb.returncode == 1 and "several fabrics" in amb.stderr
    tb("down", first)
    tb("down", second)
    assert not ours({first, second})
    status = tb("status").stdout
    assert first not in status and second not in status


def _wait_for_build_start(proc, before: set, timeout=20.0) -> set:
    """Wait until the new run has a few namespaces; returns its run id(s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = state_ids() - before
        if new and len(ours(new)) >= 3:
            return new
        if proc.poll() is not None:
            raise AssertionError(f"up ended early: {proc.stderr.read()}")
        time.sleep(0.005)
    raise AssertionError("the build never started")


def test_ctrl_c_during_up_removes_everything(big, no_leftovers):
    before = state_ids()
    proc = subprocess.Popen([sys.executable, "-m", "testbed", "up", str(big)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    new = _wait_for_build_start(proc, before)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not ours(new)
    assert not (state_ids() & new)            # no stale run-state file either


def test_sigkill_during_up_then_clean(big, no_leftovers):
    before = state_ids()
    proc = subprocess.Popen([sys.executable, "-m", "testbed", "up", str(big)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    new = _wait_for_build_start(proc, before)
    proc.kill()
    proc.wait()
    left = ours(new)
    assert left, "a SIGKILLed build should leave prefixed namespaces for clean to find"
    r = tb("clean")
    assert "removed" in r.stdout and left[0] in r.stdout
    assert not ours(new)
    assert not (state_ids() & new)


def test_validate_refuses_bad_file_and_builds_nothing(tmp_path, no_leftovers):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts: 2\nrails: [{name: r0, bandwidth: 100mbit}]\nlinks: {h9.r0: {}}\n")
    before = state_ids()
    for verb in ("validate", "up", "run"):
        r = tb(verb, str(bad), check=False)
        assert r.returncode == 2, (verb, r.stderr)
        assert "links.h9.r0" in r.stderr
    assert not ours(state_ids() - before)


def test_doctor_reports_features(no_leftovers):
    r = tb("doctor", check=False)
    for feature in ("netns", "veth", "bridge", "htb", "tbf", "netem", "nftables", "mptcp",
                    "iperf3", "mnexec"):
        assert feature in r.stdout
    assert "loss is emulated with" in r.stdout
    assert r.returncode == 0
