"""Every op of PyTorch's OpInfo database through the compiler (tilewise/testing/compiler_conformance.py):
counts per outcome, and every failing sample with its first error line.

    python scripts/compiler_opinfo_sweep.py                # first 2 float32 samples of every op
    python scripts/compiler_opinfo_sweep.py --samples 6 --ops gather,cat
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings

# Every compile cold, as a new program's: the compiler is what this checks, not the disk cache
# (the workers it starts inherit the setting).
os.environ.setdefault("TILEWISE_CACHE_DIR", "off")

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# this checkout's tilewise and tests, whatever tilewise is installed
sys.path.insert(0, _ROOT)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2, help="float32 samples per op (default 2)")
    parser.add_argument("--ops", help="comma-separated op keys (default: all)")
    parser.add_argument("--native", action="store_true",
                        help="also build each region's C kernels and hold the native executable to CPU")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from torch.testing._internal.common_methods_invocations import op_db

    from tilewise.testing import compiler_conformance as cc
    wanted = set(args.ops.split(",")) if args.ops else None
    counts, failures, started = collections.Counter(), [], time.perf_counter()
    native_runs = 0
    for op in op_db:
        key = cc.op_key(op)
        if wanted is not None and key not in wanted or key.startswith(("sparse.", "to_sparse")):
            continue
        for index, sample in enumerate(cc.samples(op, limit=args.samples)):
            status, message = cc.outcome(op, sample, native=args.native)
            counts[status] += 1
            native_runs += status == cc.PASS and message.endswith("; native")
            if status == cc.FAIL:
                failures.append(f"{key}[{index}]: {message}")
    print(f"samples {sum(counts.values())} in {time.perf_counter() - started:.0f} s: "
          + ", ".join(f"{status} {n}" for status, n in counts.most_common())
          + (f"; {native_runs} passes ran native C kernels" if args.native else ""))
    print("\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
