"""Host overhead of the neuron device's eager path, side by side with plain CPU eager.

Two measurements, each taken in one run with the contenders interleaved (one round of each in
turn, medians over the rounds), because these machines are shared and noisy:

(a) per-op host time of 2,000 small adds (8-element float32) on neuron vs on CPU, and the time
    the device path adds per op;
(b) the step time of a small MLP training step (Linear 64-128-10, batch 32, cross-entropy, SGD)
    on neuron vs on CPU, and their ratio.

Targets: at most 10 us/op added over plain CPU eager (issue 14), MLP step at most 3x plain CPU.
Run `python benchmarks/eager_overhead.py` (or `--quick` for a smoke test). `--clock cpu` times
the CPU this process uses instead of the wall clock: on a machine shared with other busy
processes, wall time mostly measures their load.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import tilewise  # noqa: F401  registers the neuron device

ADDED_US_TARGET = 10.0
# time.perf_counter: wall time; time.process_time: CPU time of all this process's threads (the
# autograd engine runs a device's backward on a thread of its own).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter
MLP_RATIO_TARGET = 3.0


def add_loop(device: str, ops: int):
    a = torch.randn(8, device=device)
    b = torch.randn(8, device=device)

    def run() -> float:
        start = clock()
        for _ in range(ops):
            a + b
        return (clock() - start) / ops

    for _ in range(100):  # warm up: op plans, allocator caches
        a + b
    return run


def mlp_steps(device: str, steps: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64).to(device)
    y = torch.randint(0, 10, (32,)).to(device)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def run() -> float:
        start = clock()
        for _ in range(steps):
            step()
        return (clock() - start) / steps

    step()  # warm up: optimizer state, autograd graph caches, op plans
    return run


def interleaved(contenders: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each contender over `rounds`, running them in alternating order."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            samples[name].append(contenders[name]())
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test, not a measurement")
    parser.add_argument("--clock", choices=CLOCKS, default="wall", help="what to time (see the module doc)")
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    ops, rounds, steps = (200, 3, 5) if args.quick else (2000, 15, 50)

    adds = interleaved({"cpu": add_loop("cpu", ops), "neuron": add_loop("neuron", ops)}, rounds)
    mlp = interleaved({"cpu": mlp_steps("cpu", steps), "neuron": mlp_steps("neuron", steps)}, rounds)

    added_us = (adds["neuron"] - adds["cpu"]) * 1e6
    ratio = mlp["neuron"] / mlp["cpu"]
    rows = [
        ("small add (8 x f32), us/op", adds["cpu"] * 1e6, adds["neuron"] * 1e6,
         f"+{added_us:.2f} us/op", f"<= +{ADDED_US_TARGET:.0f} us/op", added_us <= ADDED_US_TARGET),
        ("MLP step 64-128-10 b32 SGD, us", mlp["cpu"] * 1e6, mlp["neuron"] * 1e6,
         f"{ratio:.2f}x", f"<= {MLP_RATIO_TARGET:.0f}x", ratio <= MLP_RATIO_TARGET),
    ]
    print(f"tilewise eager overhead ({'quick, ' if args.quick else ''}{args.clock} clock, {rounds} interleaved rounds, medians; "
          f"{ops} adds/round, {steps} MLP steps/round; torch {torch.__version__})")
    header = f"{'benchmark':<32} {'cpu':>10} {'neuron':>10} {'overhead':>14} {'target':>14}  met"
    print(header)
    print("-" * len(header))
    for name, cpu, neuron, overhead, target, met in rows:
        print(f"{name:<32} {cpu:>10.2f} {neuron:>10.2f} {overhead:>14} {target:>14}  {'yes' if met else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
