"""Data-parallel reference loops, shared by examples/ddp.py, examples/fsdp.py and the tests.

Every rank builds the same TinyGPT (no dropout: each rank would draw its own masks, which no
single process on the global batch draws) under one seed, takes its slice of each global batch,
and trains with the wrapper it is given (DistributedDataParallel, or FSDP2's `fully_shard`). With
equal slices and a mean loss, averaging the ranks' gradients gives the global batch's gradient, so
the losses and weights equal single-process training on the global batch (`train_single`).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..workloads import TinyGPT, text_batches


@dataclass
class RunFigures:
    """What one rank measured over the steps after `warmup` (the steady state)."""
    losses: list[float]
    params: list[torch.Tensor]
    simulated_seconds: float = 0.0     # device time of the measured steps, collectives included
    collective_seconds: float = 0.0    # of which collectives
    collective_calls: int = 0
    collective_bytes: int = 0
    compiled_fraction: float = 0.0     # of the compute ops in the measured steps
    host_seconds: float = 0.0
    stats: dict = field(default_factory=dict)


def model_and_data(steps: int, global_batch: int, seed: int = 0):
    torch.manual_seed(seed)
    return TinyGPT(dropout=0.0), text_batches(steps, batch=global_batch, seed=seed)


def make_optimizer(model) -> torch.optim.Optimizer:
    """SGD with momentum: Adam divides each update by the root of its squared gradients, which turns
    the last-bit differences of a sum taken in another order (two ranks' halves vs one batch) into
    differences up to the learning rate for near-zero gradients; SGD keeps them at rounding size."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def loss_of(model, x, y) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def neuron_device() -> torch.device:
    """This rank's core: neuron:<local rank> where there are several, else neuron:0."""
    local_rank = dist.get_node_local_rank(fallback_rank=dist.get_rank() if dist.is_initialized() else 0)
    return torch.device("neuron", local_rank % torch.neuron.device_count())


def fully_shard_blocks(model):
    """FSDP2 as its docs recommend: each transformer block, then the root, over all the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _engine(mode: str | None):
    if mode is None:
        return contextlib.nullcontext()
    import tilewise
    return tilewise.engine(mode=mode)


def train_single(device: str = "cpu", mode: str | None = None, steps: int = 8, global_batch: int = 8,
                 seed: int = 0) -> RunFigures:
    """One process on the whole global batch: the reference the data-parallel runs must match."""
    model, data = model_and_data(steps, global_batch, seed)
    model.to(device)
    opt = make_optimizer(model)
    losses = []
    with _engine(mode):
        for x, y in data:
            loss = loss_of(model, x.to(device), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return RunFigures(losses, [p.detach().cpu().clone() for p in model.parameters()])


def train_parallel(wrap: Callable, mode: str | None, steps: int = 8, global_batch: int = 8, seed: int = 0,
                   warmup: int = 0, on_step: Callable | None = None) -> RunFigures:
    """This rank's share of data-parallel training: `wrap(model)` makes the DDP or FSDP2 model.
    Returns the global losses (the ranks' losses averaged) and this rank's full parameters."""
    import tilewise

    rank, world_size = dist.get_rank(), dist.get_world_size()
    if global_batch % world_size:
        raise ValueError(f"the global batch ({global_batch}) must divide evenly among {world_size} ranks")
    share = global_batch // world_size
    rows = slice(rank * share, (rank + 1) * share)
    device = neuron_device()
    # as with CUDA: FSDP2 and DeviceMesh make their tensors on the current device
    torch.neuron.set_device(device)
    model, data = model_and_data(steps, global_batch, seed)
    model = wrap(model.to(device))
    opt = make_optimizer(model)
    local, figures = [], None
    with _engine(mode):
        for step, (x, y) in enumerate(data):
            if step == warmup:
                figures = _Measure(tilewise.stats())
            loss = loss_of(model, x[rows].to(device), y[rows].to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            local.append(loss.item())
            if on_step is not None:
                on_step(step, local[-1])
    measured = figures.finish(tilewise.stats()) if figures is not None else RunFigures([], [])
    losses = torch.tensor(local, device=device)
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)
    measured.losses = losses.cpu().tolist()
    measured.params = full_parameters(model)
    return measured


def full_parameters(model) -> list[torch.Tensor]:
    """Every parameter as a whole CPU tensor (an FSDP2 shard is gathered first)."""
    params = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params.append(full.detach().cpu().clone())
    return params


class _Measure:
    """Figures of the steps from now on: stats() is reset here and read at `finish`."""

    def __init__(self, stats):
        stats.reset()
        self._started = time.perf_counter()

    def finish(self, stats) -> RunFigures:
        collectives = stats.collectives.values()
        return RunFigures([], [], simulated_seconds=stats.simulated_seconds,
                          collective_seconds=stats.collective_seconds,
                          collective_calls=sum(t.calls for t in collectives),
                          collective_bytes=sum(t.bytes for t in collectives),
                          compiled_fraction=stats.compiled_fraction,
                          host_seconds=time.perf_counter() - self._started, stats=stats.to_dict())
