"""The interactive shell: its verbs act on the fabric through the handles (checked in the kernel),
and `python -m testbed shell FILE` tears everything down however the session ends."""
from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.run import probes
from testbed.model import spec
from testbed.fabric import Fabric
from testbed.shell import FabricShell, run_shell

pytestmark = pytest.mark.netns
REPO = Path(__file__).resolve().parent.parent


TOPO = "name: shelltest\nhosts: 3\nrails: [{name: r0, bandwidth: 200mbit}, {name: r1, bandwidth: 100mbit}]\n"


@pytest.fixture(scope="module")
def fab():
    with Fabric(spec.loads(TOPO)) as f:
        yield f


def drive(fab, *lines) -> str:
    out = io.StringIO()
    sh = FabricShell(fab, stdin=io.StringIO(), stdout=out)
    for line in lines:
        sh.onecmd(sh.precmd(line))
    return out.getvalue()


def test_host_command_runs_inside_the_host(fab):
    out = drive(fab, "h1 ip -4 -o addr show r1")
    assert fab.topo.address("h1", "r1") in out
    out = drive(fab, "h1 ping -c1 -W1 h2.r1")   # h2.r1 -> h2's address on r1
    assert "1 received" in out and fab.topo.address("h2", "r1") in out


def test_listing_verbs(fab):
    out = drive(fab, "hosts", "rails", "links", "counters h1.r0")
    for h in ("h1", "h2", "h3"):
        assert fab.hosts[h].ns in out
    assert "198.18.1.0/24" in out and "3/3 links up" in out
    assert re.search(r"h2\.r1\s+198\.18\.1\.2/24\s+up/up\s+100mbit", out), out
    assert re.search(r"h1\.r0\s+\d+\s+\d+", out)


def test_down_cuts_the_link_and_up_restores(fab):
    out = drive(fab, "down h2.r1")
    try:
        assert "h2.r1" in out and "down" in out, out
        link = fab.links["h2.r1"]
        assert not link.host_end.is_up() and not link.peer_end.is_up()
        assert not probes.reachable(fab, "h1", "h2", "r1")
        assert probes.reachable(fab, "h1", "h2", "r0")
        assert "1 received" not in drive(fab, "h1 ping -c1 -W1 h2.r1")
    finally:
        drive(fab, "up h2.r1")
    assert fab.links["h2.r1"].host_end.is_up()
    deadline = time.monotonic() + 5
    while not probes.reachable(fab, "h1", "h2", "r1") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert probes.reachable(fab, "h1", "h2", "r1")
    drive(fab, "down h3.r0 switch")
    assert fab.links["h3.r0"].host_end.is_up() and not fab.links["h3.r0"].peer_end.is_up()
    drive(fab, "restore h3.r0")
    assert fab.links["h3.r0"].peer_end.is_up()


def test_rate_loss_blackhole_restore_read_back(fab):
    out = drive(fab, "rate r0 50mbit")
    for h in ("h1", "h2", "h3"):
        link = fab.links[f"{h}.r0"]
        assert link.up_shaper.read_back().rate_bps == pytest.approx(50e6, rel=0.01)
        assert link.down_shaper.read_back().rate_bps == pytest.approx(50e6, rel=0.01)
    assert "50mbit" in out
    drive(fab, "loss h2.r1 5%")
    assert fab.links["h2.r1"].up_shaper.read_back().loss == pytest.approx(0.05, abs=1e-3)
    drive(fab, "blackhole h2.r1")
    assert fab.links["h2.r1"].up_shaper.read_back().loss == pytest.approx(1.0)
    assert not probes.reachable(fab, "h1", "h2", "r1")
    drive(fab, "restore r0", "restore h2")
    assert fab.links["h1.r0"].up_shaper.read_back().rate_bps == pytest.approx(200e6, rel=0.01)
    assert fab.links["h2.r1"].up_shaper.read_back().loss == 0
    assert probes.reachable(fab, "h1", "h2", "r1")


def test_errors_are_reported_not_raised(fab):
    out = drive(fab, "down nosuch", "rate r0 fast", "h9 true", "loss r0", "bogus")
    assert out.count("error:") == 5, out
    assert "no such target 'nosuch'" in out


def test_scripted_session_tears_down(no_leftovers):
    """run_shell with a script on stdin: commands run, end of input leaves, nothing remains."""
    out = io.StringIO()
    script = io.StringIO("h1 ping -c1 -W1 h2.r0\nrate h1.r0 30mbit\nlinks h1.r0\n")
    code = run_shell(spec.loads("hosts: 2\nrails: [{name: r0, bandwidth: 100mbit}]\n"),
                     stdin=script, stdout=out)
    assert code == 0
    text = out.getvalue()
    assert "1 received" in text and "30mbit" in text


def test_cli_shell_subprocess(no_leftovers, tmp_path):
    topo = tmp_path / "t.yaml"
    topo.write_text("name: shellsub\nhosts: 2\nrails: [{name: r0}, {name: r1}]\n")
    cmds = "hosts\nh1 ping -c1 -W1 h2.r1\ndown r1\nh1 ping -c1 -W1 h2.r1\nexit\n"
    r = subprocess.run([sys.executable, "-m", "testbed", "shell", str(topo)], input=cmds,
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("1 received") == 1, r.stdout
    assert "0 received" in r.stdout or "unreachable" in r.stdout, r.stdout
    assert "torn down" in r.stderr


def test_cli_shell_sigterm_tears_down(no_leftovers, tmp_path):
    topo = tmp_path / "t.yaml"
    topo.write_text("name: shellterm\nhosts: 2\nrails: [{name: r0}]\n")
    p = subprocess.Popen([sys.executable, "-m", "testbed", "shell", str(topo)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=REPO)
    p.stdin.write("hosts\n")
    p.stdin.flush()
    line = ""
    deadline = time.monotonic() + 30
    while "h1" not in line and time.monotonic() < deadline:
        line = p.stdout.readline()
    assert "h1" in line
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode != 0 and "torn down" in err


def test_cli_shell_mininet_backend(no_leftovers, tmp_path):
    topo = tmp_path / "t.yaml"
    topo.write_text("name: shellmn\nhosts: 2\nrails: [{name: r0}, {name: r1}]\n")
    cmds = "h1 ping -c1 -W1 198.18.1.2\nnodes\nexit\n"
    r = subprocess.run([sys.executable, "-m", "testbed", "shell", "--backend", "mininet",
                        str(topo)], input=cmds, capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr
    both = r.stdout + r.stderr    # Mininet's CLI prints through its logger (stderr)
    assert "1 received" in both and "sw-r0" in both, both
    assert "torn down" in r.stderr
