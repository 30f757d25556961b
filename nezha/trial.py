"""Whether leaving rails out for their CPU cost pays, decided by measuring both choices.

The split leaves a rail out when the CPU one more rail costs a message (balance.rail_overhead:
a fixed figure times how long the rank's threads wait for a CPU) is more than the time the
rail saves. Where the CPU is what sets the pace that is right: 5 hosts x 14 rails on 2 cores
ran 1.6x faster with seven 10 Mbit/s rails out. Where the CPU has room it is wrong: 2 hosts x
16 rails left nine rails out (13 % of the bytes the optimum gives them) and ran at 0.82 of the
optimum, while the same split pinned over all 16 rails ran at 0.96. No one figure serves both,
and a rank cannot tell them apart from its own counters, so once the split has settled the
balancer runs a few operations at the other choice (the overhead counted, or not) and keeps
whichever every rank's clock says ran faster. The other choice is tried again after twice as
many tables each time (after the most at once if it was far slower), so a machine whose load
changes is looked at again, rarely.

The verdict comes from agreed tables only (each rank's operation time per byte, their
median), so every rank takes it at the same table.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

BASE_TABLES = 3      # the last tables' times measure the choice in use...
TRIAL_TABLES = 3     # ...against as many at the other choice
MARGIN = 0.03        # the other choice is kept only if it is this much faster,
ABORT = 0.10         # and given up at once when one table says it is this much slower
                     # (then not tried again for MAX_WAIT tables)
FIRST_WAIT = 3       # tables after the base is full before the first trial (the split settles)
MAX_WAIT = 128       # the longest wait between trials, in tables


@dataclass
class OverheadTrial:
    """The agreed factor on the rail overhead (``scale``: 1 counts it, 0 ignores it) and the
    trial that picks it."""
    scale: float = 1.0
    base: list = field(default_factory=list)     # time per byte at the choice in use
    trial: list | None = None                    # ...at the other choice, while it is tried
    wait: int = FIRST_WAIT                       # tables to pass before a trial
    backoff: int = 2 * FIRST_WAIT                # the wait after the next verdict

    def observe(self, per_byte: float, moved: bool, worth: bool) -> list:
        """One agreed HOT table: ``per_byte`` the agreed seconds per byte of the operations
        since the previous table (nan if none was measured), ``moved`` whether this table
        moved the split, ``worth`` whether the other choice would use other rails and make
        the message finish MARGIN sooner by the model. Returns (event, fields) pairs for the
        log."""
        if self.trial is not None:
            if not math.isnan(per_byte):
                self.trial.append(per_byte)
                if per_byte > statistics.median(self.base) * (1.0 + ABORT):
                    return self._verdict(aborted=True)
            return self._verdict() if len(self.trial) >= TRIAL_TABLES else []
        if not worth:
            self.base.clear()
            return []
        if not math.isnan(per_byte):
            self.base = (self.base + [per_byte])[-BASE_TABLES:]
        if len(self.base) < BASE_TABLES:
            return []
        if self.wait > 0:
            self.wait -= 1
            return []
        if moved:        # a trial starts from a split that the last table left alone
            return []
        self.scale = 1.0 - self.scale
        self.trial = []
        return [("overhead_trial", {"phase": "start", "scale": self.scale,
                                    "before_ns_per_kb": _ns_per_kb(self.base)})]

    def _verdict(self, aborted: bool = False) -> list:
        """Keep the faster choice. A trial that one table found far slower is not tried
        again for MAX_WAIT tables: where the CPU sets the pace every trial of all rails cost
        1.3-1.4x for a table (5 hosts x 15 rails on 2 cores)."""
        before, after = statistics.median(self.base), statistics.median(self.trial)
        kept = not aborted and after < before * (1.0 - MARGIN)
        if not kept:
            self.scale = 1.0 - self.scale
        fields = {"phase": "kept" if kept else "reverted", "scale": self.scale,
                  "before_ns_per_kb": _ns_per_kb(self.base),
                  "after_ns_per_kb": _ns_per_kb(self.trial)}
        self.wait = MAX_WAIT if aborted else self.backoff
        self.backoff = min(2 * self.backoff, MAX_WAIT)
        self.trial = None
        self.base = []
        return [("overhead_trial", fields)]

    def reset(self) -> list:
        """The rail set or the state changed: what was measured no longer describes the split.
        A trial in progress ends with the choice it started from."""
        events = []
        if self.trial is not None:
            self.scale = 1.0 - self.scale
            events = [("overhead_trial", {"phase": "abandoned", "scale": self.scale})]
        self.trial = None
        self.base = []
        self.wait = max(self.wait, FIRST_WAIT)
        return events


def _ns_per_kb(xs: list) -> float:
    return round(statistics.median(xs) * 1e9 * 1024, 1)
