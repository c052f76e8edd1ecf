"""One rank of tests/test_shared_cache.py: a tensor-parallel MLP (ColwiseParallel then
RowwiseParallel on a 2-rank neuron mesh) trained with SGD inside an engine block, whose regions
hold DTensor's functional collectives and read their pending results. Each rank writes its losses
and the compile cache's counters as JSON.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tensor_parallel_worker.py OUT_PREFIX
"""
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import tilewise
from tilewise.compiler import cache, native

STEPS, BUILT_AFTER = 6, 3  # steps; the step after which the native builds are waited for


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def train(model, x, steps: int = STEPS) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == BUILT_AFTER:  # the regions' C is built (or loaded from the cache) and runs from here on
            tilewise.wait_for_compiles()
    return losses


def main(prefix: str) -> None:
    dist.init_process_group("neuron")
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    model = parallelize_module(mlp().to("neuron"), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    torch.manual_seed(1)
    x = torch.randn(4, 16).to("neuron")
    with tilewise.engine():
        losses = train(model, x)
    counters = {name: getattr(cache.stats, name) for name in
                ("compiles", "disk_hits", "disk_writes", "corrupt", "unstorable", "native_disk_hits")}
    with open(f"{prefix}{dist.get_rank()}.json", "w") as out:
        json.dump({"losses": losses, "cache": counters, "libraries": len(native._libraries)}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
