"""Aggregation rails in the topology and the fabric: the spec's checks, the service started in
the rail's switch namespace and read back, ranks in the hosts reducing through it, and nothing
left behind by a teardown, a failed build or a SIGKILLed run."""
from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from nezha import aggwire
from testbed.aggregation import control
from testbed.errors import FabricError, SpecError
from testbed.fabric import Fabric, state
from testbed.kernel import netns
from testbed.model import spec

REPO = Path(__file__).resolve().parents[1]
AGG = """
name: aggtest
hosts: 3
rails:
  - {name: r0, bandwidth: 200mbit}
  - {name: r1, bandwidth: 200mbit, protocol: aggregation, aggregation_rate: 1gbit}
"""


# ------------------------------------------------------------------------ the spec
def test_nezhas_rail_numbers_name_its_tcp_rails_whatever_the_file_order():
    """Nezha numbers the rails it is given (the TCP ones, NEZHA_RAILS); with the aggregation
    rail listed first its rail 1 is r2, and the analysis must say so (it said r1)."""
    from testbed.analysis.timeline import Timeline
    topo = spec.loads("""
        name: aggfirst
        hosts: 3
        rails:
          - {name: r0, bandwidth: 100mbit, protocol: aggregation}
          - {name: r1, bandwidth: 100mbit}
          - {name: r2, bandwidth: 100mbit}
        """)
    assert topo.rail_order == ["r1", "r2", "r0"]
    assert spec.loads(AGG).rail_order == ["r0", "r1"]          # TCP first already: unchanged
    events = [{"t": 1.0, "event": "rail_down", "rank": 1, "peer": 0, "rail": 1},
              {"t": 2.0, "event": "agg_down", "rank": 0, "rail": "r0"}]
    rows = Timeline.merge(samples=None, faults=[], events=events, iterations=[], t0=0.0,
                          rails=topo.rail_order).records
    assert [r.get("rail_name") for r in rows if r.get("event")] == ["r2", "r0"]


def test_aggregation_rail_resolves_its_switch_address():
    topo = spec.loads(AGG)
    r0, r1 = topo.rails
    assert (r0.protocol, r0.switch_address, r0.aggregation_rate_bps) == ("tcp", None, None)
    assert (r1.protocol, r1.aggregation_rate_bps) == ("aggregation", 1_000_000_000)
    assert r1.switch_address == ipaddress.IPv4Interface("198.18.1.254/24")
    assert all(topo.address(h, "r1") != "198.18.1.254" for h in topo.hosts)
    assert topo.to_dict()["rails"][1]["protocol"] == "aggregation"


@pytest.mark.parametrize("rails,extra,field,accepted", [
    ("[{name: r0, protocol: sharp}]", "", "rails[0].protocol", "one of: tcp, aggregation"),
    ("[{name: r0, aggregation_rate: 1gbit}]", "", "rails[0].aggregation_rate",
     "protocol: aggregation"),
    ("[{name: r0, protocol: aggregation, aggregation_rate: 100}]", "",
     "rails[0].aggregation_rate", "a number followed by"),
    ("[{name: r0}, {name: r1, protocol: aggregation}]", "wiring: direct",
     "rails[1].protocol", "wiring: switch"),
    ("[{name: r0, protocol: aggregation}]", "rail_prefix: 30", "rails[0].protocol",
     "shorter rail_prefix"),
])
def test_bad_aggregation_fields_are_named(rails, extra, field, accepted):
    with pytest.raises(SpecError) as e:
        spec.loads(f"hosts: 2\nrails: {rails}\n{extra}\n")
    assert e.value.field == field and accepted in e.value.accepted, str(e.value)


def test_two_hosts_and_a_switch_fit_a_29_two_hosts_alone_a_30():
    spec.loads("hosts: 2\nrail_prefix: 29\nrails: [{name: r0, protocol: aggregation}]\n")
    spec.loads("hosts: 2\nrail_prefix: 30\nrails: [{name: r0}]\n")


# ------------------------------------------------------------------------ the fabric
RANK = textwrap.dedent("""
    import os, sys, numpy as np
    from nezha.config import Config
    from nezha.transport.aggregation import AggregationChannel
    c = Config.from_env()
    (rail, addr, port), = c.aggregators
    ch = AggregationChannel(addr, port, c.rank, c.world_size, c.job_secret, job="fab")
    x = np.arange(1 << 20, dtype=np.float32) * (c.rank + 1)
    y = ch.allreduce(1, x)
    want = np.arange(1 << 20, dtype=np.float32) * (c.world_size * (c.world_size + 1) // 2)
    print(rail, "ok" if np.array_equal(y, want) else "WRONG", flush=True)
""")


def rank_env(fab: Fabric, rank: int) -> dict:
    return dict(os.environ, NEZHA_RANK=str(rank), NEZHA_WORLD_SIZE=str(len(fab.hosts)),
                NEZHA_JOB_SECRET=fab.job_secret, NEZHA_AGGREGATORS=fab.aggregator_env(),
                PYTHONPATH=str(REPO))


@pytest.mark.netns
def test_ranks_in_the_hosts_allreduce_through_the_switch(no_leftovers):
    with Fabric(spec.loads(AGG)) as fab:
        agg = fab.aggregators["r1"]
        sw = fab.state.ns_name("sw-r1")
        assert (agg.ns, agg.endpoint) == (sw, "198.18.1.254:29400")
        assert fab.aggregator_env() == "r1=198.18.1.254:29400"
        assert agg.proc.pid in netns.pids_in(sw)            # in the switch, not the root
        # its connections use the ranks' TCP (the topology's, else cubic), not the host's
        argv = Path(f"/proc/{agg.proc.pid}/cmdline").read_bytes().split(b"\0")
        cc = fab.caps.congestion_control(fab.topo)
        assert cc and argv[argv.index(b"--congestion") + 1].decode() == cc
        recorded = json.loads(fab.state.path.read_text())["objects"]
        assert {"kind": "aggregator", "ns": sw, "rail": "r1", "address": "198.18.1.254",
                "port": 29400, "pid": agg.proc.pid} in recorded
        assert netns.call_in(sw, aggwire.ping, "198.18.1.254", 29400, 1.0) == \
            {"version": 1, "keys": 0, "bytes": 0}
        assert fab.status()["aggregators"] == {"r1": {
            "endpoint": "198.18.1.254:29400", "answers": True, "keys": 0, "bytes": 0}}
        procs = [fab.hosts[h].popen([sys.executable, "-c", RANK], env=rank_env(fab, r),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r, h in enumerate(fab.topo.hosts)]
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert all(o.strip().endswith("r1 ok") for o in outs), outs
        # a stranger in a host (no secret) is refused
        stranger = dict(rank_env(fab, 0), NEZHA_JOB_SECRET="")
        r = fab.hosts["h1"].run([sys.executable, "-c", RANK], env=stranger)
        assert r.returncode != 0 and "secret" in r.stderr, r.stderr[-500:]
        pid = agg.proc.pid
        agg.proc.kill()                                     # the switch dies: status says so
        agg.proc.wait()
        assert fab.aggregator_health()["r1"]["answers"] is False
    assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.netns
@pytest.mark.parametrize("argv,wait,message", [
    (["-c", "import sys; print('boom'); sys.exit(3)"], 30.0, "exited with 3: boom"),
    (["-c", "import time; time.sleep(30)"], 1.0, "does not answer on 198.18.1.254:29400"),
])
def test_a_switch_that_does_not_answer_fails_the_build(monkeypatch, no_leftovers, argv, wait,
                                                       message):
    started = []

    def bogus(rail, ns, address, port, secret, rate, congestion=None):
        log = tempfile.TemporaryFile()
        proc = netns.popen(ns, [sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT)
        started.append(proc)
        return control.Aggregator(rail, ns, address, port, proc, log)
    monkeypatch.setattr(control, "start", bogus)
    monkeypatch.setattr(control, "START_TIMEOUT", wait)
    with pytest.raises(FabricError, match=message):
        Fabric(spec.loads(AGG)).build()
    assert started and all(p.poll() is not None for p in started)


BUILDER = textwrap.dedent("""
    import sys, time
    from testbed.fabric import Fabric
    from testbed.model import spec
    fab = Fabric(spec.loads(sys.stdin.read())).build()
    print(fab.state.run_id, fab.aggregators["r1"].proc.pid, flush=True)
    time.sleep(120)
""")


@pytest.mark.netns
def test_a_sigkilled_run_leaves_a_service_that_its_clean_up_ends(no_leftovers):
    """What `clean` does for a dead run (RunState.remove_all), done to this run only."""
    builder = subprocess.Popen([sys.executable, "-c", BUILDER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=REPO,
                               env=dict(os.environ, PYTHONPATH=str(REPO)))
    builder.stdin.write(AGG)
    builder.stdin.close()
    run_id, pid = builder.stdout.readline().split()
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    run = state.RunState.load(state.STATE_DIR / f"{run_id}.json")
    assert not run.owner_alive
    assert any(o.get("kind") == "aggregator" and o.get("pid") == int(pid) for o in run.objects)
    assert int(pid) in netns.pids_in(run.ns_name("sw-r1"))     # the kill left it running
    removed = run.remove_all()
    assert run.ns_name("sw-r1") in removed
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and not _zombie(int(pid)):
        assert time.monotonic() < deadline, "the service outlived its namespace"
        time.sleep(0.05)
    assert not any(n.startswith(f"{state.PREFIX}{run_id}-") for n in netns.listing())


def test_ranks_get_the_fabrics_secret_and_the_switches(tmp_path):
    from types import SimpleNamespace

    from testbed.run.workload import Phase, WorkloadRunner
    topo = spec.loads(AGG)
    fabric = SimpleNamespace(topo=topo, caps=SimpleNamespace(congestion_control=lambda t: ""),
                             job_secret="f" * 32,
                             aggregator_env=lambda: Fabric.aggregator_env(SimpleNamespace(
                                 topo=topo, aggregation_port=control.PORT)))
    w = SimpleNamespace(hosts=None, system="nezha", kind="command")
    env = WorkloadRunner(fabric, w, tmp_path).env_for(
        "h2", 1, 29500, Phase("command", 0, None, None, "command"), tmp_path / "e",
        tmp_path / "r")
    assert env["NEZHA_JOB_SECRET"] == "f" * 32
    assert env["NEZHA_AGGREGATORS"] == "r1=198.18.1.254:29400"
