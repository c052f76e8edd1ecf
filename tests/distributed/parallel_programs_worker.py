"""One rank of tests/distributed/test_distributed.py's model-parallel programs, as a user writes them: a
two-stage pipeline (torch.distributed.pipelining, GPipe schedule) and a tensor-parallel MLP
(parallelize_module with ColwiseParallel / RowwiseParallel on a device mesh, torch.optim.SGD),
each trained in every engine mode on the "neuron" backend. Writes what it saw as JSON.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed/parallel_programs_worker.py OUT_PREFIX

With `shared_cache` after OUT_PREFIX, one rank of tests/distributed/test_shared_cache.py instead: the
tensor-parallel MLP in the mode TILEWISE_MODE names, whose regions hold DTensor's functional
collectives and read their pending results; it writes its losses and the compile cache's counters.

The pipeline's reference is the same schedule on CPU tensors through a gloo group, in these same
processes; the tensor-parallel program's is the unsplit model on the CPU, computed by the test.
Each program is run in its own try block: a failure in one mode is reported (type, message,
traceback tail) and the others still run.
"""
import contextlib
import datetime
import json
import sys
import traceback

import torch
import torch.distributed as dist

import tilewise
from tilewise.distributed.workloads import neuron_device

MODES = ("eager", "adaptive", "compiled")
STEPS, MICROBATCHES = 4, 2


def pipeline_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def pipeline_data():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)


def _mse(output, target):
    return torch.nn.functional.mse_loss(output, target)


def pipeline_training(device, group=None, mode=None) -> dict:
    """Rank 0 holds layers 0-1, rank 1 layers 2-4; GPipe over two microbatches, SGD on each stage."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank = dist.get_rank()
    layers = pipeline_model()
    stage_module = layers[:2] if rank == 0 else layers[2:]
    stage_module.to(device)
    stage = PipelineStage(stage_module, rank, 2, device, group=group)
    schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=_mse)
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=0.1)
    x, y = pipeline_data()
    losses = []
    tilewise.stats().reset()
    with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        for _ in range(STEPS):
            if rank == 0:
                schedule.step(x.to(device))
            else:
                microbatch_losses = []
                schedule.step(target=y.to(device), losses=microbatch_losses)
                losses.append(torch.stack(microbatch_losses).sum().item())
            optimizer.step()
            optimizer.zero_grad()
    stats = tilewise.stats()
    return {"losses": losses, "params": {name: p.detach().cpu().tolist() for name, p in stage_module.named_parameters()},
            "compiles": stats.compiles, "ops_compiled": stats.ops_compiled}


def tensor_parallel_model(bias: bool = True) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=bias), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=bias))


def mean_square(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


def row_mean_square(y: torch.Tensor) -> torch.Tensor:
    """A loss whose ops the native C computes bitwise as CPU (a mean over all dims does not: its
    region keeps CPU's kernels), so the shared-cache run builds and loads C."""
    return y.pow(2).sum(1).mean(0)


def tensor_parallel_data() -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


def tp_losses(model, x, steps: int = STEPS, built_after: int | None = None, loss_of=mean_square) -> list[float]:
    """SGD steps; after step `built_after` the regions' C is waited for (built, or loaded from the
    compile cache), so the steps after it run it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        loss = loss_of(model(x))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == built_after:
            tilewise.wait_for_compiles()
    return losses


def tensor_parallel_training(mode: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    device = neuron_device()
    torch.neuron.set_device(device)
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    model = parallelize_module(tensor_parallel_model().to(device), mesh,
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = tensor_parallel_data().to(device)
    tilewise.stats().reset()
    with tilewise.engine(mode=mode):
        losses = tp_losses(model, x)
        params = {name: p.full_tensor().cpu().tolist() for name, p in model.named_parameters()}
    stats = tilewise.stats()
    return {"losses": losses, "params": params, "compiles": stats.compiles, "ops_compiled": stats.ops_compiled}


SHARED_CACHE_STEPS, BUILT_AFTER = 6, 3


def shared_cache_run(prefix: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tilewise.compiler.cache import regions as cache
    from tilewise.compiler.native import build as native

    dist.init_process_group("neuron")
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    model = parallelize_module(tensor_parallel_model(bias=False).to("neuron"), mesh,
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = tensor_parallel_data().to("neuron")
    with tilewise.engine():
        losses = tp_losses(model, x, SHARED_CACHE_STEPS, BUILT_AFTER, row_mean_square)
    counters = {name: getattr(cache.stats, name) for name in
                ("compiles", "disk_hits", "disk_writes", "corrupt", "unstorable", "native_disk_hits")}
    with open(f"{prefix}{dist.get_rank()}.json", "w") as out:
        json.dump({"losses": losses, "cache": counters, "libraries": len(native._libraries)}, out)
    dist.destroy_process_group()


def _attempt(program, *args) -> dict:
    try:
        return {"ok": program(*args)}
    except Exception as error:  # reported to the test, which names the program, mode and error
        return {"error": f"{type(error).__name__}: {error}",
                "traceback": "".join(traceback.format_exc().splitlines(keepends=True)[-25:])}


def main(prefix: str) -> None:
    dist.init_process_group("neuron", timeout=datetime.timedelta(seconds=240))
    gloo = dist.new_group(backend="gloo")
    report = {"pipeline_reference": _attempt(pipeline_training, torch.device("cpu"), gloo),
              "pipeline": {}, "tensor_parallel": {}}
    for mode in MODES:
        report["pipeline"][mode] = _attempt(pipeline_training, neuron_device(), None, mode)
        dist.barrier(group=gloo)
        report["tensor_parallel"][mode] = _attempt(tensor_parallel_training, mode)
        dist.barrier(group=gloo)
    with open(f"{prefix}{dist.get_rank()}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[2:] == ["shared_cache"]:
        shared_cache_run(sys.argv[1])
    else:
        main(sys.argv[1])
    sys.exit(0)
