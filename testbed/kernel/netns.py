"""Named network namespaces: create, delete, list, and enter them. The one place that knows
where namespaces live (``NETNS_DIR``) and how to get inside one; there are exactly two ways:

* Child processes enter through ``nsenter --net`` (util-linux, on every Debian/Ubuntu)
  (``command``, ``popen``, ``run``), so a child never inherits a half-switched Python
  interpreter: tools that cache the namespace at import time (scapy) see the host's view from
  their first instruction.
* In-process work (``call_in``, ``submit_in``) runs on a dedicated worker thread of this module
  that setns()es into the namespace for the one call and back again (about 1 ms for an nft
  batch, against about 7 ms for forking ``nsenter nft``). setns() changes only the calling
  thread, so the caller's threads never change namespace; a socket opened by ``fn`` keeps the
  namespace it was created in after the worker has come back. One worker per lane, calls in
  order: ``netns`` for calls the caller waits for, ``netns-bg`` for nft deletions nobody waits
  for (acked only after an RCU grace period, 8-40 ms).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

from pyroute2 import netns as _netns

from testbed.errors import FabricError

NETNS_DIR = Path("/var/run/netns")
CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
T = TypeVar("T")


def path(name: str) -> Path:
    """Where namespace ``name`` is mounted (the file nsenter and setns open)."""
    return NETNS_DIR / name


def exists(name: str) -> bool:
    return path(name).exists()


def create(name: str) -> None:
    """Create and name a new network namespace, without forking: the netns worker thread
    unshare()s into a fresh one, bind-mounts it at ``path(name)`` and setns()es back (what
    ``ip netns add`` does in a child; pyroute2's ``netns.create`` forks a helper for it,
    about 7 ms each)."""
    _share_netns_dir()
    target = path(name)
    os.close(os.open(target, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
    try:
        call_in(None, _unshare_and_bind, str(target))
    except BaseException:
        target.unlink(missing_ok=True)
        raise


_MS_SHARED, _MS_REC, _MNT_DETACH = 1 << 20, 16384, 2
_dir_shared = False


def _share_netns_dir() -> None:
    """NETNS_DIR as a shared mount point (once per process), so a namespace mounted there is
    seen by every mount namespace (iproute2's ``netns_add`` does the same)."""
    global _dir_shared
    if _dir_shared:
        return
    NETNS_DIR.mkdir(parents=True, exist_ok=True)
    libc = _libc_handle()
    d = str(NETNS_DIR).encode()
    if libc.mount(b"", d, b"none", _MS_SHARED | _MS_REC, None) != 0:
        if libc.mount(d, d, b"none", _MS_BIND | _MS_REC, None) != 0 or \
                libc.mount(b"", d, b"none", _MS_SHARED | _MS_REC, None) != 0:
            err = ctypes.get_errno()
            raise FabricError(f"cannot make {NETNS_DIR} a shared mount: {os.strerror(err)}")
    _dir_shared = True


def _unshare_and_bind(target: str) -> None:
    """On a netns worker thread: a fresh namespace for this thread, named at ``target``; the
    thread then goes back to where it was (setns changes only this thread)."""
    libc = _libc_handle()
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
        try:
            if libc.mount(b"/proc/thread-self/ns/net", target.encode(), b"none", _MS_BIND,
                          None) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"bind mount of a new namespace at {target}: "
                                   f"{os.strerror(err)}")
        finally:
            _setns(own)
    finally:
        os.close(own)


def attach(name: str, pid: int) -> None:
    """Name the network namespace of ``pid`` (e.g. a Mininet node's shell): bind-mount
    ``/proc/PID/ns/net`` onto NETNS_DIR/NAME, what ``ip netns attach`` does."""
    target = path(name)
    NETNS_DIR.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["ip", "netns", "attach", name, str(pid)], capture_output=True, text=True)
    if r.returncode == 0 and target.exists():
        return
    # older iproute2 without `attach`: do the bind mount ourselves
    target.touch(exist_ok=True)
    libc = ctypes.CDLL(None, use_errno=True)
    src = f"/proc/{pid}/ns/net".encode()
    if libc.mount(src, str(target).encode(), None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        target.unlink(missing_ok=True)
        raise FabricError(f"cannot name the namespace of pid {pid} {name}: "
                          f"{r.stderr.strip() or os.strerror(err)}")


def remove(name: str) -> None:
    """Delete a namespace, first ending every process still inside it (they are ours)."""
    if not exists(name):
        return
    kill_processes(name)
    _netns.remove(name)


def listing() -> list[str]:
    return sorted(_netns.listnetns())


def inode(name: str) -> int:
    return os.stat(path(name)).st_ino


def pids_in(name: str) -> list[int]:
    """PIDs whose network namespace is ``name`` (matched by inode, never by name guessing)."""
    return pids_in_each([name])[name]


def pids_in_each(names: Sequence[str]) -> dict[str, list[int]]:
    """{name: PIDs in namespace ``name``} with ONE pass over /proc (a pass stats every
    process: ~7 ms with 150 processes, once per namespace that was most of a tear-down)."""
    by_inode: dict[int, str] = {}
    for name in names:
        try:
            by_inode[inode(name)] = name
        except FileNotFoundError:
            pass
    found: dict[str, list[int]] = {name: [] for name in names}
    if not by_inode:
        return found
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                ino = os.stat(f"/proc/{entry.name}/ns/net").st_ino
            except OSError:
                continue
            if ino in by_inode:
                found[by_inode[ino]].append(int(entry.name))
    return found


def kill_processes(name: str, grace: float = 1.0) -> None:
    """SIGTERM everything in the namespace, then SIGKILL what is left after ``grace`` seconds."""
    kill_pids(pids_in(name), grace)


def kill_pids(pids: Sequence[int], grace: float = 1.0) -> None:
    """SIGTERM ``pids`` (never this process), then SIGKILL what is left after ``grace``."""
    pids = [p for p in pids if p != os.getpid()]
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


def remove_all(names: Sequence[str]) -> list[str]:
    """Delete the namespaces of ``names`` that exist, first ending every process inside any
    of them (they are ours; one /proc pass for all); returns those deleted."""
    present = [n for n in names if exists(n)]
    kill_pids([pid for pids in pids_in_each(present).values() for pid in pids])
    for name in present:
        _netns.remove(name)
    return present


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
    return ["nsenter", f"--net={path(name)}", "--", *argv]


def popen(name: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(command(name, argv), **kwargs)


def run(name: str, argv: Sequence[str], check: bool = True, timeout: float | None = 60,
        **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    return subprocess.run(command(name, argv), check=check, timeout=timeout, **kwargs)


# ------------------------------------------------------------------ in-process: setns workers
_libc: Any = None
_lanes: dict[str, ThreadPoolExecutor] = {}
_lanes_pid = os.getpid()
_lanes_lock = threading.Lock()
_worker = threading.local()   # .lane is set on our worker threads only


def _libc_handle() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.unshare.argtypes = [ctypes.c_int]
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                               ctypes.c_ulong, ctypes.c_void_p]
        _libc = libc
    return _libc


def _setns(fd: int) -> None:
    if _libc_handle().setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _enter(ns: Optional[str], fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn(*args)`` with THIS thread inside namespace ``ns`` (None: where it is), then
    come back. Only ever runs on a worker thread of this module."""
    if ns is None:
        return fn(*args)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(path(ns), os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            return fn(*args)
        finally:
            _setns(own)
    finally:
        os.close(own)


def _mark_worker(lane: str) -> None:
    _worker.lane = lane


def _lane(name: str) -> ThreadPoolExecutor:
    """The single worker thread of lane ``name`` (created on first use, again after a fork:
    the parent's worker threads do not exist in the child)."""
    global _lanes_pid
    with _lanes_lock:
        if _lanes_pid != os.getpid():
            _lanes.clear()
            _lanes_pid = os.getpid()
        if name not in _lanes:
            _lanes[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                              initializer=_mark_worker, initargs=(name,))
        return _lanes[name]


def submit_in(ns: Optional[str], fn: Callable[..., T], *args: Any,
              lane: str = "netns") -> "Future[T]":
    """Queue ``fn(*args)`` to run inside ``ns`` on the worker thread of ``lane`` (one thread per
    lane, calls in order); work on another lane does not wait behind it. Called from a worker
    thread itself, ``fn`` runs there at once (a worker never waits for a worker)."""
    if getattr(_worker, "lane", None) is not None:
        done: Future = Future()
        try:
            done.set_result(_enter(ns, fn, *args))
        except BaseException as e:
            done.set_exception(e)
        return done
    return _lane(lane).submit(_enter, ns, fn, *args)


def call_in(ns: Optional[str], fn: Callable[..., T], *args: Any, timeout: float = 10.0,
            lane: str = "netns") -> T:
    """Run ``fn(*args)`` inside namespace ``ns`` (None: the root namespace) on a worker thread
    and return its result (or raise its exception); sockets ``fn`` opens belong to ``ns``."""
    return submit_in(ns, fn, *args, lane=lane).result(timeout)


def _renice(nice: int) -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def set_lane_priority(nice: int, lane: str = "netns") -> None:
    """Run ``lane``'s worker thread at ``nice`` (root only; Linux nice values are per
    thread): a fault's nft change waits on that worker, and a nice-0 thread on a loaded
    machine waits for a time slice. Raises OSError when not permitted."""
    call_in(None, _renice, nice, lane=lane)
