"""Long differential fuzz run: random programs on CPU and on `neuron` in eager, adaptive and compiled
mode (drawn by tilewise/testing/fuzz_programs.py, checked by tilewise/testing/fuzzing.py), counting
programs tried, mismatches and errors.

    python scripts/fuzz.py                          # 10,000 programs, one process, every area
    python scripts/fuzz.py --programs 2000 --workers 2 --seed 7 --failures fuzz_failures.txt
    python scripts/fuzz.py --without interrupts,swap  # leave out areas whose engine fix is pending
    python scripts/fuzz.py --features none          # the first fuzzer's programs only
    python scripts/fuzz.py --native                 # every compiled region runs its C (built at once)

Areas (tilewise/testing/fuzzing.py Features): data (`.data =` on pending values), set_copy, swap
(torch.utils.swap_tensors), aliases (views of one base written through each other), half (float16
and bfloat16 programs), interrupts (KeyboardInterrupt inside a flush, then every value read),
poison (lazily made buffers start as NaN/sentinel).

A mismatch is a program whose device results differ from the CPU's (values, dtype, shape); an error
is one the CPU runs and the device raises on. Failures are grouped into classes by their message;
the first few of each class are minimised (lines and outputs dropped while it still fails) and
printed as a `Program(...)` to paste into tests/test_fuzz_regressions.py. Exit status 1 when
anything failed. The script tests the checkout it sits in (its root goes first on sys.path).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
import warnings

# Every compile cold, as a new program's: the compiler is what this checks, not the disk cache
# (the workers it starts inherit the setting).
os.environ.setdefault("TILEWISE_CACHE_DIR", "off")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def failure_class(message: str) -> str:
    """What a failure says, without its mode, iteration, step numbers and value names: one key
    per kind of failure, to count and to minimise one of each."""
    first = message.splitlines()[0]
    first = re.sub(r"^\w+ mode, iteration \d+(, )?", "", first)
    first = re.sub(r"in statement \d+ `.*?`", "in a statement", first)
    first = re.sub(r"\((before|after) it\)", "(before/after it)", first)
    first = re.sub(r"(Scalars|Tensor-likes) are not (close|equal)", "values differ", first)
    first = re.sub(r"\b[xv]\d+\b", "<value>", first)
    return re.sub(r"\d+", "#", first)[:160]


class _OutOfTime(Exception):
    """The --minutes budget is spent: stop drawing programs."""


def run_worker(programs: int, seed: int, max_ops: int, progress_every: int, features, minutes: float,
               minimise: int, native: bool = False) -> dict:
    from hypothesis import HealthCheck, Phase, given, reject, settings
    from hypothesis import seed as hypothesis_seed

    from tilewise.testing import fuzz_programs, fuzzing
    import tilewise
    if native:
        from tilewise.testing import native_everywhere
        native_everywhere.force_native(setattr)

    warnings.filterwarnings("ignore")
    counts = {"tried": 0, "rejected": 0, "mismatches": 0, "errors": 0, "failures": []}
    started = time.perf_counter()

    @hypothesis_seed(seed)
    @settings(max_examples=programs, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fuzz_programs.programs(max_ops=max_ops, features=features))
    def one(program):
        if time.perf_counter() - started > minutes * 60:
            raise _OutOfTime
        if not fuzzing.runs_on_cpu(program):
            counts["rejected"] += 1
            reject()
        counts["tried"] += 1
        try:
            fuzzing.check(program, features=features)
        except fuzzing.Mismatch as failure:
            kind = "errors" if failure.raised else "mismatches"
            counts[kind] += 1
            print(f"--- {kind} #{counts[kind]} (seed {seed}): {failure}", flush=True)
            counts["failures"].append((kind, program, str(failure)))
        if counts["tried"] % progress_every == 0:
            print(f"[seed {seed}] {counts['tried']} programs, {counts['mismatches']} mismatches, "
                  f"{counts['errors']} errors, {time.perf_counter() - started:.0f} s", flush=True)

    try:
        one()
    except _OutOfTime:
        print(f"[seed {seed}] --minutes {minutes:g} spent after {counts['tried']} programs", flush=True)
    minimised, per_class = [], collections.Counter()
    for kind, program, message in counts.pop("failures"):
        key = failure_class(message)
        per_class[key] += 1
        if per_class[key] > 1 or len(minimised) >= minimise:  # one program per class, `minimise` at most
            continue
        fails = lambda p: _failure(p, features) == key  # noqa: E731  (the same class, not any failure)
        if fails(program):
            small = fuzzing.minimise(program, fails)
            minimised.append({"kind": kind, "class": key, "program": repr(small), "message": _message(small, features)})
        else:  # fails only after the programs before it: kept whole, with what it said then
            minimised.append({"kind": kind, "class": key, "program": repr(program), "message": "fails only after "
                              "earlier programs (passes on fresh caches); first failure:\n" + message})
    counts["failures"] = minimised
    counts["classes"] = dict(per_class)
    counts["seconds"] = time.perf_counter() - started
    counts["compiles"] = tilewise.stats().compiles
    return counts


def _failure(program, features) -> str | None:
    """The class of the program's failure on fresh caches, or None when it passes."""
    from tilewise.testing import fuzzing
    import tilewise
    tilewise.reset_caches()
    try:
        fuzzing.check(program, features=features)
    except fuzzing.Mismatch as failure:
        return failure_class(str(failure))
    return None


def _message(program, features) -> str:
    from tilewise.testing import fuzzing
    import tilewise
    tilewise.reset_caches()
    try:
        fuzzing.check(program, features=features)
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
    parser.add_argument("--features", default="all", help="areas to fuzz, comma separated, or all/none "
                        "(default all)")
    parser.add_argument("--without", default="", help="areas to leave out, comma separated")
    parser.add_argument("--minimise", type=int, default=20,
                        help="failure classes to minimise per worker (default 20; the rest are counted)")
    parser.add_argument("--minutes", type=float, default=float("inf"),
                        help="stop drawing programs after this many minutes (then minimise and report)")
    parser.add_argument("--native", action="store_true", help="every compiled region builds its C at once and "
                        "runs it (no trial against the recorded graph): the fuzzer holds the C to CPU")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.programs < 1 or args.workers < 1 or args.max_ops < 1 or args.progress < 1:
        parser.error("--programs, --workers, --max-ops and --progress must be >= 1")

    from tilewise.testing import fuzzing
    try:
        features = fuzzing.Features.parse(args.features)
        left_out = fuzzing.Features.parse(args.without)
    except ValueError as error:
        parser.error(str(error))
    features = dataclasses.replace(features, **{name: False for name in left_out.names()})
    print(f"areas: {', '.join(features.names()) or 'none (the first fuzzer)'}", flush=True)
    started = time.perf_counter()
    if args.worker:
        result = run_worker(args.programs, args.seed, args.max_ops, args.progress, features, args.minutes,
                            args.minimise, args.native)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.workers == 1:
        results = [run_worker(args.programs, args.seed, args.max_ops, args.progress, features, args.minutes,
                              args.minimise, args.native)]
    else:
        results = _run_workers(args, features)
    total = {key: sum(r[key] for r in results) for key in ("tried", "rejected", "mismatches", "errors", "compiles")}
    failures = [f for r in results for f in r["failures"]]
    seconds = time.perf_counter() - started
    for failure in failures:
        print(f"\n=== {failure['kind'][:-1]}: {failure['message']}\n{failure['program']}")
    classes = collections.Counter()
    for r in results:
        classes.update(r["classes"])
    if classes:
        print("\nfailure classes (programs):")
        for key, count in classes.most_common():
            print(f"  {count:6d}  {key}")
    if args.failures:
        with open(args.failures, "w") as f:
            json.dump(failures, f, indent=1)
    print(f"\nprograms tried {total['tried']} (plus {total['rejected']} the CPU refused), "
          f"mismatches {total['mismatches']}, errors {total['errors']}, regions compiled {total['compiles']}, "
          f"time {seconds:.0f} s ({seconds / max(total['tried'], 1):.3f} s per program, "
          f"{args.workers} worker{'s' if args.workers > 1 else ''})")
    return 1 if failures else 0


def _run_workers(args, features) -> list[dict]:
    share = -(-args.programs // args.workers)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--programs", str(share),
                               "--seed", str(args.seed + i), "--max-ops", str(args.max_ops),
                               "--progress", str(args.progress), "--features", ",".join(features.names()),
                               "--minutes", str(args.minutes), "--minimise", str(args.minimise)]
                              + (["--native"] if args.native else []),
                              stdout=subprocess.PIPE, text=True)
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
