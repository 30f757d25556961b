"""Multi-rail emulation testbed: topology files become shaped namespace fabrics that run Nezha,
break rails on schedule, measure what happened and give a verdict."""
from testbed.errors import SpecError, TestbedError
from testbed.model.spec import Topology, load, loads

__all__ = ["SpecError", "TestbedError", "Topology", "load", "loads"]
