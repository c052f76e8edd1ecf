"""Host time of each compiled region of a workload: its recorded graph (what a region runs until
its C is built, and after, when the C measures slower), its decomposed graph on PyTorch, and its
native executable (the kernels' C in the decomposed graph), side by side in one process on the same
inputs; the machine's load falls on all three (each figure is the best of 3 rounds of `--runs` calls).
*calls recorded / native* counts the calls each graph makes per run (its call_function nodes): on
small tensors a region's host time follows them, whatever its C does.

    python benchmarks/native_regions.py mlp      # also: gpt, chain, seq, readloss, cnn
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."), os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

import tilewise  # noqa: E402
from tilewise.compiler.cache import regions as cache  # noqa: E402
from tilewise.compiler.native import tiers  # noqa: E402

import run  # noqa: E402  the workloads of benchmarks/run.py

BUILD_TIMEOUT = 300


def calls(gm: torch.fx.GraphModule) -> int:
    """The calls a graph makes per run: ops, C kernels, and the getitems that unpack their results."""
    return sum(node.op == "call_function" for node in gm.graph.nodes)


def region_inputs(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Inputs in the region's layouts: floats in [0.5, 1) (valid for logs and divisions), zeros else."""
    made = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            meta = node.meta["val"]
            storage = torch.zeros(meta.untyped_storage().nbytes() // meta.element_size(), dtype=meta.dtype)
            if meta.dtype.is_floating_point:
                storage.uniform_(0.5, 1)
            made.append(storage.as_strided(meta.shape, meta.stride(), meta.storage_offset()))
    return made


def best_ms(fn, inputs, runs: int) -> float:
    rounds = []
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(runs):
            fn(*inputs)
        rounds.append((time.perf_counter() - started) / runs * 1e3)
    return min(rounds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(run.WORKLOADS))
    parser.add_argument("--runs", type=int, default=100, help="calls per round (default 100)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    step = run.WORKLOADS[args.workload][0]("neuron", lambda fn: fn, 6, True)
    with tilewise.config.patch(cache_dir="", host_backend="torch"), tilewise.engine(mode="compiled"):
        for i in range(6):
            step(i)
    tiers.CHOOSE_BY_MEASUREMENT = False  # `run` is the C once built: it is what is measured here
    totals = [0.0, 0.0, 0.0]
    print(f"{'region':<12} {'tier':<8} {'C kernels':>9} {'on PyTorch':>10} {'calls recorded / native':>23} "
          f"{'recorded ms':>11} {'decomposed ms':>13} {'native ms':>9} {'native/recorded':>15}")
    for compiled in list(cache._memory.values()):
        inputs = region_inputs(compiled.gm)
        compiled.start_native()
        tier = compiled.wait_native(BUILD_TIMEOUT)
        compiled.run(*inputs)  # warm all
        recorded = compiled.source.forward if compiled.source is not None else compiled.run_torch
        times = [best_ms(fn, inputs, args.runs) for fn in (recorded, compiled.run_torch, compiled.run)]
        totals = [total + ms for total, ms in zip(totals, times)]
        call_counts = f"{calls(compiled.source or compiled.gm)} / {calls(compiled.host_graph)}"
        print(f"{compiled.name:<12} {tier.value:<8} {len(compiled.native.kernels):>9} {len(compiled.native.refused):>10} "
              f"{call_counts:>23} {times[0]:>11.3f} {times[1]:>13.3f} {times[2]:>9.3f} {times[2] / times[0]:>14.2f}x")
    print(f"{'all regions':<12} {'':<8} {'':>9} {'':>10} {'':>23} {totals[0]:>11.3f} {totals[1]:>13.3f} {totals[2]:>9.3f} "
          f"{totals[2] / totals[0]:>14.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
