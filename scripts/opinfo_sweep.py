"""Full OpInfo conformance sweep of the neuron device against CPU.

Runs every sample of every op in PyTorch's OpInfo database: float32 forward, gradients (ops with
autograd), bfloat16 and int64 forward (ops whose CPU kernels support them). Prints counts per mode,
exclusions by category, the float32 pass rate and the failing ops with their first error line.

    python scripts/opinfo_sweep.py               # everything
    python scripts/opinfo_sweep.py --quick       # first 2 samples per op and mode
    python scripts/opinfo_sweep.py --ops add,mul --modes float32,grad --jobs 2 --json out.json
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def sweep_op(task):
    """All samples of one op in the requested modes: [(key, mode, status, message), ...]."""
    key, modes, limit = task
    import conformance as c
    warnings.filterwarnings("ignore")
    op = c.OPS[key]
    rows = []
    for mode in modes:
        if not c.applies(op, mode):
            continue
        try:
            sample_list = c.samples(op, mode, limit)
        except Exception as error:  # noqa: BLE001
            rows.append((key, mode, c.NOT_RUN, f"sample generation failed: {error}"[:200]))
            continue
        for sample in sample_list:
            outcome = c.run_sample(op, sample, mode)
            rows.append((key, mode, outcome.status, outcome.message))
    return rows


def report(rows, elapsed: float) -> int:
    import conformance as c
    counts = collections.defaultdict(collections.Counter)
    excluded_by_category = collections.defaultdict(collections.Counter)
    failures = collections.defaultdict(list)
    for key, mode, status, message in rows:
        counts[mode][status] += 1
        if status == c.EXCLUDED_:
            excluded_by_category[mode][c.category_of(message)] += 1
        elif status == c.FAIL:
            failures[(key, mode)].append(message)

    print(f"\nOpInfo conformance sweep, neuron vs CPU ({elapsed:.0f} s)\n")
    header = f"{'mode':<10}{'run on CPU':>12}{'passed':>10}{'failed':>10}{'excluded':>10}{'not run':>10}{'pass rate':>11}"
    print(header)
    print("-" * len(header))
    for mode in c.MODES:
        n = counts[mode]
        ran = n[c.PASS] + n[c.FAIL] + n[c.EXCLUDED_]
        rate = 100.0 * n[c.PASS] / ran if ran else 0.0
        print(f"{mode:<10}{ran:>12}{n[c.PASS]:>10}{n[c.FAIL]:>10}{n[c.EXCLUDED_]:>10}{n[c.NOT_RUN]:>10}{rate:>10.2f}%")
    print("\n'run on CPU' = passed + failed + excluded: samples that run on CPU; 'not run' = samples that "
          "fail on CPU too or have nothing to differentiate. Pass rate = passed / run on CPU.\n")

    print("Excluded samples by category:")
    categories = sorted({cat for per_mode in excluded_by_category.values() for cat in per_mode})
    for category in categories:
        per_mode = ", ".join(f"{mode} {excluded_by_category[mode][category]}" for mode in c.MODES
                             if excluded_by_category[mode][category])
        print(f"  {category:<30}{per_mode}")

    print(f"\nFailing ops ({len(failures)}):" if failures else "\nFailing ops: none")
    for (key, mode), messages in sorted(failures.items()):
        print(f"  {key} [{mode}] {len(messages)} sample(s): {messages[0]}")

    f32 = counts["float32"]
    ran = f32[c.PASS] + f32[c.FAIL] + f32[c.EXCLUDED_]
    rate = f32[c.PASS] / ran if ran else 0.0
    print(f"\nfloat32 forward pass rate over samples that run on CPU: {100 * rate:.2f}% "
          f"({f32[c.PASS]}/{ran}); target >= 98%")
    return 0 if rate >= 0.98 and not failures else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="first 2 samples per op and mode")
    parser.add_argument("--ops", help="comma-separated OpInfo names (name or name.variant)")
    parser.add_argument("--modes", default="float32,grad,bfloat16,int64")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--json", help="write every sample's outcome to this file")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for one op (--jobs > 1)")
    args = parser.parse_args(argv)

    import conformance as c
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = set(modes) - set(c.MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; allowed: {', '.join(c.MODES)}")
    keys = args.ops.split(",") if args.ops else list(c.OPS)
    missing = [k for k in keys if k not in c.OPS]
    if missing:
        parser.error(f"not OpInfo names: {missing}")
    tasks = [(key, modes, 2 if args.quick else None) for key in keys]

    start = time.perf_counter()
    rows = []
    if args.jobs > 1:
        pending = set(keys)
        with multiprocessing.get_context("fork").Pool(args.jobs, initializer=_one_thread) as pool:
            results = pool.imap_unordered(sweep_op, tasks, chunksize=1)
            try:
                for done in range(1, len(tasks) + 1):
                    # A worker that dies (an abort in native code) loses its op: stop waiting.
                    op_rows = results.next(timeout=args.timeout)
                    pending.discard(op_rows[0][0] if op_rows else None)
                    pending -= {row[0] for row in op_rows}
                    rows.extend(op_rows)
                    _progress(done, len(tasks), start)
            except multiprocessing.TimeoutError:
                print(f"no result for {args.timeout} s; unfinished ops (crashed or hung): "
                      f"{sorted(pending)[:20]}", file=sys.stderr)
    else:
        for done, task in enumerate(tasks, 1):
            rows.extend(sweep_op(task))
            _progress(done, len(tasks), start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return report(rows, time.perf_counter() - start)


def _one_thread():
    import torch
    torch.set_num_threads(1)


def _progress(done: int, total: int, start: float) -> None:
    if done % 25 == 0 or done == total:
        print(f"[{done}/{total} ops, {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
