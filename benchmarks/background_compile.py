"""What compiling in the background changes for a training loop in adaptive mode: the same loop with
`background_compile` off (the step that compiles waits for it) and on (a compile process compiles
while the steps go on eagerly), side by side in one run, each in a fresh process with the disk cache
off (every compile cold).

Per row: total seconds; the longest step and the median step (ms); the step whose flush first ran
a compiled region; compile seconds on the steps' path (this process: the passes, or taking in the
background's result) and in the compile process; the compiled fraction of compute ops.

    python benchmarks/background_compile.py            # MLP 600 steps, TinyGPT 200, TinyGPT at random lengths 200
    python benchmarks/background_compile.py --quick    # 60, 20, 20
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORKLOADS = {"mlp": (600, 60), "gpt": (200, 20), "gptlen": (200, 20)}  # steps: (full, quick)
SETTINGS = ("off", "on")

CHILD = """
import json, sys, time
import tilewise
from tilewise import workloads
name, steps = sys.argv[1], int(sys.argv[2])
times, first, last = [], [None], [time.perf_counter()]
def on_step(i):
    now = time.perf_counter(); times.append(now - last[0]); last[0] = now
    if first[0] is None and tilewise.stats().ops_compiled:
        first[0] = i
start = time.perf_counter()
{"mlp": workloads.train_mlp, "gpt": workloads.train_gpt,
 "gptlen": workloads.train_gpt_at_lengths}[name]("neuron", "adaptive", steps=steps, on_step=on_step)
total = time.perf_counter() - start
s = tilewise.stats()
print(json.dumps({"total": total, "longest": max(times), "median": sorted(times)[len(times) // 2],
                  "first_compiled_step": first[0], "compile_seconds": s.compile_seconds,
                  "background_seconds": s.background_seconds, "compiled_fraction": s.compiled_fraction}))
"""


def run(name: str, steps: int, setting: str) -> dict:
    env = {**os.environ, "TILEWISE_CACHE_DIR": "off", "TILEWISE_BACKGROUND_COMPILE": setting,
           "TILEWISE_MODE": "adaptive"}
    out = subprocess.run([sys.executable, "-c", CHILD, name, str(steps)], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(f"{'workload':<8} {'background':<10} {'steps':>5} {'total s':>8} {'longest ms':>10} {'median ms':>9} "
          f"{'1st compiled':>12} {'compile s here':>14} {'s in process':>12} {'compiled':>8}")
    started = time.perf_counter()
    for i, (name, (full, quick)) in enumerate(WORKLOADS.items()):
        steps = quick if args.quick else full
        order = SETTINGS if i % 2 == 0 else SETTINGS[::-1]  # the machine's load falls on both alike
        rows = {setting: run(name, steps, setting) for setting in order}
        for setting in SETTINGS:
            r = rows[setting]
            first = "-" if r["first_compiled_step"] is None else str(r["first_compiled_step"])
            print(f"{name:<8} {setting:<10} {steps:>5} {r['total']:>8.2f} {r['longest'] * 1e3:>10.0f} "
                  f"{r['median'] * 1e3:>9.1f} {first:>12} {r['compile_seconds']:>14.3f} "
                  f"{r['background_seconds']:>12.3f} {100 * r['compiled_fraction']:>7.1f}%")
        off, on = rows["off"], rows["on"]
        print(f"{name:<8} on/off: total {on['total'] / off['total']:.2f}x, longest step "
              f"{on['longest'] / off['longest']:.2f}x, compile on the steps' path "
              f"{on['compile_seconds'] / max(off['compile_seconds'], 1e-9):.2f}x")
    print(f"({time.perf_counter() - started:.0f} s; median step over all steps, warm-up and compiles included)")


if __name__ == "__main__":
    main()
