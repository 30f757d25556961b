"""One rank of test_netns.test_idle_threads_sleep_until_there_is_something_to_do: how
often this rank's watcher threads woke (voluntary context switches,
/proc/self/task/TID/status) while it sat idle between 1 MiB allreduces over slow shaped
rails. Prints one JSON line: {"exact": bool, "idle_wakeups": {thread: n}, "idle_s": s}.

usage: wakeups_prog.py RANK WORLD RAILS MASTER
"""
import json
import sys
import threading
import time

import numpy as np

from nezha import Context


def wakeups() -> dict[str, int]:
    out = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        out[t.name] = int(line.split()[1])
        except OSError:
            pass
    return out


def main() -> None:
    rank, world, rails, master = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    count = 1 << 18                                       # 1 MiB of float32
    with Context(rank, world, rails=rails.split(","), master=master, timeout=30) as ctx:
        exact = True
        ctx.allreduce(np.ones(count, np.float32))         # connections up, estimates in
        ctx.barrier()
        for it in range(3):
            a = np.full(count, rank + it, np.float32)
            ctx.allreduce(a)
            exact &= bool(np.all(a == sum(r + it for r in range(world))))
        ctx.barrier()
        idle_s = 1.5
        i0 = wakeups()
        time.sleep(idle_s)
        i1 = wakeups()
        ctx.barrier()
        idle = {n: i1[n] - i0[n] for n in i1 if n in i0 and n in
                ("nz-probe", "nz-liveness", "nz-health")}
        print(json.dumps({"exact": exact, "idle_wakeups": idle, "idle_s": idle_s}),
              flush=True)


if __name__ == "__main__":
    main()
