"""The fields of a ``kind: train`` workload: which model, how long, which backend(s), and what
its per-step losses are held against (``reference``).

Kept apart from scenario.py (which calls ``parse_train``) because a training job has its own
vocabulary; validation needs no torch import (the worker, testbed/run/train.py, builds the
models named in TRAIN_MODELS; a test keeps the two lists equal).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from testbed.errors import SpecError, quote
from testbed.model.units import parse_choice, parse_int

TRAIN_MODELS = ("mlp", "convnet")
TRAIN_BACKENDS = ("nezha", "gloo")
TRAIN_DATA = ("synthetic",)
TRAIN_KEYS = ("model", "params", "steps", "batch", "backend", "backends", "seed", "data",
              "reference")
# keys of other kinds a train workload does not take, and what to write instead
NOT_FOR_TRAIN = {"size": "model/params", "sizes": "model/params", "duration": "steps",
                 "iterations": "steps", "system": "backend", "systems": "backends",
                 "dtype": "(float32 always)", "op": "(DDP averages)", "command": "kind: command"}
MIN_PARAMS, MAX_PARAMS = 10_000, 64_000_000
MAX_STEPS, MAX_BATCH, MAX_SEED = 100_000, 4096, 2**31 - 1
_PARAMS_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_params(value: Any, field_: str) -> int:
    """A parameter count: 4000000, "4M", "500k"."""
    n: Optional[float] = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and (m := _PARAMS_RE.match(value)):
        n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6}[m.group(2).lower()]
    if n is None or not MIN_PARAMS <= n <= MAX_PARAMS:
        raise SpecError(field_, f"{quote(value)} is not accepted",
                        "a parameter count from 10k to 64M, e.g. 4M, 500k or 1000000")
    return int(n)


def _backends(raw: dict, f: str) -> tuple[str, ...]:
    if "backend" in raw and "backends" in raw:
        raise SpecError(f"{f}.backends", "given together with backend",
                        "backend: B for one, or backends: [nezha, gloo] to compare them")
    if "backends" not in raw:
        return (parse_choice(raw.get("backend", "nezha"), TRAIN_BACKENDS, f"{f}.backend"),)
    b = raw["backends"]
    if not isinstance(b, list) or not b:
        raise SpecError(f"{f}.backends", f"{quote(b)} is not a list",
                        f"a list from: {', '.join(TRAIN_BACKENDS)}")
    out = tuple(parse_choice(x, TRAIN_BACKENDS, f"{f}.backends[{i}]") for i, x in enumerate(b))
    if len(set(out)) != len(out):
        raise SpecError(f"{f}.backends", "a backend is listed twice", "each backend once")
    return out


def _losses(value: Any, field_: str) -> tuple[float, ...]:
    if not isinstance(value, list) or not value or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        raise SpecError(field_, "not a list of per-step losses", "a non-empty list of numbers")
    return tuple(float(v) for v in value)


def load_reference(value: Any, source: Optional[str], backends: tuple[str, ...],
                   field_: str) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """A reference file: a JSON list of per-step losses (for every backend), or a mapping
    {backend: [losses]} such as the ``train_losses.json`` every train run writes. A relative
    path is taken from the topology file's directory."""
    path = Path(value)
    if not path.is_absolute() and source and Path(source).parent.is_dir():
        path = Path(source).parent / path
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpecError(field_, f"{quote(str(path))} cannot be read as JSON ({e.__class__.__name__})",
                        "auto, none, or the path of a JSON file of per-step losses") from None
    if isinstance(doc, list):
        return tuple((b, _losses(doc, field_)) for b in backends)
    if not isinstance(doc, dict):
        raise SpecError(field_, "the file holds neither a list nor a mapping",
                        "[loss, loss, ...] or {backend: [loss, ...]}")
    for b in backends:
        if b not in doc:
            raise SpecError(field_, f"the file has no losses for backend {b}",
                            f"a key for each of: {', '.join(backends)}")
    return tuple((b, _losses(doc[b], f"{field_} ({b})")) for b in backends)


def parse_train(raw: dict, source: Optional[str], f: str) -> dict[str, Any]:
    """The train fields of ``raw`` (kind: train) as Workload keyword arguments."""
    for k, instead in NOT_FOR_TRAIN.items():
        if k in raw:
            raise SpecError(f"{f}.{k}", "not used with kind: train", instead)
    kw: dict[str, Any] = {"model": parse_choice(raw.get("model", "mlp"), TRAIN_MODELS,
                                                f"{f}.model"),
                          "backends": _backends(raw, f)}
    if "params" in raw:
        if kw["model"] != "mlp":
            raise SpecError(f"{f}.params", f"only used with model: mlp (model is "
                            f"{kw['model']})", "model: mlp, or no params key")
        kw["params"] = parse_params(raw["params"], f"{f}.params")
    kw["steps"] = parse_int(raw.get("steps", 20), f"{f}.steps", 1, MAX_STEPS)
    kw["batch"] = parse_int(raw.get("batch", 8), f"{f}.batch", 1, MAX_BATCH)
    kw["seed"] = parse_int(raw.get("seed", 0), f"{f}.seed", 0, MAX_SEED)
    kw["data"] = parse_choice(raw.get("data", "synthetic"), TRAIN_DATA, f"{f}.data")
    warmup = raw.get("warmup", 1)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or \
            not 0 <= warmup < kw["steps"]:
        raise SpecError(f"{f}.warmup", f"{quote(warmup)} is not accepted",
                        f"an integer >= 0 and < steps ({kw['steps']}): steps left out of the "
                        "step time")
    kw["warmup"] = warmup
    if "rounds" in raw and len(kw["backends"]) < 2:
        raise SpecError(f"{f}.rounds", "only used with several backends",
                        "backends: [nezha, gloo], or no rounds key")
    ref = raw.get("reference", "auto")
    if ref in ("auto", "none"):
        kw["reference"] = ref
    elif isinstance(ref, str) and ref.strip():
        kw["reference"] = ref
        kw["reference_losses"] = load_reference(ref, source, kw["backends"], f"{f}.reference")
    else:
        raise SpecError(f"{f}.reference", f"{quote(ref)} is not accepted",
                        "auto (a fault-free run of the same job first, when there are faults), "
                        "none, or the path of a JSON file of per-step losses")
    return kw
