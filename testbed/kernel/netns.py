"""Named network namespaces: create, delete, list, and run processes inside them.

Processes enter a namespace through ``nsenter --net`` (util-linux, on every Debian/Ubuntu), so a
child never inherits a half-switched Python interpreter: tools that cache the namespace at import
time (scapy) see the host's view from their first instruction.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from pyroute2 import netns as _netns

NETNS_DIR = Path("/var/run/netns")


def exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def create(name: str) -> None:
    _netns.create(name)


def remove(name: str) -> None:
    """Delete a namespace, first ending every process still inside it (they are ours)."""
    if not exists(name):
        return
    kill_processes(name)
    _netns.remove(name)


def listing() -> list[str]:
    return sorted(_netns.listnetns())


def inode(name: str) -> int:
    return os.stat(NETNS_DIR / name).st_ino


def pids_in(name: str) -> list[int]:
    """PIDs whose network namespace is ``name`` (matched by inode, never by name guessing)."""
    try:
        target = inode(name)
    except FileNotFoundError:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(entry / "ns" / "net").st_ino == target:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def kill_processes(name: str, grace: float = 1.0) -> None:
    """SIGTERM everything in the namespace, then SIGKILL what is left after ``grace`` seconds."""
    pids = [p for p in pids_in(name) if p != os.getpid()]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.5)):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _alive(p)]
            time.sleep(0.02)
        pids = alive
        if not pids:
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours still answers kill(0); treat it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def command(name: str, argv: Sequence[str]) -> list[str]:
    """The argv that runs ``argv`` inside namespace ``name``."""
    return ["nsenter", f"--net={NETNS_DIR / name}", "--", *argv]


def popen(name: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(command(name, argv), **kwargs)


def run(name: str, argv: Sequence[str], check: bool = True, timeout: float | None = 60,
        **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    return subprocess.run(command(name, argv), check=check, timeout=timeout, **kwargs)
