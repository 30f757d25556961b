"""Nezha: multi-rail collective communication (allreduce, broadcast, allgather,
reduce_scatter, barrier) over several network rails, with online cost-balanced splitting.
See nezha/context.py for the API."""
from .errors import *  # noqa: F401,F403
from .context import Context, SYSTEMS  # noqa: F401

__all__ = ["Context", "SYSTEMS"]
