"""One end of a competing flow (the ``traffic`` fault): a paced sender or a counting receiver.

Run as a script inside a host's namespace (``python flowgen.py send|recv ...``, launched by
``testbed/run/traffic.py`` through the same ``Host.popen`` the workload's ranks use). The
standard library only, and no import of the testbed package: a flow starts in ~30 ms and costs
no numpy import on a 2-core machine that also runs the ranks.

Every ~100 ms each end appends one JSON line to its ``--out`` file::

    {"t": <time.monotonic()>, "bytes": <cumulative payload bytes>, "role": "send"|"recv"}

CLOCK_MONOTONIC is shared by every namespace of the machine, so these lines line up with the
kernel samples and Nezha's events. The last line has ``"final": true`` (on a normal end and on
SIGTERM/SIGINT).

Pacing (the fault's ``value``, a rate of Ethernet frames like a rail's ``bandwidth``): the
payload is sent through a token bucket at value x payload/frame (TCP: MSS/(MTU+14); UDP:
datagram/(datagram+42)), refilled continuously and capped at 10 ms worth, so a sender that
was blocked (TCP's window, a full rail) does not burst afterwards. TCP also gets
SO_MAX_PACING_RATE (TCP paces internally since Linux 4.13, no fq needed), which spreads each
burst over its interval; TCP takes what it can up to the cap, UDP offers exactly the cap.
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import time

REPORT_S = 0.1
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
UDP_SEGMENT = 103             # SOL_UDP option: one send of many datagrams (GSO), Linux 4.18+
TCP_CHUNK = 64 << 10
BURST_S = 0.01
CONNECT_TIMEOUT_S = 10.0

_stop = False


def _on_signal(signum, frame) -> None:
    global _stop
    _stop = True


class Reporter:
    """Cumulative byte count, written as a JSON line every REPORT_S."""

    def __init__(self, path: str, role: str) -> None:
        self.f = open(path, "a", buffering=1)
        self.role = role
        self.bytes = 0
        self.next = 0.0

    def add(self, n: int, now: float) -> None:
        self.bytes += n
        if now >= self.next:
            self.line(now)

    def line(self, now: float, **extra) -> None:
        self.f.write(json.dumps({"t": now, "bytes": self.bytes, "role": self.role, **extra})
                     + "\n")
        self.next = now + REPORT_S

    def close(self, **extra) -> None:
        self.line(time.monotonic(), final=True, **extra)
        self.f.close()


def _sleep_until(t: float) -> bool:
    """Sleep until monotonic ``t``; False if told to stop first."""
    while not _stop:
        left = t - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(left, 0.05))
    return False


def _connect(args) -> socket.socket:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((args.bind, 0))
        s.settimeout(1.0)
        try:
            s.connect((args.to, args.port))
            return s
        except OSError:
            s.close()
            if _stop or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def send(args) -> int:
    rep = Reporter(args.out, "send")
    rep.line(time.monotonic(), start_at=args.start_at, stop_at=args.stop_at)
    payload_bps = args.rate * args.factor
    if not _sleep_until(args.start_at - (0.3 if args.proto == "tcp" else 0.0)):
        rep.close()
        return 0
    if args.proto == "tcp":
        sock = _connect(args)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, int(args.rate / 8))
        except OSError:
            pass
        if args.congestion:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION,
                                args.congestion.encode())
            except OSError:
                pass
        chunk = TCP_CHUNK
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((args.bind, 0))
        sock.connect((args.to, args.port))
        chunk = args.datagram
        try:     # one send of up to 44 datagrams: 44x fewer system calls
            sock.setsockopt(socket.IPPROTO_UDP, UDP_SEGMENT, args.datagram)
            chunk = args.datagram * max(1, min(44, int(payload_bps / 8 * 0.002 / args.datagram)))
        except OSError:
            pass
    sock.settimeout(0.2)
    buf = memoryview(bytearray(chunk))
    if not _sleep_until(args.start_at):
        rep.close()
        return 0
    burst = max(chunk, payload_bps / 8 * BURST_S)
    tokens, last = float(chunk), time.monotonic()
    rep.line(last, started=True)
    while not _stop:
        now = time.monotonic()
        if args.stop_at and now >= args.stop_at:
            break
        tokens = min(burst, tokens + (now - last) * payload_bps / 8)
        last = now
        if tokens < chunk:
            time.sleep(min(0.05, (chunk - tokens) * 8 / payload_bps))
            continue
        try:
            n = sock.send(buf) if args.proto == "tcp" else sock.send(buf[:chunk])
        except socket.timeout:
            n = 0
        except OSError:      # UDP: ENOBUFS / ECONNREFUSED from an ICMP; TCP: reset
            if args.proto == "tcp":
                break
            n = 0
        tokens -= n
        rep.add(n, time.monotonic())
    sock.close()
    rep.close()
    return 0


def recv(args) -> int:
    rep = Reporter(args.out, "recv")
    kind = socket.SOCK_STREAM if args.proto == "tcp" else socket.SOCK_DGRAM
    ls = socket.socket(socket.AF_INET, kind)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((args.bind, args.port))
    if args.proto == "tcp":
        ls.listen(1)
    ls.settimeout(REPORT_S)
    rep.line(time.monotonic(), listening=True)
    conn = None if args.proto == "tcp" else ls
    buf = bytearray(1 << 18)
    while not _stop:
        now = time.monotonic()
        if args.stop_at and now >= args.stop_at + 1.0:
            break
        if conn is None:
            try:
                conn, _ = ls.accept()
                conn.settimeout(REPORT_S)
            except socket.timeout:
                rep.add(0, time.monotonic())
            continue
        try:
            n = conn.recv_into(buf)
            if n == 0 and args.proto == "tcp":
                break
        except socket.timeout:
            n = 0
        except OSError:
            break
        rep.add(n, time.monotonic())
    if conn is not None and conn is not ls:
        conn.close()
    ls.close()
    rep.close()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", choices=("send", "recv"))
    p.add_argument("--proto", choices=("tcp", "udp"), default="tcp")
    p.add_argument("--bind", required=True, help="local rail address")
    p.add_argument("--to", help="receiver's rail address (send)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rate", type=float, default=0.0, help="offered rate, bit/s of frames")
    p.add_argument("--factor", type=float, default=1.0, help="payload per frame byte")
    p.add_argument("--datagram", type=int, default=1472, help="UDP payload per datagram")
    p.add_argument("--start-at", type=float, default=0.0, help="monotonic s")
    p.add_argument("--stop-at", type=float, default=0.0, help="monotonic s; 0: until killed")
    p.add_argument("--congestion", default="", help="TCP congestion control")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return send(args) if args.role == "send" else recv(args)


if __name__ == "__main__":
    sys.exit(main())
