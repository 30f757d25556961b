"""One run, start to finish: the runner's pipeline, the fault scheduler, the workload on every
host, packet capture and probes."""
