"""An aggregation switch's lifecycle inside the fabric: start it in the rail's switch
namespace, read it back (PING / PONG), stop it.

The fabric records the service in its run state before it starts it, and the service lives in
the rail's switch namespace, which the run state records too: ``clean`` deleting that namespace
ends every process in it (testbed.kernel.netns.remove), so a service outlives no run, however
the run ended. The job secret reaches the service through its environment (readable by root
only, as /proc/PID/environ is), never its command line (readable by everyone).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

from nezha import aggwire
from nezha.errors import ProtocolError
from testbed.errors import FabricError
from testbed.kernel import netns

REPO_ROOT = Path(__file__).resolve().parents[2]
PORT = aggwire.DEFAULT_PORT   # where the fabric runs every aggregation service
START_TIMEOUT = 15.0       # s for the service to answer its first PING (python + numpy import)
STOP_GRACE = 2.0           # s after SIGTERM before SIGKILL


@dataclass
class Aggregator:
    """A running aggregation service: where it listens and its process."""
    rail: str
    ns: str
    address: str
    port: int
    proc: subprocess.Popen
    log: IO[bytes]

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"

    def log_tail(self, lines: int = 5) -> str:
        self.log.seek(0)
        return " | ".join(self.log.read().decode(errors="replace").strip().splitlines()[-lines:])


def start(rail: str, ns: str, address: str, port: int, secret: str,
          rate_bps: Optional[int], congestion: Optional[str] = None) -> Aggregator:
    """Start the service inside ``ns`` (nsenter; the process never runs in the root
    namespace), its connections under ``congestion`` (the ranks' TCP). Returns at once:
    ``wait_ready`` reads it back."""
    argv = [sys.executable, "-m", "testbed.aggregation.service", "--listen", f"{address}:{port}"]
    if rate_bps:
        argv += ["--rate", f"{rate_bps}bit"]
    if congestion:
        argv += ["--congestion", congestion]
    env = dict(os.environ, NEZHA_JOB_SECRET=secret, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    log = tempfile.TemporaryFile(prefix=f"nezha-agg-{rail}-")   # unlinked: gone with us
    proc = netns.popen(ns, argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                       stdin=subprocess.DEVNULL, cwd=REPO_ROOT)
    return Aggregator(rail, ns, address, port, proc, log)


def ping(address: str, port: int, timeout: float = 1.0) -> dict:
    """The service's PONG (``aggwire.ping``): the fabric's read-back of a switch (run it
    inside a namespace that reaches ``address``)."""
    return aggwire.ping(address, port, timeout)


def wait_ready(agg: Aggregator, timeout: Optional[float] = None) -> dict:
    """PING the service from inside its namespace until it answers; FabricError (with its
    output) if it exits or stays silent for ``timeout`` (START_TIMEOUT)."""
    timeout = START_TIMEOUT if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
        if agg.proc.poll() is not None:
            raise FabricError(f"aggregation service of rail {agg.rail} exited with "
                              f"{agg.proc.returncode}: {agg.log_tail() or 'no output'}")
        try:
            return netns.call_in(agg.ns, ping, agg.address, agg.port, 0.5)
        except (OSError, ValueError, ProtocolError) as e:
            if time.monotonic() > deadline:
                raise FabricError(f"aggregation service of rail {agg.rail} does not answer on "
                                  f"{agg.endpoint} after {timeout:g} s ({e}): "
                                  f"{agg.log_tail() or 'no output'}") from None
            time.sleep(0.05)


def stop(agg: Aggregator) -> None:
    """SIGTERM, then SIGKILL after STOP_GRACE; the process is reaped either way."""
    if agg.proc.poll() is None:
        agg.proc.terminate()
        try:
            agg.proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            agg.proc.kill()
            agg.proc.wait()
    agg.log.close()
