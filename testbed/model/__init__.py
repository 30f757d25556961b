"""What a run is about, as typed data: units, the topology (spec), the scenario (workload, faults,
expectations) and the records a run produces. Nothing here touches the kernel."""
