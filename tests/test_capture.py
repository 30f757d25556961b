"""Captures and the Nezha dissector: the split measured from the pcap files agrees with Nezha's
own per-rail counters and with the kernel's interface counters."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nezha import wire
from testbed.model import spec
from testbed.run.capture import Capture
from testbed.pcap.dissect import Nezha, Reassembler, Segment, frame
from testbed.fabric import Fabric
from testbed.pcap.report import analyse, format_report

REPO = Path(__file__).resolve().parent.parent

# Fallback rank when nezha/worker.py is absent: NEZHA_* from the environment, ITERS allreduces of
# SIZE bytes of float64 with exactly representable values; one JSON line per iteration with the
# check and Nezha's cumulative per-rail counters.
RANK = r"""
import json, sys, numpy as np
from nezha.context import Context
size, iters = int(sys.argv[1]), int(sys.argv[2])
ctx = Context()
n = size // 8
for i in range(iters):
    a = np.arange(n, dtype=np.float64) + ctx.rank * 1000 + i
    ctx.allreduce(a)
    exp = sum(np.arange(n, dtype=np.float64) + r * 1000 + i for r in range(ctx.world_size))
    st = ctx.stats()
    print(json.dumps({"iter": i, "ok": bool(np.array_equal(a, exp)), "rail_bytes": ctx.rail_bytes(),
                      "rails": st["rails"], "shares": st["shares"]}), flush=True)
ctx.close()
"""


def rank_env(fab, host: str, rank: int, world: int, port: int, events: Path) -> dict:
    topo = fab.topo
    env = dict(os.environ)
    env.update({"NEZHA_RANK": str(rank), "NEZHA_WORLD_SIZE": str(world),
                "NEZHA_MASTER_ADDR": topo.address(topo.hosts[0], topo.rails[0].name),
                "NEZHA_MASTER_PORT": str(port),
                "NEZHA_RAILS": ",".join(topo.address(host, r.name) for r in topo.rails),
                "NEZHA_EVENT_LOG": str(events), "NEZHA_SYSTEM": "nezha", "NEZHA_TIMEOUT": "30",
                "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    return env


def run_allreduce(fab, out: Path, size: int, iters: int, port: int = 29611) -> list[dict]:
    """Launch one rank per host like testbed/run/workload.py (``python -m nezha.worker`` with NEZHA_*
    in the environment, inside the host via Host.popen); returns each rank's summary record
    (``rail_bytes``: bytes Nezha sent per rail index) after checking every iteration is exact."""
    worker = (REPO / "nezha" / "worker.py").exists()
    procs = []
    for rank, h in enumerate(fab.topo.hosts):
        env = rank_env(fab, h, rank, len(fab.topo.hosts), port, out / f"{h}.events.jsonl")
        res = out / f"{h}.results.jsonl"
        env["NEZHA_RESULTS"] = str(res)
        argv = [sys.executable, "-m", "nezha.worker", "--size", str(size), "--iterations",
                str(iters), "--dtype", "float64"] if worker else \
            [sys.executable, "-c", RANK, str(size), str(iters)]
        procs.append((res, fab.hosts[h].popen(argv, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, cwd=REPO)))
    summaries = []
    for res, p in procs:
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0, e[-2000:]
        lines = o.splitlines() if not worker else res.read_text().splitlines()
        recs = [json.loads(l) for l in lines if l.startswith("{")]
        iters_ = [r for r in recs if "iter" in r]
        assert len(iters_) == iters and all(r["ok"] for r in iters_), "allreduce result wrong"
        summary = [r for r in recs if r.get("summary")]
        summaries.append(summary[-1] if summary else iters_[-1])   # inline rank: cumulative
    return summaries


# ------------------------------------------------------------------ the layer, offline
def test_layer_matches_nezha_wire():
    fields = dict(type=wire.DATA, kind=wire.K_ALLREDUCE, dtype=2, redop=1, rail=1, src=3, aux=0,
                  op_id=7, step=2, chunk=5, offset=4096, length=100, msg_total=8192, op_total=16384)
    ours = bytes(Nezha(**fields))
    assert ours == wire.pack(**fields)
    h = wire.unpack(ours)        # nezha accepts what the layer builds
    assert (h.op_id, h.step, h.chunk, h.offset) == (7, 2, 5, 4096)
    p = Nezha(frame(b"x" * 10, type=wire.DATA, msg_total=10))
    assert p.length == 10 and p.crc_ok() and bytes(p.payload) == b"x" * 10
    assert not Nezha(frame(crc=1)).crc_ok()
    assert "DATA" in p.summary()


def test_reassembler_spans_segments_and_counts_retransmits():
    stream = b"".join(frame(bytes(1000), type=wire.DATA, op_id=1, chunk=i, offset=i * 1000,
                            msg_total=3000) for i in range(3))
    flow = ("10.0.0.1", 1000, "10.0.0.2", 2000)
    ra = Reassembler("r0")
    out = ra.feed(Segment(0, flow, 99, 0x02, b"", 60))           # SYN: isn 100
    segs = [(0, 700), (700, 1500), (1500, 2400), (2400, len(stream))]
    order = [0, 2, 1, 1, 3]                                       # out of order and a repeat
    for i in order:
        a, b = segs[i]
        out += ra.feed(Segment(i, flow, 100 + a, 0x18, stream[a:b], b - a + 54))
    assert [f.header.chunk for f in out] == [0, 1, 2]
    assert [f.header.offset for f in out] == [0, 1000, 2000]
    st = ra.flows[flow]
    assert st.retrans_segments == 1 and st.retrans_bytes == 800 and st.error is None


# ------------------------------------------------------------------ on a real fabric
@pytest.mark.netns
def test_split_from_pcap_matches_nezha_and_kernel(tmp_path):
    topo = spec.loads("name: cap\nhosts: 2\nrails: [{name: r0, bandwidth: 200mbit}, "
                      "{name: r1, bandwidth: 100mbit}]\n")
    with Fabric(topo) as fab:
        before = {name: l.counters() for name, l in fab.links.items()}
        cap_dir = tmp_path / "captures"
        with Capture(fab, cap_dir, max_mb=200) as cap:
            results = run_allreduce(fab, tmp_path, size=8 << 20, iters=4)
        after = {name: l.counters() for name, l in fab.links.items()}
    manifest = cap.manifest
    assert sorted(f["file"] for f in manifest["files"]) == \
        ["h1.r0.pcap", "h1.r1.pcap", "h2.r0.pcap", "h2.r1.pcap"]
    assert not any(f.get("truncated") or f.get("kernel_dropped") for f in manifest["files"])

    rep = analyse(tmp_path)
    print(format_report(rep))
    # 1. Nezha's own counters: bytes sent per rail, summed over ranks == DATA bytes on the wire
    nezha_rail = {r: sum(rank["rail_bytes"][str(i)] for rank in results)
                  for i, r in enumerate(("r0", "r1"))}
    for r in ("r0", "r1"):
        assert rep["rails"][r]["data_bytes"] == pytest.approx(nezha_rail[r], rel=0.02), r
    nz_total = sum(nezha_rail.values())
    for r in ("r0", "r1"):
        assert rep["split"][r] == pytest.approx(nezha_rail[r] / nz_total, abs=0.02)
    # per host too: what each rank says it sent is what left its host
    for i, h in enumerate(("h1", "h2")):
        for j, r in enumerate(("r0", "r1")):
            assert rep["sent_by_host"][h].get(r, 0) == pytest.approx(
                results[i]["rail_bytes"][str(j)], rel=0.02)
    # 2. the kernel: bytes leaving each host's rail interface == captured outgoing wire bytes
    kern = {r: sum(after[f"{h}.{r}"]["tx_bytes"] - before[f"{h}.{r}"]["tx_bytes"]
                   for h in ("h1", "h2")) for r in ("r0", "r1")}
    for r in ("r0", "r1"):
        assert rep["rails"][r]["wire_bytes"] == pytest.approx(kern[r], rel=0.02), \
            f"{r}: pcap {rep['rails'][r]['wire_bytes']} kernel {kern[r]}"
    kt = sum(kern.values())
    for r in ("r0", "r1"):
        assert rep["split"][r] == pytest.approx(kern[r] / kt, abs=0.02)
    # both rails carried data, nothing rerouted (hedge copies of a late share, e.g. while the
    # split is still equal, are counted apart and always name the other rail's share)
    assert all(rep["rails"][r]["chunks"] > 0 for r in ("r0", "r1"))
    assert rep["rerouted"] == []
    for hc in rep["hedged"]:
        assert hc["copies_on"] and set(hc["copies_on"]).isdisjoint(hc["rails"]), hc
    assert any(o["kind"] == "allreduce" for o in rep["operations"].values())


@pytest.mark.netns
def test_size_cap_and_cli_verb(tmp_path):
    topo = spec.loads("name: capcap\nhosts: 2\nrails: [{name: r0}]\n")
    with Fabric(topo) as fab:
        with Capture(fab, tmp_path / "captures", max_mb=0.2) as cap:
            run_allreduce(fab, tmp_path, size=2 << 20, iters=1, port=29612)
    sizes = [(tmp_path / "captures" / f["file"]).stat().st_size for f in cap.manifest["files"]]
    assert all(s <= 200_000 for s in sizes)
    assert any(f["truncated"] for f in cap.manifest["files"])
    r = subprocess.run([sys.executable, "-m", "testbed", "pcap", str(tmp_path), "--json"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["rails"]["r0"]["frames"] > 0
    r = subprocess.run([sys.executable, "-m", "testbed", "pcap", str(tmp_path)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and "truncated=True" in r.stdout, r.stdout + r.stderr


@pytest.mark.netns
def test_pcap_shows_aggregation_bytes_on_the_aggregation_rail(tmp_path, no_leftovers):
    """topologies/aggregation.yaml, shortened (2 hosts, 3 allreduces of 1 MiB), captured: r1
    carries only aggregation frames (contributions up, results down, a handshake per rank),
    r0 only Nezha frames and other TCP (the rendezvous store)."""
    import yaml

    from testbed.run.runner import run_topology
    doc = yaml.safe_load((REPO / "topologies" / "aggregation.yaml").read_text())
    doc.pop("expect", None)
    doc.update(name="aggcap", hosts=2, capture={"max_mb": 32},
               workload={"kind": "allreduce", "size": "1MiB", "iterations": 3})
    out = run_topology(spec.loads(yaml.safe_dump(doc)), tmp_path / "run", say=lambda m: None)
    assert out.metrics["wrong_results"] == 0, out.metrics.notes
    rep = analyse(tmp_path / "run")
    print(format_report(rep))
    r0, r1 = rep["rails"]["r0"]["protocols"], rep["rails"]["r1"]["protocols"]
    assert set(r1) == {"aggregation"} and "aggregation" not in r0
    assert r0["nezha"]["frame_bytes"] > 0 and rep["rails"]["r0"]["data_bytes"] > 0
    agg = r1["aggregation"]
    assert agg["malformed"] == 0 and not rep["rails"]["r1"]["unparsed_flows"]
    types = agg["types"]
    assert types["CONTRIB"]["bytes"] > 100_000 and types["handshake"]["frames"] >= 2 * 4
    # each rank sends its share up and gets the reduced share back: as many bytes each way
    assert types["RESULT"]["bytes"] == types["CONTRIB"]["bytes"]
    assert types["ERROR"]["frames"] == 0
    assert rep["rails"]["r1"]["wire_bytes"] == agg["wire_bytes"] > types["CONTRIB"]["bytes"] * 2
