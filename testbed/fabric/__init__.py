"""Live handles over a built fabric (Fabric, Host, Intf, Link, Rail), the shaper that applies and
reads back each rail's shape, the Mininet backend, run state for cleanup, the signal guard."""
from testbed.fabric.fabric import Fabric, Host, Intf, Link, Rail

__all__ = ["Fabric", "Host", "Intf", "Link", "Rail"]
