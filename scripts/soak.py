"""Soak: train the reference MLP on `neuron` in adaptive mode and watch memory stay flat.

    python scripts/soak.py                 # 1,000 steps, figures every 100
    python scripts/soak.py --steps 300 --every 50

Prints, per checkpoint: device memory in use (torch.neuron.memory_allocated), the process's
resident memory, compiled regions and plans kept, and the engine's learned-state sizes; then the
growth from the first checkpoint after warm-up to the last.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def resident_bytes() -> int:
    """The process's resident set size (Linux /proc; ru_maxrss elsewhere is a peak, not a level)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def engine_sizes() -> dict:
    from tilewise.adaptive import RUNTIME
    return {"regions": len(RUNTIME.memory.regions), "plans": len(RUNTIME.memory.plans), "fingerprints": len(RUNTIME.memory.seen),
            "meta signatures": len(RUNTIME.memory.meta_cache), "timeline events": len(__import__("tilewise").DEVICE.timeline.events)}


def soak(steps: int, every: int, report=print) -> list[dict]:
    """Train for `steps` steps; a checkpoint dict every `every` steps (after a gc.collect())."""
    from tilewise.workloads import train_mlp
    checkpoints = []

    def on_step(step):
        if step % every == 0:
            gc.collect()
            point = {"step": step, "device": torch.neuron.memory_allocated(), "resident": resident_bytes(),
                     **engine_sizes()}
            checkpoints.append(point)
            report(f"step {step:>6}  device {point['device'] / 2**10:9.1f} KiB  resident "
                   f"{point['resident'] / 2**20:8.1f} MiB  regions {point['regions']:>3}  plans {point['plans']:>3}  "
                   f"fingerprints {point['fingerprints']:>4}  meta signatures {point['meta signatures']:>4}  "
                   f"timeline events {point['timeline events']:>6}")

    train_mlp("neuron", "adaptive", steps=steps, on_step=on_step)
    return checkpoints


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    if args.steps < 2 * args.every or args.every < 1:
        parser.error("--steps must be at least twice --every (a warm-up checkpoint and a later one)")
    import tilewise
    started = time.perf_counter()
    points = soak(args.steps, args.every)
    first, last = points[0], points[-1]
    print(f"\nafter warm-up (step {first['step']}) to step {last['step']}: device memory "
          f"{last['device'] - first['device']:+d} B, resident {(last['resident'] - first['resident']) / 2**20:+.1f} MiB; "
          f"{args.steps} steps in {time.perf_counter() - started:.1f} s; "
          f"compiled fraction {100 * tilewise.stats().compiled_fraction:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
