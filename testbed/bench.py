"""Benchmark: set-up and tear-down time of a fabric, ours (pyroute2) against Mininet building the
same fabric (hosts, one Linux bridge per rail, TCLink with the same rates), side by side.

    sudo ./tb bench [--repeat 3] [--shapes 8x4,32x2] [--json out.json]
    sudo ./tb bench --faults 60      # fault timing instead: lateness of 60 faults' changes

Figures, not a test: it prints min / median / max per system and shape, and the ratio, and the
machine's load average before and after (other work on a shared machine slows both systems).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

try:
    from testbed.model import spec
    from testbed.fabric import Fabric
except ImportError as _e:     # python3 -m testbed.bench with a python that lacks our packages
    if __name__ == "__main__":
        from testbed._bootstrap import reexec
        reexec(_e)            # runs the command in the project's environment, or says how
    raise

RATE_MBIT = 100


def topology_text(hosts: int, rails: int) -> str:
    rail_lines = "".join(f"  - {{name: r{k}, bandwidth: {RATE_MBIT}mbit}}\n" for k in range(rails))
    return f"name: bench-{hosts}x{rails}\nhosts: {hosts}\nrails:\n{rail_lines}"


def ours(hosts: int, rails: int) -> tuple[float, float]:
    fab = Fabric(spec.loads(topology_text(hosts, rails)))
    t0 = time.monotonic()
    fab.build()
    t_up = time.monotonic() - t0
    t0 = time.monotonic()
    fab.teardown()
    return t_up, time.monotonic() - t0


def mininet(hosts: int, rails: int) -> tuple[float, float]:
    """The same fabric in Mininet: switches in namespaces too (no root-namespace links)."""
    from mininet.link import TCLink
    from mininet.log import setLogLevel
    from mininet.net import Mininet
    from mininet.nodelib import LinuxBridge
    from mininet.topo import Topo

    setLogLevel("error")

    class RailTopo(Topo):
        def build(self):
            sws = [self.addSwitch(f"nztb{k}", cls=LinuxBridge, inNamespace=True, stp=False)
                   for k in range(rails)]
            for i in range(hosts):
                h = self.addHost(f"h{i + 1}", ip=None)
                for k, sw in enumerate(sws):
                    self.addLink(h, sw, cls=TCLink, bw=RATE_MBIT,
                                 params1={"ip": f"198.18.{k}.{i + 1}/24"})

    t0 = time.monotonic()
    net = Mininet(topo=RailTopo(), controller=None, autoSetMacs=False, autoStaticArp=False,
                  build=False, waitConnected=False)
    net.build()
    net.start()
    t_up = time.monotonic() - t0
    t0 = time.monotonic()
    net.stop()
    return t_up, time.monotonic() - t0


def fault_schedule_text(n: int) -> str:
    """4 hosts x 2 rails and ``n`` faults 0.1 s apart, each for 50 ms: rate, loss and
    link-down in turn, on single links and (every fifth) a whole rail."""
    targets = ["h1.r0", "h2.r1", "r0", "h3.r1", "h4.r0"]
    values = {"rate": ", value: 20mbit", "loss": ", value: 5%", "link-down": ""}
    lines = []
    for i in range(n):
        action = ("rate", "loss", "link-down")[i % 3]
        lines.append(f"  - {{at: {0.2 + 0.1 * i:.2f}s, action: {action}, "
                     f"target: {targets[i % 5]}{values[action]}, for: 0.05s}}\n")
    return ("name: bench-faults\nhosts: 4\nrails:\n  - {name: r0, bandwidth: 100mbit}\n"
            "  - {name: r1, bandwidth: 200mbit}\nfaults:\n" + "".join(lines))


def fault_timing(n: int) -> dict:
    """Run ``n`` faults on a real fabric; per action and target kind, how late their start
    and end took effect (the kernel's last ack minus the scheduled time), in ms."""
    from testbed.model.scenario import build
    from testbed.run.faults import FaultInjector
    topo = spec.loads(fault_schedule_text(n))
    with Fabric(topo) as fab:
        inj = FaultInjector(fab, build(topo).faults)
        inj.start()
        time.sleep(0.2 + 0.1 * n + 0.3)
        inj.stop()
        errors = list(inj.errors)
    by: dict[str, list[float]] = {}
    for r in inj.records:
        late = [r.t_applied - inj.t0 - r.at]
        if r.t_end is not None:
            late.append(r.t_end - inj.t0 - r.at - r.duration)
        by.setdefault(f"{r.target_kind} {r.action}", []).extend(x * 1e3 for x in late)
    by["all"] = [x for k, xs in list(by.items()) for x in xs]
    return {"late_ms": by, "errors": errors}


def measure(fn: Callable[[int, int], tuple[float, float]], hosts: int, rails: int,
            repeat: int) -> dict:
    ups, downs = [], []
    for _ in range(repeat):
        up, down = fn(hosts, rails)
        ups.append(up)
        downs.append(down)
    return {"up": ups, "down": downs}


def _fmt(xs: list[float]) -> str:
    return f"{min(xs):7.2f} {statistics.median(xs):7.2f} {max(xs):7.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.bench", description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--shapes", default="8x4,32x2", help="HOSTSxRAILS list")
    p.add_argument("--no-mininet", action="store_true")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--faults", type=int, metavar="N",
                   help="measure fault timing instead: N faults on 4 hosts x 2 rails")
    a = p.parse_args(argv)
    if a.faults:
        print("load average (1, 5, 15 min): %.2f %.2f %.2f" % os.getloadavg())
        r = fault_timing(a.faults)
        print(f"{'changes':<22} {'n':>4} {'median ms':>10} {'worst ms':>9}")
        for key, xs in sorted(r["late_ms"].items()):
            print(f"{key:<22} {len(xs):>4} {statistics.median(xs):>10.2f} {max(xs):>9.2f}")
        for e in r["errors"]:
            print(f"error: {e}")
        print("load average after: %.2f %.2f %.2f" % os.getloadavg())
        if a.json:
            with open(a.json, "w") as f:
                json.dump(r, f, indent=1)
        return 1 if r["errors"] else 0
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    systems = {"testbed": ours}
    if not a.no_mininet:
        systems["mininet"] = mininet
    results: dict = {"load_before": os.getloadavg()}
    print("load average (1, 5, 15 min): %.2f %.2f %.2f" % results["load_before"])
    print(f"{'fabric':<8} {'system':<8} {'up s: min  median     max':<26}  "
          f"{'down s: min  median     max':<26}")
    for hosts, rails in shapes:
        key = f"{hosts}x{rails}"
        results[key] = {}
        for name, fn in systems.items():
            print(f"  .. {key} {name}", file=sys.stderr, flush=True)
            r = measure(fn, hosts, rails, a.repeat)
            results[key][name] = r
            print(f"{key:<8} {name:<8} {_fmt(r['up']):<26}  {_fmt(r['down']):<26}", flush=True)
        if "mininet" in results[key]:
            ratio_up = statistics.median(results[key]["mininet"]["up"]) / \
                statistics.median(results[key]["testbed"]["up"])
            ratio_down = statistics.median(results[key]["mininet"]["down"]) / \
                statistics.median(results[key]["testbed"]["down"])
            results[key]["ratio"] = {"up": ratio_up, "down": ratio_down}
            print(f"{key:<8} mininet/testbed median: set-up {ratio_up:.1f}x, "
                  f"tear-down {ratio_down:.1f}x")
    results["load_after"] = os.getloadavg()
    print("load average after: %.2f %.2f %.2f" % results["load_after"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
