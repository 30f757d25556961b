"""Baselines: make_context() picks a system; GlooContext wraps torch.distributed (gloo).

torch is imported only when the gloo system is asked for (it is slow to import).
"""
from __future__ import annotations

import os
from datetime import timedelta


from .buffers import as_array, written_back
from .config import Config
from .context import Context
from .errors import ConfigError
from .kinds import ALL_SYSTEMS as SYSTEMS, SYSTEMS as NEZHA_SYSTEMS
from .rails import parse_rails
from .rendezvous import parse_master


def iface_of(addr: str) -> str | None:
    """Name of the local interface that holds ``addr`` (None if not found)."""
    try:
        from pyroute2 import IPRoute
        with IPRoute() as ipr:
            for msg in ipr.get_addr(family=2):
                if msg.get_attr("IFA_ADDRESS") == addr or msg.get_attr("IFA_LOCAL") == addr:
                    link = ipr.get_links(msg["index"])[0]
                    return link.get_attr("IFLA_IFNAME")
    except Exception:
        return None
    return None


class GlooContext:
    """The same API as Context for allreduce/broadcast/allgather/barrier, over torch gloo
    bound to the first rail's interface (GLOO_SOCKET_IFNAME)."""

    system = "gloo"

    def __init__(self, rank=None, world_size=None, rails=None, master=None, *, timeout=30.0,
                 events=None, config: Config | None = None, **_):
        cfg = config if config is not None else Config.from_env()
        try:
            import torch
            import torch.distributed as dist
        except ImportError as e:
            raise ConfigError("system 'gloo' needs torch (pip install torch==2.13.0, or ./install.sh)") from e
        self.torch, self.dist = torch, dist
        self.rank = int(_first(rank, cfg.rank, -1))
        self.world_size = int(_first(world_size, cfg.world_size, 0))
        self.rail_addrs = parse_rails(_first(rails, cfg.rails))[:1]
        self.nrails = 1
        ifname = iface_of(self.rail_addrs[0])
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        host, port = parse_master(master, cfg)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=timeout))
        self._ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                     "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}

    def _t(self, buf, dtype=None):
        arr, wb = as_array(buf, dtype)
        return self.torch.from_numpy(arr), wb

    def allreduce(self, buf, op="sum", dtype=None):
        t, wb = self._t(buf, dtype)
        self.dist.all_reduce(t, op=self._ops[op])
        return written_back(buf, wb)

    def broadcast(self, buf, root=0, dtype=None):
        t, wb = self._t(buf, dtype)
        self.dist.broadcast(t, src=root)
        return written_back(buf, wb)

    def allgather(self, inbuf, outbuf, dtype=None):
        t, _ = self._t(inbuf, dtype)
        o, wb = self._t(outbuf, dtype)
        self.dist.all_gather(list(o.chunk(self.world_size)), t)
        return written_back(outbuf, wb)

    def reduce_scatter(self, inbuf, outbuf, op="sum", dtype=None):
        t, _ = self._t(inbuf, dtype)
        o, wb = self._t(outbuf, dtype)
        try:
            self.dist.reduce_scatter(o, list(t.clone().chunk(self.world_size)), op=self._ops[op])
        except RuntimeError as e:
            raise ConfigError(f"reduce_scatter is not available with torch gloo: {e}") from e
        return written_back(outbuf, wb)

    def barrier(self):
        self.dist.barrier()

    def rail_bytes(self):
        return {}

    def stats(self):
        return {"system": "gloo", "state": "n/a", "shares": [1.0], "rails": []}

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    def __enter__(self):
        return self

    def __exit__(self, *e):
        self.close()


def _first(*values):
    """The first value that is not None (an argument, then the config, then a default)."""
    return next((v for v in values if v is not None), None)


def make_context(system: str | None = None, **kw):
    """A Context for ``system`` (NEZHA_SYSTEM by default), or a GlooContext for "gloo"."""
    kw["config"] = cfg = kw.get("config") or Config.from_env()
    system = system or cfg.system
    if system == "gloo":
        kw.pop("store", None)
        kw.pop("group", None)
        return GlooContext(**kw)
    if system not in NEZHA_SYSTEMS:
        raise ConfigError(f"unknown system {system!r} (one of {', '.join(SYSTEMS)})")
    return Context(system=system, **kw)
