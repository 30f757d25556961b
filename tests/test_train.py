"""The `train` workload: its fields are checked before anything runs, its metrics are computed
from the ranks' per-step lines (never passing when not measured), and on a real fabric DDP over
Nezha survives a rail fault with losses identical on every rank and equal, bit for bit, to the
same job run first without the fault. `command` workloads get torchrun's variables."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from testbed.analysis import metrics as metrics_mod
from testbed.analysis import report
from testbed.analysis.verdict import judge
from testbed.errors import SpecError
from testbed.model import spec
from testbed.model.records import FaultRecord
from testbed.model.scenario import build
from testbed.model.train_spec import TRAIN_MODELS
from testbed.run.runner import run_topology

ROOT = Path(__file__).resolve().parent.parent
HEAD = """
name: t
hosts: 3
rails: [{name: r0, bandwidth: 200mbit}, {name: r1, bandwidth: 200mbit}]
"""


def scenario(workload: str, extra: str = ""):
    return build(spec.loads(HEAD + f"workload: {workload}\n" + extra))


# ------------------------------------------------------------------------------- the fields
def test_defaults_and_fields():
    w = scenario("{kind: train}").workload
    assert (w.model, w.params, w.steps, w.batch, w.backends, w.seed, w.data, w.warmup,
            w.reference) == ("mlp", 1_000_000, 20, 8, ("nezha",), 0, "synthetic", 1, "auto")
    w = scenario("{kind: train, model: mlp, params: 4M, steps: 5, batch: 2, backends: [nezha, "
                 "gloo], seed: 3, warmup: 0, rounds: 2}").workload
    assert (w.params, w.steps, w.batch, w.backends, w.seed, w.warmup, w.rounds) == \
        (4_000_000, 5, 2, ("nezha", "gloo"), 3, 0, 2)
    assert scenario("{kind: train, params: 500k}").workload.params == 500_000


@pytest.mark.parametrize("workload, field, accepted", [
    ("{kind: train, model: resnet}", "workload.model", "mlp, convnet"),
    ("{kind: train, steps: 0}", "workload.steps", "integer >= 1"),
    ("{kind: train, steps: 2.5}", "workload.steps", "integer >= 1"),
    ("{kind: train, batch: 0}", "workload.batch", "integer >= 1"),
    ("{kind: train, backend: nccl}", "workload.backend", "nezha, gloo"),
    ("{kind: train, backends: [nezha, mpi]}", "workload.backends[1]", "nezha, gloo"),
    ("{kind: train, backends: [nezha, nezha]}", "workload.backends", "each backend once"),
    ("{kind: train, backend: gloo, backends: [nezha]}", "workload.backends", "to compare"),
    ("{kind: train, params: 4G}", "workload.params", "10k to 64M"),
    ("{kind: train, params: 100}", "workload.params", "10k to 64M"),
    ("{kind: train, model: convnet, params: 1M}", "workload.params", "model: mlp"),
    ("{kind: train, data: imagenet}", "workload.data", "synthetic"),
    ("{kind: train, seed: -1}", "workload.seed", "integer >= 0"),
    ("{kind: train, steps: 3, warmup: 3}", "workload.warmup", "< steps (3)"),
    ("{kind: train, rounds: 2}", "workload.rounds", "backends: [nezha, gloo]"),
    ("{kind: train, size: 1MiB}", "workload.size", "model/params"),
    ("{kind: train, iterations: 5}", "workload.iterations", "steps"),
    ("{kind: train, system: gloo}", "workload.system", "backend"),
    ("{kind: train, reference: 3}", "workload.reference", "auto"),
    ("{kind: train, reference: /nonexistent/losses.json}", "workload.reference", "JSON"),
    ("{kind: allreduce, model: mlp}", "workload.model", "kind: train"),
    ("{kind: command, command: 'true', steps: 3}", "workload.steps", "kind: train"),
])
def test_bad_fields_name_the_field_and_what_is_valid(workload, field, accepted):
    with pytest.raises(SpecError) as e:
        scenario(workload)
    assert e.value.field == field, str(e.value)
    assert accepted in str(e.value)


def test_expect_loss_matches_reference_takes_a_boolean():
    sc = scenario("{kind: train}", "expect: {loss_matches_reference: true, step_time_ms: "
                  "{max: 500}}")
    assert [(x.metric, x.describe()) for x in sc.expect] == \
        [("loss_matches_reference", "true"), ("step_time_ms", "<= 500")]
    with pytest.raises(SpecError) as e:
        scenario("{kind: train}", "expect: {loss_matches_reference: 1}")
    assert e.value.field == "expect.loss_matches_reference" and "true or false" in str(e.value)


def test_reference_file_a_list_or_per_backend(tmp_path):
    (tmp_path / "l.json").write_text("[2.5, 2.25]")
    (tmp_path / "m.json").write_text('{"nezha": [1.0, 0.5]}')
    topo = tmp_path / "t.yaml"
    topo.write_text(HEAD + "workload: {kind: train, steps: 2, backends: [nezha, gloo], "
                    "reference: l.json}\n")     # relative to the topology file
    assert build(spec.load(topo)).workload.reference_losses == \
        (("nezha", (2.5, 2.25)), ("gloo", (2.5, 2.25)))
    topo.write_text(HEAD + "workload: {kind: train, steps: 2, backends: [nezha, gloo], "
                    f"reference: {tmp_path / 'm.json'}}}\n")
    with pytest.raises(SpecError, match="no losses for backend gloo"):
        build(spec.load(topo))


def test_the_worker_builds_every_model_validation_accepts():
    pytest.importorskip("torch")
    from testbed.run.train import MODELS
    assert tuple(sorted(MODELS)) == tuple(sorted(TRAIN_MODELS))


# ------------------------------------------------------------------------------- the metrics
def lines(losses_by_rank: dict[int, list[float]], t0: float = 100.0, step_s: float = 0.1,
          slow_rank: int = -1, phase: int = 0, backend: str = "nezha") -> list[dict]:
    """What the ranks write: step i of every rank starts at t0 + i * step_s; ``slow_rank``
    takes twice as long."""
    out = []
    for rank, losses in losses_by_rank.items():
        for i, loss in enumerate(losses):
            t = t0 + i * step_s
            d = step_s * (2 if rank == slow_rank else 1) * 0.5
            out.append({"rank": rank, "phase": phase, "system": backend, "step": i,
                        "t_start": t, "t_end": t + d, "loss": loss, "samples": 8,
                        "backend": backend})
    return out


def compute(workload: str, recs, reference=(), faults=""):
    sc = scenario(workload, faults)
    topo = spec.loads(HEAD + f"workload: {workload}\n" + faults)
    return metrics_mod.compute(topo, sc, None, recs, [], [], 100.0,
                               extra={"rank_errors": 0, "train_reference": reference})


FAULT = "faults: [{at: 1s, action: link-down, target: h2.r1, for: 1s}]\n"


def test_metrics_of_a_run_that_matches_its_reference():
    losses = [2.3, 2.1, 1.9, 1.7]
    ref = lines({r: losses for r in range(3)}, t0=50.0)
    m = compute("{kind: train, steps: 4}", lines({r: losses for r in range(3)}, slow_rank=2),
                ref, FAULT)
    assert m["loss_matches_reference"] is True
    assert m["loss_final"] == 1.7
    assert m["step_time_ms"] == pytest.approx(100.0)        # the slow rank's 0.1 s
    # steps 1..3: 3 ranks x 8 samples x 3 steps from 100.1 to 100.4
    assert m["samples_per_s"] == pytest.approx(72 / 0.3)
    tr = m.detail["train"]["backends"]["nezha"]
    assert tr["reference"] == losses and len(tr["rounds"][0]) == 4


def test_a_rank_that_differs_or_a_changed_loss_fails_and_says_where():
    good = [2.3, 2.1, 1.9]
    ref = lines({r: good for r in range(3)})
    m = compute("{kind: train, steps: 3}", lines({0: good, 1: good, 2: [2.3, 2.1, 1.9000001]}),
                ref, FAULT)
    assert m["loss_matches_reference"] is False
    assert "step 2: the ranks' losses differ" in m.notes["loss_matches_reference"]
    m = compute("{kind: train, steps: 3}", lines({r: [2.3, 2.2, 1.9] for r in range(3)}), ref,
                FAULT)
    assert m["loss_matches_reference"] is False
    assert "step 1: loss 2.2 != reference 2.1" in m.notes["loss_matches_reference"]
    m = compute("{kind: train, steps: 3}", lines({0: good, 1: good, 2: good[:2]}), ref, FAULT)
    assert m["loss_matches_reference"] is False and m["loss_final"] is None


def test_without_a_reference_it_is_not_measured_and_fails_its_expectation():
    recs = lines({r: [2.0, 1.0] for r in range(3)})
    for workload, faults, why in [("{kind: train, steps: 2}", "", "the run has no faults"),
                                  ("{kind: train, steps: 2, reference: none}", FAULT,
                                   "reference: none")]:
        m = compute(workload, recs, (), faults)
        assert m["loss_matches_reference"] is None and why in m.notes["loss_matches_reference"]
        sc = scenario(workload, faults + "expect: {loss_matches_reference: true}\n")
        v = judge(sc.expect, m)
        assert not v.passed and "not measured" in v.rows[0].note
    m = compute("{kind: allreduce, size: 1MiB}", [])
    assert m["step_time_ms"] is None and "train workload" in m.notes["step_time_ms"]


def test_reference_from_a_file_and_the_plot(tmp_path):
    (tmp_path / "ref.json").write_text(json.dumps({"nezha": [2.0, 1.5, 1.25], "gloo":
                                                   [2.0, 1.5, 1.0]}))
    w = f"{{kind: train, steps: 3, backends: [nezha, gloo], reference: {tmp_path / 'ref.json'}}}"
    recs = lines({r: [2.0, 1.5, 1.25] for r in range(3)}) + \
        lines({r: [2.0, 1.5, 1.0] for r in range(3)}, t0=110.0, phase=1, backend="gloo")
    m = compute(w, recs, (), FAULT)
    assert m["loss_matches_reference"] is True and m["loss_final"] == 1.25   # nezha's
    assert set(m.detail["train"]["backends"]) == {"nezha", "gloo"}
    fault = FaultRecord(0, "link-down", "h2.r1", label="link-down h2.r1", t_applied=100.15,
                        t_end=100.25)
    topo = spec.loads(HEAD)
    assert report.plot_train(tmp_path / "train.png", topo, m, [fault], 100.0).stat().st_size \
        > 5000
    report.write_train_losses(tmp_path / "train_losses.json", m)
    assert json.loads((tmp_path / "train_losses.json").read_text()) == \
        {"nezha": [2.0, 1.5, 1.25], "gloo": [2.0, 1.5, 1.0]}


# ------------------------------------------------------------------------------- on a fabric
TRAIN = """
name: train-e2e
hosts: 3
rails: [{name: r0, bandwidth: 200mbit}, {name: r1, bandwidth: 200mbit}]
tcp: {rto_min: 5ms}
workload: {kind: train, model: mlp, params: 1M, steps: 30, batch: 4, seed: 1, timeout: 60s}
faults: [{at: 6s, action: link-down, target: h2.r1, for: 5s}]
expect: {rank_errors: 0, loss_matches_reference: true, step_time_ms: {max: 2000}}
"""


@pytest.mark.netns
@pytest.mark.slow
def test_ddp_over_nezha_survives_a_rail_fault_bit_for_bit(tmp_path, no_leftovers):
    out = run_topology(spec.loads(TRAIN), tmp_path / "r", say=lambda m: None)
    m = out.metrics
    assert out.passed, (out.verdict.failures, m.notes)
    assert m["rank_errors"] == 0 and m["loss_matches_reference"] is True
    assert m["step_time_ms"] > 0 and m["samples_per_s"] > 0 and m["loss_final"] > 0
    ranks = tmp_path / "r" / "ranks"
    per_rank = {}
    for kind in ("ref", "train"):
        for p in sorted(ranks.glob(f"00-{kind}-nezha-h*.results.jsonl")):
            per_rank[(kind, p.name)] = [json.loads(l)["loss"] for l in p.read_text().splitlines()]
    runs = list(per_rank.values())
    assert len(runs) == 6 and all(len(r) == 30 for r in runs)
    assert all(r == runs[0] for r in runs), "losses differ between ranks or from the reference"
    assert runs[0][-1] < runs[0][0]                  # it trains
    # the fault hit the training: some step ran while h2.r1 was down
    fault = out.faults[0]
    steps = m.detail["train"]["backends"]["nezha"]["rounds"][0]
    t0 = m.detail["t0"]
    assert any(s["t_end_rel"] >= fault.t_applied - t0 and s["t_start_rel"] <= fault.t_end - t0
               for s in steps), (fault, steps[0], steps[-1])
    assert (tmp_path / "r" / "train.png").stat().st_size > 5000
    assert json.loads((tmp_path / "r" / "train_losses.json").read_text())["nezha"] == runs[0]


TORCHRUN = """
name: torchrun-vars
hosts: 2
rails: [{name: r0, bandwidth: 200mbit}, {name: r1, bandwidth: 200mbit}]
workload:
  kind: command
  timeout: 60s
  command: >-
    echo "vars $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT
    $NEZHA_MASTER_PORT" && python examples/train_ddp.py --backend nezha --steps 3
    --width 64 --layers 2
expect: {rank_errors: 0}
"""


@pytest.mark.netns
@pytest.mark.slow
def test_command_workload_gets_torchrun_variables(tmp_path, no_leftovers):
    """A user's own torchrun script (examples/train_ddp.py) runs unchanged as a command: the
    testbed sets what torchrun would, MASTER_ADDR being rank 0's first-rail address."""
    out = run_topology(spec.loads(TORCHRUN), tmp_path / "c", say=lambda m: None)
    ranks = json.loads((tmp_path / "c" / "ranks.json").read_text())
    logs = [Path(r["log"]).read_text(errors="replace") for r in ranks]
    assert out.passed, logs
    for rank, log in enumerate(logs):
        v = re.search(r"vars (\S+) (\S+) (\S+) (\S+) (\S+) (\S+) (\S+)", log).groups()
        assert v[:5] == (str(rank), "2", "0", "1", "198.18.0.1"), v
        assert v[5] != v[6] and int(v[5]) > 0
    assert "median step" in logs[0]           # rank 0 of train_ddp.py finished its summary
