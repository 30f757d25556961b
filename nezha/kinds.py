"""What a collective call can name: systems, element types, reduction ops.

One home for these lists: the Context checks calls against them and the testbed's scenario
files (testbed/model/scenario.py) are validated against the same tuples, so a scenario can
never ask for something the library refuses.
"""
from __future__ import annotations

from .wire import REDOPS

# systems a Context runs; "gloo" (torch.distributed) comes from nezha.baselines
SYSTEMS: tuple[str, ...] = ("nezha", "single", "stripe", "mptcp")
ALL_SYSTEMS: tuple[str, ...] = SYSTEMS + ("gloo",)
DTYPES: tuple[str, ...] = ("float32", "float64", "float16", "int32", "int64")
# reduction ops: the wire's redop names (code 0 "none" aside), in code order
OPS: tuple[str, ...] = tuple(name for code, name in sorted(REDOPS.items()) if code)
