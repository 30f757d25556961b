"""Packet captures of every host's rail interfaces: one pcap file per host and rail.

    with Capture(fabric, results / "captures", max_mb=64):
        ... run the workload ...
    # captures/h1.r0.pcap, h1.r1.pcap, ..., captures/capture.json (what, where, drops, caps)

Why tcpdump, driven by a small recorder process, and not scapy's sniffer:
* Speed and completeness. A rail carries hundreds of Mbit/s; scapy's ``sniff`` decodes every
  packet in Python and on two cores drops packets silently, and a capture that misses packets
  cannot be compared byte for byte with kernel counters. tcpdump uses a kernel ring (TPACKET)
  and reports the packets the kernel dropped, which we record.
* Namespaces. The recorder is started *inside* the host's namespace (``Host.popen`` ->
  ``nsenter --net``), so tcpdump opens the interface there from its first instruction; nothing
  has to follow a namespace change after import (scapy would not).
* The size cap. tcpdump's ``-C``/``-W`` rotate and overwrite the oldest data, which loses the
  start of the run. The recorder (``python -m testbed.run.capture``, this module) instead reads
  tcpdump's pcap stream and writes whole packet records until the cap, then drops the rest and
  says so (``truncated``); the file is always a valid pcap.
* Full packets (snaplen 0): Nezha frames are cut from the TCP byte stream (testbed/pcap/dissect.py),
  which needs every payload byte; a short snaplen would lose frame boundaries.

``start()`` returns once every tcpdump is listening; ``stop()`` ends them (SIGTERM: tcpdump
flushes), waits for the files to be complete, and writes ``capture.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFEST = "capture.json"
_PCAP_HDR = 24
_REC = struct.Struct("=IIII")    # ts_sec, ts_usec, incl_len, orig_len (tcpdump: native order)


@dataclass
class Recorder:
    host: str
    rail: str
    path: Path
    proc: subprocess.Popen
    stats: dict = field(default_factory=dict)


class Capture:
    """Record every (host, rail) interface of a fabric to ``out_dir/HOST.RAIL.pcap``."""

    def __init__(self, fabric, out_dir, max_mb: float = 64, hosts: Optional[Sequence[str]] = None,
                 rails: Optional[Sequence[str]] = None, ready_timeout: float = 10.0) -> None:
        self.fabric = fabric
        self.out_dir = Path(out_dir)
        self.max_bytes = int(max_mb * 1_000_000)
        self.hosts = list(hosts or fabric.topo.hosts)
        self.rails = list(rails or [r.name for r in fabric.topo.rails])
        self.ready_timeout = ready_timeout
        self.recorders: list[Recorder] = []
        self.manifest: dict = {}

    def __enter__(self) -> "Capture":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Capture":
        self.out_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        try:
            for h in self.hosts:
                for r in self.rails:
                    path = self.out_dir / f"{h}.{r}.pcap"
                    argv = [sys.executable, "-m", "testbed.run.capture", "--iface", r,
                            "--out", str(path), "--max-bytes", str(self.max_bytes)]
                    proc = self.fabric.hosts[h].popen(argv, stdout=subprocess.PIPE,
                                                      stderr=subprocess.PIPE, text=True,
                                                      stdin=subprocess.DEVNULL, env=env)
                    self.recorders.append(Recorder(h, r, path, proc))
            deadline = time.monotonic() + self.ready_timeout
            for rec in self.recorders:
                line = _readline(rec.proc, deadline)
                if line.strip() != "ready":
                    err = rec.proc.stderr.read() if rec.proc.poll() is not None else ""
                    raise RuntimeError(f"capture on {rec.host}.{rec.rail} did not start: "
                                       f"{line.strip() or err.strip() or 'timeout'}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> dict:
        """End every recorder, wait for complete files, write and return the manifest."""
        if not self.recorders:
            return self.manifest
        for rec in self.recorders:
            if rec.proc.poll() is None:
                rec.proc.send_signal(signal.SIGTERM)
        for rec in self.recorders:
            try:
                out, err = rec.proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                rec.proc.kill()
                out, err = rec.proc.communicate()
            for line in out.splitlines():
                if line.startswith("{"):
                    rec.stats = json.loads(line)
            if not rec.stats:
                rec.stats = {"error": err.strip()[-500:]}
            host = self.fabric.hosts.get(rec.host)
            if host is not None and rec.proc in host.processes:
                host.processes.remove(rec.proc)
        topo = self.fabric.topo
        self.manifest = {
            "topology": topo.name,
            "rails": [r.name for r in topo.rails],          # index order = Nezha rail index
            "hosts": {h: {r.name: topo.address(h, r.name) for r in topo.rails}
                      for h in topo.hosts},
            "max_bytes": self.max_bytes,
            "files": [{"host": rec.host, "rail": rec.rail, "file": rec.path.name, **rec.stats}
                      for rec in self.recorders],
        }
        (self.out_dir / MANIFEST).write_text(json.dumps(self.manifest, indent=1))
        self.recorders = []
        return self.manifest

    @property
    def files(self) -> list[Path]:
        return [self.out_dir / f["file"] for f in self.manifest.get("files", [])]


def _readline(proc: subprocess.Popen, deadline: float) -> str:
    """One line of the recorder's stdout, or '' at the deadline."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(max(0.0, deadline - time.monotonic()))
    return box[0] if box else ""


# ------------------------------------------------------------------ the recorder process
def _read_exact(f, n: int) -> bytes:
    data = f.read(n)
    return data if data is not None else b""


def _start_tcpdump(iface: str) -> tuple[subprocess.Popen, list[str]]:
    """tcpdump writing pcap to its stdout, returned once it listens, and the list that collects
    its other stderr lines. SIGTERM/SIGINT to this process are passed on (tcpdump flushes)."""
    tcpdump = subprocess.Popen(["tcpdump", "-i", iface, "-n", "-s", "0", "-U", "-B", "16384",
                                "--immediate-mode", "-w", "-"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    errors: list[str] = []
    ready = threading.Event()

    def stderr_reader():
        for raw in tcpdump.stderr:
            line = raw.decode(errors="replace").strip()
            if "listening on" in line:
                ready.set()
            else:
                errors.append(line)
        ready.set()
    threading.Thread(target=stderr_reader, daemon=True).start()

    def on_signal(signum, frame):
        if tcpdump.poll() is None:
            tcpdump.send_signal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ready.wait(10)
    if tcpdump.poll() is not None:
        raise SystemExit(f"tcpdump on {iface} failed: {' | '.join(errors)}")
    return tcpdump, errors


def _copy_capped(src, f, max_bytes: int, stats: dict) -> None:
    """Copy a pcap stream to ``f`` record by record until ``max_bytes``; count the rest."""
    hdr = _read_exact(src, _PCAP_HDR)
    if len(hdr) != _PCAP_HDR:
        return
    f.write(hdr)
    written = _PCAP_HDR
    while True:
        rh = _read_exact(src, _REC.size)
        if len(rh) < _REC.size:
            break
        incl = _REC.unpack(rh)[2]
        body = _read_exact(src, incl)
        if len(body) < incl:
            break
        if written + len(rh) + incl > max_bytes:
            stats["truncated"] = True
            stats["dropped_packets"] += 1
            continue
        f.write(rh)
        f.write(body)
        written += len(rh) + incl
        stats["packets"] += 1
    stats["bytes"] = written


def record(iface: str, out: str, max_bytes: int) -> dict:
    """Run tcpdump on ``iface`` (in this process's namespace) and write whole packet records
    to ``out`` until ``max_bytes``. Ends on SIGTERM/SIGINT; returns statistics."""
    tcpdump, errors = _start_tcpdump(iface)
    print("ready", flush=True)
    stats = {"packets": 0, "bytes": 0, "dropped_packets": 0, "truncated": False}
    with open(out, "wb") as f:
        _copy_capped(tcpdump.stdout, f, max_bytes, stats)
        f.flush()
        os.fsync(f.fileno())
    tcpdump.wait()
    time.sleep(0.05)
    for line in errors:
        if "dropped by kernel" in line:
            stats["kernel_dropped"] = int(line.split()[0])
        if "captured" in line.split():
            stats["tcpdump_captured"] = int(line.split()[0])
    return stats


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.run.capture",
                                description="record one interface of this namespace to pcap")
    p.add_argument("--iface", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-bytes", type=int, default=64_000_000)
    a = p.parse_args(argv)
    stats = record(a.iface, a.out, a.max_bytes)
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
