"""Whether the engine finds a loop's step however often the program reads a value (issue 43).

Three loops on `neuron`: an MLP (32-64-10, AdamW) training step, TinyGPT's training step (AdamW),
and a sampler that reads nothing (x <- x - sigma_t * f(x), sigma a Python float new every step).
Each runs with a read of a value (`loss.item()`, `x.sum().item()`) every 1, 10, 50, 1000 steps and
never, in one engine block; printed per row: the compiled fraction of the ops after warm-up (the
first third of the steps), the compiles and their seconds, the segments flushed at a found step
boundary, the period found (ops) and, for the last row of each loop, the ratio of its compile
seconds to the read-every-step row's. Each row runs in a fresh process (the engine's and the
compiler's caches are process-wide), rows of one loop one after another.

    python benchmarks/steps.py [--quick] [--mode adaptive|compiled] [--steps N] [--finder on|off] [--loops mlp,...]

`--memory` runs the sampler and the MLP 10,000 steps each with no read (adaptive mode, a fresh
process each) and prints the host's resident memory every 1,000 steps and its growth from step
1,000 to the end.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

INTERVALS = (1, 10, 50, 1000, None)  # None: no read at all


def _mlp(steps):
    import torch
    import torch.nn.functional as F
    from tilewise.workloads import MLP
    torch.manual_seed(0)
    model = MLP().to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(steps)]

    def step(i):
        x, y = data[i]
        loss = F.cross_entropy(model(x.to("neuron")), y.to("neuron"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _gpt(steps):
    import torch
    import torch.nn.functional as F
    from tilewise.workloads import TinyGPT, text_batches
    torch.manual_seed(0)
    model = TinyGPT().to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = text_batches(steps)

    def step(i):
        x, y = (t.to("neuron") for t in data[i])
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _sampler(steps):
    import torch
    import torch.nn as nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to("neuron")
    state = {"x": torch.randn(16, 32).to("neuron")}
    sigmas = [1.0 / (1 + i) for i in range(steps)]

    def step(i):
        with torch.no_grad():
            state["x"] = state["x"] - sigmas[i] * model(state["x"])
        return state["x"]
    return step


LOOPS = {"mlp": _mlp, "tinygpt": _gpt, "sampler": _sampler}
MEMORY_STEPS, MEMORY_EVERY = 10_000, 1_000


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory(loop: str, steps: int) -> None:
    """One loop, `steps` steps with no read in adaptive mode, in this process: the host's resident
    memory, the device memory held and the engine caches' entries every MEMORY_EVERY steps."""
    import torch
    import tilewise
    step = LOOPS[loop](steps)
    print(f"{loop}: {steps} steps, no read, adaptive mode")
    print(f"{'step':>6} {'RSS MiB':>8} {'device MiB':>10} {'cache entries':>13}")
    rss = {}
    with tilewise.engine(mode="adaptive") as stats:
        for i in range(steps):
            step(i)
            if (i + 1) % MEMORY_EVERY == 0:
                tilewise.sync()
                rss[i + 1] = _rss_mib()
                entries = sum(size.entries for size in stats.cache_sizes().values())
                print(f"{i + 1:6d} {rss[i + 1]:8.1f} {torch.neuron.memory_allocated() / 2**20:10.2f} {entries:13d}",
                      flush=True)
    first = min(rss)
    print(f"{loop}: RSS growth from step {first} to {steps}: {rss[steps] - rss[first]:+.1f} MiB; "
          f"compiled fraction {stats.compiled_fraction:.3f}")


def row(loop: str, interval: int | None, steps: int, mode: str) -> dict:
    """One loop at one read interval, in this process."""
    import tilewise
    step = LOOPS[loop](steps)
    warm = steps // 3
    with tilewise.engine(mode=mode):
        stats = tilewise.stats()
        for i in range(steps):
            if i == warm:
                tilewise.sync()
                compiled, eager = stats.ops_compiled, stats.ops_eager
            value = step(i)
            if interval is not None and (i + 1) % interval == 0:
                value.sum().item()
    after = (stats.ops_compiled - compiled) / max(1, stats.ops_compiled - compiled + stats.ops_eager - eager)
    finder = getattr(stats, "steps", None)
    return {"fraction": after, "compiles": stats.compiles, "compile_seconds": stats.compile_seconds,
            "cuts": getattr(finder, "cuts", 0), "period": getattr(finder, "period", None)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    parser.add_argument("--mode", default="adaptive", choices=("adaptive", "compiled"))
    parser.add_argument("--steps", type=int, default=None, help="steps per row (default 150; 60 for TinyGPT)")
    parser.add_argument("--finder", default="on", choices=("on", "off"),
                        help="off: step_search_ops=0, segments end at reads only (the engine before issue 43)")
    parser.add_argument("--loops", default=",".join(LOOPS), help="comma-separated: " + ", ".join(LOOPS))
    parser.add_argument("--memory", action="store_true",
                        help=f"host memory over {MEMORY_STEPS} steps with no read (sampler and MLP, adaptive)")
    parser.add_argument("--memory-row", help=argparse.SUPPRESS)  # a loop, its memory run in this process
    parser.add_argument("--row", help=argparse.SUPPRESS)  # loop:interval, run in this process
    args = parser.parse_args()
    if args.memory:
        for loop in (args.loops.split(",") if args.loops != ",".join(LOOPS) else ("sampler", "mlp")):
            subprocess.run([sys.executable, __file__, "--memory-row", loop, "--steps", str(args.steps or MEMORY_STEPS)],
                           check=True)
        return
    if args.memory_row:
        memory(args.memory_row, args.steps)
        return
    if args.row:
        loop, interval = args.row.split(":")
        print(json.dumps(row(loop, None if interval == "never" else int(interval), args.steps, args.mode)))
        return
    print(f"mode {args.mode}, step finder {args.finder}; fraction: compiled ops after the first third of the steps")
    print(f"{'loop':8} {'read every':>10} {'steps':>5} {'fraction':>8} {'compiles':>8} {'compile s':>9} "
          f"{'cuts':>5} {'period':>6} {'vs every 1':>10}")
    for loop in args.loops.split(","):
        steps = args.steps or (30 if args.quick else 60 if loop == "tinygpt" else 150)
        base = None
        for interval in INTERVALS:
            name = "never" if interval is None else str(interval)
            env = dict(os.environ, **({"TILEWISE_STEP_SEARCH_OPS": "0"} if args.finder == "off" else {}))
            out = subprocess.run([sys.executable, __file__, "--row", f"{loop}:{name}", "--steps", str(steps),
                                  "--mode", args.mode], capture_output=True, text=True, check=True, env=env)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            base = result["compile_seconds"] if base is None else base
            ratio = result["compile_seconds"] / base if base else float("nan")
            print(f"{loop:8} {name:>10} {steps:>5} {result['fraction']:8.3f} {result['compiles']:8d} "
                  f"{result['compile_seconds']:9.2f} {result['cuts']:5d} {str(result['period']):>6} "
                  f"{ratio:10.2f}", flush=True)


if __name__ == "__main__":
    main()
