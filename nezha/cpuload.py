"""How much longer this process's CPU work takes than its CPU time: the run-queue stretch.

One more rail costs a rank CPU per message (frames, ACKs, thread wake-ups). On a host whose
CPUs are shared (several ranks per host, or 5 ranks on this 2-core test machine) that CPU
time is stretched by the time the rank's threads wait for a CPU; the split must charge the
stretched figure (``balance.rail_overhead``). The kernel counts both per thread
(/proc/<pid>/task/<tid>/schedstat: nanoseconds on a CPU, nanoseconds runnable but waiting),
so the stretch is measured for this process over the last interval, not guessed from the
system's one-minute load average, which counts other jobs' threads and lags a change by a
minute (5 ranks x 14 rails on 2 cores: it said 1.4 through a 20 s run whose ranks' threads
measured 4-7 here; 2 ranks started right after that run were charged 4.3 by it).
"""
from __future__ import annotations

import os
import time

MIN_RUN_NS = 20_000_000    # CPU time an interval must hold to give a new figure (20 ms)
MAX_STRETCH = 16.0         # a figure beyond this is a stalled host, not a rail's price
MIN_INTERVAL_S = 0.5       # the threads are read at most this often: a rank of 14 rails has
                           # ~60 threads, 0.5-1.7 ms to read, and a table is built before
                           # every exchange (every operation in COLD)


class RunQueueStretch:
    """(CPU time + run-queue wait) / CPU time of this process's threads since the previous
    ``sample``. 1.0 where the kernel does not count (no /proc, no schedstat)."""

    def __init__(self, task_dir: str = "/proc/self/task", min_interval_s: float = MIN_INTERVAL_S):
        self.task_dir = task_dir
        self.min_interval_s = min_interval_s
        self._read_at = -float("inf")
        self.value = 1.0
        self._last: dict[str, tuple[int, int]] = {}
        self._run = 0       # CPU and wait ns gathered since the last figure
        self._wait = 0

    def _read(self) -> dict[str, tuple[int, int]]:
        out = {}
        try:
            tids = os.listdir(self.task_dir)
        except OSError:
            return out
        for tid in tids:
            try:
                fd = os.open(f"{self.task_dir}/{tid}/schedstat", os.O_RDONLY)
                try:
                    run, wait = os.read(fd, 128).split()[:2]
                finally:
                    os.close(fd)
                out[tid] = (int(run), int(wait))
            except (OSError, ValueError):
                continue    # a thread that ended meanwhile
        return out

    def sample(self) -> float:
        """The stretch over the time since the figure before (kept until the threads have
        run MIN_RUN_NS since, so an idle moment does not make a figure of noise). The threads
        are read at most every ``min_interval_s``; between reads the last figure stands."""
        t = time.monotonic()
        if t - self._read_at < self.min_interval_s:
            return self.value
        self._read_at = t
        now = self._read()
        for tid, (run, wait) in now.items():
            prev_run, prev_wait = self._last.get(tid, (0, 0))
            self._run += max(0, run - prev_run)
            self._wait += max(0, wait - prev_wait)
        self._last = now
        if self._run >= MIN_RUN_NS:
            self.value = min(MAX_STRETCH, max(1.0, (self._run + self._wait) / self._run))
            self._run = self._wait = 0
        return self.value
