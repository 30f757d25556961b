"""One rank of a ``train`` workload: a real model trained with DDP, one JSON line per step.

The testbed runs ``python -m testbed.run.train`` on every host with torchrun's variables
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) and NEZHA_RAILS / NEZHA_JOB_SECRET set, so the
same script would run under torchrun. Every rank appends to NEZHA_RESULTS, per step::

    {"step": i, "t_start": .., "t_end": .., "loss": .., "samples": .., "backend": ..}

``t_start``/``t_end``: time.monotonic() around forward, backward (DDP's gradient allreduce)
and the optimizer step. ``loss``: the loss of the step's *global* batch (every rank's samples)
under this rank's weights after the step, computed outside the timed span. It depends on the
weights only, so it is identical on every rank exactly when the replicas are identical, and
equal to a fault-free run's exactly when the faults changed no bit of training.

Data (``synthetic``): a fixed pool of POOL_BATCHES global batches of random inputs, labelled
by a fixed random linear teacher (all from ``seed``); every rank draws the step's global batch
from the pool with a generator seeded by (seed, step) and trains on its own shard. A small
pool, so the loss falls visibly within a few dozen steps. One thread per rank: ranks share the machine's cores, and a fixed thread count
keeps the forward passes' bits the same on every rank.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

CLASSES = 10
IMAGE = (1, 28, 28)        # convnet's synthetic images
MLP_LAYERS = 4             # hidden width x width layers of the mlp
LR, MOMENTUM = 0.05, 0.9
POOL_BATCHES = 4           # the synthetic data set: this many global batches of samples


def mlp(params: int) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """MLP_LAYERS square layers whose width gives ~``params`` parameters: a wide model whose
    gradients (4 bytes each) dominate the step, i.e. communication-bound."""
    width = max(8, int(math.sqrt(params / MLP_LAYERS)))
    layers: list[torch.nn.Module] = []
    for _ in range(MLP_LAYERS):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, CLASSES)), (width,)


def convnet(params: int) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """A small LeNet-like net on 28x28 images (~0.1M parameters; ``params`` is not used):
    more compute per byte of gradient than the mlp."""
    del params
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 5, padding=2), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 5, padding=2), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 7 * 7, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, CLASSES)), IMAGE


# model name -> builder(params) -> (module, input shape); testbed.model.scenario.TRAIN_MODELS
# lists the same names (a test keeps them equal) so validation needs no torch import
MODELS: dict[str, Callable[[int], tuple[torch.nn.Module, tuple[int, ...]]]] = {
    "mlp": mlp, "convnet": convnet}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="mlp")
    p.add_argument("--params", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="samples per rank and step")
    p.add_argument("--backend", choices=["nezha", "gloo"], default="nezha")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", choices=["synthetic"], default="synthetic")
    p.add_argument("--timeout", type=float, default=60.0, help="each collective's wait, s")
    return p.parse_args(argv)


def init_backend(backend: str, timeout: float) -> None:
    """The process group from torchrun's env; gloo bound to the first rail's interface (as
    the gloo baseline is), so it uses one rail where Nezha uses all."""
    if backend == "nezha":
        import nezha.torch  # noqa: F401  (registers the backend)
    else:
        from nezha.baselines import iface_of
        first = os.environ.get("NEZHA_RAILS", "").split(",")[0]
        ifname = iface_of(first) if first else None
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))


class Synthetic:
    """The global batch of every step, the same on every rank; labels from a fixed teacher."""

    def __init__(self, seed: int, shape: tuple[int, ...], batch: int, world: int) -> None:
        self.seed, self.batch, self.world = seed, batch, world
        g = torch.Generator().manual_seed(seed * 7919 + 1)
        teacher = torch.randn(math.prod(shape), CLASSES, generator=g)
        self.x = torch.randn(POOL_BATCHES * batch * world, *shape, generator=g)
        self.y = (self.x.flatten(1) @ teacher).argmax(dim=1)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        idx = torch.randperm(len(self.x), generator=g)[:self.batch * self.world]
        return self.x[idx], self.y[idx]

    def shard(self, x: torch.Tensor, y: torch.Tensor, rank: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        a = rank * self.batch
        return x[a:a + self.batch], y[a:a + self.batch]


def train(args: argparse.Namespace, rank: int, world: int, out) -> None:
    """The training loop: one timed step (forward, backward with DDP's allreduce, optimizer
    step) then the global batch's loss, one line per step."""
    torch.manual_seed(args.seed)
    module, shape = MODELS[args.model](args.params)
    ddp = DDP(module)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    data = Synthetic(args.seed, shape, args.batch, world)
    lossf = torch.nn.functional.cross_entropy
    if rank == 0:
        n = sum(p.numel() for p in module.parameters())
        print(f"{args.model}: {n} parameters ({n * 4 / 2**20:.1f} MiB of gradients), "
              f"{world} ranks, backend {args.backend}", flush=True)
    for step in range(args.steps):
        x, y = data.global_batch(step)
        xs, ys = data.shard(x, y, rank)
        t_start = time.monotonic()
        opt.zero_grad()
        lossf(ddp(xs), ys).backward()
        opt.step()
        t_end = time.monotonic()
        with torch.no_grad():
            loss = float(lossf(module(x), y))
        out.write(json.dumps({"step": step, "t_start": t_start, "t_end": t_end, "loss": loss,
                              "samples": len(xs), "backend": args.backend}) + "\n")
        out.flush()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    init_backend(args.backend, args.timeout)
    gc.freeze()          # see nezha/worker.py: a full collection in one rank stalls them all
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.environ.get("NEZHA_RESULTS")
    try:
        with open(path, "a") if path else open(os.devnull, "w") as out:
            train(args, rank, world, out)
    finally:
        dist.destroy_process_group()
    print(f"rank {rank}: {args.steps} steps done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
