"""Functions run inside rank processes by tests/nezha/test_torch.py (the nezha torch backend).

Each checks its results against a reference computed locally from every rank's known inputs
and returns (failures, digests) so the parent can also check identical bits on all ranks."""
from __future__ import annotations

import hashlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from nezha.testing import loopback_rails

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8]
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
OPS = ["SUM", "AVG", "MAX", "MIN", "PRODUCT"]
WIDE = {torch.bfloat16: torch.float32, torch.float16: torch.float16}


def init(rank: int, world: int, port: int, backend: str = "nezha", nrails: int = 2) -> None:
    """torchrun's environment plus NEZHA_RAILS, then init_process_group(backend)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), NEZHA_RAILS=",".join(loopback_rails(nrails)))
    import nezha.torch  # noqa: F401  (registers the backend)
    torch.set_num_threads(1)
    dist.init_process_group(backend, timeout=timedelta(seconds=20))


def digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def data(rank: int, it: int, shape, dtype, op: str) -> torch.Tensor:
    """Small integers: every reduction is exact in every dtype (bfloat16 and uint8 too)."""
    i = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64).reshape(shape)
    if op == "PRODUCT":
        v = torch.tensor([1, 2, 3 if dtype == torch.uint8 else -1])[(i * 3 + rank + it) % 3]
    else:
        v = (i * 7 + rank * 13 + it * 5) % 11 - (0 if dtype == torch.uint8 else 5)
    return v.to(dtype)


def reference(world: int, it: int, shape, dtype, op: str) -> torch.Tensor:
    """What the group must return: the reduction in int64 (integers, wrapped when narrowed)
    or in the type Nezha reduces in (floats), AVG as the sum divided there."""
    wide = WIDE.get(dtype, dtype) if dtype in FLOATS else torch.int64
    x = torch.stack([data(r, it, shape, dtype, op).to(wide) for r in range(world)])
    red = {"SUM": x.sum(0, dtype=wide), "AVG": x.sum(0, dtype=wide), "MAX": x.amax(0),
           "MIN": x.amin(0), "PRODUCT": x.prod(0, dtype=wide)}[op]
    if op == "AVG":
        red = red.div_(world)
    return red.to(dtype)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and digest(got) == digest(want)


def allreduce_matrix(rank: int, world: int, fails: list, digests: list) -> None:
    """Every dtype x op, alternately on a contiguous tensor and on a strided view (whose
    neighbours must stay untouched)."""
    it = 0
    for dtype in DTYPES:
        for op in OPS:
            if op == "AVG" and dtype not in FLOATS:
                continue
            base = torch.zeros(4, 10, dtype=dtype)
            x = data(rank, it, (4, 5), dtype, op) if it % 2 else base[:, ::2]
            if not it % 2:
                x.copy_(data(rank, it, (4, 5), dtype, op))
            dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
            if not _same(x, reference(world, it, (4, 5), dtype, op)):
                fails.append(("allreduce", str(dtype), op, x.tolist()))
            if not it % 2 and base[:, 1::2].any():
                fails.append(("allreduce wrote outside the view", str(dtype), op))
            digests.append(digest(x))
            it += 1
    wrap = torch.full((3,), 100, dtype=torch.int8)           # 100 * world wraps like int8
    dist.all_reduce(wrap)
    if wrap.tolist() != torch.full((3,), 100 * world, dtype=torch.int64).to(torch.int8).tolist():
        fails.append(("int8 wrap-around", wrap.tolist()))


def random_floats(rank: int, world: int, fails: list, digests: list) -> None:
    """Inexact float32 sums: the same bits everywhere, close to the sum in float64."""
    g = [torch.Generator().manual_seed(100 + r) for r in range(world)]
    xs = [torch.randn(10_001, generator=gr) for gr in g]
    x = xs[rank].clone()
    dist.all_reduce(x)
    want = torch.stack(xs).double().sum(0).float()
    if not torch.allclose(x, want, rtol=1e-5, atol=1e-5):
        fails.append(("random float32 sum", float((x - want).abs().max())))
    digests.append(digest(x))


def movement(rank: int, world: int, fails: list, digests: list) -> None:
    """broadcast from every root, all_gather, all_gather_into_tensor, reduce_scatter (both
    forms), barrier; odd byte counts (padding) and strided tensors included."""
    def mk(r, dtype, shape):
        return data(r, 7, shape, dtype, "SUM")
    for root in range(world):
        for dtype, shape in [(torch.float32, (4, 5)), (torch.bool, (7,)), (torch.bfloat16, (3,))]:
            x = mk(rank, dtype, shape) if rank == root else torch.zeros(shape, dtype=dtype)
            dist.broadcast(x, src=root)
            if not _same(x, mk(root, dtype, shape)):
                fails.append(("broadcast", root, str(dtype)))
        base = torch.zeros(6, 6, dtype=torch.int64)
        view = base.t()[:, :3]
        if rank == root:
            view.copy_(mk(root, torch.int64, (6, 3)))
        dist.broadcast(view, src=root)
        if not _same(view, mk(root, torch.int64, (6, 3))) or base.t()[:, 3:].any():
            fails.append(("broadcast strided", root))
    for dtype, shape in [(torch.int16, (3,)), (torch.float64, (2, 2)), (torch.uint8, (5,))]:
        outs = [torch.empty(shape, dtype=dtype) for _ in range(world)]
        dist.all_gather(outs, mk(rank, dtype, shape))
        if not all(_same(o, mk(r, dtype, shape)) for r, o in enumerate(outs)):
            fails.append(("all_gather", str(dtype)))
        out = torch.empty((world,) + shape, dtype=dtype)
        dist.all_gather_into_tensor(out, mk(rank, dtype, shape))
        if not _same(out, torch.stack([mk(r, dtype, shape) for r in range(world)])):
            fails.append(("all_gather_into_tensor", str(dtype)))
        digests.append(digest(out))
    reduce_scatters(rank, world, fails)
    dist.barrier()


def reduce_scatters(rank: int, world: int, fails: list) -> None:
    for dtype, op in [(torch.float32, "SUM"), (torch.int8, "MAX"), (torch.bfloat16, "AVG")]:
        full = data(rank, 3, (world, 6), dtype, op)
        want = reference(world, 3, (world, 6), dtype, op)[rank]
        out = torch.empty(6, dtype=dtype)
        dist.reduce_scatter_tensor(out, full, op=getattr(dist.ReduceOp, op))
        if not _same(out, want):
            fails.append(("reduce_scatter_tensor", str(dtype), op))
        out2 = torch.zeros(12, dtype=dtype)[::2]
        dist.reduce_scatter(out2, list(full.unbind(0)), op=getattr(dist.ReduceOp, op))
        if not _same(out2, want):
            fails.append(("reduce_scatter", str(dtype), op))


def objects(rank: int, world: int, fails: list) -> None:
    got = [None] * world
    dist.all_gather_object(got, {"rank": rank, "name": "r" * (rank + 1)})
    if got != [{"rank": r, "name": "r" * (r + 1)} for r in range(world)]:
        fails.append(("all_gather_object", got))
    root = world - 1
    lst = [("from", root), [1, 2.5]] if rank == root else [None, None]
    dist.broadcast_object_list(lst, src=root)
    if lst != [("from", root), [1, 2.5]]:
        fails.append(("broadcast_object_list", lst))


def async_handles(rank: int, world: int, fails: list) -> None:
    """Queued work completes in order; wait in reverse; futures carry the tensors."""
    xs = [torch.full((1000,), float(rank + k)) for k in range(5)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    for w in reversed(works):
        w.wait()
        if not w.is_completed():
            fails.append("is_completed() after wait()")
    for k, x in enumerate(xs):
        if not torch.equal(x, torch.full((1000,), float(sum(range(world)) + world * k))):
            fails.append(("async allreduce", k))
    y = torch.ones(3)
    fut = dist.all_reduce(y, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    if not torch.equal(fut.wait(), torch.full((3,), 2.0 * world)):
        fails.append(("future", fut.wait()))


def coalesced(rank: int, world: int, fails: list) -> None:
    """torch's coalescing manager hands a batch of the same collective over in one call."""
    total = float(sum(range(world)))
    a, b = torch.full((5,), float(rank)), torch.full((3,), 2.0 * rank, dtype=torch.float64)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    if a.tolist() != [total] * 5 or b.tolist() != [2 * total] * 3:
        fails.append(("coalesced all_reduce", a.tolist(), b.tolist()))
    ins = [torch.full((2,), float(rank)), torch.arange(3) + rank]
    outs = [torch.empty(2 * world), torch.empty(3 * world, dtype=torch.int64)]
    with dist._coalescing_manager():
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    want = [torch.arange(world).repeat_interleave(2).float(),
            torch.cat([torch.arange(3) + r for r in range(world)])]
    if not all(torch.equal(o, w) for o, w in zip(outs, want)):
        fails.append(("coalesced all_gather_into_tensor", [o.tolist() for o in outs]))
    full = [torch.arange(2.0 * world) * (rank + 1), torch.ones(world, dtype=torch.int32)]
    got = [torch.empty(2), torch.empty(1, dtype=torch.int32)]
    with dist._coalescing_manager():
        for o, i in zip(got, full):
            dist.reduce_scatter_tensor(o, i)
    k = sum(r + 1 for r in range(world))
    if got[0].tolist() != [2.0 * rank * k, (2.0 * rank + 1) * k] or got[1].tolist() != [world]:
        fails.append(("coalesced reduce_scatter_tensor", [g.tolist() for g in got]))


def unsupported(rank: int, world: int, fails: list) -> None:
    """Each refused on the caller's thread, naming the call; nothing is sent."""
    from nezha.torch import UnsupportedCall
    x = torch.ones(4)
    calls = {
        "send": lambda: dist.send(x, (rank + 1) % world),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(4 * world),
                                                            torch.ones(4 * world)),
        "BAND": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.BAND),
        "PREMUL_SUM": lambda: dist.all_reduce(x, op=dist._make_nccl_premul_sum(2.0)),
        "bool": lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool)),
        "AVG needs a floating dtype": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int64),
                                                              op=dist.ReduceOp.AVG),
    }
    for name, call in calls.items():
        try:
            call()
            fails.append(("not refused", name))
        except UnsupportedCall as e:
            if name not in str(e) and name.lower() not in str(e):
                fails.append(("message does not name the call", name, str(e)))
        except Exception as e:
            fails.append(("wrong error", name, type(e).__name__, str(e)))


def errors_propagate(rank: int, world: int, fails: list) -> None:
    """A collective that fails on the worker (sizes differ between ranks) raises through
    wait() and the future; later calls raise too. Last: it leaves the Context unusable."""
    from nezha import NezhaError
    w = dist.all_reduce(torch.ones(10 + rank), async_op=True)
    try:
        w.wait()
        fails.append("mismatched allreduce did not fail")
    except NezhaError:
        pass
    if not w.is_completed() or w.is_success():
        fails.append("failed work not completed / reported success")
    try:
        w.get_future().wait()
        fails.append("future of a failed work has a value")
    except Exception:
        pass
    try:
        dist.all_reduce(torch.ones(3))
        fails.append("a call after the failure did not raise")
    except NezhaError:
        pass


def collectives(rank: int, world: int, port: int) -> dict:
    """Every section on one group (one start-up for all). -> {"fails": {section: [...]},
    "digests": [...]}; the error section runs last since it leaves the Context failed."""
    init(rank, world, port)
    fails: dict = {}
    digests: list = []
    sections = [("allreduce", lambda f: allreduce_matrix(rank, world, f, digests)),
                ("random", lambda f: random_floats(rank, world, f, digests)),
                ("movement", lambda f: movement(rank, world, f, digests)),
                ("objects", lambda f: objects(rank, world, f)),
                ("async", lambda f: async_handles(rank, world, f)),
                ("coalesced", lambda f: coalesced(rank, world, f)),
                ("unsupported", lambda f: unsupported(rank, world, f)),
                ("errors", lambda f: errors_propagate(rank, world, f))]
    for name, run in sections:
        run(fails.setdefault(name, []))
    dist.destroy_process_group()
    return {"fails": fails, "digests": digests}


# ---------------------------------------------------------------------------------- DDP
STEPS = 5


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of step ``step`` (known to the reference too)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(rank: int) -> tuple[list, list, list]:
    """DDP unchanged, on the default group: rank 0's initial weights (the others start from
    other seeds: DDP's broadcast must fix that), buckets of ~4 KB so several reductions are
    in flight during backward. -> (this rank's per-step losses, the mean over ranks of each
    step's loss, final parameters as numpy arrays)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(rank)
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.004)
    opt = optimizer(ddp)
    losses, means = [], []
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        total = loss.detach().clone()
        dist.all_reduce(total)            # SUM: gloo has no AVG
        means.append(total.item() / dist.get_world_size())
    return losses, means, [p.detach().numpy().copy() for p in model.parameters()]


def small_groups(rank: int, world: int) -> list:
    """new_group(backend="nezha") of one rank each: a group of size 1 works."""
    groups = [dist.new_group([r], backend="nezha") for r in range(world)]
    mine = groups[rank]
    fails = []
    x = torch.arange(4.0) + rank
    dist.all_reduce(x, group=mine)
    got = [None]
    dist.all_gather_object(got, rank, group=mine)
    dist.barrier(group=mine)
    if not torch.equal(x, torch.arange(4.0) + rank) or got != [rank] or mine.size() != 1:
        fails.append(("group of one", x.tolist(), got))
    return fails


def compressed(rank: int) -> list:
    """DDP with torch's fp16 compression hook (a Python hook on an async all_reduce future,
    float16 reductions; torch allows its bf16 hook only with NCCL). -> digests of the
    trained weights per hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    out = []
    for hook in (hooks.fp16_compress_hook,):
        torch.manual_seed(rank)
        model = mlp()
        ddp = DDP(model)
        ddp.register_comm_hook(None, hook)
        opt = optimizer(ddp)
        for step in range(2):
            x, y = batch(step, rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        out.append(digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
    return out


def ddp_job(rank: int, world: int, port: int, port2: int, second: str = "nezha") -> dict:
    """Train with nezha; then sub-groups of one; then the same job again on a new group with
    ``second`` ("nezha": reproducibility; "gloo": the same job over torch's own backend)."""
    init(rank, world, port)
    first = train(rank)
    hooked = compressed(rank)
    fails = small_groups(rank, world)
    dist.destroy_process_group()
    init(rank, world, port2, backend=second)
    again = train(rank)
    dist.destroy_process_group()
    return {"first": first, "second": again, "fails": fails, "hooked": hooked}


def reference_training(world: int) -> tuple[list, list]:
    """One process, no torch.distributed: every rank's shard on the same model, each gradient
    divided by the world size (as DDP does before its sum) and summed in rank order.
    -> (losses[rank][step], final parameters)."""
    torch.manual_seed(0)
    model = mlp()
    opt = optimizer(model)
    losses = [[] for _ in range(world)]
    for step in range(STEPS):
        total = None
        for r in range(world):
            x, y = batch(step, r)
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses[r].append(loss.item())
            g = [p.grad / world for p in model.parameters()]
            total = g if total is None else [a + b for a, b in zip(total, g)]
        for p, g in zip(model.parameters(), total):
            p.grad = g
        opt.step()
    return losses, [p.detach().numpy().copy() for p in model.parameters()]
