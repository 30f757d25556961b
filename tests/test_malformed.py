"""Malformed Nezha frames against a live endpoint inside the testbed.

A 2-host fabric; rank 0 (the endpoint, and the rendezvous store) runs on h2, listening on h2's
rail addresses. Frames are crafted with the scapy layer (testbed/pcap/dissect.py) and sent over TCP
from h1, in two ways:

* in-band: rank 1 on h1 is a legitimate member that, after one correct allreduce, pushes
  crafted bytes down its established connection to rank 0 (Context._debug_send_raw). Rank 0
  must reject them with a logged error (event log "error" + a clear exception), never crash,
  never hang, and never return a wrong result.
* stray: before rank 1 joins, a foreign process on h1 reads rank 0's rail endpoints from the
  (unauthenticated) store and connects to them with bad frames; the legitimate allreduce that
  follows must complete with exact results.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nezha import wire
from testbed.model import spec
from testbed.pcap.dissect import frame
from testbed.fabric import Fabric

pytestmark = pytest.mark.netns
REPO = Path(__file__).resolve().parent.parent
N = 1 << 16            # float64 elements per allreduce (512 KiB)

RANK = r"""
import json, sys, time, numpy as np
from nezha.context import Context
from nezha.errors import NezhaError
iters, n = int(sys.argv[1]), int(sys.argv[2])
spec = sys.argv[3].split("*") if len(sys.argv) > 3 else [""]
inject = bytes.fromhex(spec[0]) * int(spec[1] if len(spec) > 1 else 1)   # HEX[*REPEAT]
rail, kill = (int(sys.argv[4]), sys.argv[5] == "kill") if inject else (0, False)
def out(**rec): print(json.dumps(rec), flush=True)
try:
    ctx = Context()
except NezhaError as e:
    out(error=type(e).__name__, types=[c.__name__ for c in type(e).__mro__], message=str(e)); sys.exit(3)
for i in range(iters):
    if inject and i == 1:
        time.sleep(0.5)     # let the endpoint finish op 0 (its last ACKs) first
        ctx._debug_send_raw(1 - ctx.rank, rail, inject)
        if kill:
            time.sleep(0.3)
            ctx._debug_kill_rail(1 - ctx.rank, rail)
    a = np.arange(n, dtype=np.float64) + ctx.rank * 1000 + i
    try:
        ctx.allreduce(a)
    except NezhaError as e:
        out(iter=i, error=type(e).__name__, types=[c.__name__ for c in type(e).__mro__], message=str(e))
        ctx.close(); sys.exit(3)
    exp = sum(np.arange(n, dtype=np.float64) + r * 1000 + i for r in range(ctx.world_size))
    out(iter=i, ok=bool(np.array_equal(a, exp)))
ctx.close()
"""

STRAY = r"""
import json, socket, sys, time
from nezha.store import StoreClient
host, port, frames = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
st = StoreClient(host, port, timeout=20)
info = json.loads(st.get("nezha/info/0", 20))
sent = 0
for addr, p in info["rails"]:
    for hexdata in frames:
        s = socket.create_connection((addr, p), timeout=5)
        s.sendall(bytes.fromhex(hexdata))
        s.close()
        sent += 1
print(json.dumps({"sent": sent, "endpoints": info["rails"]}), flush=True)
"""


@pytest.fixture(scope="module")
def fab():
    topo = spec.loads("name: malformed\nhosts: 2\nrails: [{name: r0, bandwidth: 500mbit}, "
                      "{name: r1, bandwidth: 500mbit}]\n")
    with Fabric(topo) as f:
        yield f


_port = iter(range(29700, 29800))


def env_for(fab, host, rank, port, events):
    topo = fab.topo
    env = dict(os.environ)
    env.update({"NEZHA_RANK": str(rank), "NEZHA_WORLD_SIZE": "2",
                "NEZHA_MASTER_ADDR": topo.address("h2", "r0"), "NEZHA_MASTER_PORT": str(port),
                "NEZHA_RAILS": ",".join(topo.address(host, r.name) for r in topo.rails),
                "NEZHA_EVENT_LOG": str(events), "NEZHA_TIMEOUT": "15", "PYTHONPATH": str(REPO)})
    return env


def start_rank(fab, host, rank, port, events, *args):
    return fab.hosts[host].popen([sys.executable, "-c", RANK, "5", str(N), *args],
                                 env=env_for(fab, host, rank, port, events),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=REPO)


def finish(proc, timeout=60):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"rank hung: {err[-1500:]}")
    recs = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    return proc.returncode, recs, err


def events_of(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def check_no_crash_no_wrong_result(code, recs, err, who):
    assert code in (0, 3), f"{who} crashed (exit {code}): {err[-1500:]}"
    assert "Traceback" not in err, f"{who} raised an unhandled exception: {err[-1500:]}"
    wrong = [r for r in recs if r.get("ok") is False]
    assert not wrong, f"{who} returned a wrong result: {wrong}"


def D(**kw) -> dict:   # a DATA header from rank 1 for op 1, valid unless a test breaks it
    base = dict(type=wire.DATA, kind=wire.K_ALLREDUCE, dtype=2, redop=1, src=1, op_id=1,
                step=0, chunk=0, offset=0, msg_total=16)
    base.update(kw)
    return base


CASES = {
    # name: (bytes, regex the endpoint's error must match)
    "bad_magic": (frame(b"x" * 16, **D(magic=b"EVIL")), r"bad magic"),
    "bad_version": (frame(b"x" * 16, **D(version=wire.VERSION + 7)), r"wire version"),
    "bad_checksum": (frame(b"x" * 16, **D(crc=0xDEADBEEF)), r"checksum"),
    "impossible_offset": (frame(b"x" * 16, **D(offset=1 << 40)), r"outside message"),
    "impossible_length": (frame(**D(length=wire.MAX_PAYLOAD + 1, msg_total=1 << 40)),
                          r"too long"),
    "unknown_operation": (frame(b"x" * 16, **D(op_id=10 ** 9)), r"sent data for op"),
    "unknown_type": (frame(**D(type=42, length=0)), r"unknown frame type"),
    "forged_sender": (frame(b"x" * 16, **D(src=7)), r"claims src rank"),
    "truncated_then_traffic": (frame(b"x" * 16, **D())[:23], r"magic|checksum|version|type"),
    "flood": ((frame(b"x" * 16, **D(magic=b"EVIL")), 20000), r"bad magic"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inband_malformed_frame_is_rejected(fab, tmp_path, case):
    data, pattern = CASES[case]
    arg = f"{data[0].hex()}*{data[1]}" if isinstance(data, tuple) else data.hex()
    port = next(_port)
    ev0, ev1 = tmp_path / "r0.events.jsonl", tmp_path / "r1.events.jsonl"
    endpoint = start_rank(fab, "h2", 0, port, ev0)
    time.sleep(0.2)
    attacker = start_rank(fab, "h1", 1, port, ev1, arg, "0", "keep")
    code0, recs0, err0 = finish(endpoint)
    code1, recs1, err1 = finish(attacker)
    check_no_crash_no_wrong_result(code0, recs0, err0, "endpoint")
    check_no_crash_no_wrong_result(code1, recs1, err1, "attacker")
    assert recs0[0].get("ok") is True, recs0          # before the attack: exact
    assert len(recs0) < 5, f"endpoint completed every allreduce despite {case}"
    failure = [r for r in recs0 if "error" in r]
    assert failure, f"endpoint accepted {case}: {recs0}"
    f = failure[0]
    assert "ProtocolError" in f["types"], f
    assert re.search(pattern, f["message"]), f
    logged = [e for e in events_of(ev0) if e["event"] == "error"]
    assert logged and re.search(pattern, logged[0]["message"]), events_of(ev0)[-3:]
    # the peer learns why (ABORT) or sees the connection drop: it fails cleanly too
    assert any("error" in r for r in recs1) or all(r.get("ok") for r in recs1), recs1


def test_truncated_frame_and_dead_rail_fails_over_or_fails_cleanly(fab, tmp_path):
    """Half a header, then the connection breaks: the endpoint sees a truncated frame. Either
    the collective moves to the other rail and completes exactly, or it fails with a clear
    CommError; never a wrong result, never a hang."""
    port = next(_port)
    ev0 = tmp_path / "r0.events.jsonl"
    endpoint = start_rank(fab, "h2", 0, port, ev0)
    time.sleep(0.2)
    attacker = start_rank(fab, "h1", 1, port, tmp_path / "r1.events.jsonl",
                          frame(b"x" * 16, **D())[:30].hex(), "0", "kill")
    code0, recs0, err0 = finish(endpoint)
    code1, recs1, err1 = finish(attacker)
    check_no_crash_no_wrong_result(code0, recs0, err0, "endpoint")
    check_no_crash_no_wrong_result(code1, recs1, err1, "peer")
    if code0 == 0:
        assert len(recs0) == 5 and all(r["ok"] for r in recs0)
    else:
        err = [r for r in recs0 if "error" in r][0]
        assert "CommError" in err["types"] and err["message"], err
    evs = events_of(ev0)
    assert any(e["event"] in ("rail_down", "error") for e in evs), evs[-5:]


def stray_attack(fab, tmp_path, frames: list[bytes]):
    port = next(_port)
    ev0 = tmp_path / "r0.events.jsonl"
    endpoint = start_rank(fab, "h2", 0, port, ev0)
    stray = fab.hosts["h1"].run([sys.executable, "-c", STRAY, fab.topo.address("h2", "r0"),
                                 str(port), json.dumps([f.hex() for f in frames])],
                                env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO,
                                check=False, timeout=60)
    assert stray.returncode == 0, stray.stderr
    peer = start_rank(fab, "h1", 1, port, tmp_path / "r1.events.jsonl")
    code0, recs0, err0 = finish(endpoint)
    code1, recs1, err1 = finish(peer)
    return (code0, recs0, err0, ev0), (code1, recs1, err1), json.loads(stray.stdout)


def test_stray_connections_with_bad_frames_do_not_disturb_the_job(fab, tmp_path):
    frames = [frame(b"{}", type=wire.HELLO, magic=b"EVIL"),
              frame(b"{}", type=wire.HELLO, version=9),
              frame(b'{"rank": 1, "rail": 0, "session": "forged", "world": 2}',
                    type=wire.HELLO, src=1),
              frame(b"x" * 16, **D()),                          # DATA before any HELLO
              frame(**D(length=wire.MAX_PAYLOAD + 1, msg_total=1 << 40)),
              frame(b"{}", type=wire.HELLO)[:20]]               # truncated, then closed
    frames += [frame(b"x" * 16, **D(magic=b"EVIL"))] * 20       # a flood of connections
    (code0, recs0, err0, ev0), (code1, recs1, err1), sent = stray_attack(fab, tmp_path, frames)
    assert sent["sent"] == 2 * len(frames)
    check_no_crash_no_wrong_result(code0, recs0, err0, "endpoint")
    check_no_crash_no_wrong_result(code1, recs1, err1, "peer")
    assert code0 == 0 and code1 == 0, (recs0, recs1, err0[-800:])
    assert len(recs0) == 5 and all(r["ok"] for r in recs0)


def test_stray_bad_frames_are_logged(fab, tmp_path):
    frames = [frame(b"{}", type=wire.HELLO, magic=b"EVIL")]
    (code0, recs0, err0, ev0), _, _ = stray_attack(fab, tmp_path, frames)
    assert code0 == 0
    evs = events_of(ev0)
    assert any(e["event"] in ("error", "rejected", "stray_connection") and
               "magic" in json.dumps(e) for e in evs), [e["event"] for e in evs]


HOLD = r"""
import json, socket, sys, time
from nezha.store import StoreClient
st = StoreClient(sys.argv[1], int(sys.argv[2]), timeout=20)
info = json.loads(st.get("nezha/info/0", 20))
socks = [socket.create_connection(tuple(ep)) for ep in info["rails"]]
for s in socks:
    s.sendall(bytes.fromhex(sys.argv[3]))       # the start of a HELLO, then nothing
print("held", flush=True)
time.sleep(60)
"""


def test_held_partial_hello_does_not_block_the_job(fab, tmp_path):
    port = next(_port)
    endpoint = start_rank(fab, "h2", 0, port, tmp_path / "r0.events.jsonl")
    hold = fab.hosts["h1"].popen([sys.executable, "-c", HOLD, fab.topo.address("h2", "r0"),
                                  str(port), frame(b"{}", type=wire.HELLO)[:10].hex()],
                                 env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO,
                                 stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout.readline().strip() == "held"
        peer = start_rank(fab, "h1", 1, port, tmp_path / "r1.events.jsonl")
        code0, recs0, err0 = finish(endpoint)
        code1, recs1, err1 = finish(peer)
        # whatever happens, it is clean: no crash, no wrong result
        check_no_crash_no_wrong_result(code0, recs0, err0, "endpoint")
        check_no_crash_no_wrong_result(code1, recs1, err1, "peer")
        assert code0 == 0 and len(recs0) == 5, recs0
    finally:
        hold.kill()
        hold.wait()
