"""Multi-rail emulation testbed: topology files become shaped namespace fabrics that run Nezha,
break rails on schedule, measure what happened and give a verdict."""
try:
    from testbed.errors import SpecError, TestbedError
    from testbed.model.spec import Topology, load, loads
except ImportError as _e:     # python3 -m testbed with a python that lacks our packages
    from testbed._bootstrap import reexec as _reexec
    _reexec(_e)               # runs the command in the project's environment, or says how
    raise

__all__ = ["SpecError", "TestbedError", "Topology", "load", "loads"]
