"""Run-state files: the record of every kernel object a run created, written before it is created.

Clean-up deletes what these files name, not whatever matches a pattern, so a run can never remove
another tool's namespaces, and a run killed with SIGKILL is fully described by its file. Files
live in /run (a tmpfs), which a reboot empties together with the namespaces they describe.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from testbed.kernel import netns

PREFIX = "nzt-"  # every namespace this project creates starts with it
RUN_NS_RE = re.compile(re.escape(PREFIX) + r"([0-9a-f]{4})-")      # a run's namespaces
SCRATCH_NS_RE = re.compile(re.escape(PREFIX) + r"[a-z]+-(\d+)$")   # a probe's, with its pid
STATE_DIR = Path(os.environ.get("NEZHA_TESTBED_STATE", "/run/nezha-testbed"))


def _proc_start(pid: int) -> Optional[str]:
    """The kernel's start time of ``pid``: with the pid, it names one process across reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass
class RunState:
    run_id: str
    name: str
    pid: int
    pid_start: Optional[str]
    started: float
    backend: str = "pyroute2"
    namespaces: list[str] = field(default_factory=list)
    objects: list[dict] = field(default_factory=list)   # links etc., informational
    topology: dict = field(default_factory=dict)           # resolved, for people
    topology_doc: dict = field(default_factory=dict)       # as written, to re-attach
    detached: bool = False                                # `up`: the fabric outlives its builder
    path: Optional[Path] = None

    # ---------------------------------------------------------------- creation
    @classmethod
    def new(cls, name: str, backend: str, topology: dict, doc: dict) -> "RunState":
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        while True:
            run_id = secrets.token_hex(2)
            path = STATE_DIR / f"{run_id}.json"
            if not path.exists() and not any(n.startswith(f"{PREFIX}{run_id}-")
                                             for n in netns.listing()):
                break
        st = cls(run_id=run_id, name=name, pid=os.getpid(), pid_start=_proc_start(os.getpid()),
                 started=time.time(), backend=backend, topology=topology, topology_doc=dict(doc),
                 path=path)
        st.save()
        return st

    def ns_name(self, suffix: str) -> str:
        return f"{PREFIX}{self.run_id}-{suffix}"

    def record_namespace(self, ns: str) -> None:
        """Write-ahead: the name is on disk before the namespace exists."""
        if not ns.startswith(PREFIX):
            raise ValueError(f"namespace {ns!r} lacks the project prefix {PREFIX!r}")
        self.namespaces.append(ns)
        self.save()

    def record_object(self, **obj) -> None:
        self.objects.append(obj)

    def save(self) -> None:
        assert self.path is not None
        data = {k: v for k, v in self.__dict__.items() if k != "path"}
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    # ---------------------------------------------------------------- reading
    @classmethod
    def load(cls, path: Path) -> "RunState":
        data = json.loads(path.read_text())
        return cls(**data, path=path)

    @property
    def owner_alive(self) -> bool:
        return self.pid_start is not None and _proc_start(self.pid) == self.pid_start

    @property
    def live(self) -> bool:
        """Up and owned: its builder still runs, or it was left up on purpose (`up`)."""
        return self.owner_alive or (self.detached and all(netns.exists(n) for n in self.namespaces))

    def remove_all(self) -> list[str]:
        """Delete every recorded namespace (links inside die with them), then the file."""
        removed = []
        for ns in reversed(self.namespaces):
            if netns.exists(ns):
                netns.remove(ns)
                removed.append(ns)
        if self.path and self.path.exists():
            self.path.unlink()
        return removed


def runs() -> list[RunState]:
    if not STATE_DIR.is_dir():
        return []
    out = []
    for path in sorted(STATE_DIR.glob("*.json")):
        try:
            out.append(RunState.load(path))
        except (ValueError, TypeError, OSError):
            continue
    return out


def find(name_or_id: Optional[str] = None) -> list[RunState]:
    """Live runs matching a topology name or run id (all live runs when none is given)."""
    live = [r for r in runs() if r.live]
    if name_or_id is None:
        return live
    return [r for r in live if name_or_id in (r.name, r.run_id)]


def clean(everything: bool = False) -> dict:
    """Remove what dead runs left: first the namespaces their run-state files record, then any
    run namespace (``nzt-XXXX-...``) of no live run and any scratch namespace (``nzt-probe-PID``)
    whose process is gone; names without our prefix are never touched. ``everything`` also tears
    down fabrics left up on purpose."""
    removed_ns: list[str] = []
    removed_runs: list[str] = []
    keep: set[str] = set()
    for r in runs():
        if r.owner_alive and not everything:
            keep.update(r.namespaces)
            continue
        if r.detached and r.live and not everything:
            keep.update(r.namespaces)
            continue
        removed_ns += r.remove_all()
        removed_runs.append(r.run_id)
    for ns in netns.listing():
        if ns in keep:
            continue
        scratch = SCRATCH_NS_RE.match(ns)
        if RUN_NS_RE.match(ns) or (scratch and not os.path.exists(f"/proc/{scratch.group(1)}")):
            netns.remove(ns)
            removed_ns.append(ns)
    for tmp in STATE_DIR.glob("*.tmp") if STATE_DIR.is_dir() else []:
        tmp.unlink()
    return {"runs": removed_runs, "namespaces": removed_ns}
