"""Soak: train the reference MLP on `neuron` in adaptive mode and watch memory stay flat.

    python scripts/soak.py                 # 1,000 steps, figures every 100
    python scripts/soak.py --steps 300 --every 50

Prints, per checkpoint: device memory in use (torch.neuron.memory_allocated), the process's
resident memory, compiled regions and plans kept, and the engine's learned-state sizes; then the
growth from the first checkpoint after warm-up to the last.
"""
from __future__ import annotations

import argparse
import sys
import time

from tilewise.testing.soak import soak


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
