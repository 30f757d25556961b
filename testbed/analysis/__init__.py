"""From what a run recorded to a verdict: kernel counter samples, the merged timeline, metrics
(one function each), the verdict against the topology's expectations, the report and plots."""
