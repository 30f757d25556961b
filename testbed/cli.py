"""`python -m testbed VERB ...`: each verb is a thin layer over a library call.

Exit status: 0 success (or every expectation held), 1 a failed expectation or a runtime failure,
2 bad input (the message names the field and what would be accepted).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from testbed.kernel import netns
from testbed.fabric import state
from testbed.errors import TestbedError

DEFAULT_TOPOLOGY = Path(__file__).resolve().parent.parent / "topologies" / "default.yaml"


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


def _progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def _require_root() -> None:
    if os.geteuid() != 0:
        raise TestbedError("network namespaces need root: run with sudo (or as root)")


def _one_run(name: Optional[str]) -> state.RunState:
    runs = state.find(name)
    if not runs:
        what = f"named {name!r} " if name else ""
        raise TestbedError(f"no fabric {what}is up (start one with: python -m testbed up FILE)")
    if len(runs) > 1:
        listing = ", ".join(f"{r.name} (id {r.run_id})" for r in runs)
        raise TestbedError(f"several fabrics are up: {listing}; pick one with --run NAME")
    return runs[0]


# ------------------------------------------------------------------------------------- verbs
def cmd_validate(args) -> int:
    from testbed.kernel.capabilities import probe
    from testbed.model.scenario import build
    from testbed.model.spec import check_capabilities, load
    from testbed.model.units import format_rate
    topo = load(args.file)
    if not args.no_kernel:
        check_capabilities(topo, probe())
    sc = build(topo)
    print(f"{topo.source}: valid — {len(topo.hosts)} hosts x {len(topo.rails)} rails "
          f"({topo.wiring} wiring, {topo.backend} backend)")
    for r in topo.rails:
        agg = ""
        if r.switch_address is not None:
            agg = (f", aggregation switch on {r.switch_address.ip}"
                   + (f" at {format_rate(r.aggregation_rate_bps)}"
                      if r.aggregation_rate_bps else ""))
        print(f"  rail {r.name}: {r.subnet}, {r.shape.describe()}, mtu {r.mtu}{agg}")
    overrides = [l for l in topo.links.values() if l.shape != topo.rail(l.rail).shape]
    for l in overrides:
        print(f"  link {l.name}: {l.shape.describe()}")
    w = sc.workload
    if w and w.kind == "train":
        size = f", {w.params} parameters" if w.model == "mlp" else ""
        print(f"  workload: train {w.model}{size}, {w.steps} steps of batch {w.batch}, "
              f"backends {', '.join(w.backends)}, reference {w.reference}")
    elif w:
        print(f"  workload: {w.kind}")
    for f in sc.faults:
        print(f"  fault at {f.at:g}s: {f.label}" + (f" for {f.duration:g}s" if f.duration else ""))
    for e in sc.expect:
        print(f"  expect {e.metric} {e.describe()}")
    return 0


def cmd_up(args) -> int:
    from testbed.fabric import Fabric
    from testbed.model.spec import load
    _require_root()
    topo = load(args.file)
    fab = Fabric(topo, progress=_progress)
    fab.build()
    run_id = fab.state.run_id
    try:
        _print_status(fab)
        fab.detach()
    except BaseException:
        fab.teardown()
        raise
    print(f"fabric {topo.name} is up (run id {run_id}); `python -m testbed down {topo.name}` "
          f"removes it")
    return 0


def cmd_down(args) -> int:
    _require_root()
    run = _one_run(args.name)
    removed = run.remove_all()
    print(f"fabric {run.name} (run id {run.run_id}) is down: {len(removed)} namespaces removed")
    return 0


def cmd_exec(args) -> int:
    _require_root()
    run = _one_run(args.run)
    if not args.command:
        raise TestbedError("no command given: python -m testbed exec HOST -- CMD ...")
    hosts = run.topology.get("hosts", [])
    if args.host not in hosts:
        raise TestbedError(f"host {args.host!r} is not in fabric {run.name} "
                           f"(hosts: {', '.join(hosts)})")
    argv = netns.command(run.ns_name(args.host), args.command)
    os.execvp(argv[0], argv)
    return 127  # not reached


def cmd_status(args) -> int:
    from testbed.fabric import Fabric
    _require_root()
    runs = state.find(args.name)
    if args.json:
        out = []
        for r in runs:
            fab = Fabric.attach(r)
            out.append(fab.status())
            fab.close()
        print(json.dumps(out, indent=1))
        return 0
    if not runs:
        print("no fabric is up")
        return 0
    for r in runs:
        fab = Fabric.attach(r)
        _print_status(fab)
        fab.close()
    return 0


def _print_status(fab) -> None:
    topo = fab.topo
    st = fab.state
    print(f"fabric {topo.name} (run id {st.run_id}, {len(topo.hosts)} hosts x {len(topo.rails)} "
          f"rails, {topo.wiring} wiring; loss via {fab.caps.loss_method or 'nothing'})")
    print(f"  {'link':<12} {'address':<18} {'state':<6} {'to switch':<34} from switch")
    for link in fab.links.values():
        d = link.describe()
        up = link.up_shaper.read_back().describe()
        down = link.down_shaper.read_back().describe()
        print(f"  {link.name:<12} {topo.link(link.host, link.rail).address!s:<18} "
              f"{'up' if d['up'] else 'DOWN':<6} {up:<34} {down}")
    for rail, agg in fab.aggregator_health().items():
        state_ = (f"answers ({agg['keys']} keys, {agg['bytes']} bytes pending)"
                  if agg["answers"] else f"DOES NOT ANSWER ({agg['error']})")
        print(f"  aggregation switch of {rail} on {agg['endpoint']}: {state_}")


def cmd_clean(args) -> int:
    _require_root()
    removed = state.clean(everything=args.all)
    for u in removed["unreadable"]:
        mine = [ns for ns in removed["kept"] if u.protects(ns)]
        what = (f"its namespaces {state.PREFIX}{u.run_id}-* were left alone ({len(mine)}: "
                f"{' '.join(mine[:8])}{' ...' if len(mine) > 8 else ''})" if u.run_id
                else "it names no run id, so nothing was protected by it")
        print(f"warning: kept run {u.run_id or '?'}: its state file {u.path} does not load "
              f"({u.reason}); {what}. Look at the file, then delete it (and those namespaces: "
              f"ip netns delete NAME) by hand.", file=sys.stderr)
    if not removed["namespaces"] and not removed["runs"]:
        print("nothing to clean" + (" (some runs were kept, see above)"
                                    if removed["unreadable"] else ""))
    else:
        print(f"removed {len(removed['namespaces'])} namespaces of {len(removed['runs'])} runs: "
              + " ".join(removed["namespaces"]))
    return 0


def cmd_doctor(args) -> int:
    from testbed.kernel.capabilities import probe
    caps = probe()
    rows = caps.as_rows()
    width = max(len(r[0]) for r in rows)
    for feature, ok, detail in rows:
        print(f"  {feature:<{width}}  {'ok  ' if ok else 'MISSING'}  {detail}")
    print(f"loss is emulated with: {caps.loss_method or 'nothing (no netem, no nftables)'}")
    print("delay/jitter: " + ("netem" if caps.netem else
                              "not available (no sch_netem): topologies with delay are refused"))
    essential = caps.netns and caps.veth and caps.bridge and caps.htb
    return 0 if essential else 1


def cmd_run(args) -> int:
    from testbed.run.runner import run_file
    _require_root()
    return run_file(args.file or DEFAULT_TOPOLOGY, results_dir=args.results,
                    backend=args.backend, capture=args.capture)


def cmd_shell(args) -> int:
    from testbed.shell import run_shell
    from testbed.model.spec import load
    _require_root()
    return run_shell(load(args.file), backend=args.backend, progress=_progress)


def cmd_pcap(args) -> int:
    from testbed.pcap.report import main as pcap_main
    return pcap_main(args.results, as_json=args.json, rails=args.rails)


def cmd_shapes(args) -> int:
    from testbed.shapes import main as shapes_main
    return shapes_main(args)


def cmd_adapt(args) -> int:
    from testbed.adapt import main as adapt_main
    return adapt_main(args)


# ------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m testbed",
                                description="Multi-rail emulation testbed for Nezha.")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    _fabric_verbs(sub)
    _tool_verbs(sub)
    return p


def _fabric_verbs(sub) -> None:
    """The verbs that build, run, inspect and remove fabrics."""
    s = sub.add_parser("run", help="build a topology, run its workload and faults, give a verdict")
    s.add_argument("file", nargs="?", help=f"topology file (default: {DEFAULT_TOPOLOGY.name})")
    s.add_argument("--results", help="results folder (default: results/NAME-TIMESTAMP)")
    s.add_argument("--backend", choices=("pyroute2", "mininet"), help="override the file's backend")
    s.add_argument("--capture", action="store_true", help="record every rail to pcap files")
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("validate", help="check a topology file without building anything")
    s.add_argument("file")
    s.add_argument("--no-kernel", action="store_true",
                   help="skip the check against this kernel's capabilities")
    s.set_defaults(func=cmd_validate)

    s = sub.add_parser("up", help="build a topology's fabric and leave it up")
    s.add_argument("file")
    s.set_defaults(func=cmd_up)

    s = sub.add_parser("down", help="tear down a fabric left up by `up`")
    s.add_argument("name", nargs="?", help="topology name or run id (needed when several are up)")
    s.set_defaults(func=cmd_down)

    s = sub.add_parser("exec", help="run a command inside a host's namespace")
    s.add_argument("host")
    s.add_argument("--run", help="topology name or run id (needed when several are up)")
    s.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    s.set_defaults(func=cmd_exec)

    s = sub.add_parser("status", help="what is up: hosts, addresses, shaping read from the kernel")
    s.add_argument("name", nargs="?")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("clean", help="remove everything a killed run left behind")
    s.add_argument("--all", action="store_true", help="also tear down fabrics left up on purpose")
    s.set_defaults(func=cmd_clean)


def _tool_verbs(sub) -> None:
    """The verbs around fabrics: the machine, a shell, captures, the shapes benchmark."""
    s = sub.add_parser("doctor", help="kernel features and tools this machine has")
    s.set_defaults(func=cmd_doctor)

    s = sub.add_parser("shell", help="build a topology, explore it interactively, tear it down")
    s.add_argument("file")
    s.add_argument("--backend", choices=("pyroute2", "mininet"), help="override the file's backend")
    s.set_defaults(func=cmd_shell)

    s = sub.add_parser("pcap", help="per-rail split, retransmits and reroutes from captures")
    s.add_argument("results", help="results folder (or a folder of *.pcap files)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--rails", help="rail names in index order, e.g. r0,r1 (default: from files)")
    s.set_defaults(func=cmd_pcap)

    from testbed.shapes import add_arguments as shapes_arguments
    s = sub.add_parser("shapes", help="randomized topologies: nezha vs single rail vs MPTCP vs "
                       "the bottleneck-aware optimum, one row per seed")
    shapes_arguments(s)
    s.set_defaults(func=cmd_shapes)

    from testbed.adapt import add_arguments as adapt_arguments
    s = sub.add_parser("adapt", help="a rail that slows, meets competing traffic or goes down: "
                       "nezha vs MPTCP per hosts x rails, against the ideal")
    adapt_arguments(s)
    s.set_defaults(func=cmd_adapt)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) is not None:
        if args.command[:1] == ["--run"] and len(args.command) > 1:   # exec HOST --run X -- ...
            args.run, args.command = args.command[1], args.command[2:]
        if args.command[:1] == ["--"]:
            args.command = args.command[1:]
    try:
        return args.func(args)
    except TestbedError as e:
        _err(str(e))
        return e.exit_code
    except KeyboardInterrupt:
        _err("interrupted; everything built was removed")
        return 130


if __name__ == "__main__":
    sys.exit(main())
