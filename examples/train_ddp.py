"""A communication-bound DDP job (wide linear layers, a tiny synthetic batch) that runs under
torchrun unchanged with either backend, printing each step's time and loss:

    NEZHA_RAILS=eth1,eth2 NEZHA_JOB_SECRET=... torchrun --nnodes 2 --node-rank 0 \\
        --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 1 \\
        examples/train_ddp.py --backend nezha

On one host, for a try: NEZHA_RAILS=127.0.0.1,127.0.0.2 torchrun --nproc-per-node 2
examples/train_ddp.py. The loss printed is the mean over ranks (the same bits on every rank).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["nezha", "gloo"], default="nezha")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--width", type=int, default=1024, help="units per layer")
    p.add_argument("--layers", type=int, default=4, help="width x width layers "
                   "(4 x 1024: 16 MiB of float32 gradients per step)")
    p.add_argument("--batch", type=int, default=8, help="samples per rank and step")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def model_for(args: argparse.Namespace) -> torch.nn.Module:
    layers: list = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def step(ddp: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
         y: torch.Tensor) -> float:
    """One training step; -> the mean loss over ranks."""
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)          # SUM: gloo has no AVG on CPU
    return total.item() / dist.get_world_size()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.backend == "nezha":
        import nezha.torch  # noqa: F401  (registers the "nezha" backend)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    ddp = DDP(model_for(args))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    times = []
    for i in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=gen)
        y = torch.randn(args.batch, args.width, generator=gen)
        t0 = time.perf_counter()
        loss = step(ddp, opt, x, y)
        times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"step {i:3d}  {times[-1] * 1e3:8.1f} ms  loss {loss:.9g}", flush=True)
    if rank == 0:
        grad_mib = sum(p.numel() for p in ddp.parameters()) * 4 / 2**20
        print(f"{args.backend}: {world} ranks, {grad_mib:.1f} MiB of gradients per step, "
              f"median step {statistics.median(times[1:] or times) * 1e3:.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
