"""`clean` proves before it removes: a state file that does not load keeps its run, a build that
records and creates while clean decides loses nothing, a live writer's temporary stays, and no
name from a state file reaches anything but one of that run's own namespaces."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.fabric import state
from testbed.kernel import netns

ROOT = Path(__file__).resolve().parent.parent


def record(rid: str, **changes) -> dict:
    """A state file's content as this version writes it (owner: a process that is gone)."""
    data = {"run_id": rid, "name": "t", "pid": _dead_pid(), "pid_start": "1", "started": 1.0,
            "backend": "pyroute2", "namespaces": [f"nzt-{rid}-h1", f"nzt-{rid}-sw-r0"],
            "objects": [{"kind": "veth", "ns": f"nzt-{rid}-h1", "ifname": "r0",
                         "peer_ns": f"nzt-{rid}-sw-r0", "peer_ifname": "h1"}],
            "topology": {"hosts": ["h1"], "rails": [{"name": "r0"}]}, "topology_doc": {},
            "detached": False}
    data.update(changes)
    return data


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ---- pure: what a state file may name ---------------------------------------------------------
@pytest.mark.parametrize("change,words", [
    ({"future_key": 1}, "unknown keys future_key"),
    ({"namespaces": ["nzt-../../proc/self/ns/net"]}, "not a namespace name of run"),
    ({"namespaces": ["nzt-abcd-../../../proc/1/ns/net"]}, "not a namespace name of run"),
    ({"namespaces": ["../netns/nzt-abcd-h1"]}, "not a namespace name of run"),
    ({"namespaces": ["nzt-ffff-h1"]}, "not a namespace name of run abcd"),   # another run's
    ({"namespaces": ["nzt-abcd-h1 x"]}, "not a namespace name"),
    ({"namespaces": ["nzt-abcd-" + "h" * 40]}, "not a namespace name"),
    ({"namespaces": [7]}, "not a namespace name"),
    ({"objects": [{"ns": "nzt-abcd-h1", "ifname": "../x"}]}, "not an interface name"),
    ({"objects": [{"peer_ns": "/proc/self/ns/net"}]}, "not a namespace name"),
    ({"topology": {"hosts": ["../../proc/1/ns/net"]}}, "not a host or rail name"),
    ({"run_id": "ffff"}, "does not match the file name"),
    ({"pid": "self"}, "pid is a str"),
])
def test_a_state_file_naming_anything_but_its_own_namespaces_does_not_load(tmp_path, change,
                                                                            words):
    path = tmp_path / "abcd.json"
    path.write_text(json.dumps(record("abcd")))
    assert state.RunState.load(path).namespaces == ["nzt-abcd-h1", "nzt-abcd-sw-r0"]
    path.write_text(json.dumps(record("abcd", **change)))
    with pytest.raises(state.StateFileError) as info:
        state.RunState.load(path)
    assert words in str(info.value)


def test_scan_names_unreadable_files_and_their_run_ids(tmp_path, monkeypatch):
    monkeypatch.setattr(state, "STATE_DIR", tmp_path)
    (tmp_path / "abcd.json").write_text(json.dumps(record("abcd")))
    (tmp_path / "beef.json").write_text(json.dumps(record("beef"))[:50])      # truncated
    (tmp_path / "notes.json").write_text("{}")
    loaded, unreadable = state.scan()
    assert [r.run_id for r in loaded] == ["abcd"]
    assert [(u.path.name, u.run_id) for u in unreadable] == [("beef.json", "beef"),
                                                             ("notes.json", None)]
    assert unreadable[0].protects("nzt-beef-h1") and not unreadable[0].protects("nzt-abcd-h1")
    assert not unreadable[1].protects("nzt-note-h1")
    assert state.runs() == loaded


def test_save_writes_a_temporary_named_by_its_writer(tmp_path):
    st = state.RunState(run_id="abcd", name="t", pid=os.getpid(), pid_start="1", started=1.0,
                        path=tmp_path / "abcd.json")
    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append(Path(src).name)
        real(src, dst)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "replace", spy)
        st.save()
    assert seen == [f"abcd.{os.getpid()}.tmp"]
    assert state.RunState.load(tmp_path / "abcd.json").run_id == "abcd"


# ---- against the real state directory and namespaces (root) -----------------------------------
def _free_run_id() -> str:
    while True:
        run_id = secrets.token_hex(2)
        if not (state.STATE_DIR / f"{run_id}.json").exists() and \
                not any(n.startswith(f"nzt-{run_id}-") for n in netns.listing()):
            return run_id


@contextlib.contextmanager
def planted(run_id: str, content, namespaces=("h1",)):
    """A state file for ``run_id`` (dict: as JSON; str: as written) and namespaces of that run,
    all removed again at the end."""
    state.STATE_DIR.mkdir(parents=True, exist_ok=True)
    path = state.STATE_DIR / f"{run_id}.json"
    made = [f"nzt-{run_id}-{suffix}" for suffix in namespaces]
    try:
        if content is not None:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        for ns in made:
            netns.create(ns)
        yield path, made
    finally:
        for ns in made:
            if netns.exists(ns):
                netns.remove(ns)
        path.unlink(missing_ok=True)


def tb_clean(timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed", "clean"], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


@pytest.mark.netns
@pytest.mark.parametrize("kind", ["newer-version", "truncated"])
def test_a_run_whose_state_file_does_not_load_is_kept_and_reported(kind, no_leftovers):
    run_id = _free_run_id()
    good = json.dumps(record(run_id, namespaces=[f"nzt-{run_id}-h1"], objects=[]))
    content = good[:-1] + ', "written_by": "v2"}' if kind == "newer-version" else good[:40]
    with planted(run_id, content) as (path, made):
        r = tb_clean()
        assert r.returncode == 0, r.stderr
        assert netns.exists(made[0]), "clean removed a namespace of a run it could not read"
        assert path.exists(), "the unreadable state file must stay for a person to look at"
        assert f"kept run {run_id}" in r.stderr and str(path) in r.stderr
        assert made[0] in r.stderr and made[0] not in r.stdout


@pytest.mark.netns
def test_clean_waits_for_a_build_that_is_recording_and_creating(no_leftovers):
    """A build holds the lock between writing its record and creating the namespace; clean
    decides only after, so it sees both (before the lock it removed the new namespace)."""
    run_id = _free_run_id()
    with planted(run_id, None) as (path, made):
        with state.lock():                      # this process is a build, mid-creation
            proc = subprocess.Popen([sys.executable, "-m", "testbed", "clean"], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(1.5)                      # long enough for clean to have decided
            assert proc.poll() is None, "clean did not wait for the lock"
            assert netns.exists(made[0])
            path.write_text(json.dumps(record(run_id, pid=os.getpid(),
                                              pid_start=state._proc_start(os.getpid()),
                                              namespaces=made, objects=[])))
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert netns.exists(made[0]) and made[0] not in out


@pytest.mark.netns
def test_a_build_holds_the_lock_while_creating_and_not_after(no_leftovers, monkeypatch):
    from testbed.fabric import Fabric
    from testbed.model import spec

    def held() -> bool:
        fd = os.open(state.STATE_DIR / state.LOCK_FILE, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)                         # also releases it if this took it
        return False

    seen = []
    create = netns.create

    def spying_create(name):
        if state.RUN_NS_RE.match(name):          # not a capability probe's scratch namespace
            seen.append(held())
        create(name)
    monkeypatch.setattr(netns, "create", spying_create)
    with Fabric(spec.loads("name: locked\nhosts: 2\nrails: [{name: r0}]\n")):
        assert not held(), "a fabric that is up must not hold the state lock"
    assert seen == [True, True, True]            # h1, h2, sw-r0


@pytest.mark.netns
def test_clean_keeps_the_temporary_of_a_live_writer(no_leftovers):
    run_id = _free_run_id()
    state.STATE_DIR.mkdir(parents=True, exist_ok=True)
    live = state.STATE_DIR / f"{run_id}.{os.getpid()}.tmp"
    dead = state.STATE_DIR / f"{run_id}.{_dead_pid()}.tmp"
    try:
        live.write_text("{")
        dead.write_text("{")
        r = tb_clean()
        assert r.returncode == 0, r.stderr
        assert live.exists(), "clean deleted a temporary that a live process may be renaming"
        assert not dead.exists()
    finally:
        live.unlink(missing_ok=True)
        dead.unlink(missing_ok=True)


@pytest.mark.netns
def test_a_crafted_name_in_a_state_file_reaches_nothing(no_leftovers):
    """A dead run's file names '../netns/nzt-Y-h1' (outside its own prefix): clean used to
    follow it into another (live) run's namespace and kill the processes in it. The same path
    trick reached /proc/self/ns/net, i.e. every process of the root namespace; such a file must
    not load at all."""
    victim = _free_run_id()
    with planted(victim, record(victim, pid=os.getpid(), pid_start=state._proc_start(os.getpid()),
                                namespaces=[f"nzt-{victim}-h1"], objects=[])) as (_, made):
        sleeper = netns.popen(made[0], ["sleep", "60"])
        try:
            crafted = _free_run_id()
            with planted(crafted, record(crafted, namespaces=[f"../netns/{made[0]}"],
                                         objects=[]), namespaces=()) as (path, _):
                r = tb_clean()
                assert sleeper.poll() is None, "clean killed a process of another run"
                assert netns.exists(made[0]), "clean followed a crafted name out of its run"
                assert r.returncode == 0, r.stderr
                assert path.exists() and f"kept run {crafted}" in r.stderr
        finally:
            sleeper.kill()
            sleeper.wait()
