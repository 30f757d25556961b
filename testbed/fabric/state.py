"""Run-state files: the record of every kernel object a run created, written before it is created.

Clean-up deletes what these files name, not whatever matches a pattern, so a run can never remove
another tool's namespaces, and a run killed with SIGKILL is fully described by its file. Files
live in /run (a tmpfs), which a reboot empties together with the namespaces they describe.

Clean-up proves before it removes:
  * a file that does not load (truncated, a key of a newer version, a name that is not one of
    this run's namespace names) keeps its run: the run id in the file name protects every
    namespace of that run, and the file stays for a person to look at;
  * builds hold ``lock()`` while they record and create, and ``clean`` while it decides and
    removes, so clean never sees a namespace whose record it read before it was written;
  * a ``.tmp`` file is only removed when the process that writes it (its pid is in its name) is
    gone.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from testbed.kernel import netns

PREFIX = "nzt-"  # every namespace this project creates starts with it
RUN_NS_RE = re.compile(re.escape(PREFIX) + r"([0-9a-f]{4})-")      # a run's namespaces
SCRATCH_NS_RE = re.compile(re.escape(PREFIX) + r"[a-z]+-(\d+)$")   # a probe's, with its pid
STATE_DIR = Path(os.environ.get("NEZHA_TESTBED_STATE", "/run/nezha-testbed"))
LOCK_FILE = "lock"                                  # in STATE_DIR; see lock()
RUN_ID_RE = re.compile(r"[0-9a-f]{4}")
_SUFFIX_RE = re.compile(r"(sw-)?[a-z][a-z0-9]{0,14}")   # a host, or sw-RAIL: a rail's switch
_IFNAME_RE = re.compile(r"[a-z][a-z0-9]{0,14}")         # a host or rail name (testbed.model)
_TMP_RE = re.compile(r"[0-9a-f]{4}\.(\d+)\.tmp")        # RUNID.PID.tmp: save()'s temporary
_FIELDS: dict[str, tuple[type, ...]] = {
    "run_id": (str,), "name": (str,), "pid": (int,), "pid_start": (str, type(None)),
    "started": (int, float), "backend": (str,), "namespaces": (list,), "objects": (list,),
    "topology": (dict,), "topology_doc": (dict,), "detached": (bool,)}
_REQUIRED = ("run_id", "name", "pid", "pid_start", "started")


class StateFileError(ValueError):
    """A run-state file that does not load as one this version wrote; its run is kept."""


def check_namespace(name: Any, run_id: str) -> str:
    """``name`` if it is one of run ``run_id``'s namespace names (``nzt-RUNID-HOST`` or
    ``nzt-RUNID-sw-RAIL``): never a path (no ``/``, no ``..``), never another run's."""
    own = f"{PREFIX}{run_id}-"
    if not isinstance(name, str) or not name.startswith(own) \
            or not _SUFFIX_RE.fullmatch(name[len(own):]):
        shown = repr(name)[:80]
        raise StateFileError(f"{shown} is not a namespace name of run {run_id} "
                             f"({own}HOST or {own}sw-RAIL)")
    return name


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
        self.record_namespaces([ns])

    def record_namespaces(self, names: list[str]) -> None:
        """Write-ahead for several namespaces with one write (a write is an fsync: 4 ms
        each on this machine, a quarter of a 64-host build when done per namespace)."""
        for ns in names:
            if not ns.startswith(PREFIX):
                raise ValueError(f"namespace {ns!r} lacks the project prefix {PREFIX!r}")
        self.namespaces.extend(names)
        self.save()

    def record_object(self, **obj) -> None:
        self.objects.append(obj)

    def save(self) -> None:
        assert self.path is not None
        data = {k: v for k, v in self.__dict__.items() if k != "path"}
        tmp = self.path.with_name(f"{self.path.stem}.{os.getpid()}.tmp")   # see _clean_tmp
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    # ---------------------------------------------------------------- reading
    @classmethod
    def load(cls, path: Path) -> "RunState":
        """The run a state file describes; StateFileError unless every field has the type this
        version writes and every name is one of this run's own (``check_namespace``)."""
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise StateFileError(f"unreadable: {str(e)[:200]}") from None
        if not isinstance(data, dict):
            raise StateFileError(f"a JSON {type(data).__name__}, not an object")
        unknown = sorted(str(k)[:40] for k in data if k not in _FIELDS)
        if unknown:
            raise StateFileError(f"unknown keys {', '.join(unknown[:5])} (a newer version?)")
        for key in _REQUIRED:
            if key not in data:
                raise StateFileError(f"no {key}")
        for key, value in data.items():
            if not isinstance(value, _FIELDS[key]) or (key == "pid" and (
                    isinstance(value, bool) or value <= 0)):
                raise StateFileError(f"{key} is a {type(value).__name__}")
        run_id = data["run_id"]
        if not RUN_ID_RE.fullmatch(run_id) or path.stem != run_id:
            raise StateFileError(f"run id {run_id[:20]!r} does not match the file name")
        for ns in data.get("namespaces", []):
            check_namespace(ns, run_id)
        topology = data.get("topology", {})
        names = list(topology.get("hosts") or []) + [r.get("name") if isinstance(r, dict) else r
                                                     for r in topology.get("rails") or []]
        for name in names:
            if not isinstance(name, str) or not _IFNAME_RE.fullmatch(name):
                raise StateFileError(f"{repr(name)[:80]} is not a host or rail name")
        for obj in data.get("objects", []):
            if not isinstance(obj, dict):
                raise StateFileError("an object that is not a JSON object")
            for key in ("ns", "peer_ns"):
                if key in obj:
                    check_namespace(obj[key], run_id)
            for key in ("ifname", "peer_ifname"):
                if key in obj and not (isinstance(obj[key], str)
                                       and _IFNAME_RE.fullmatch(obj[key])):
                    raise StateFileError(f"{repr(obj[key])[:80]} is not an interface name")
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
        for ns in self.namespaces:
            check_namespace(ns, self.run_id)     # before anything is removed
        removed = netns.remove_all(list(reversed(self.namespaces)))
        if self.path and self.path.exists():
            self.path.unlink()
        return removed


@dataclass(frozen=True)
class Unreadable:
    """A state file that did not load: its run is kept, never cleaned."""

    path: Path
    reason: str

    @property
    def run_id(self) -> Optional[str]:
        """The run id of the file name (RUNID.json), when it has that form."""
        return self.path.stem if RUN_ID_RE.fullmatch(self.path.stem) else None

    def protects(self, ns: str) -> bool:
        return self.run_id is not None and ns.startswith(f"{PREFIX}{self.run_id}-")


def scan() -> tuple[list[RunState], list[Unreadable]]:
    """Every run-state file: the runs that loaded, and the files that did not."""
    if not STATE_DIR.is_dir():
        return [], []
    loaded, unreadable = [], []
    for path in sorted(STATE_DIR.glob("*.json")):
        try:
            loaded.append(RunState.load(path))
        except StateFileError as e:
            unreadable.append(Unreadable(path, str(e)))
    return loaded, unreadable


def runs() -> list[RunState]:
    """The runs whose state files load (``scan`` also names the others)."""
    return scan()[0]


_lock_guard = threading.RLock()     # threads of this process take turns; nesting is fine
_lock_fd: Optional[int] = None
_lock_depth = 0


@contextlib.contextmanager
def lock() -> Iterator[None]:
    """The state directory's lock (``flock`` on STATE_DIR/lock): a build holds it while it
    records and creates (not for its whole run), ``clean`` while it decides and removes.
    Re-entrant within a process; the kernel releases it when a holder dies."""
    global _lock_fd, _lock_depth
    with _lock_guard:
        if _lock_depth == 0:
            STATE_DIR.mkdir(parents=True, exist_ok=True)
            fd = os.open(STATE_DIR / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            _lock_fd = fd
        _lock_depth += 1
        try:
            yield
        finally:
            _lock_depth -= 1
            if _lock_depth == 0 and _lock_fd is not None:
                os.close(_lock_fd)           # closing the descriptor releases the lock
                _lock_fd = None


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
    down fabrics left up on purpose. A state file that does not load keeps its run (and every
    namespace with its run id), whatever ``everything`` says: it is reported under
    ``unreadable``, with the namespaces it protects under ``kept``."""
    removed_ns: list[str] = []
    removed_runs: list[str] = []
    kept: list[str] = []
    with lock():      # no build records or creates while this decides and removes
        loaded, unreadable = scan()
        keep_ids: set[str] = set()
        for r in loaded:
            if not everything and (r.owner_alive or (r.detached and r.live)):
                keep_ids.add(r.run_id)
                continue
            removed_ns += r.remove_all()
            removed_runs.append(r.run_id)
        for ns in netns.listing():
            run = RUN_NS_RE.match(ns)
            if run and run.group(1) in keep_ids:
                continue
            if any(u.protects(ns) for u in unreadable):
                kept.append(ns)
                continue
            scratch = SCRATCH_NS_RE.match(ns)
            if run or (scratch and not os.path.exists(f"/proc/{scratch.group(1)}")):
                netns.remove(ns)
                removed_ns.append(ns)
        _clean_tmp()
    return {"runs": removed_runs, "namespaces": removed_ns, "unreadable": unreadable,
            "kept": kept}


def _clean_tmp() -> None:
    """Remove the temporaries of writers that are gone (RUNID.PID.tmp with no process PID); a
    live process's may be renamed into place at any moment, and a name without a pid has an
    unknown writer: both stay."""
    for tmp in STATE_DIR.glob("*.tmp") if STATE_DIR.is_dir() else []:
        m = _TMP_RE.fullmatch(tmp.name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            tmp.unlink(missing_ok=True)
