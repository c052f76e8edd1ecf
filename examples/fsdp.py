"""Sharded data-parallel training on neuron with FSDP2 (`torch.distributed.fsdp.fully_shard`).

    torchrun --standalone --nproc-per-node 2 examples/fsdp.py
    TILEWISE_MODE=eager torchrun --standalone --nproc-per-node 2 examples/fsdp.py --compare

Each transformer block and then the whole model is sharded over the ranks' cores: parameters
live as DTensor shards; forward and backward all-gather them per block and reduce-scatter the
gradients, through the "neuron" process group. `--compare` trains the same model in one plain CPU
process on the global batch and checks that the losses and final weights match.
"""
import argparse
import json
import sys

import torch
import torch.distributed as dist

import tilewise
from tilewise.distributed.workloads import fully_shard_blocks, neuron_device, train_parallel, train_single


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="global batch, split evenly among the ranks")
    parser.add_argument("--compare", action="store_true", help="check against one CPU process on the global batch")
    parser.add_argument("--json", help="rank 0 writes its steady-state figures here")
    args = parser.parse_args()

    dist.init_process_group("neuron")
    rank = dist.get_rank()
    torch.neuron.set_device(neuron_device())
    mode = tilewise.config.mode

    def show(step, local_loss):
        if rank == 0:
            print(f"step {step:3d}  rank-0 loss {local_loss:.4f}")

    run = train_parallel(fully_shard_blocks, mode, steps=args.steps, global_batch=args.batch, warmup=args.steps // 2,
                         on_step=show)
    failed = False
    if rank == 0:
        print(f"global losses ({dist.get_world_size()} ranks, mode {mode}): "
              + " ".join(f"{loss:.4f}" for loss in run.losses))
        print(tilewise.stats().report())
        print(f"steady state (last {args.steps - args.steps // 2} steps): {run.simulated_seconds * 1e3:.3f} ms "
              f"simulated, {100 * run.collective_seconds / max(run.simulated_seconds, 1e-30):.1f}% in collectives, "
              f"{100 * run.compiled_fraction:.1f}% of compute ops compiled")
        if args.json:
            write_figures(args.json, run, args.steps - args.steps // 2)
        if args.compare:
            failed = not compare(run, args)
    dist.destroy_process_group()
    return 1 if failed else 0


def write_figures(path, run, steps) -> None:
    with open(path, "w") as f:
        json.dump({"ranks": dist.get_world_size(), "steps": steps, "simulated_seconds": run.simulated_seconds,
                   "collective_seconds": run.collective_seconds, "collective_calls": run.collective_calls,
                   "collective_bytes": run.collective_bytes, "compiled_fraction": run.compiled_fraction}, f)


def compare(run, args) -> bool:
    single = train_single("cpu", None, steps=args.steps, global_batch=args.batch)
    loss_diff = max(abs(a - b) for a, b in zip(run.losses, single.losses, strict=True))
    param_diff = max((a - b).abs().max().item() for a, b in zip(run.params, single.params, strict=True))
    same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(run.params, single.params, strict=True))
    same = same and loss_diff <= 1e-4
    print(f"single CPU process on the global batch: losses {' '.join(f'{x:.4f}' for x in single.losses)}")
    print(f"max |loss difference| {loss_diff:.2e}, max |weight difference| {param_diff:.2e}: "
          + ("match (float32 tolerance)" if same else "MISMATCH"))
    return same


if __name__ == "__main__":
    sys.exit(main())
