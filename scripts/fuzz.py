"""Long differential fuzz run: random programs on CPU and on `neuron` in eager, adaptive and compiled
mode (tests/fuzzing.py), counting programs tried, mismatches and errors.

    python scripts/fuzz.py                          # 10,000 programs, one process
    python scripts/fuzz.py --programs 2000 --workers 2 --seed 7 --failures fuzz_failures.txt

A mismatch is a program whose device results differ from the CPU's (values, dtype, shape); an error
is one the CPU runs and the device raises on. Each one is minimised (lines and outputs dropped
while it still fails) and printed as a `Program(...)` to paste into tests/test_fuzz_regressions.py.
Exit status 1 when anything failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def run_worker(programs: int, seed: int, max_ops: int, progress_every: int) -> dict:
    from hypothesis import HealthCheck, Phase, given, reject, settings
    from hypothesis import seed as hypothesis_seed

    import fuzzing
    import tilewise

    warnings.filterwarnings("ignore")
    counts = {"tried": 0, "rejected": 0, "mismatches": 0, "errors": 0, "failures": []}
    started = time.perf_counter()

    @hypothesis_seed(seed)
    @settings(max_examples=programs, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fuzzing.programs(max_ops=max_ops))
    def one(program):
        if not fuzzing.runs_on_cpu(program):
            counts["rejected"] += 1
            reject()
        counts["tried"] += 1
        try:
            fuzzing.check(program)
        except fuzzing.Mismatch as failure:
            kind = "errors" if failure.raised else "mismatches"
            counts[kind] += 1
            print(f"--- {kind} #{counts[kind]} (seed {seed}): {failure}", flush=True)
            counts["failures"].append((kind, program, str(failure)))
        if counts["tried"] % progress_every == 0:
            print(f"[seed {seed}] {counts['tried']} programs, {counts['mismatches']} mismatches, "
                  f"{counts['errors']} errors, {time.perf_counter() - started:.0f} s", flush=True)

    one()
    minimised = []
    for kind, program, message in counts.pop("failures"):
        if _fails(program):
            small = fuzzing.minimise(program, _fails)
            minimised.append({"kind": kind, "program": repr(small), "message": _message(small)})
        else:  # fails only after the programs before it: kept whole, with what it said then
            minimised.append({"kind": kind, "program": repr(program), "message": "fails only after earlier "
                              "programs (passes on fresh caches); first failure:\n" + message})
    counts["failures"] = minimised
    counts["seconds"] = time.perf_counter() - started
    counts["compiles"] = tilewise.stats().compiles
    return counts


def _fails(program) -> bool:
    import fuzzing
    import tilewise
    tilewise.reset_caches()
    try:
        fuzzing.check(program)
    except fuzzing.Mismatch:
        return True
    return False


def _message(program) -> str:
    import fuzzing
    import tilewise
    tilewise.reset_caches()
    try:
        fuzzing.check(program)
    except fuzzing.Mismatch as failure:
        return str(failure).splitlines()[0]
    return "passes after tilewise.reset_caches(): depends on what ran before it"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=10_000, help="programs to try (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed of the first worker")
    parser.add_argument("--workers", type=int, default=1, help="processes, each with its own seed")
    parser.add_argument("--max-ops", type=int, default=8, help="op specs per program at most")
    parser.add_argument("--progress", type=int, default=250, help="print progress every N programs")
    parser.add_argument("--failures", default=None, help="also write the minimised failures to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.programs < 1 or args.workers < 1 or args.max_ops < 1 or args.progress < 1:
        parser.error("--programs, --workers, --max-ops and --progress must be >= 1")

    started = time.perf_counter()
    if args.worker:
        print("RESULT " + json.dumps(run_worker(args.programs, args.seed, args.max_ops, args.progress)), flush=True)
        return 0
    if args.workers == 1:
        results = [run_worker(args.programs, args.seed, args.max_ops, args.progress)]
    else:
        results = _run_workers(args)
    total = {key: sum(r[key] for r in results) for key in ("tried", "rejected", "mismatches", "errors", "compiles")}
    failures = [f for r in results for f in r["failures"]]
    seconds = time.perf_counter() - started
    for failure in failures:
        print(f"\n=== {failure['kind'][:-1]}: {failure['message']}\n{failure['program']}")
    if args.failures:
        with open(args.failures, "w") as f:
            json.dump(failures, f, indent=1)
    print(f"\nprograms tried {total['tried']} (plus {total['rejected']} the CPU refused), "
          f"mismatches {total['mismatches']}, errors {total['errors']}, regions compiled {total['compiles']}, "
          f"time {seconds:.0f} s ({seconds / max(total['tried'], 1):.3f} s per program, "
          f"{args.workers} worker{'s' if args.workers > 1 else ''})")
    return 1 if failures else 0


def _run_workers(args) -> list[dict]:
    share = -(-args.programs // args.workers)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--programs", str(share),
                               "--seed", str(args.seed + i), "--max-ops", str(args.max_ops),
                               "--progress", str(args.progress)], stdout=subprocess.PIPE, text=True)
             for i in range(args.workers)]
    results = []

    def relay(proc):  # one reader per worker, so no worker blocks on a full pipe
        for line in proc.stdout:
            if line.startswith("RESULT "):
                results.append(json.loads(line[len("RESULT "):]))
            else:
                print(line, end="", flush=True)

    readers = [threading.Thread(target=relay, args=(proc,)) for proc in procs]
    for reader in readers:
        reader.start()
    for proc, reader in zip(procs, readers):
        reader.join()
        if proc.wait() != 0:
            raise SystemExit(f"a fuzz worker failed with exit status {proc.returncode}")
    return results


if __name__ == "__main__":
    sys.exit(main())
