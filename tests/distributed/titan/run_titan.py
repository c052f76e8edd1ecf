"""TorchTitan's own Trainer on the `llama3_debugmodel`, on `neuron` or on the CPU, under torchrun.

    torchrun --standalone --nproc-per-node 2 tests/distributed/titan/run_titan.py \
        --device neuron --assets DIR --out losses.json [--tp 2]

The configuration is the debug model's (`llama3_debugmodel()`, its AdamW, warm-up and decay, selective
activation checkpointing) with: seed 42 and deterministic algorithms (torchtitan's
`debug.deterministic`), 10 steps, local batch 2, sequence 128, no checkpointing, validation or
profiling, the tokenizer and c4_test-like dataset of `make_assets` (no network), FSDP2 over the ranks
(`data_parallel_shard_degree=-1`) or tensor parallelism of degree `--tp`, on more than one process
with torchtitan's `partial_dtensor` SPMD backend (its default, spmd_types, needs a newer
fully_shard than torch 2.13's). titan_adapters.apply(device)
runs first, the same adapters for both devices (dense causal SDPA for flex attention, the
set_timeout shim, FSDP2's reduce-scatter as a plain sum; the CPU run also makes torchtitan's device "cpu" and its backend gloo).

Mode: TILEWISE_MODE (tilewise's config) picks eager, adaptive or compiled. Eager runs the Trainer as is
(the device runs op by op). For adaptive and compiled, `Trainer.train` runs inside one
`tilewise.engine()` block: the launcher calls `trainer.train()` within `with tilewise.engine():`,
the whole loop (data loading, steps, metrics) as a user would wrap a training loop, with nothing
inside torchtitan changed.

Rank 0 writes JSON to --out: per-step losses and gradient norms (torchtitan's logged metrics, as
floats), the seconds of training, and for neuron in an engine block the engine's compile counts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import titan_adapters  # noqa: E402

SEED, STEPS, LOCAL_BATCH, SEQ = 42, 10, 2, 128


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "neuron"), required=True)
    parser.add_argument("--assets", required=True, help="directory make_assets wrote")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel degree (the rest is FSDP2)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--nondeterministic", action="store_true",
                        help="without torchtitan's debug.deterministic (regions then may run the native C tier)")
    return parser.parse_args()


def trainer_config(args: argparse.Namespace, dump_folder: str):
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.hf_assets_path = os.path.join(args.assets, "tokenizer")
    config.dataloader.dataset = "c4_test"
    config.dataloader.dataset_path = os.path.join(args.assets, "c4_test")
    config.training.local_batch_size = LOCAL_BATCH
    config.training.seq_len = SEQ
    config.training.steps = args.steps
    config.checkpoint.enable = False
    config.validator.enable = False
    config.profiler.enable_profiling = False
    config.metrics.log_freq = 1
    config.debug.seed = SEED
    config.debug.deterministic = not args.nondeterministic
    config.parallelism.tensor_parallel_degree = args.tp
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchtitan's default, spmd_types, hands torch 2.13's fully_shard `dp_mesh_dims` with plain
        # parameters, which it refuses ("all parameters must be DTensors on the full SPMD mesh");
        # partial_dtensor is the classic path: DTensor for TP, FSDP2 over the data-parallel mesh.
        config.parallelism.spmd_backend = "partial_dtensor"
    config.dump_folder = dump_folder
    titan_adapters.dense_causal_attention(config.model_spec.model)
    return config


def record_metrics(trainer) -> dict:
    """Wrap the metrics processor's log to keep each step's loss and gradient norm."""
    seen = {"losses": [], "grad_norms": []}
    log = trainer.metrics_processor.log

    def recording_log(step, global_avg_loss, global_max_loss, grad_norm, *rest, **kwargs):
        seen["losses"].append(float(global_avg_loss))
        seen["grad_norms"].append(float(grad_norm))
        return log(step, global_avg_loss, global_max_loss, grad_norm, *rest, **kwargs)

    trainer.metrics_processor.log = recording_log
    return seen


def train(trainer, device: str) -> dict:
    if device == "cpu":
        trainer.train()
        return {"mode": "cpu"}
    import tilewise

    mode = tilewise.config.mode
    if mode == "eager":
        trainer.train()
        return {"mode": mode}
    tilewise.stats().reset()
    with tilewise.engine():
        trainer.train()
    stats = tilewise.stats()
    return {"mode": mode, "compiles": stats.compiles, "ops_compiled": stats.ops_compiled,
            "ops_seen": stats.ops_seen}


def main() -> None:
    args = parse()
    titan_adapters.apply(args.device)
    import torch
    from torchtitan.tools.logging import init_logger

    init_logger()
    dump_folder = os.path.join(os.path.dirname(os.path.abspath(args.out)), f"dump-{args.device}")
    config = trainer_config(args, dump_folder)
    trainer = config.build()
    titan_adapters.sum_reduction_for_gloo(trainer.model_parts)
    seen = record_metrics(trainer)
    start = time.perf_counter()
    try:
        report = train(trainer, args.device)
    finally:
        trainer.close()
    report.update(seen, seconds=time.perf_counter() - start, device=args.device, tp=args.tp,
                  world_size=torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
    if torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
        torch.distributed.destroy_process_group()
    else:
        rank = 0
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
