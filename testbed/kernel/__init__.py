"""The kernel, thinly: entering namespaces, probing what this kernel can emulate, nftables,
link statistics. No policy lives here (pyroute2's habit)."""
