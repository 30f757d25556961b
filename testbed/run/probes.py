"""Active probes that check a fabric from the outside, as a real client would: iperf3 for rate,
numbered one-way UDP datagrams for loss, ping for reachability."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

from testbed.fabric import Fabric

_UDP_RX = r"""
import select, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
s.bind((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
seen = set()
while True:    # until the sender's end marker, or stdin closes (the sender is done)
    readable, _, _ = select.select([s, sys.stdin], [], [])
    if s in readable:
        data = s.recv(2048)
        if data == b"end":
            break
        seen.add(int.from_bytes(data[:4], "big"))
    elif not sys.stdin.read(1):
        break
print(len(seen), flush=True)
"""


_UDP_TX = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 0))
dst = (sys.argv[2], int(sys.argv[3])); n = int(sys.argv[4]); gap = float(sys.argv[5])
pad = bytes(64)
t = time.monotonic()
for i in range(n):
    s.sendto(i.to_bytes(4, "big") + pad, dst)
    t += gap
    d = t - time.monotonic()
    if d > 0:
        time.sleep(d)
time.sleep(0.2)
for _ in range(20):
    s.sendto(b"end", dst)
"""


_ports = itertools.count(5201)


def iperf3(fabric: Fabric, src: str, dst: str, rail: str, seconds: float = 3.0,
           port: int | None = None) -> float:
    """TCP goodput in bit/s from ``src`` to ``dst`` over ``rail`` (receiver-side figure)."""
    topo = fabric.topo
    port = port or next(_ports)
    dst_ip, src_ip = topo.address(dst, rail), topo.address(src, rail)
    server = fabric.hosts[dst].popen(["iperf3", "-s", "-1", "-B", dst_ip, "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cc = fabric.caps.congestion_control(topo)
    try:
        for _ in range(100):   # until the server listens
            r = fabric.hosts[src].run(["iperf3", "-c", dst_ip, "-B", src_ip, "-p", str(port),
                                       "-t", str(seconds), "-O", "1", "-J"]
                                      + (["-C", cc] if cc else []), check=False,
                                      timeout=seconds + 30)
            try:
                result = json.loads(r.stdout)
            except json.JSONDecodeError:
                result = {"error": r.stdout[-300:] + r.stderr[-300:]}
            if r.returncode == 0 and "sum_received" in result.get("end", {}):
                return float(result["end"]["sum_received"]["bits_per_second"])
            if "connect" not in str(result.get("error", "")):
                break    # not a server that is still starting: a real failure
            time.sleep(0.05)
        raise RuntimeError(f"iperf3 {src}->{dst} over {rail} failed: {result.get('error')}")
    finally:
        server.kill()
        server.wait()


def on_wire(goodput_bps: float, mtu: int = 1500) -> float:
    """The Ethernet rate that carried a TCP goodput: shaping counts whole frames (MTU + 14 bytes
    for MTU - 52 bytes of payload with timestamps), so goodput alone is ~4.4 % below the rate,
    as on a real NIC."""
    return goodput_bps * (mtu + 14) / (mtu - 52)


def udp_loss(fabric: Fabric, src: str, dst: str, rail: str, count: int = 5000,
             gap: float = 0.0002, port: int = 47000) -> float:
    """Fraction of ``count`` numbered one-way UDP datagrams that did not arrive."""
    topo = fabric.topo
    dst_ip, src_ip = topo.address(dst, rail), topo.address(src, rail)
    # The receiver has no idle timeout: a sender slow to start on a loaded machine is not loss
    # (CI once counted 100 % when the python sender took over 2 s to start). It stops at the
    # sender's end marker, or when its stdin closes after the sender has exited.
    rx = fabric.hosts[dst].popen([sys.executable, "-c", _UDP_RX, dst_ip, str(port)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready"
        fabric.hosts[src].run([sys.executable, "-c", _UDP_TX, src_ip, dst_ip, str(port),
                               str(count), str(gap)], check=True, timeout=count * gap + 30)
        out, _ = rx.communicate(timeout=30)
        return 1.0 - int(out.split()[-1]) / count
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()


def reachable(fabric: Fabric, src: str, dst: str, rail: str, timeout_s: float = 1.0) -> bool:
    ip = fabric.topo.address(dst, rail)
    r = fabric.hosts[src].run(["ping", "-c", "1", "-W", str(timeout_s), "-I", rail, ip],
                              check=False, timeout=timeout_s + 5)
    return r.returncode == 0
