"""Evidence of what kernel MPTCP did during a run: ``ip mptcp monitor`` in every host's
namespace while the ``mptcp`` system runs, each event stamped on the run's clock.

One process per host (``ip mptcp monitor``, started through ``Host.popen`` like the ranks, so it
lives in the host's namespace and the fabric's teardown kills it whatever happens); a reader
thread per process stamps each line with ``time.monotonic()`` (CLOCK_MONOTONIC, the clock of
the fault records and iterations) as it arrives (iproute2 flushes every event) and appends it,
parsed, to ``mptcp_events.jsonl``:

    {"mono": 1234.567, "host": "h1", "event": "SF_CLOSED", "token": "0a1b2c3d",
     "saddr": "198.18.1.1", "daddr": "198.18.1.2", "sport": 40000, "dport": 29501,
     "locid": 1, "remid": 1, "error": 110, "backup": 0, "raw": "..."}

``event`` is the monitor's name (CREATED, ESTABLISHED, CLOSED, ANNOUNCED, REMOVED,
SF_ESTABLISHED, SF_CLOSED, SF_PRIORITY; LISTENER_CREATED/CLOSED, which iproute2 6.1 prints as
"UNKNOWN 15/16"). The report (testbed/analysis/mptcp.py) adds ``t``, seconds since the run's t0,
and summarises the file. ``stop`` ends every monitor (SIGTERM, then KILL) and joins the readers;
the workload runner calls it when its phases end, on an error or Ctrl-C too.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

EVENTS_FILE = "mptcp_events.jsonl"
_UNKNOWN = {"15": "LISTENER_CREATED", "16": "LISTENER_CLOSED"}
_LINE = re.compile(r"^\[\s*([A-Z_]+(?: \d+)?)\s*\]\s*(.*)$")
_INTS = ("sport", "dport", "locid", "remid", "error", "backup", "flags", "ifindex")
MIB_EVERY = 0.25       # s between two reads of each host's MPTcpExt counters


def read_mib() -> dict[str, int]:
    """This thread's namespace's MPTcpExt counters (/proc/net/netstat is the process's)."""
    with open("/proc/thread-self/net/netstat") as f:
        lines = f.read().splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("MPTcpExt:"):
            return {k: int(v) for k, v in zip(names.split()[1:], values.split()[1:])}
    return {}


def parse(line: str) -> Optional[dict]:
    """One monitor line as a dict (None for anything else)."""
    m = _LINE.match(line.strip())
    if not m:
        return None
    name = m.group(1)
    if name.startswith("UNKNOWN "):
        name = _UNKNOWN.get(name.split()[1], name.replace(" ", "_"))
    ev: dict = {"event": name}
    for key, val in re.findall(r"(\w+)=(\S+)", m.group(2)):
        key = {"saddr4": "saddr", "daddr4": "daddr", "saddr6": "saddr",
               "daddr6": "daddr"}.get(key, key)
        if key in _INTS:
            try:
                val = int(val)
            except ValueError:
                pass
        ev[key] = val
    return ev


class MptcpMonitor:
    """``ip mptcp monitor`` in each of ``hosts``' namespaces, into ``path`` (appended)."""

    def __init__(self, fabric, hosts, path: Path, append: bool = False) -> None:
        self.fabric = fabric
        self.hosts = list(hosts)
        self.path = Path(path)
        self.append = append
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._out = None
        self._stop = threading.Event()

    @property
    def running(self) -> bool:
        return bool(self.procs)

    def start(self, settle: float = 0.3) -> "MptcpMonitor":
        """Start one monitor per host; ``settle``: time for them to subscribe to the
        multicast group before the first connection (an event before that is not seen)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(self.path, "a" if self.append else "w")
        try:
            for host in self.hosts:
                h = self.fabric.hosts[host]
                proc = h.popen(["ip", "mptcp", "monitor"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                               bufsize=1)
                self.procs.append((host, proc))
                st = getattr(self.fabric, "state", None)
                if st is not None:      # recorded as soon as it exists, as flows are
                    st.record_object(kind="mptcp-monitor", ns=h.ns, pid=proc.pid)
                    st.save()
                t = threading.Thread(target=self._read, args=(host, proc), daemon=True,
                                     name=f"mptcp-monitor-{host}")
                t.start()
                self.threads.append(t)
            t = threading.Thread(target=self._sample_mib, daemon=True, name="mptcp-mib")
            t.start()
            self.threads.append(t)
        except BaseException:
            self.stop()
            raise
        time.sleep(settle)
        return self

    def _write(self, ev: dict) -> None:
        with self._lock:
            if self._out is not None:
                self._out.write(json.dumps(ev) + "\n")
                self._out.flush()

    def _sample_mib(self) -> None:
        """Every MIB_EVERY, each host's MPTcpExt counters; an ``MIB`` event with the ones that
        moved (SubflowStale, SubflowRecover, MPTCPRetrans, DuplicateData, ...), the first
        read as ``MIB_BASE`` with all of them."""
        from testbed.kernel import netns
        last: dict[str, dict] = {}
        while True:
            for host in self.hosts:
                try:
                    mib = netns.call_in(self.fabric.hosts[host].ns, read_mib, lane="mptcp-mib")
                except Exception:
                    continue
                now = time.monotonic()
                prev = last.get(host)
                last[host] = mib
                if prev is None:
                    self._write({"mono": round(now, 6), "host": host, "event": "MIB_BASE",
                                 "counters": mib})
                    continue
                delta = {k: v - prev.get(k, 0) for k, v in mib.items() if v != prev.get(k, 0)}
                if delta:
                    self._write({"mono": round(now, 6), "host": host, "event": "MIB",
                                 "delta": delta})
            if self._stop.wait(MIB_EVERY):
                return

    def _read(self, host: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            now = time.monotonic()
            ev = parse(line)
            if ev is None:
                continue
            self._write({"mono": round(now, 6), "host": host, **ev, "raw": line.strip()})

    def stop(self, grace: float = 1.0) -> None:
        """End every monitor (a moment first, for the events of connections just closed)."""
        if self.procs:
            time.sleep(0.1)
        self._stop.set()
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for _, p in self.procs:
            try:
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for t in self.threads:
            t.join(grace)
        for _, p in self.procs:
            if p.stdout is not None:
                p.stdout.close()
        with self._lock:
            if self._out is not None:
                self._out.close()
                self._out = None
        self.procs, self.threads = [], []
        self._stop.clear()
