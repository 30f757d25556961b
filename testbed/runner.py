"""Kept so that ``from testbed.runner import run_topology`` goes on working: the runner lives in
``testbed.run.runner``."""
from testbed.run.runner import RunOutcome, default_results_dir, run_file, run_topology

__all__ = ["RunOutcome", "default_results_dir", "run_file", "run_topology"]
