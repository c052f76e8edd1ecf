"""One rank of tests/distributed/test_distributed.py: runs every collective and a short DDP training on the
"neuron" process group, and writes what it saw as JSON for the test process to judge.

    python tests/distributed/distributed_worker.py OUT.json   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Then DDP and FSDP2 (`fully_shard`) train a small GPT for a few steps in each mode.
Every collective runs twice on the same inputs: on neuron tensors through the default ("neuron")
group, and on CPU tensors through a gloo group, the reference. In the lazy modes the inputs are
computed inside the engine block, so the collective has to compute the pending work first.

    python tests/distributed/distributed_worker.py OUT.json dtensor

runs the DTensor programs instead (tensor parallel, sequence parallel, FSDP2, with gradient
clipping and AdamW) on a CPU mesh, the reference, and on a neuron mesh in every mode.
"""
import contextlib
import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import tilewise
from tilewise.distributed.workloads import fully_shard_blocks, neuron_device, train_parallel
from tilewise.eager.executor import counters

MODES = ("eager", "adaptive")
STEPS, WARMUP, BATCH = 6, 4, 4


def inputs(rank: int, world: int, device) -> dict[str, torch.Tensor]:
    """Rank-dependent values, made by ops (pending in the lazy modes)."""
    base = torch.arange(4 * world * 3, dtype=torch.float32, device=device).reshape(4 * world, 3)
    return {"x": base * (rank + 1) + 0.5, "y": (base + rank).sin(), "wide": base.t() * (rank - 0.25)}


def collectives(device, group) -> dict[str, list]:
    """Each collective of the suite on this device's tensors through `group`; results as lists."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = inputs(rank, world, device)
    out: dict[str, list] = {}

    x = t["x"].clone()
    dist.all_reduce(x, group=group)
    out["all_reduce_sum"] = x
    for name, op in (("max", dist.ReduceOp.MAX), ("avg", dist.ReduceOp.AVG)):
        y = t["y"].clone()
        dist.all_reduce(y, op=op, group=group)
        out[f"all_reduce_{name}"] = y
    wide = t["wide"].clone()[:, 1:]  # a non-contiguous view: gloo works on a dense copy
    dist.all_reduce(wide, group=group)
    out["all_reduce_view"] = wide
    pair = [t["x"].clone(), t["y"].clone()]
    with dist._coalescing_manager(group=group, async_ops=True) as manager:  # one allreduce_coalesced
        for p in pair:
            dist.all_reduce(p, group=group)
    manager.wait()
    out["all_reduce_coalesced"] = torch.cat([p.flatten() for p in pair])

    gathered = [torch.empty_like(t["y"]) for _ in range(world)]
    dist.all_gather(gathered, t["y"], group=group)
    out["all_gather"] = torch.stack(gathered)
    into = torch.empty(world * t["x"].shape[0], 3, device=device)
    dist.all_gather_single(into, t["x"], group=group)
    out["all_gather_single"] = into

    scattered = torch.empty(4, 3, device=device)
    dist.reduce_scatter(scattered, list(t["x"].chunk(world)), group=group)
    out["reduce_scatter"] = scattered
    single = torch.empty(4, 3, device=device)
    dist.reduce_scatter_single(single, t["y"], group=group)
    out["reduce_scatter_single"] = single
    averaged = torch.empty(4, 3, device=device)
    dist.reduce_scatter_single(averaged, t["x"], op=dist.ReduceOp.AVG, group=group)
    out["reduce_scatter_single_avg"] = averaged

    # FSDP2's shape of call: several all-gathers (and reduce-scatters) coalesced into one
    a, b = torch.empty(world * 4, 3, device=device), torch.empty(world * 2, 3, device=device)
    with dist._coalescing_manager(group=group, async_ops=True) as manager:
        dist.all_gather_single(a, t["x"][:4], group=group)
        dist.all_gather_single(b, t["y"][2:4], group=group)
    manager.wait()
    out["all_gather_single_coalesced"] = torch.cat([a.flatten(), b.flatten()])
    c, d = torch.empty(4, 3, device=device), torch.empty(4, 3, device=device)
    with dist._coalescing_manager(group=group, async_ops=True) as manager:
        dist.reduce_scatter_single(c, t["x"], group=group)
        dist.reduce_scatter_single(d, t["y"], op=dist.ReduceOp.AVG, group=group)
    manager.wait()
    out["reduce_scatter_single_coalesced"] = torch.cat([c.flatten(), d.flatten()])

    bcast = t["x"].clone()
    dist.broadcast(bcast, src=1, group=group)
    out["broadcast"] = bcast
    dist.barrier(group=group)

    exchanged = torch.empty(4 * world, 3, device=device)
    dist.all_to_all_single(exchanged, t["x"], group=group)
    out["all_to_all_single"] = exchanged

    # the collectives c10d runs on the group's gloo backend (no Python hook): not charged
    reduced = t["y"].clone()
    dist.reduce(reduced, dst=0, group=group)
    if rank == 0:
        out["reduce"] = reduced
    pieces = [torch.empty(4, 3, device=device) for _ in range(world)]
    dist.all_to_all(pieces, list(t["x"].chunk(world)), group=group)
    out["all_to_all"] = torch.stack(pieces)
    gathered_at_root = [torch.empty_like(t["y"]) for _ in range(world)] if rank == 0 else None
    dist.gather(t["y"], gathered_at_root, dst=0, group=group)
    if rank == 0:
        out["gather"] = torch.stack(gathered_at_root)
    part = torch.empty(4, 3, device=device)
    dist.scatter(part, list(t["x"].chunk(world)) if rank == 1 else None, src=1, group=group)
    out["scatter"] = part

    if rank == 0:
        dist.send(t["y"], dst=1, group=group)
        out["send_recv"] = t["y"]
    elif rank == 1:
        received = torch.zeros_like(t["y"])
        dist.recv(received, src=0, group=group)
        out["send_recv"] = received
    return {name: value.cpu().tolist() for name, value in out.items()}


def mlp_and_input():
    torch.manual_seed(0)
    return (torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
            torch.randn(5, 8))


def sgd_losses(model, x, device, steps: int = 4) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = model(x.to(device)).pow(2).sum()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
        losses.append(loss.item())
    return losses


def tensor_parallel(mode: str) -> dict:
    """Megatron-style tensor parallelism (DTensor): the first layer split by columns, the second
    by rows, the partial sums all-reduced by DTensor's functional collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model, x = mlp_and_input()
    device = neuron_device()  # this rank's core, current as for CUDA
    torch.neuron.set_device(device)
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    model = parallelize_module(model.to(device), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    tilewise.stats().reset()
    with tilewise.engine(mode=mode):
        losses = sgd_losses(model, x, device)
    return {"losses": losses, "collectives": {k: vars(t) for k, t in tilewise.stats().collectives.items()}}


DTENSOR_MODES = ("eager", "adaptive", "compiled")
DTENSOR_STEPS = 5


def tensor_parallel_mlp(device, mesh):
    """The MLP, its first layer split by columns, its second by rows (Megatron-style)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model, x = mlp_and_input()
    return parallelize_module(model.to(device), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}), x


def sequence_parallel_norm(device, mesh):
    """RMSNorm over this rank's share of the sequence (SequenceParallel), then the MLP in tensor
    parallel, its input gathered along the sequence and its output scattered back."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.RMSNorm(8), torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 4 * world, 8)[:, 4 * rank:4 * (rank + 1)]
    plan = {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1)),
            "3": RowwiseParallel(output_layouts=Shard(1))}
    return parallelize_module(model.to(device), mesh, plan), x


def fully_sharded_mlp(device, mesh):
    """FSDP2: each linear layer, then the root, sharded over the ranks; each rank its rows."""
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
    x = torch.randn(4 * world, 8)[4 * rank:4 * (rank + 1)]
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh), x


DTENSOR_PROGRAMS = {"tensor_parallel": tensor_parallel_mlp, "sequence_parallel": sequence_parallel_norm,
                    "fsdp": fully_sharded_mlp}


def dtensor_training(make, device, mode: str | None) -> dict:
    """A few steps of torchtitan's loop on the program `make` builds: forward, backward, gradient
    clipping (foreach), AdamW (foreach); this rank's losses and whole parameters, and what the
    engine compiled."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    model, x = make(device, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    losses = []
    tilewise.reset_caches()  # each mode compiles its own regions
    tilewise.stats().reset()
    executed, before = [], counters.ops  # ops the eager executor ran one by one, each step
    with tilewise.engine(mode=mode, threshold=2) if mode else contextlib.nullcontext():
        for _ in range(DTENSOR_STEPS):
            loss = model(x.to(device)).pow(2).sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            executed.append(counters.ops - before)
            before = counters.ops
    stats = tilewise.stats()
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().tolist()
              for p in model.parameters()]
    return {"losses": losses, "params": params, "compiles": stats.compiles,
            "compiled_fraction": stats.compiled_fraction, "executed": executed, "report": stats.report()}


def dtensor_main(path: str) -> None:
    """The DTensor programs on a CPU mesh (gloo: the reference) and on a neuron mesh in each mode."""
    dist.init_process_group("neuron", timeout=datetime.timedelta(seconds=240))
    torch.use_deterministic_algorithms(True)
    torch.neuron.set_device(neuron_device())  # as with CUDA: DTensor makes its tensors on the current device
    report = {}
    for name, make in DTENSOR_PROGRAMS.items():
        report[name] = {"cpu": dtensor_training(make, "cpu", None)}
        for mode in DTENSOR_MODES:
            report[name][mode] = dtensor_training(make, neuron_device(), mode)
    with open(path, "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def batch_norm_cnn_and_data(steps: int = 4, global_batch: int = 8):
    """A CNN with BatchNorm and its batches: SyncBatchNorm's workload, and its reference."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.BatchNorm2d(6), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(6 * 5 * 5, 4))
    data = [(torch.randn(global_batch, 3, 5, 5), torch.randint(0, 4, (global_batch,))) for _ in range(steps)]
    return model, data


def batch_norm_training(model, data, device, rows=slice(None), mode: str | None = None) -> dict:
    """SGD steps on `rows` of each batch: the losses, then the parameters and BatchNorm's running
    statistics (the state dict)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        for x, y in data:
            loss = torch.nn.functional.cross_entropy(model(x[rows].to(device)), y[rows].to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return {"losses": losses, "state": {k: v.cpu().tolist() for k, v in module.state_dict().items()}}


def sync_batch_norm(mode: str) -> dict:
    """DDP with SyncBatchNorm, each rank on its half of the global batch: statistics all-gathered."""
    model, data = batch_norm_cnn_and_data()
    rank, world = dist.get_rank(), dist.get_world_size()
    share = data[0][0].shape[0] // world
    device = neuron_device()
    model = DistributedDataParallel(torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device))
    return batch_norm_training(model, data, device, slice(rank * share, (rank + 1) * share), mode)


def trace_lanes() -> dict:
    trace = tilewise.DEVICE.timeline.chrome_trace()
    tids = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] == 1}
    collective = tids.get("Collectives")
    return {"lanes": sorted(tids), "collective_events": sorted({e["name"].split()[0] for e in trace["traceEvents"]
                                                                if e.get("ph") == "X" and e.get("tid") == collective})}


def explorer_view(html_path: str) -> dict:
    """What the explorer's report shows of a block of collectives: headline labels, the lane."""
    import tilewise.explorer
    from tilewise.explorer import summary

    with tilewise.explorer.record() as recorded:
        with tilewise.engine(mode="adaptive"):
            collectives("neuron", None)
    recorded.write_report(html_path)
    with open(html_path) as f:
        html = f.read()
    return {"headline": dict(summary.headline(recorded.run().data["stats"])),
            "time_by_engine": dict(summary.time_breakdown(recorded.run().data["trace"])["engines"]),
            "html_names_the_lane": "Collectives" in html}


def main(path: str) -> None:
    # a rank waits in a collective while the other compiles; on a loaded 2-core machine that can
    # take long, and a collective that times out kills the run (the test's own bound is TIMEOUT_S)
    dist.init_process_group("neuron", timeout=datetime.timedelta(seconds=240))
    gloo = dist.new_group(backend="gloo")
    report = {"backend": dist.get_backend(), "reference": collectives("cpu", gloo), "modes": {}}
    for mode in MODES:
        tilewise.stats().reset()
        with tilewise.engine(mode=mode):
            results = collectives("neuron", None)
        counted = {kind: vars(t) for kind, t in tilewise.stats().collectives.items()}
        report["modes"][mode] = {"collectives": results, "counted": counted,
                                 "tensor_parallel": tensor_parallel(mode), "sync_batch_norm": sync_batch_norm(mode)}
        for name, wrap in (("ddp", DistributedDataParallel), ("fsdp", fully_shard_blocks)):
            run = train_parallel(wrap, mode, steps=STEPS, global_batch=BATCH, warmup=WARMUP)
            report["modes"][mode][name] = {
                "losses": run.losses, "params": [p.tolist() for p in run.params],
                "compiled_fraction": run.compiled_fraction, "cache_hits": run.stats["cache_hits"],
                "collectives": run.stats["collectives"], "collective_seconds": run.collective_seconds,
                "simulated_seconds": run.simulated_seconds}
    report["trace"] = trace_lanes()
    report["explorer"] = explorer_view(path + ".html")
    with open(path, "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[2:] == ["dtensor"]:
        dtensor_main(sys.argv[1])
    else:
        main(sys.argv[1])
    sys.exit(0)
