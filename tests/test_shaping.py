"""DirectionShaper on a real veth pair between two namespaces, measured with iperf3 and UDP."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from testbed.errors import CapabilityError, ShapingMismatch
from testbed.fabric.shaper import DirectionShaper, shapes_match
from testbed.kernel import nftables, tc
from testbed.kernel.nftables import decode_nft_rule, nft_rule
from testbed.kernel.tc import CLASS_HANDLE, HTB_HANDLE, decode_netem, netem_kwargs
from testbed.model.spec import Shape

from binomial import assert_loss

MBIT = 1_000_000
A_IP, B_IP = "198.18.0.1", "198.18.0.2"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")


# ---- message building, no kernel needed -------------------------------------------------------
def test_htb_parameters():
    # bucket: never below two 64 KiB GSO skbs; 4 ms at high rates
    assert tc.htb_burst(50 * MBIT) == 2 * (65536 + 1514)
    assert tc.htb_burst(1000 * MBIT) == 500_000
    assert tc.htb_quantum(500 * MBIT) == 62_500
    assert tc.htb_quantum(1 * MBIT) == 1514
    assert tc.htb_quantum(10_000 * MBIT) == 200_000
    # 10 ms of the rate in full frames, at least 20 packets
    assert tc.fifo_limit(50 * MBIT) == 42
    assert tc.fifo_limit(1000 * MBIT) == 826
    assert tc.fifo_limit(10 * MBIT) == 20
    kw = tc.htb_class_kwargs(200 * MBIT + 3)
    assert kw["rate"] == kw["ceil"] == 25_000_000 and kw["burst"] == kw["cburst"]
    # GSO skbs of 2 ms at the rail's slowest link, one frame at least, 64 KiB at most; the
    # bucket holds two of them: 6.4 ms at 10 Mbit/s instead of 107 ms with 64 KiB skbs
    assert tc.gso_size(10 * MBIT) == 2500 and tc.gso_size(None) == 65536
    assert tc.gso_size(1 * MBIT) == 1514 and tc.gso_size(1 * MBIT, 9000) == 9014
    assert tc.gso_size(1000 * MBIT) == 65536
    assert tc.htb_burst(10 * MBIT, 1500, tc.gso_size(10 * MBIT)) == 2 * (2500 + 1514)
    assert tc.htb_class_kwargs(10 * MBIT, 1500, 2500)["burst"] == 8028


def test_netem_message_round_trip():
    """The netem options pyroute2 would send, encoded and decoded as the kernel's dump."""
    from pyroute2.netlink.rtnl.tcmsg import sched_netem, tcmsg
    shape = Shape(rate_bps=100 * MBIT, loss=0.05, delay_s=0.010, jitter_s=0.002)
    kw = netem_kwargs(shape)
    assert kw["delay"] == 10_000 and kw["jitter"] == 2_000 and kw["loss"] == pytest.approx(5.0)
    # limit covers the fifo plus twice rate x (delay + 4 jitter) in MTU frames
    assert kw["limit"] >= tc.fifo_limit(100 * MBIT) + 2 * (100 * MBIT / 8 * 0.018 / 1514)
    msg = tcmsg()
    msg["index"], msg["handle"], msg["parent"] = 1, 0x100000, CLASS_HANDLE
    msg["attrs"] = [["TCA_KIND", "netem"], ["TCA_OPTIONS", sched_netem.get_parameters(kw)]]
    msg.encode()
    back = tcmsg(msg.data)
    back.decode()
    opts = back.get_attr("TCA_OPTIONS")
    loss, delay, jitter = decode_netem(opts)
    assert opts["limit"] == kw["limit"]
    assert abs(loss - 0.05) < 1e-6 and abs(delay - 0.010) < 1e-6 and abs(jitter - 0.002) < 1e-6
    assert shapes_match(shape, Shape(100 * MBIT, loss, delay, jitter))
    # unshaped rate: the queue is sized for veth's ~10 Gbit/s
    assert netem_kwargs(Shape(delay_s=0.05))["limit"] > 80_000
    black_hole = sched_netem.get_parameters(netem_kwargs(Shape(loss=1.0)))
    assert black_hole["loss"] == 0xFFFFFFFF


def test_nft_rule_text_and_decode():
    assert nft_rule(0.05) == "numgen random mod 1000000 < 50000 counter drop"
    assert nft_rule(1.0) == "counter drop"
    assert decode_nft_rule([{"counter": {"packets": 1, "bytes": 2}}, {"drop": None}]) == 1.0
    expr = [{"match": {"op": "<", "left": {"numgen": {"mode": "random", "mod": 1000000,
                                                       "offset": 0}}, "right": 50000}},
            {"counter": {"packets": 3, "bytes": 300}}, {"drop": None}]
    assert decode_nft_rule(expr) == 0.05
    assert decode_nft_rule(expr[:2]) is None      # no drop: not ours
    with pytest.raises(ValueError):
        nftables.loss_threshold(1.5)
    accept = [{"accept": None}]
    assert nftables.nft_generation(0.05) == [nft_rule(0.05), "accept"]
    assert nftables.nft_generation(0) == ["accept"]
    assert nftables.nft_generation(1.0) == ["counter drop"]
    # head generation decides; rules behind it are dead
    assert nftables.decode_nft_chain([expr, accept, accept]) == (0.05, 2)
    assert nftables.decode_nft_chain([accept, expr, accept]) == (0.0, 1)
    assert nftables.decode_nft_chain([[{"counter": {}}, {"drop": None}], expr]) == (1.0, 1)
    assert nftables.decode_nft_chain([]) == (0.0, 0)
    with pytest.raises(ValueError):
        nftables.decode_nft_chain([expr, expr])        # a second drop would compound the loss


def test_shapes_match_tolerances():
    assert shapes_match(Shape(200 * MBIT + 5), Shape(200 * MBIT))
    assert not shapes_match(Shape(200 * MBIT), Shape(199 * MBIT))
    assert not shapes_match(Shape(None), Shape(1 * MBIT))
    assert not shapes_match(Shape(loss=0.05), Shape(loss=0.0501))
    assert shapes_match(Shape(delay_s=0.01), Shape(delay_s=0.0100005))


# ---- real namespaces -------------------------------------------------------------------------
def _sh(*cmd, **kw):
    return subprocess.run(list(cmd), check=True, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def pair():
    """Two namespaces joined by a veth (ta in A, tb in B); yields (ipr_a, ipr_b, ns_a, ns_b)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    from pyroute2 import IPRoute, netns
    ns_a, ns_b = f"nzt-shtest-{os.getpid()}-a", f"nzt-shtest-{os.getpid()}-b"
    netns.create(ns_a)
    netns.create(ns_b)
    ipr_a = ipr_b = None
    try:
        ipr_a, ipr_b = IPRoute(netns=ns_a), IPRoute(netns=ns_b)
        ipr_a.link("add", ifname="ta", kind="veth", peer={"ifname": "tb", "net_ns_fd": ns_b})
        ia, ib = ipr_a.link_lookup(ifname="ta")[0], ipr_b.link_lookup(ifname="tb")[0]
        ipr_a.addr("add", index=ia, address=A_IP, prefixlen=24)
        ipr_b.addr("add", index=ib, address=B_IP, prefixlen=24)
        for ipr, idx in ((ipr_a, ia), (ipr_b, ib)):
            ipr.link("set", index=idx, state="up")
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        yield ipr_a, ipr_b, ns_a, ns_b
    finally:
        for ipr in (ipr_a, ipr_b):
            if ipr is not None:
                ipr.close()
        for ns in (ns_a, ns_b):
            try:
                netns.remove(ns)
            except Exception:
                pass


@pytest.fixture(scope="module")
def caps():
    from testbed.kernel.capabilities import probe
    return probe()


@pytest.fixture
def shaper(pair, caps):
    ipr_a, ipr_b, ns_a, ns_b = pair
    s = DirectionShaper(ipr_a, ns_a, "ta", ipr_b, ns_b, "tb", caps, mtu=1500, name="h1.r0:up")
    yield s
    s.clear()


def _iperf3(ns_a, ns_b, seconds=3, port=5201) -> dict:
    if shutil.which("iperf3") is None:
        pytest.skip("iperf3 not installed")
    server = subprocess.Popen(["ip", "netns", "exec", ns_b, "iperf3", "-s", "-1", "-p", str(port),
                               "-B", B_IP], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):   # wait until the server listens
            r = subprocess.run(["ip", "netns", "exec", ns_b, "ss", "-Hltn", f"sport = :{port}"],
                               capture_output=True, text=True)
            if r.stdout.strip():
                break
            time.sleep(0.02)
        out = _sh("ip", "netns", "exec", ns_a, "iperf3", "-c", B_IP, "-p", str(port),
                  "-t", str(seconds), "-O", "1", "-J", timeout=seconds + 20).stdout
        return json.loads(out)
    finally:
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _goodput(result: dict) -> float:
    return result["end"]["sum_received"]["bits_per_second"]


def _wire_rate(result: dict, mtu: int = 1500) -> float:
    """The L2 rate htb shapes, from iperf3's goodput: every full segment of MSS payload bytes
    is an MTU + 14 byte frame (1448 -> 1514: goodput can never exceed 95.6 % of the rate)."""
    mss = result["start"].get("tcp_mss_default") or 1448
    return _goodput(result) * (mtu + 14) / mss


def _check_rate(result: dict, mbit: int, what: str) -> None:
    rate = mbit * MBIT
    got, wire = _goodput(result), _wire_rate(result)
    print(f"\n{what}: iperf3 TCP goodput {got / MBIT:.1f} Mbit/s ({(got / rate - 1) * 100:+.2f}% "
          f"of {mbit} Mbit/s), on the wire {wire / MBIT:.1f} Mbit/s ({(wire / rate - 1) * 100:+.2f}%)")
    assert got <= rate                       # the shaper never lets more through
    assert abs(wire / rate - 1) <= 0.05      # within 5 % of the set (L2) rate


RECEIVER = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s.bind((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
s.settimeout(5.0)
seen = set()
try:
    while True:
        data, _ = s.recvfrom(2048)
        seen.add(int(data[:8]))
        s.settimeout(0.5)
except socket.timeout:
    pass
print(len(seen), flush=True)
"""

SENDER = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
n = int(sys.argv[3])
pad = b"x" * 92
for i in range(n):
    s.sendto(b"%08d" % i + pad, (sys.argv[1], int(sys.argv[2])))
    if i % 200 == 199:
        time.sleep(0.002)
"""


def _udp_probe(ns_a, ns_b, n, port=9999) -> int:
    """Send n one-way UDP probes A -> B; return how many distinct ones B received."""
    rx = subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, "-c", RECEIVER, B_IP,
                           str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready"
        _sh("ip", "netns", "exec", ns_a, sys.executable, "-c", SENDER, B_IP, str(port), str(n),
            timeout=60)
        out, _ = rx.communicate(timeout=30)
        return int(out.strip())
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()


def _class(ipr, ifname):
    idx = ipr.link_lookup(ifname=ifname)[0]
    return next(c for c in ipr.get_classes(index=idx) if c["handle"] == CLASS_HANDLE)


def _class_bytes(ipr, ifname) -> int:
    return _class(ipr, ifname).get_attr("TCA_STATS2").get_attr("TCA_STATS_BASIC")["bytes"]


@root_only
@pytest.mark.slow
@pytest.mark.timing            # a TCP rate measured over 3 s on a shared 2-core machine
@pytest.mark.flaky(reruns=1, reruns_delay=2)
@pytest.mark.parametrize("mbit", [50, 200, 500])
def test_iperf3_rate_accuracy(pair, shaper, mbit):
    _, _, ns_a, ns_b = pair
    shape = Shape(rate_bps=mbit * MBIT)
    shaper.apply(shape)
    assert shaper.read_back() == shape
    _check_rate(_iperf3(ns_a, ns_b, seconds=3), mbit, f"{mbit} Mbit/s")


@root_only
@pytest.mark.slow
def test_runtime_rate_change_in_place(pair, shaper):
    """Correctness of a change: the same qdisc and class, nothing rebuilt, the new rate read
    back. (How fast, and the rate it gives: test_runtime_rate_change_is_fast_and_exact.)"""
    ipr_a, _, ns_a, ns_b = pair
    shaper.apply(Shape(rate_bps=200 * MBIT))
    _iperf3(ns_a, ns_b, seconds=1)       # put bytes on the class counters
    before = _class_bytes(ipr_a, "ta")
    assert before > 0
    t0 = time.monotonic()
    acked = shaper.change(Shape(rate_bps=50 * MBIT))
    assert t0 <= acked <= time.monotonic()
    # same qdisc and class handles, not rebuilt: the class's byte counter survived the change
    idx = ipr_a.link_lookup(ifname="ta")[0]
    assert [q["handle"] for q in ipr_a.get_qdiscs(index=idx)
            if q["index"] == idx and q["parent"] == 0xFFFFFFFF] == [HTB_HANDLE]
    assert _class_bytes(ipr_a, "ta") >= before
    assert shaper.read_back() == Shape(rate_bps=50 * MBIT)


@root_only
@pytest.mark.slow
@pytest.mark.timing            # a duration (< 50 ms) and a TCP rate measured over 3 s
@pytest.mark.flaky(reruns=1, reruns_delay=2)
def test_runtime_rate_change_is_fast_and_exact(pair, shaper):
    _, _, ns_a, ns_b = pair
    shaper.apply(Shape(rate_bps=200 * MBIT))
    t0 = time.monotonic()
    acked = shaper.change(Shape(rate_bps=50 * MBIT))
    elapsed = time.monotonic() - t0
    print(f"\nrate change 200 -> 50 mbit: {elapsed * 1e3:.2f} ms (kernel ack after "
          f"{(acked - t0) * 1e3:.2f} ms)")
    assert elapsed < 0.050
    _check_rate(_iperf3(ns_a, ns_b, seconds=3), 50, "after change to 50 Mbit/s")


@root_only
def test_loss_5_percent_measured(pair, shaper, caps):
    if caps.loss_method is None:
        pytest.skip("neither netem nor nftables")
    _, _, ns_a, ns_b = pair
    shaper.apply(Shape(loss=0.05))
    desc = shaper.describe()
    assert desc["loss_method"] == caps.loss_method
    if not caps.netem:
        assert desc["loss_method"] == "nftables" and desc["qdiscs"] == []
        assert "< 50000" in desc["nft"]
    assert shaper.read_back() == Shape(loss=0.05)
    n = 10_000
    got = _udp_probe(ns_a, ns_b, n)
    lost = (n - got) / n
    print(f"\nloss 5%: {n - got} of {n} probes lost = {lost * 100:.2f}% via {desc['loss_method']}")
    assert_loss(lost, 0.05, n, f"loss 5% via {desc['loss_method']}")   # 4.02 % .. 5.98 %
    if not caps.netem:
        assert shaper.describe()["nft_drops"] == n - got   # every loss is ours


@pytest.fixture(params=["pyroute2", "rtnl"])
def loss_shaper(request, pair, caps, monkeypatch):
    """The shaper on pyroute2's IPRoute (nft text through libnftables) and on the fabric's own
    netlink handles, where a runtime loss change is encoded by testbed.kernel.nfnl; yields
    (shaper, the number of nfnl insertions so far)."""
    from testbed.kernel import nfnl
    from testbed.kernel.rtnl import Rtnl
    ipr_a, ipr_b, ns_a, ns_b = pair
    handles = (ipr_a, ipr_b) if request.param == "pyroute2" else (Rtnl(ns_a), Rtnl(ns_b))
    calls = []
    real = nfnl.insert_loss_rules
    monkeypatch.setattr(nfnl, "insert_loss_rules", lambda *a: (calls.append(a), real(*a)))
    s = DirectionShaper(handles[0], ns_a, "ta", handles[1], ns_b, "tb", caps, mtu=1500,
                        name="h1.r0:up")
    yield s, calls
    s.clear()
    if request.param == "rtnl":
        for h in handles:
            h.close()


@root_only
def test_loss_change_5_0_100(pair, loss_shaper, caps, request):
    if caps.loss_method is None:
        pytest.skip("neither netem nor nftables")
    shaper, nfnl_calls = loss_shaper
    _, _, ns_a, ns_b = pair
    shape = Shape(rate_bps=200 * MBIT, loss=0.05)
    shaper.apply(shape)
    assert shaper.read_back() == shape
    # 0 % and 100 %: every probe crosses / none does; 5 %: within the binomial bound of 3000
    # probes (3.21 % .. 6.79 %), so a change that left no loss behind fails
    for loss, n in ((0.0, 300), (1.0, 300), (0.05, 3000)):
        t0 = time.monotonic()
        shaper.change(Shape(rate_bps=200 * MBIT, loss=loss))
        elapsed = time.monotonic() - t0
        print(f"\nloss change -> {loss * 100:g}%: {elapsed * 1e3:.2f} ms")
        assert elapsed < 0.050
        assert shaper.read_back() == Shape(rate_bps=200 * MBIT, loss=loss)
        if loss == 0 and not caps.netem:
            assert shaper.describe()["nft"] is None       # the drop rule is gone
        got = _udp_probe(ns_a, ns_b, n, port=9998)
        print(f"   {n - got} of {n} probes lost")
        if loss in (0.0, 1.0):
            assert got == round(n * (1 - loss)), (loss, got)
        else:
            assert_loss((n - got) / n, loss, n, "after a change back to 5 %")
    if not caps.netem:        # the fabric's handles take the encoded path, pyroute2's not
        fast = request.node.callspec.params["loss_shaper"] == "rtnl"
        assert len(nfnl_calls) == (3 if fast else 0), nfnl_calls


@root_only
def test_unshaped_leaves_no_qdisc_and_clear(pair, shaper, caps):
    ipr_a, _, ns_a, ns_b = pair
    idx = ipr_a.link_lookup(ifname="ta")[0]
    shaper.apply(Shape(rate_bps=100 * MBIT, loss=0.01))
    kinds = {q.get_attr("TCA_KIND") for q in ipr_a.get_qdiscs(index=idx) if q["index"] == idx}
    assert "htb" in kinds
    shaper.change(Shape())
    assert shaper.read_back() == Shape()
    kinds = {q.get_attr("TCA_KIND") for q in ipr_a.get_qdiscs(index=idx) if q["index"] == idx}
    assert not kinds & {"htb", "netem", "pfifo"}
    shaper.apply(Shape(rate_bps=100 * MBIT, loss=0.01))
    shaper.clear()
    assert shaper.read_back() == Shape()
    if caps.nftables:
        r = subprocess.run(["ip", "netns", "exec", ns_b, "nft", "list", "chain", "netdev",
                            "nezha_testbed", shaper.chain], capture_output=True)
        assert r.returncode != 0


@root_only
def test_readback_mismatch_is_refused(pair, shaper, monkeypatch):
    shaper.apply(Shape(rate_bps=100 * MBIT))
    # the kernel "silently" keeps another rate: simulate by lying about what we send
    real = tc.htb_class_kwargs
    monkeypatch.setattr(tc, "htb_class_kwargs",
                        lambda rate, mtu=1500, gso=65536: real(rate // 2, mtu, gso))
    with pytest.raises(ShapingMismatch) as exc:
        shaper.change(Shape(rate_bps=80 * MBIT))
    assert "h1.r0:up" in str(exc.value) and "80000000" in str(exc.value) \
        and "40000000" in str(exc.value)


@root_only
def test_delay_without_netem_is_refused(pair, shaper, caps):
    if caps.netem:
        pytest.skip("this kernel has sch_netem: delay is tested by test_netem_delay_read_back")
    with pytest.raises(CapabilityError) as exc:
        shaper.apply(Shape(rate_bps=100 * MBIT, delay_s=0.010))
    assert exc.value.field == "delay"
    assert "netem" in str(exc.value)
    assert shaper.read_back() == Shape()     # nothing half-applied


@root_only
def test_netem_delay_read_back(pair, shaper, caps):
    if not caps.netem:
        pytest.skip(f"kernel lacks sch_netem ({caps.details.get('netem')}): "
                    "delay refusal is tested instead")
    shape = Shape(rate_bps=100 * MBIT, loss=0.01, delay_s=0.010, jitter_s=0.001)
    shaper.apply(shape)
    got = shaper.read_back()
    assert shapes_match(shape, got)
    assert shaper.describe()["loss_method"] == "netem"
    t0 = time.monotonic()
    shaper.change(Shape(rate_bps=100 * MBIT, delay_s=0.020))
    assert time.monotonic() - t0 < 0.050
    assert shapes_match(Shape(rate_bps=100 * MBIT, delay_s=0.020), shaper.read_back())
    shaper.change(Shape(delay_s=0.005))          # netem alone, as root
    assert shapes_match(Shape(delay_s=0.005), shaper.read_back())


@root_only
def test_handle_for_existing_fabric_changes_in_place(pair, shaper, caps):
    """A second process (status, faults) makes a new DirectionShaper for an existing link:
    read_back works at once and change() is still in place, not a rebuild."""
    ipr_a, ipr_b, ns_a, ns_b = pair
    loss = 0.02 if caps.loss_method else 0.0
    shaper.apply(Shape(rate_bps=200 * MBIT, loss=loss))
    _udp_probe(ns_a, ns_b, 200, port=9997)
    before = _class_bytes(ipr_a, "ta")
    assert before > 0
    other = DirectionShaper(ipr_a, ns_a, "ta", ipr_b, ns_b, "tb", caps)
    assert other.read_back() == Shape(rate_bps=200 * MBIT, loss=loss)
    t0 = time.monotonic()
    other.change(Shape(rate_bps=100 * MBIT, loss=loss / 2))
    assert time.monotonic() - t0 < 0.050
    assert _class_bytes(ipr_a, "ta") >= before
    assert shaper.read_back() == Shape(rate_bps=100 * MBIT, loss=loss / 2)
    d = other.describe()
    assert d["rate"] == "100mbit" and d["rate_bps"] == 100 * MBIT
    assert d["loss_method"] == (caps.loss_method if loss else None)
    assert d["qdiscs"][0].startswith("htb 1:") and "class htb 1:10 rate 100mbit" in d["qdiscs"][1]
    print("\n" + json.dumps(d, indent=1))


def test_decode_kernel_netem_dump_with_64bit_attributes():
    """A netem dump as a current kernel sends it: tc_netem_qopt followed by nested
    TCA_NETEM_LATENCY64/JITTER64 (types 10, 11) that pyroute2 does not name."""
    import struct
    from pyroute2.netlink.rtnl.tcmsg import tcmsg
    ticks = lambda s: int(s * 1e6 * 15.625)   # psched ticks of 64 ns
    qopt = struct.pack("=6I", ticks(0.025), 5000, int(0.1 * 0xFFFFFFFF), 0, 0, ticks(0.003))
    nested = b"".join(struct.pack("=HHq", 12, t, v) for t, v in ((10, 25_000_000),
                                                                   (11, 3_000_000)))
    options = qopt + nested
    kind = b"netem\0"
    attrs = (struct.pack("=HH", 4 + len(kind), 1) + kind + b"\0" * (-len(kind) % 4)
             + struct.pack("=HH", 4 + len(options), 2) + options)
    body = struct.pack("=BBHiIII", 0, 0, 0, 3, 0x100000, CLASS_HANDLE, 0) + attrs
    raw = struct.pack("=IHHII", 16 + len(body), 36, 2, 1, 0) + body   # RTM_NEWQDISC, multi
    msg = tcmsg(raw)
    msg.decode()
    opts = msg.get_attr("TCA_OPTIONS")
    loss, delay, jitter = decode_netem(opts)
    assert opts["limit"] == 5000
    assert abs(delay - 0.025) < 1e-6 and abs(jitter - 0.003) < 1e-6 and abs(loss - 0.1) < 1e-6


class _RecordingIPRoute:
    """Stands in for pyroute2's IPRoute: records tc calls and encodes each one the way pyroute2
    would send it (so bad netem/htb arguments fail here, on a kernel without netem too)."""

    def __init__(self):
        self.calls = []

    def link_lookup(self, ifname):
        return [7]

    def get_qdiscs(self, index=None):
        return []

    def tc(self, command, kind=None, index=0, handle=0, **kw):
        from pyroute2.netlink.rtnl.tcmsg import plugins, tcmsg
        self.calls.append((command, kind, handle, kw.get("parent"), dict(kw)))
        if kind in ("netem", "htb") and command != "del":
            plugin = plugins[kind]
            if command.endswith("class"):
                opts = plugin.get_class_parameters(dict(kw))
            else:
                opts = plugin.get_parameters(dict(kw))
            msg = tcmsg()
            msg["index"], msg["handle"], msg["parent"] = index, handle, kw.get("parent", 0)
            msg["attrs"] = [["TCA_KIND", kind], ["TCA_OPTIONS", opts]]
            msg.encode()


def test_netem_code_paths_message_building(monkeypatch):
    """What apply/change send on a kernel WITH netem (cannot run here), kernel-free."""
    from testbed.kernel.capabilities import Capabilities
    caps = Capabilities(netns=True, veth=True, htb=True, netem=True, nftables=True)
    fake = _RecordingIPRoute()
    s = DirectionShaper(fake, "nzt-x-a", "ta", fake, "nzt-x-b", "tb", caps, name="h1.r0:up",
                        per_packet_loss=False)
    monkeypatch.setattr(s, "_verify", lambda shape: setattr(s, "shape", shape))
    monkeypatch.setattr(s, "_remove_tree", lambda: fake.calls.append(("remove-tree",)))
    monkeypatch.setattr(nftables, "nft_run", lambda *a, **k: pytest.fail("nft used with netem"))

    s.apply(Shape(rate_bps=100 * MBIT, loss=0.01, delay_s=0.010))
    assert [c[:4] for c in fake.calls[1:]] == [
        ("add", "htb", HTB_HANDLE, None), ("add-class", "htb", CLASS_HANDLE, HTB_HANDLE),
        ("add", "netem", tc.LEAF_HANDLE, CLASS_HANDLE)]
    netem = fake.calls[-1][4]
    assert netem["delay"] == 10_000 and netem["loss"] == pytest.approx(1.0)
    assert netem["limit"] >= tc.MIN_QUEUE_PKTS

    fake.calls.clear()
    s.change(Shape(rate_bps=50 * MBIT, delay_s=0.020, jitter_s=0.002))   # all in place
    assert [c[:4] for c in fake.calls] == [
        ("change-class", "htb", CLASS_HANDLE, HTB_HANDLE),
        ("change", "netem", tc.LEAF_HANDLE, CLASS_HANDLE)]
    assert fake.calls[1][4]["jitter"] == 2_000 and fake.calls[1][4]["loss"] == 0

    fake.calls.clear()
    s.change(Shape(rate_bps=50 * MBIT))                   # netem leaf -> pfifo leaf
    assert [c[:3] for c in fake.calls] == [("del", "netem", tc.LEAF_HANDLE),
                                           ("add", "pfifo", tc.LEAF_HANDLE)]

    fake.calls.clear()
    s.change(Shape(loss=1.0))                             # black hole, netem alone at the root
    assert fake.calls[0] == ("remove-tree",)
    assert fake.calls[1][:4] == ("add", "netem", tc.LEAF_HANDLE, tc.TC_H_ROOT)
    assert fake.calls[1][4]["loss"] == 100.0

    with pytest.raises(CapabilityError):
        DirectionShaper(fake, "a", "ta", fake, "b", "tb", Capabilities(htb=True),
                        ).apply(Shape(loss=0.1))


@root_only
@pytest.mark.slow
def test_tcp_loss_is_per_packet(pair, shaper, caps):
    """With loss, TSO/GSO go off on the egress interface: TCP loses single MTU packets at the
    asked rate, not whole 64 KiB GSO skbs; offloads come back when the loss is gone."""
    if caps.loss_method != "nftables":
        pytest.skip("per-packet accounting via the nft drop counter")
    ipr_a, _, ns_a, ns_b = pair
    shaper.apply(Shape(rate_bps=200 * MBIT, loss=0.01))
    assert shaper.offloads() == {"tso": False, "gso": False}
    d0 = shaper.describe()
    result = _iperf3(ns_a, ns_b, seconds=3)
    d1 = shaper.describe()
    drops = d1["nft_drops"] - d0["nft_drops"]
    packets = d1["class_stats"]["packets"] - d0["class_stats"]["packets"]
    sent = result["end"]["sum_sent"]
    print(f"\n1% loss over TCP: {drops} drops of {packets} packets = {drops / packets * 100:.2f}%, "
          f"{sent['retransmits']} retransmits, goodput "
          f"{_goodput(result) / MBIT:.1f} Mbit/s")
    assert drops > 100                       # many single-packet losses, not a few bursts
    assert 0.006 <= drops / packets <= 0.014
    t0 = time.monotonic()
    shaper.change(Shape(rate_bps=200 * MBIT))
    print(f"loss 1% -> 0 with offloads back on: {(time.monotonic() - t0) * 1e3:.2f} ms")
    assert shaper.offloads() == {"tso": True, "gso": True}
