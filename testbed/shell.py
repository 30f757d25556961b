"""`python -m testbed shell FILE`: bring a topology up, explore it interactively, tear it down.

With the Mininet backend the shell is Mininet's own ``CLI(net)`` (``h1 ping -c1 198.18.0.2``,
``h1 iperf3 -s &``, ``nodes``, ``net``...). With the pyroute2 backend it is ``FabricShell``, a
small ``cmd.Cmd`` with the same ``HOST CMD...`` convention plus the testbed's own verbs, all acting
through the fabric's handles (``Fabric.target``: ``h2.r1`` a link, ``r1`` a rail, ``h2`` a host)::

    h1 ping -c1 h2.r1        run a command in h1 (h2.r1 -> h2's address on r1; h2 -> its r0 one)
    hosts | rails | links    what is there (links: address, state, shaping read back)
    counters [LINK]          kernel byte/packet counters of host ends
    down TARGET [host|switch|both] / up TARGET [...]
    rate TARGET 50mbit | loss TARGET 5% | blackhole TARGET | restore TARGET
    exit | quit | Ctrl-D

The fabric is torn down whatever ends the shell: ``exit``, end of input (Ctrl-D), Ctrl-C when
the input is not a terminal, SIGTERM, or an exception. On a terminal Ctrl-C stops the running
host command (or clears the line) and keeps the fabric, like bash and Mininet do.
"""
from __future__ import annotations

import cmd
import shlex
import signal
import subprocess
import sys
from dataclasses import replace
from typing import IO, Callable, Optional

from testbed.errors import SpecError, TestbedError
from testbed.fabric import Fabric, Link, Rail
from testbed.fabric.guard import sigterm_as_interrupt
from testbed.model.units import parse_percent, parse_rate

ENDS = ("host", "switch", "both")


class FabricShell(cmd.Cmd):
    """Interactive control of a built fabric (pyroute2 backend, or any Fabric)."""

    prompt = "testbed> "

    def __init__(self, fabric: Fabric, stdin: Optional[IO] = None,
                 stdout: Optional[IO] = None) -> None:
        super().__init__(stdin=stdin, stdout=stdout)
        self.fabric = fabric
        if stdin is not None:
            self.use_rawinput = False
        self.intro = (f"fabric {fabric.topo.name}: {len(fabric.hosts)} hosts "
                      f"({', '.join(fabric.hosts)}) x {len(fabric.rails)} rails "
                      f"({', '.join(fabric.rails)}). `help` lists commands, `exit` tears down.")
        self.last_status = 0

    # ------------------------------------------------------------------ plumbing
    def say(self, text: str = "") -> None:
        self.stdout.write(text + "\n")
        self.stdout.flush()

    def emptyline(self) -> bool:
        return False

    def onecmd(self, line: str) -> bool:
        try:
            return super().onecmd(line)
        except (TestbedError, SpecError, KeyError, ValueError) as e:
            msg = str(e) if not isinstance(e, KeyError) else f"no such target {e.args[0]!r}"
            self.say(f"error: {msg}")
            self.last_status = 1
            return False

    def precmd(self, line: str) -> str:
        self.last_status = 0
        return line

    def _targets(self, name: str) -> list[Link]:
        t = self.fabric.target(name)
        if isinstance(t, Link):
            return [t]
        if isinstance(t, Rail):
            return list(t.links)
        return self.fabric.host_links(t.name)

    def _args(self, arg: str, n_min: int, n_max: int, usage: str) -> list[str]:
        args = shlex.split(arg)
        if not n_min <= len(args) <= n_max:
            raise ValueError(f"usage: {usage}")
        return args

    # ------------------------------------------------------------------ HOST CMD...
    def default(self, line: str) -> bool:
        first, _, rest = line.strip().partition(" ")
        if first in ("EOF",):
            return self.do_exit("")
        if first not in self.fabric.hosts:
            self.say(f"error: unknown command or host {first!r} (hosts: "
                     f"{', '.join(self.fabric.hosts)}; `help` lists commands)")
            self.last_status = 1
            return False
        if not rest.strip():
            raise ValueError(f"usage: {first} CMD ARGS...")
        self.last_status = self.run_in(first, rest)
        return False

    def substitute(self, rest: str) -> str:
        """Host names become addresses in arguments: ``h2.r1`` -> h2 on r1, ``h2`` -> h2 on
        the first rail (Mininet's convention). The command word itself is left alone."""
        try:
            words = shlex.split(rest)
        except ValueError:
            return rest
        topo = self.fabric.topo
        out = words[:1]
        for w in words[1:]:
            host, _, rail = w.partition(".")
            if host in self.fabric.hosts and (not rail or rail in self.fabric.rails):
                w = topo.address(host, rail or topo.rails[0].name)
            out.append(w)
        return " ".join(shlex.quote(w) for w in out)

    def run_in(self, host: str, command_line: str) -> int:
        """Run a shell command line in a host, streaming its output; Ctrl-C stops it."""
        argv = ["sh", "-c", self.substitute(command_line)]
        proc = self.fabric.hosts[host].popen(argv, stdin=subprocess.DEVNULL,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                             text=True, bufsize=1, start_new_session=True)
        try:
            for line in proc.stdout:
                self.stdout.write(line)
                self.stdout.flush()
            return proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.say("^C")
            return 130
        finally:
            proc.stdout.close()
            self.fabric.hosts[host].processes.remove(proc)

    # ------------------------------------------------------------------ looking
    def do_hosts(self, arg: str) -> None:
        """hosts: every host, its namespace and its address on each rail"""
        for h in self.fabric.hosts.values():
            addrs = "  ".join(f"{r}={a}" for r, a in h.addresses.items())
            self.say(f"{h.name:<6} {h.ns:<22} {addrs}")

    def do_rails(self, arg: str) -> None:
        """rails: every rail, its subnet, switch namespace and configured shape"""
        topo = self.fabric.topo
        for rail in self.fabric.rails.values():
            spec = topo.rail(rail.name)
            up = sum(1 for l in rail.links if l.host_end.is_up() and l.peer_end.is_up())
            self.say(f"{rail.name:<6} {str(spec.subnet):<18} {rail.ns or '(direct)':<22} "
                     f"{spec.shape.describe():<24} {up}/{len(rail.links)} links up")

    def do_links(self, arg: str) -> None:
        """links [TARGET]: address, state (host end/switch end) and shaping read from the kernel"""
        links = self._targets(arg.strip()) if arg.strip() else list(self.fabric.links.values())
        self.say(f"{'link':<10} {'address':<18} {'state':<10} {'to switch':<30} from switch")
        for link in links:
            addr = self.fabric.topo.link(link.host, link.rail).address
            st = "/".join("up" if e.is_up() else "DOWN" for e in (link.host_end, link.peer_end))
            to_sw = link.up_shaper.read_back().describe()
            from_sw = link.down_shaper.read_back().describe()
            self.say(f"{link.name:<10} {str(addr):<18} {st:<10} {to_sw:<30} {from_sw}")

    def do_counters(self, arg: str) -> None:
        """counters [TARGET]: kernel counters of each link's host end (rx = from the rail)"""
        links = self._targets(arg.strip()) if arg.strip() else list(self.fabric.links.values())
        self.say(f"{'link':<10} {'tx_bytes':>14} {'rx_bytes':>14} {'tx_pkts':>10} "
                 f"{'rx_pkts':>10} {'drops':>7}")
        for link in links:
            c = link.counters()
            self.say(f"{link.name:<10} {c['tx_bytes']:>14} {c['rx_bytes']:>14} "
                     f"{c['tx_packets']:>10} {c['rx_packets']:>10} "
                     f"{c['tx_dropped'] + c['rx_dropped']:>7}")

    # ------------------------------------------------------------------ faults
    def _state(self, arg: str, up: bool) -> None:
        verb = "up" if up else "down"
        args = self._args(arg, 1, 2, f"{verb} TARGET [host|switch|both]")
        end = args[1] if len(args) > 1 else "both"
        if end not in ENDS:
            raise ValueError(f"end must be one of {', '.join(ENDS)}, not {end!r}")
        links = self._targets(args[0])
        for link in links:
            link.set_state(up, end)
        self.say(f"{verb}: {', '.join(l.name for l in links)} ({end})")

    def do_down(self, arg: str) -> None:
        """down TARGET [host|switch|both]: take links down (TARGET: h2.r1, r1 or h2)"""
        self._state(arg, False)

    def do_up(self, arg: str) -> None:
        """up TARGET [host|switch|both]: bring links up again"""
        self._state(arg, True)

    def _shape(self, target: str, **changes) -> None:
        links = self._targets(target)
        for link in links:
            link.update_shape(**changes)
        for link in links:
            self.say(f"{link.name}: {link.up_shaper.read_back().describe()} (read back)")

    def do_rate(self, arg: str) -> None:
        """rate TARGET RATE: change the rate in place, both directions (e.g. rate r0 50mbit)"""
        target, value = self._args(arg, 2, 2, "rate TARGET RATE (e.g. rate r0 50mbit)")
        self._shape(target, rate_bps=parse_rate(value, "rate"))

    def do_loss(self, arg: str) -> None:
        """loss TARGET PERCENT: random loss, both directions (e.g. loss h2.r1 5%)"""
        target, value = self._args(arg, 2, 2, "loss TARGET PERCENT (e.g. loss h2.r1 5%)")
        self._shape(target, loss=parse_percent(value, "loss"))

    def do_blackhole(self, arg: str) -> None:
        """blackhole TARGET: drop everything while the link stays up (100 % loss)"""
        (target,) = self._args(arg, 1, 1, "blackhole TARGET")
        self._shape(target, loss=1.0)

    def do_restore(self, arg: str) -> None:
        """restore TARGET: back to the topology file's shape, links up at both ends"""
        (target,) = self._args(arg, 1, 1, "restore TARGET")
        topo = self.fabric.topo
        links = self._targets(target)
        for link in links:
            link.set_shape(topo.link(link.host, link.rail).shape)
            link.set_state(True, "both")
        self.say(f"restored: {', '.join(l.name for l in links)}")

    # ------------------------------------------------------------------ leaving
    def do_exit(self, arg: str) -> bool:
        """exit: tear the fabric down and leave (also: quit, Ctrl-D)"""
        return True

    do_quit = do_exit

    def do_EOF(self, arg: str) -> bool:
        self.say("")
        return True

    def cmdloop_safe(self, interactive: bool) -> None:
        """cmdloop that survives Ctrl-C on a terminal (clears the line) and leaves on it
        otherwise."""
        intro = self.intro
        while True:
            try:
                self.cmdloop(intro)
                return
            except KeyboardInterrupt:
                if not interactive:
                    raise
                self.say("^C (exit or Ctrl-D tears the fabric down)")
                intro = ""


def run_shell(topo, backend: Optional[str] = None, stdin: Optional[IO] = None,
              stdout: Optional[IO] = None, progress: Callable[[str], None] = lambda m: None,
              caps=None) -> int:
    """Build ``topo`` (backend override optional), run the shell, always tear down.
    Returns 0, or the status of the last command when it failed (for scripted use)."""
    from testbed.fabric.mininet_backend import fabric_class
    if backend and backend != topo.backend:
        topo = replace(topo, backend=backend)
    fab = fabric_class(topo)(topo, caps, progress=progress)
    out = stdout or sys.stdout
    with sigterm_as_interrupt():
        return _build_and_serve(fab, topo, stdin, out, progress)


def _build_and_serve(fab, topo, stdin: Optional[IO], out: IO,
                     progress: Callable[[str], None]) -> int:
    in_ = stdin or sys.stdin
    try:
        fab.build()
        progress(f"fabric up in {fab.build_seconds * 1000:.0f} ms (run id {fab.state.run_id})")
        if topo.backend == "mininet":
            from mininet.cli import CLI
            out.write("mininet CLI: `h1 ping -c1 ADDRESS`, `nodes`, `net`, `help`; "
                      "exit or Ctrl-D tears the fabric down\n")
            out.flush()
            CLI(fab.mininet_net(), stdin=in_)
            return 0
        shell = FabricShell(fab, stdin=stdin, stdout=out)
        interactive = stdin is None and sys.stdin.isatty()
        shell.cmdloop_safe(interactive)
        return 0
    finally:
        t = fab.teardown()
        progress(f"fabric torn down in {t * 1000:.0f} ms")
