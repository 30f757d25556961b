"""Scratch network namespaces with shaped rails for nezha checks (root only).

hosts h0..h{n-1} (namespaces ``nzt-<tag>-h<i>``) and one switch namespace with a bridge per
rail. Rail r of host i: veth ``r<r>`` with address 198.18.<r>.<i+1>/24 (198.18.0.0/15).
Each rail's veth is rate-limited with htb in both directions (host egress and switch egress).
Nothing is added to the root namespace.
"""
from __future__ import annotations

import os
import subprocess
import uuid


def sh(*cmd, check=True):
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


def htb(ns, dev, mbit):
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:",
       "htb", "default", "10")
    sh("ip", "netns", "exec", ns, "tc", "class", "replace", "dev", dev, "parent", "1:",
       "classid", "1:10", "htb", "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit", "burst", "64k",
       "cburst", "64k")


class Fabric:
    def __init__(self, nhosts: int, rates_mbit, tag: str | None = None):
        self.tag = tag or f"{os.getpid() % 100000}{uuid.uuid4().hex[:3]}"
        self.n = nhosts
        self.rates = list(rates_mbit)
        self.sw = f"nzt-{self.tag}-sw"
        self.hosts = [f"nzt-{self.tag}-h{i}" for i in range(nhosts)]
        self.created = []

    def addr(self, host, rail):
        return f"198.18.{rail}.{host + 1}"

    def rails(self, host):
        return ",".join(self.addr(host, r) for r in range(len(self.rates)))

    def up(self):
        try:
            for ns in [self.sw] + self.hosts:
                sh("ip", "netns", "add", ns)
                self.created.append(ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            for r, rate in enumerate(self.rates):
                br = f"br{r}"
                sh("ip", "-n", self.sw, "link", "add", br, "type", "bridge")
                sh("ip", "-n", self.sw, "link", "set", br, "up")
                for i, ns in enumerate(self.hosts):
                    swdev = f"h{i}r{r}"
                    sh("ip", "-n", self.sw, "link", "add", swdev, "type", "veth", "peer", "name",
                       f"r{r}", "netns", ns)
                    sh("ip", "-n", self.sw, "link", "set", swdev, "master", br, "up")
                    sh("ip", "-n", ns, "addr", "add", f"{self.addr(i, r)}/24", "dev", f"r{r}")
                    sh("ip", "-n", ns, "link", "set", f"r{r}", "up")
                    if rate:
                        htb(ns, f"r{r}", rate)
                        htb(self.sw, swdev, rate)
            return self
        except BaseException:
            self.down()
            raise

    def set_rate(self, rail, mbit):
        for i, ns in enumerate(self.hosts):
            htb(ns, f"r{rail}", mbit)
            htb(self.sw, f"h{i}r{rail}", mbit)

    def link(self, host, rail, up: bool):
        sh("ip", "-n", self.hosts[host], "link", "set", f"r{rail}", "up" if up else "down")

    def popen(self, host, args, **kw):
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[host]] + list(args), **kw)

    def down(self):
        for ns in reversed(self.created):
            sh("ip", "netns", "del", ns, check=False)
        self.created = []

    def __enter__(self):
        return self.up()

    def __exit__(self, *e):
        self.down()
