"""python -m nezha.worker end to end on loopback (three processes)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from nezha.testing import free_port
from nezha.worker import Pattern, parse_size

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("dtype", ["float16", "int32", "float64"])
def test_pattern_closed_form_matches_numpy(op, dtype):
    world = 5
    p = Pattern(101, dtype, op, world)
    bufs = []
    for r in range(world):
        b = np.empty(101, dtype)
        p.fill(b, r, 3)
        bufs.append(b)
    red = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    res = red.reduce(np.stack(bufs), axis=0).astype(dtype)
    assert p.mismatches(res, 3) == 0
    res[7] += 1
    assert p.mismatches(res, 3) == 1


def test_parse_size():
    assert parse_size("16M") == 16 << 20 and parse_size("4KiB") == 4096 and parse_size(100) == 100


def run_workers(tmp_path, world, extra, env_extra=None):
    port = free_port()
    procs = []
    for r in range(world):
        cmd = [sys.executable, "-m", "nezha.worker", "--rank", str(r), "--world-size", str(world),
               "--rails", "127.0.0.1,127.0.0.2", "--master", f"127.0.0.1:{port}",
               "--results", str(tmp_path / f"res{r}.jsonl"), "--events", str(tmp_path / f"ev{r}.jsonl"),
               "--timeout", "10"] + extra
        env = dict(os.environ, PYTHONPATH=ROOT, **(env_extra or {}))
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        _, err = p.communicate(timeout=60)
        out.append((p.returncode, err))
    return out


def test_worker_iterations(tmp_path):
    out = run_workers(tmp_path, 3, ["--size", "1M", "--iterations", "6", "--dtype", "float16"])
    assert [rc for rc, _ in out] == [0, 0, 0], out
    lines = [json.loads(l) for l in open(tmp_path / "res1.jsonl")]
    iters = [l for l in lines if "iter" in l]
    assert [l["iter"] for l in iters] == list(range(6))
    assert all(l["ok"] and l["mismatches"] == 0 and l["t_end"] > l["t_start"] for l in iters)
    assert sum(sum(l["rail_bytes"].values()) for l in iters) > 6 * (1 << 20) * 2 / 3
    summ = lines[-1]
    assert summ["summary"] and summ["ok"] and summ["iterations"] == 6 and summ["exit_code"] == 0
    events = [json.loads(l) for l in open(tmp_path / "ev0.jsonl")]
    assert events[0]["event"] == "init" and all("t" in e for e in events)


def test_worker_duration_mode_same_count_on_all_ranks(tmp_path):
    out = run_workers(tmp_path, 2, ["--size", "64K", "--duration", "0.5"])
    assert [rc for rc, _ in out] == [0, 0], out
    counts = [json.loads(open(tmp_path / f"res{r}.jsonl").readlines()[-1])["iterations"] for r in range(2)]
    assert counts[0] == counts[1] > 1


def test_worker_warmup_and_at_least_iterations_and_duration(tmp_path):
    """--warmup 2 --iterations 3 --duration 0.5: two marked warm-up iterations first, then at
    least 3 measured ones and at least 0.5 s of them (a 4 KiB allreduce: many more than 3)."""
    out = run_workers(tmp_path, 2, ["--size", "4K", "--warmup", "2", "--iterations", "3",
                                    "--duration", "0.5"])
    assert [rc for rc, _ in out] == [0, 0], out
    for r in range(2):
        lines = [json.loads(l) for l in open(tmp_path / f"res{r}.jsonl")]
        iters = [l for l in lines if "iter" in l]
        assert [l["warmup"] for l in iters[:3]] == [True, True, False]
        measured = [l for l in iters if not l["warmup"]]
        assert len(measured) > 3
        assert measured[-1]["t_end"] - measured[0]["t_start"] >= 0.45
        assert lines[-1]["warmup"] == 2 and lines[-1]["iterations"] == len(iters)
    # only the iterations count with no duration: exactly 2 + 3
    only = tmp_path / "iterations-only"
    only.mkdir()
    out = run_workers(only, 2, ["--size", "4K", "--warmup", "2", "--iterations", "3"])
    assert [rc for rc, _ in out] == [0, 0], out
    iters = [json.loads(l) for l in open(only / "res0.jsonl") if '"iter"' in l]
    assert len(iters) == 5 and sum(not l["warmup"] for l in iters) == 3


def test_trace_logs_every_chunk_sent_and_received(tmp_path):
    """NEZHA_TRACE=1: a tx event per chunk sent and an rx event per chunk received, with the
    chunk's identity and its start time (what a per-chunk timeline is drawn from)."""
    out = run_workers(tmp_path, 2, ["--size", "1M", "--iterations", "2"],
                      env_extra={"NEZHA_TRACE": "1"})
    assert [rc for rc, _ in out] == [0, 0], out
    ev = [json.loads(l) for l in open(tmp_path / "ev0.jsonl")]
    tx = [e for e in ev if e["event"] == "tx"]
    rx = [e for e in ev if e["event"] == "rx"]
    assert tx and rx
    assert all(e["t0"] <= e["t"] and e["len"] >= 0 and {"rail", "peer", "op", "step", "off"} <= set(e)
               for e in tx + rx)           # (a barrier's empty ring segments are 0-byte chunks)
    # every byte rank 1 sent rank 0 in the allreduces arrived as traced chunks
    assert sum(e["len"] for e in rx) >= 2 * (1 << 20) // 2


def test_worker_reports_comm_errors(tmp_path):
    # rank 1 uses a different size: a clear error and a non-zero exit on both ranks
    port = free_port()
    procs = []
    for r, size in ((0, "64K"), (1, "128K")):
        cmd = [sys.executable, "-m", "nezha.worker", "--rank", str(r), "--world-size", "2",
               "--rails", "127.0.0.1", "--master", f"127.0.0.1:{port}", "--size", size,
               "--iterations", "2", "--timeout", "5"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=30)
        assert p.returncode == 4, err
        assert "Mismatch" in err or "failed" in err


def test_worker_missing_arguments():
    r = subprocess.run([sys.executable, "-m", "nezha.worker"], cwd=ROOT, capture_output=True,
                       text=True, env={k: v for k, v in os.environ.items() if not k.startswith("NEZHA_")})
    assert r.returncode == 2 and "missing" in r.stderr
