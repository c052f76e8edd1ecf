"""What the engine's own threads cost the rest of the program: plain CPU work, timed before the
engine compiled anything in this process and after (its compiler thread alive), side by side.

The compiler thread runs PyTorch's kernels when it traces a region; had it its own OpenMP team, the
program's parallel kernels would wait for theirs to wake (tilewise/host_threads.py). PyTorch keeps
its default intra-op threads here (one per core), as a program does.

    python benchmarks/engine_threads.py [--quick]
"""
import argparse
import statistics
import threading
import time

import torch
import torch.nn.functional as F

import tilewise
from tilewise.workloads import MLP


def cpu_work():
    """A 64 x 64 matmul, and an MLP training step on the CPU."""
    torch.manual_seed(0)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))

    def step():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return {"64x64 matmul": lambda: torch.mm(a, b), "MLP step (CPU)": step}


def median_us(fn, rounds: int, per_round: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(per_round):
            fn()
        times.append((time.perf_counter() - started) / per_round)
    return 1e6 * statistics.median(times)


def compile_a_region() -> int:
    """An adaptive MLP loop on `neuron` until its step is a compiled region, compiled here (not
    loaded from the disk cache, which would leave the compiler thread nothing to run)."""
    torch.manual_seed(0)
    model = MLP().to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 32).to("neuron"), torch.randint(0, 10, (64,)).to("neuron")
    with tilewise.config.patch(cache_dir=""), tilewise.engine(mode="adaptive") as stats:
        for _ in range(tilewise.config.threshold + 2):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
    return stats.compiles


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, for a smoke test")
    args = parser.parse_args()
    rounds, per_round = (3, 20) if args.quick else (15, 200)
    work = cpu_work()
    before = {name: median_us(fn, rounds, per_round) for name, fn in work.items()}
    compiles = compile_a_region()
    after = {name: median_us(fn, rounds, per_round) for name, fn in work.items()}
    print(f"torch intra-op threads {torch.get_num_threads()}; engine compiles {compiles}; "
          f"threads alive {sorted(t.name for t in threading.enumerate())}")
    print(f"{'CPU work':<18}{'before us':>11}{'after us':>11}{'after/before':>14}")
    for name in work:
        print(f"{name:<18}{before[name]:>11.1f}{after[name]:>11.1f}{after[name] / before[name]:>13.2f}x")


if __name__ == "__main__":
    main()
