"""The stray-with-store-access attack of issue 12, across a fabric: two ranks on hosts h0 and h1
of scratch namespaces (two rails each, one bridge per rail), and a stranger on a third host h2
of the same rails that knows everything about the job except its secret: the store's address,
rank 0's rail endpoints, the session token and the group (handed to it in a file, as if it had
sniffed them). It tries what the finding did (read the store; HELLO as rank 1 then DATA on each
of rank 0's rails) and every variant of test_security.attack. The job must finish with exact
results on its original connections, and the stranger must get nothing.

On 8725423 (no secret, store open to all) the same attack made both ranks return an allreduce
with 512 of 1024 elements wrong, without any error; the loopback version is
test_security.test_stray_without_the_secret_can_neither_read_the_store_nor_take_a_rail."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shaped import Fabric
from securityfns import SECRET

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = [pytest.mark.netns, pytest.mark.slow]

RANK = r"""
import json, os, sys, time
import numpy as np
import nezha
from securityfns import exact_allreduces, events_of

rank, rails, master, secret, tmp = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
ev = os.path.join(tmp, f"ev{rank}.jsonl")
done = os.path.join(tmp, "attack.json")
with nezha.Context(rank, 2, rails=rails.split(","), master=master, timeout=20.0, events=ev,
                   secret=secret) as ctx:
    before = {k: id(c) for k, c in ctx._engine.conns.items()}
    if rank == 0:    # what a sniffer on the rails would know: everything but the secret
        host, port = master.rsplit(":", 1)
        known = {"store": [host, int(port)], "endpoints": ctx._rdv.infos[0]["rails"],
                 "session": ctx._rdv.session}
        with open(os.path.join(tmp, "known.json.tmp"), "w") as f:
            json.dump(known, f)
        os.rename(os.path.join(tmp, "known.json.tmp"), os.path.join(tmp, "known.json"))
    oks, it = [], 0
    while True:      # allreduces until the stranger is done (both ranks agree when: max)
        oks += exact_allreduces(ctx, rank, 2, [it], pause=0.05)
        it += 1
        stop = np.array([os.path.exists(done) or it >= 1200], dtype=np.int32)
        ctx.allreduce(stop, op="max")
        if stop[0]:
            break
    ctx.barrier()
    oks += exact_allreduces(ctx, rank, 2, range(it, it + 5))
    same = before == {k: id(c) for k, c in ctx._engine.conns.items()}
print(json.dumps({"oks": oks, "same_conns": same, "iterations": it}))
"""

STRAY = r"""
import json, os, socket, sys, time
import securityfns
from securityfns import attack


class Refusable(socket.socket):
    # rank 0 may close a stranger's connection while it is still sending (across a fabric
    # the reset comes back before the rest of HELLO + DATA is written): that is a refusal,
    # recorded as a closed connection by drain(), and the attack goes on with its next try
    __slots__ = ()

    def sendall(self, data, *flags):
        try:
            return super().sendall(data, *flags)
        except (ConnectionResetError, BrokenPipeError):
            return None


def create_connection(*a, **kw):
    s = socket.create_connection(*a, **kw)
    s.__class__ = Refusable
    return s


securityfns.socket = type("socket_module", (), {"create_connection": staticmethod(create_connection),
                                                  "timeout": socket.timeout})

tmp = sys.argv[1]
known_path = os.path.join(tmp, "known.json")
deadline = time.monotonic() + 60
while not os.path.exists(known_path):
    if time.monotonic() > deadline:
        sys.exit("rank 0 never published what a sniffer would know")
    time.sleep(0.05)
known = json.load(open(known_path))
got = attack(tuple(known["store"]), known["endpoints"], known["session"], world=2)
got["rails"] = {f"{rail}:{name}": list(v) for (rail, name), v in got["rails"].items()}
with open(os.path.join(tmp, "attack.json.tmp"), "w") as f:
    json.dump(got, f)
os.rename(os.path.join(tmp, "attack.json.tmp"), os.path.join(tmp, "attack.json"))
"""


def test_stray_on_the_fabric_with_everything_but_the_secret_changes_nothing(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    env.pop("NEZHA_JOB_SECRET", None)
    with Fabric(3, [0, 0]) as fab:
        master = f"{fab.addr(0, 0)}:29471"
        ranks = [fab.popen(i, [sys.executable, "-c", RANK, str(i), fab.rails(i), master, SECRET,
                               str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for i in range(2)]
        stray = fab.popen(2, [sys.executable, "-c", STRAY, str(tmp_path)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out = []
        for p in ranks + [stray]:
            try:
                o, e = p.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                p.kill()
                o, e = p.communicate()
            out.append((p.returncode, o, e))
    assert [rc for rc, _, _ in out] == [0, 0, 0], out
    # the job: every allreduce exact, before, during and after the attack, on its own sockets
    for rank, (_, o, e) in enumerate(out[:2]):
        res = json.loads(o.strip().splitlines()[-1])
        assert res["oks"] and all(res["oks"]), (rank, res["oks"], e[-2000:])
        assert res["same_conns"], (rank, "a live connection was replaced")
    # the stranger: refused by the store with and without a guessed secret, no plain-protocol
    # leak of the session, and no rail handshake of any kind accepted (each closed on it)
    got = json.loads((tmp_path / "attack.json").read_text())
    assert got["store_no_secret"].startswith("refused"), got["store_no_secret"]
    assert got["store_wrong_secret"].startswith("refused"), got["store_wrong_secret"]
    assert got["store_plain_leak"] is False
    assert len(got["rails"]) == 2 * 6, got["rails"]
    for k, (acc, closed) in got["rails"].items():
        assert not acc and closed, (k, acc, closed)
    # rank 0 logged each try as a stray connection, and the store's refusals
    ev0 = [json.loads(line) for line in open(tmp_path / "ev0.jsonl") if line.strip()]
    strays = [e for e in ev0 if e["event"] == "stray_connection"]
    assert len(strays) >= 2 * 6, [e.get("reason") for e in strays]
    assert any(e["event"] == "store_refused" for e in ev0)
    print(f"\n{len(strays)} stray connections, iterations {[json.loads(o.strip().splitlines()[-1])['iterations'] for _, o, _ in out[:2]]}, store: {got['store_no_secret'][:60]}")
