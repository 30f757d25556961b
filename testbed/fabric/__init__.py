"""Live handles over a built fabric (Fabric, Host, Intf, Link, Rail), the shaper that applies and
reads back each rail's shape, the Mininet backend, run state for cleanup, the signal guard."""
from testbed.fabric.fabric import BRIDGE, Fabric, Host, Intf, Link, Rail

__all__ = ["BRIDGE", "Fabric", "Host", "Intf", "Link", "Rail"]
