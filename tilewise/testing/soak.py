"""The soak loop: the reference MLP trained on `neuron` in adaptive mode, with a checkpoint of
device memory, resident memory and the engine's cache sizes every few steps (scripts/soak.py prints
them; tests/test_leaks.py holds them flat)."""
from __future__ import annotations

import gc
import os

import torch


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
