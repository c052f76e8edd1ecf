"""Host time per op added by the adaptive engine in steady state, against plain CPU eager.

Runs a chain of small adds (the step) on the CPU, on the CPU under a TorchDispatchMode that runs
every op as it comes (the floor of any engine built on a dispatch mode), on `neuron` op by op, and
on `neuron` inside tilewise.engine(mode="adaptive") once its region is compiled; the contenders
alternate round by round in one run (shared, noisy machines) and medians are reported.

    python benchmarks/adaptive_overhead.py [--quick] [--clock cpu]

`--clock cpu` times the CPU this process uses instead of the wall clock: on a machine shared with
other busy processes, wall time mostly measures their load. Target (issue 14): adaptive recording
adds at most 8 us per op to plain CPU eager.
"""
import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tilewise

OPS_PER_STEP = 100
# time.perf_counter: wall time; time.process_time: CPU time of all this process's threads.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def step(a, b):
    x = a
    for _ in range(OPS_PER_STEP):
        x = x + b
    return x


class DoNothingMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def step_in_mode(a, b):
    with DoNothingMode():
        return step(a, b)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, for a smoke test")
    parser.add_argument("--clock", choices=CLOCKS, default="wall", help="what to time (see the module doc)")
    args = parser.parse_args()
    rounds = 5 if args.quick else 60
    clock = CLOCKS[args.clock]
    a, b = torch.randn(8), torch.randn(8)
    a_dev, b_dev = a.to("neuron"), b.to("neuron")
    timings = {"cpu eager": [], "cpu, do-nothing mode": [], "neuron eager": [], "neuron adaptive": [],
               "  of which recording": []}

    def adaptive_step():
        started = clock()
        result = step(a_dev, b_dev)  # held over the flush, as a program holds what it computed:
        recorded = clock()           # a region whose results nobody holds computes nothing
        tilewise.sync()
        del result
        timings["  of which recording"].append(recorded - started)

    with tilewise.engine(mode="adaptive"):
        for _ in range(tilewise.config.threshold + 2):  # warm up: the region compiles
            adaptive_step()
    timings["  of which recording"].clear()
    for _ in range(rounds):
        for name, fn in (("cpu eager", lambda: step(a, b)), ("cpu, do-nothing mode", lambda: step_in_mode(a, b)),
                         ("neuron eager", lambda: step(a_dev, b_dev))):
            started = clock()
            fn()
            timings[name].append(clock() - started)
        with tilewise.engine(mode="adaptive"):
            started = clock()
            adaptive_step()
            timings["neuron adaptive"].append(clock() - started)
    per_op = {name: statistics.median(ts) / OPS_PER_STEP * 1e6 for name, ts in timings.items()}
    base = per_op["cpu eager"]
    print(f"{args.clock} clock, {rounds} interleaved rounds, medians")
    print(f"{'contender':<24}{'us/op':>8}{'added us/op':>14}")
    for name, us in per_op.items():
        added = f"{us - base:>14.2f}" if name != "cpu eager" else f"{'':>14}"
        print(f"{name:<24}{us:>8.2f}{added}")
    stats = tilewise.stats()
    print(f"compiled fraction {100 * stats.compiled_fraction:.1f}%, compiles {stats.compiles}, "
          f"cache hits {stats.cache_hits}")


if __name__ == "__main__":
    main()
