"""Judge finished `compare` runs the way `testbed shapes` judges its drawn shapes (the README's
table of the shapes issue 16 names; examples/held-out/ holds those topologies).

    for f in examples/held-out/*.yaml; do
        sudo ./tb run $f --results results/held-out/$(basename $f .yaml); done
    .venv/bin/python scripts/steady_table.py examples/held-out/*.yaml --results results/held-out

One markdown row per topology (its results in RESULTS/<file name without .yaml>): each system's median busbw over every timed iteration ("all") and
over iterations >= --steady-from ("steady", testbed.shapes.steady_busbw), Nezha's steady busbw
over the clean optimum (testbed.shapes.optimum: the sum over rails of each rail's slowest hop
as TCP goodput; a lossy rail counts at its wire rate, so on lossy shapes the single-rail ratio
is the one that says more), Nezha over single and over MPTCP (steady), and per round the
first iteration from which Nezha stays within 10 % of its steady time
(testbed.shapes.ops_to_balance)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.model import spec  # noqa: E402
from testbed.shapes import ops_to_balance, optimum, steady_busbw  # noqa: E402

SYSTEMS = ("nezha", "single", "mptcp")


def row(topology: Path, folder: Path, steady_from: int) -> str:
    """The table row of one topology file and the results folder of its compare run."""
    its = json.loads((folder / "results.json").read_text())["detail"]["iterations"]
    topo = spec.loads(topology.read_text())
    opt = optimum(topo).sum_bps
    busbw = {s: steady_busbw(its, s, steady_from)[0] for s in SYSTEMS}
    every = {s: steady_busbw(its, s, 1)[0] for s in SYSTEMS}
    rounds = sorted({r["phase"] for r in its if r.get("system") == "nezha"})
    ops = [ops_to_balance([r for r in its if r["phase"] == p], "nezha", steady_from)
           for p in rounds]

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"

    def mbit(v):
        return f"{v:.0f}" if v else "-"

    cells = [topology.stem] + [f"{mbit(every[s])} / {mbit(busbw[s])}" for s in SYSTEMS]
    cells += [ratio(busbw["nezha"], opt / 1e6 if opt else None),
              ratio(busbw["nezha"], busbw["single"]), ratio(busbw["nezha"], busbw["mptcp"]),
              ", ".join("-" if k is None else str(k) for k in ops)]
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("topologies", nargs="+", type=Path, help="topology files (compare runs)")
    ap.add_argument("--results", type=Path, required=True,
                    help="folder holding one results folder per topology, named by its file")
    ap.add_argument("--steady-from", type=int, default=6,
                    help="first iteration index of the steady window (default 6)")
    args = ap.parse_args()
    print("| run | nezha all / steady | single all / steady | mptcp all / steady "
          "| nezha/opt | nezha/single | nezha/mptcp | ops to balance |")
    print("|---|---|---|---|---|---|---|---|")
    for topology in args.topologies:
        print(row(topology, args.results / topology.stem, args.steady_from))
    return 0


if __name__ == "__main__":
    sys.exit(main())
