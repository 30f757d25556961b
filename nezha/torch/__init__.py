"""torch.distributed backend "nezha": DDP and the c10d collectives on Nezha's rails.

    import nezha.torch                      # registers the backend
    torch.distributed.init_process_group("nezha")    # under torchrun
    model = torch.nn.parallel.DistributedDataParallel(model)

Environment: torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (torch's env:// init) plus
NEZHA_RAILS (this host's rail addresses or interface names, the same rail order on every host)
and, to authenticate the rail connections, NEZHA_JOB_SECRET; every other NEZHA_* variable
(nezha/config.py) applies as for a Context. ``init_process_group(timeout=...)`` is the
Context's timeout (rendezvous and each collective wait), in place of NEZHA_TIMEOUT.

Rendezvous: through the c10d store torch gives every process group (store.py says why: no
second port, any placement of rank 0, sub-groups from ``new_group`` work too).

Provided: allreduce (SUM, AVG, MAX, MIN, PRODUCT), broadcast, all_gather (list) and
all_gather_into_tensor, reduce_scatter (list) and reduce_scatter_tensor, barrier, and what
torch builds on them (all_gather_object, broadcast_object_list, DDP). Reductions take float32,
float64, float16, bfloat16, int64, int32, int16, int8 and uint8 (tensors.py: bfloat16 and the
narrow integers are widened, reduced and narrowed back); broadcast and gathers take any dtype.
CPU tensors; non-contiguous ones are copied to contiguous memory and back. Every call returns
at once with a Work (``wait``, ``is_completed``, ``get_future``); one worker thread per group
runs the collectives in submission order (work.py). send/recv, all_to_all, gather, scatter,
reduce and the bitwise or PREMUL_SUM ops raise ``UnsupportedCall`` naming the call.

Determinism: Nezha's ring reduces segment j of a buffer (the world size's equal split of its
elements) along the fixed chain of ranks j, j+1, ..., j-1 as ((x_j + x_j+1) + x_j+2) + ...,
whatever the rails and however the bytes were split over them, and then copies the finished
bits to every rank. So every rank gets the same bits, and a run repeated with the same inputs,
world size and bucket layout (DDP's buckets are deterministic for a given model) gets the same
bits again. DDP divides each gradient by the world size before the sum.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from .group import NezhaProcessGroup
from .tensors import UnsupportedCall

BACKEND = "nezha"

__all__ = ["BACKEND", "NezhaProcessGroup", "UnsupportedCall", "register"]


def _create(store, rank: int, size: int, timeout: timedelta) -> NezhaProcessGroup:
    """torch's creator hook: the group's prefixed store, its rank and size, its timeout."""
    return NezhaProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Make ``init_process_group("nezha")`` and ``new_group(backend="nezha")`` known to torch
    (CPU tensors; the default CPU backend stays gloo). Idempotent."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


register()
