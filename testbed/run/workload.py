"""Workloads: launch one rank per host inside the fabric and collect what every rank recorded.

A workload is a list of phases (one system at one message size); `allreduce` is one phase,
`sweep` and `compare` are several, run one after another on the same fabric. `command` runs the
user's own program on every host with the rails and the rendezvous in environment variables
(Nezha's and torchrun's), `train` a DDP job (testbed/run/train.py) once per backend, after a
fault-free reference run of it when the file has faults and `reference: auto`.
Every rank of a run (a `command` too) gets the run's job secret, NEZHA_JOB_SECRET, drawn afresh
per run (by the fabric, whose aggregation switches hold it too): the store, the rails and the
aggregation switches of a run admit only its own ranks. NEZHA_AGGREGATORS names the switches of
aggregation rails (RAIL=ADDR:PORT,...).
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from testbed.fabric import Fabric
from testbed.model.records import IterationRecord, load_jsonl
from testbed.model.scenario import Workload

BASE_PORT = 29500
# MASTER_PORT (torch's store) = NEZHA_MASTER_PORT + this: distinct from Nezha's store port, and
# per phase like it, so a phase never meets the last one's TIME_WAIT sockets
TORCH_PORT_OFFSET = 1000
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Phase:
    system: str
    size: int
    iterations: Optional[int]
    duration: Optional[float]
    name: str = ""
    reference: bool = False      # train: the fault-free run the losses are held against


@dataclass
class RankProcess:
    host: str
    rank: int
    proc: subprocess.Popen
    results: Path
    events: Path
    log: Path
    killed: bool = False


@dataclass
class PhaseResult:
    phase: Phase
    ranks: list[dict] = field(default_factory=list)       # host, rank, exit code, killed, error
    iterations: list[IterationRecord] = field(default_factory=list)  # every rank's lines
    events: list[dict] = field(default_factory=list)      # every rank's Nezha events
    t_start: float = 0.0
    t_end: float = 0.0
    timed_out: bool = False


def phases(w: Workload) -> list[Phase]:
    if w.kind == "allreduce":
        return [Phase(w.system, w.size, w.iterations, w.duration, f"{w.system}")]
    if w.kind == "sweep":
        sizes = w.sizes or (w.size,)
        return [Phase(w.system, s, w.iterations or (None if w.duration else 5), w.duration,
                      f"{w.system}-{s}") for s in sizes]
    if w.kind == "compare":
        sizes = w.sizes or (w.size,)
        # the systems take turns (rounds > 1): a machine whose speed drifts over a minute
        # (other work, CPU frequency) then favours none of them
        return [Phase(sys_, s, w.iterations or (None if w.duration else 5), w.duration,
                      f"{sys_}-{s}") for s in sizes for _ in range(w.rounds) for sys_ in w.systems]
    if w.kind == "command":
        return [Phase("command", 0, w.iterations, w.duration, "command")]
    if w.kind == "train":     # rounds > 1: the backends take turns, as a compare's systems do
        return [Phase(b, 0, w.steps, None, f"train-{b}") for _ in range(w.rounds)
                for b in w.backends]
    return []


def reference_phases(w: Workload, faults: tuple) -> list[Phase]:
    """train, reference: auto, with faults: the same job once per backend without them."""
    if w.kind != "train" or w.reference != "auto" or not faults:
        return []
    return [Phase(b, 0, w.steps, None, f"ref-{b}", reference=True) for b in w.backends]


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


class WorkloadRunner:
    """Launches ranks on the fabric's hosts; `kill(host, signal)` serves the fault schedule."""

    def __init__(self, fabric: Fabric, workload: Workload, out_dir: Path,
                 progress: Callable[[str], None] = lambda m: None) -> None:
        self.fabric = fabric
        self.workload = workload
        self.out_dir = out_dir
        self.progress = progress
        self.hosts = list(workload.hosts or fabric.topo.hosts)
        self.current: list[RankProcess] = []
        self._port = BASE_PORT
        self._mptcp_ready = False
        self.mptcp_monitor = None     # testbed/run/mptcp_monitor.py, while mptcp phases run
        self._mptcp_recorded = False
        # NEZHA_JOB_SECRET of every rank of this run: the fabric's, which its aggregation
        # switches were given (a fabric handle without one: a fresh secret)
        self.secret = getattr(fabric, "job_secret", None) or secrets.token_hex(16)
        # every rank's sockets use it (NEZHA_TCP_CONGESTION), whatever the namespace default
        self.congestion = fabric.caps.congestion_control(fabric.topo)

    def env_for(self, host: str, rank: int, port: int, phase: Phase, events: Path,
                results: Path) -> dict:
        topo = self.fabric.topo
        rails = self.rails_for(phase)
        master = topo.address(self.hosts[0], rails[0].name)
        env = dict(os.environ)
        # NEZHA_SYSTEM is what Context.from_env() builds: a command phase is named "command",
        # but the user's program gets the file's `system:` (nezha unless given)
        system = self.workload.system if phase.system == "command" else phase.system
        if self.workload.kind in ("command", "train"):
            env.update(self.torchrun_env(rank, port))
        if phase.system == "command":
            # `python my_train.py` is this interpreter (the project's environment, where nezha
            # and numpy are installed), not whatever python sudo's PATH finds first
            env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent),
                                                        os.environ.get("PATH")]))
        env.update({
            "NEZHA_RANK": str(rank), "NEZHA_WORLD_SIZE": str(len(self.hosts)),
            "NEZHA_MASTER_ADDR": master, "NEZHA_MASTER_PORT": str(port),
            "NEZHA_RAILS": ",".join(topo.address(host, r.name) for r in rails),
            "NEZHA_RAIL_NAMES": ",".join(r.name for r in rails),
            "NEZHA_EVENT_LOG": str(events), "NEZHA_RESULTS": str(results),
            "NEZHA_SYSTEM": system, "TESTBED_HOST": host,
            "NEZHA_JOB_SECRET": self.secret,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                         os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        })
        if self.congestion:
            env["NEZHA_TCP_CONGESTION"] = self.congestion
        aggregators = self.fabric.aggregator_env() if hasattr(self.fabric, "aggregator_env") \
            else ""
        if aggregators:
            env["NEZHA_AGGREGATORS"] = aggregators
        return env

    def rails_for(self, phase: Phase) -> list:
        """The rails a rank drives as TCP rails: MPTCP takes every rail as a subflow path
        (an aggregation rail is an IP network too: "MPTCP over both rails"); every other
        system only the TCP ones, since nezha reaches an aggregation rail's switch through
        NEZHA_AGGREGATORS as the other protocol it is, not as one more TCP rail."""
        topo = self.fabric.topo
        if phase.system == "mptcp" or (phase.system == "command" and
                                       self.workload.system == "mptcp"):
            return list(topo.rails)
        return topo.tcp_rails or list(topo.rails)

    def torchrun_env(self, rank: int, port: int) -> dict[str, str]:
        """What torchrun would set for one process per host, so that a training script's
        ``init_process_group`` (env://) needs no glue: rank 0's first-rail address."""
        topo = self.fabric.topo
        return {"MASTER_ADDR": topo.address(self.hosts[0], topo.rails[0].name),
                "MASTER_PORT": str(port + TORCH_PORT_OFFSET), "RANK": str(rank),
                "WORLD_SIZE": str(len(self.hosts)), "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1"}

    def argv(self, phase: Phase) -> list[str]:
        w = self.workload
        if phase.system == "command":
            return list(w.command)
        if w.kind == "train":
            return [sys.executable, "-m", "testbed.run.train", "--model", w.model,
                    "--params", str(w.params), "--steps", str(w.steps), "--batch", str(w.batch),
                    "--backend", phase.system, "--seed", str(w.seed), "--data", w.data,
                    "--timeout", f"{w.timeout:g}"]
        argv = [sys.executable, "-m", "nezha.worker", "--system", phase.system,
                "--size", str(phase.size), "--dtype", w.dtype, "--op", w.op]
        if w.warmup:
            argv += ["--warmup", str(w.warmup)]
        if phase.iterations:
            argv += ["--iterations", str(phase.iterations)]
        if phase.duration:
            argv += ["--duration", str(phase.duration)]
        return argv

    def _prepare_mptcp(self) -> None:
        """MPTCP's path manager is per namespace: once per run, every host gets the expert
        configuration (nezha/transport/mptcp.py, ``configure_mptcp_endpoints``: sysctls,
        limits, ``signal`` endpoints, and why), and ``ip mptcp monitor`` starts recording in
        every host's namespace (testbed/run/mptcp_monitor.py) into ``mptcp_events.jsonl``
        next to ``ranks/``, the evidence of what MPTCP did around each fault; ``close``
        stops it."""
        if self._mptcp_ready:
            return
        from nezha.transport.mptcp import configure_mptcp_endpoints
        from testbed.run.mptcp_monitor import EVENTS_FILE, MptcpMonitor
        topo = self.fabric.topo
        for host in self.hosts:
            configure_mptcp_endpoints([(topo.address(host, r.name), r.name)
                                       for r in topo.rails], netns=self.fabric.hosts[host].ns)
        self.mptcp_monitor = MptcpMonitor(self.fabric, self.hosts,
                                          self.out_dir.parent / EVENTS_FILE,
                                          append=self._mptcp_recorded).start()
        self._mptcp_recorded = True   # a later run() of this runner appends
        self._mptcp_ready = True

    def close(self) -> None:
        """Stop what the run started besides the ranks (the MPTCP monitor)."""
        if self.mptcp_monitor is not None:
            self.mptcp_monitor.stop()
            self.mptcp_monitor = None
            self._mptcp_ready = False       # a later run() configures and records again

    def launch(self, phase: Phase, index: int) -> list[RankProcess]:
        if phase.system == "mptcp":
            self._prepare_mptcp()
        self._port += 1
        procs = []
        for rank, host in enumerate(self.hosts):
            stem = self.out_dir / f"{index:02d}-{phase.name}-{host}"
            results, events, logf = (Path(f"{stem}.results.jsonl"), Path(f"{stem}.events.jsonl"),
                                     Path(f"{stem}.log"))
            env = self.env_for(host, rank, self._port, phase, events, results)
            with open(logf, "w") as log:
                proc = self.fabric.hosts[host].popen(self.argv(phase), env=env, stdout=log,
                                                     stderr=subprocess.STDOUT,
                                                     stdin=subprocess.DEVNULL, cwd=REPO_ROOT)
            procs.append(RankProcess(host, rank, proc, results, events, logf))
        self.current = procs
        return procs

    def kill(self, host: str, sig: str = "KILL") -> None:
        for rp in self.current:
            if rp.host == host and rp.proc.poll() is None:
                rp.killed = True
                # nsenter execs the program, so the pid is the rank itself
                rp.proc.send_signal(getattr(signal, f"SIG{sig}"))

    def wait(self, procs: list[RankProcess], timeout: float, every: float = 2.0) -> bool:
        """Wait for every rank, reporting progress (iterations rank 0 finished) as it goes."""
        start = time.monotonic()
        deadline = start + timeout
        next_report = start + every
        while time.monotonic() < deadline:
            if all(rp.proc.poll() is not None for rp in procs):
                return True
            if time.monotonic() >= next_report:
                next_report += every
                done = _count_lines(procs[0].results)
                alive = sum(rp.proc.poll() is None for rp in procs)
                what = "steps" if self.workload.kind == "train" else "iterations"
                self.progress(f"   .. {time.monotonic() - start:4.0f} s: {done} {what}, "
                              f"{alive}/{len(procs)} ranks running")
            time.sleep(0.05)
        for rp in procs:
            if rp.proc.poll() is None:
                rp.proc.kill()
                rp.proc.wait()
        return False

    def run_phase(self, phase: Phase, index: int) -> PhaseResult:
        res = PhaseResult(phase, t_start=time.monotonic())
        procs = self.launch(phase, index)
        limit = self.workload.timeout + (phase.duration or 0)
        res.timed_out = not self.wait(procs, limit)
        res.t_end = time.monotonic()
        for rp in procs:
            code = rp.proc.returncode
            tail = rp.log.read_text(errors="replace").strip().splitlines()[-3:] \
                if rp.log.exists() else []
            res.ranks.append({"host": rp.host, "rank": rp.rank, "exit_code": code,
                              "killed": rp.killed, "log": str(rp.log),
                              "error": None if code == 0 else " | ".join(tail)})
            for rec in load_jsonl(rp.results):
                rec.setdefault("rank", rp.rank)
                rec.setdefault("system", phase.system)
                rec["phase"] = index
                res.iterations.append(IterationRecord.from_dict(rec))
            for ev in load_jsonl(rp.events):
                ev.setdefault("rank", rp.rank)
                ev["phase"] = index
                res.events.append(ev)
        return res

    def run(self, on_phase: Callable[[int, int, Phase], None] = lambda i, n, p: None,
            plan: Optional[list[Phase]] = None) -> list[PhaseResult]:
        """Every phase of ``plan`` (default: the workload's), one after another."""
        out = []
        plan = phases(self.workload) if plan is None else plan
        try:
            for i, phase in enumerate(plan):
                on_phase(i, len(plan), phase)
                out.append(self.run_phase(phase, i))
        finally:        # an error or Ctrl-C too: no monitor outlives the run
            self.close()
        return out
