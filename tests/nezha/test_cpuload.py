"""The run-queue stretch that prices a rail's CPU (nezha/cpuload.py, balance.rail_overhead)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from nezha import balance
from nezha.cpuload import MIN_RUN_NS, RunQueueStretch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _threads(root, **stats):
    """A fake /proc/<pid>/task: thread id -> (ns on a CPU, ns waiting for one)."""
    for tid in os.listdir(root):
        os.remove(root / tid / "schedstat")
        os.rmdir(root / tid)
    for tid, (run, wait) in stats.items():
        (root / tid).mkdir()
        (root / tid / "schedstat").write_text(f"{run} {wait} 7\n")


def test_the_stretch_is_cpu_plus_wait_over_cpu_of_every_thread(tmp_path):
    _threads(tmp_path, t1=(60_000_000, 90_000_000), t2=(40_000_000, 60_000_000))
    assert RunQueueStretch(str(tmp_path), min_interval_s=0).sample() == 2.5


def test_only_the_time_since_the_last_figure_counts_and_threads_come_and_go(tmp_path):
    s = RunQueueStretch(str(tmp_path), min_interval_s=0)
    _threads(tmp_path, t1=(100_000_000, 300_000_000))
    assert s.sample() == 4.0
    # t1 ended; t2 is new and has run 50 ms without waiting: the host is no longer loaded
    _threads(tmp_path, t2=(50_000_000, 0))
    assert s.sample() == 1.0


def test_too_little_cpu_time_keeps_the_last_figure(tmp_path):
    s = RunQueueStretch(str(tmp_path), min_interval_s=0)
    _threads(tmp_path, t1=(MIN_RUN_NS, MIN_RUN_NS))
    assert s.sample() == 2.0
    # an idle moment: 1 ms of CPU that waited 9 is noise, not a figure...
    _threads(tmp_path, t1=(MIN_RUN_NS + 1_000_000, MIN_RUN_NS + 9_000_000))
    assert s.sample() == 2.0
    # ...but it is kept and counts once enough CPU time has passed
    _threads(tmp_path, t1=(2 * MIN_RUN_NS + 1_000_000, MIN_RUN_NS + 9_000_000))
    assert s.sample() == (MIN_RUN_NS + 1_000_000 + 9_000_000) / (MIN_RUN_NS + 1_000_000)


def test_the_threads_are_read_at_most_once_per_interval(tmp_path):
    s = RunQueueStretch(str(tmp_path), min_interval_s=60)
    _threads(tmp_path, t1=(100_000_000, 150_000_000))
    assert s.sample() == 2.5
    _threads(tmp_path, t1=(200_000_000, 150_000_000))
    assert s.sample() == 2.5        # not read again within the minute


def test_without_the_kernel_counters_the_stretch_is_one(tmp_path):
    assert RunQueueStretch(str(tmp_path / "absent"), min_interval_s=0).sample() == 1.0


@pytest.mark.timing            # a third process on that CPU (the suite's machine is shared) adds to it
@pytest.mark.flaky(reruns=1, reruns_delay=2)
def test_a_process_sharing_its_cpu_with_a_busy_one_measures_about_two():
    """On the real kernel: this process and a busy loop pinned to one CPU each get half of
    it, so this process's CPU work takes about twice its CPU time."""
    prog = textwrap.dedent("""
        import os, subprocess, sys, time
        from nezha.cpuload import RunQueueStretch
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(busy.pid, {cpu})
        try:
            time.sleep(0.2)
            s = RunQueueStretch()
            s.sample()
            t = time.monotonic()
            while time.monotonic() - t < 1.0:
                pass
            print(s.sample())
        finally:
            busy.kill()
    """)
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                         timeout=30, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert 1.6 < float(out.stdout) < 2.6


def test_the_rail_overhead_is_the_cpu_cost_times_the_stretch():
    assert balance.rail_overhead(300e-6, 2.5) == 300e-6 * 2.5
    assert balance.rail_overhead(300e-6, 0.5) == 300e-6     # never cheaper than the CPU time


def test_each_table_carries_this_rank_s_stretched_rail_cost():
    bal = balance.Balancer(2, rail_cpu_s=300e-6)

    class Loaded:
        def sample(self):
            return 3.0
    bal.stretch = Loaded()
    col = bal.local_table()[:, balance.OVERHEAD_COLUMN]
    assert np.allclose(col, 900e-6)
