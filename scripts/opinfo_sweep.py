"""Full OpInfo conformance sweep of the neuron device against CPU, per engine mode and sample kind.

Runs every sample of every op in PyTorch's OpInfo database (tilewise/testing/conformance.py) on two axes:
the engine mode (eager; adaptive with threshold 1 and compiled, where the sample's ops are recorded
and compiled as a region; an op's samples share the engine's caches) and the sample kind (float32,
bfloat16 and float16 forward, float32 gradients, int64 forward; each where the op's CPU kernels
support it). Prints per mode and kind the pass rate and how many samples ran compiled code,
exclusions by category, the failures grouped by their first error line, and the compile failures
the lazy modes fell back from (still correct, but eager).

    python scripts/opinfo_sweep.py                                   # everything (long)
    python scripts/opinfo_sweep.py --kinds float32 --jobs 2          # float32, three modes
    python scripts/opinfo_sweep.py --quick --engines compiled        # first 2 samples per op and kind
    python scripts/opinfo_sweep.py --ops add,mul --kinds float32,grad --json out.json
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import sys
import time
import warnings

# Every compile cold, as a new program's: the compiler is what this checks, not the disk cache
# (the workers it starts inherit the setting).
os.environ.setdefault("TILEWISE_CACHE_DIR", "off")

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# this checkout's tilewise and tests, whatever tilewise is installed
sys.path.insert(0, _ROOT)

TARGET = 0.995  # float32 pass rate to reach in every engine mode


def sweep_op(task):
    """All samples of one op in the requested kinds and modes: (key, rows), a row being (key,
    engine, kind, status, message, ops compiled, compile failure)."""
    key, engines, kinds, limit = task
    from tilewise.testing import conformance as c
    warnings.filterwarnings("ignore")
    op = c.OPS[key]
    rows = []
    for kind in kinds:
        if not c.applies(op, kind):
            continue
        try:
            sample_list = c.samples(op, kind, limit)
        except Exception as error:  # noqa: BLE001
            rows += [(key, engine, kind, c.NOT_RUN, f"sample generation failed: {error}"[:200], 0, "")
                     for engine in engines]
            continue
        for engine in engines:
            rows += _sweep_samples(c, op, sample_list, kind, engine)
    return key, rows


def _sweep_samples(c, op, sample_list, kind: str, engine: str) -> list:
    """The op's samples one after the other on one set of caches, as a program's steps: each new
    signature compiles (no recompile limit), and each sample meets the plans and recorded metadata
    its predecessors left."""
    import tilewise
    key = c.op_key(op)
    tilewise.reset_caches()
    with tilewise.config.patch(recompile_limit=len(sample_list) + 1):
        return [(key, engine, kind, *c.run_sample(op, sample, kind, engine, fresh=False))
                for sample in sample_list]


def _group(message: str) -> str:
    """A failure message with its numbers blanked, so one cause with many shapes is one group."""
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", message)


def report(rows, elapsed: float, engines, kinds) -> int:
    from tilewise.testing import conformance as c
    counts = collections.defaultdict(collections.Counter)
    compiled = collections.Counter()
    excluded = collections.defaultdict(collections.Counter)
    failures = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    compile_failures = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    for key, engine, kind, status, message, ops_compiled, compile_failure in rows:
        counts[engine, kind][status] += 1
        compiled[engine, kind] += bool(ops_compiled) and status == c.PASS
        if status == c.EXCLUDED_:
            excluded[engine, kind][c.category_of(message)] += 1
        elif status == c.FAIL:
            failures[engine, kind][_group(message)][key] += 1
        if compile_failure:
            compile_failures[engine, kind][_group(compile_failure)][key] += 1

    print(f"\nOpInfo conformance sweep, neuron vs CPU ({elapsed:.0f} s)\n")
    header = (f"{'engine':<10}{'kind':<10}{'run on CPU':>11}{'passed':>8}{'failed':>8}{'excluded':>9}"
              f"{'not run':>8}{'compiled':>9}{'pass rate':>11}")
    print(header)
    print("-" * len(header))
    for engine in engines:
        for kind in kinds:
            n = counts[engine, kind]
            ran = n[c.PASS] + n[c.FAIL] + n[c.EXCLUDED_]
            rate = 100.0 * n[c.PASS] / ran if ran else 0.0
            print(f"{engine:<10}{kind:<10}{ran:>11}{n[c.PASS]:>8}{n[c.FAIL]:>8}{n[c.EXCLUDED_]:>9}"
                  f"{n[c.NOT_RUN]:>8}{compiled[engine, kind]:>9}{rate:>10.2f}%")
    print("\n'run on CPU' = passed + failed + excluded; 'not run' = fails on CPU too, or nothing to "
          "differentiate; 'compiled' = passed samples that ran a compiled region. Pass rate = passed / "
          "run on CPU.\n")
    _print_excluded(excluded, engines, kinds)
    _print_groups("Failures", failures, engines, kinds)
    _print_groups("Compile failures (the engine ran these eagerly, correctly)", compile_failures, engines, kinds)
    return _verdict(counts, engines, c)


def _print_excluded(excluded, engines, kinds) -> None:
    print("Excluded samples by category:")
    for (engine, kind), per_category in sorted(excluded.items()):
        for category, n in per_category.most_common():
            print(f"  {engine:<9}{kind:<9}{n:>5}  {category}")


def _print_groups(title: str, groups, engines, kinds) -> None:
    for engine in engines:
        for kind in kinds:
            by_message = groups.get((engine, kind))
            if not by_message:
                continue
            total = sum(sum(ops.values()) for ops in by_message.values())
            print(f"\n{title} [{engine} {kind}]: {total} sample(s)")
            for message, ops in sorted(by_message.items(), key=lambda item: -sum(item[1].values())):
                listed = ", ".join(f"{op} ({n})" for op, n in ops.most_common())
                print(f"  {sum(ops.values()):>4}  {message}\n        {listed}")


def _verdict(counts, engines, c) -> int:
    ok = True
    for engine in engines:
        n = counts[engine, "float32"]
        ran = n[c.PASS] + n[c.FAIL] + n[c.EXCLUDED_]
        if ran:
            rate = n[c.PASS] / ran
            ok &= rate >= TARGET
            print(f"float32 pass rate [{engine}]: {100 * rate:.2f}% ({n[c.PASS]}/{ran}); target >= {100 * TARGET}%")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="first 2 samples per op and kind")
    parser.add_argument("--limit", type=int, help="first N samples per op and kind")
    parser.add_argument("--ops", help="comma-separated OpInfo names (name or name.variant)")
    parser.add_argument("--engines", default="eager,adaptive,compiled")
    parser.add_argument("--kinds", default="float32,grad,bfloat16,float16,int64")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--json", help="write every sample's outcome to this file")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds one op may take (all its kinds and modes) before it is killed, reported hung")
    args = parser.parse_args(argv)

    from tilewise.testing import conformance as c
    engines = _choices(parser, "engines", args.engines, c.ENGINE_MODES)
    kinds = _choices(parser, "kinds", args.kinds, c.KINDS)
    keys = args.ops.split(",") if args.ops else list(c.OPS)
    missing = [k for k in keys if k not in c.OPS]
    if missing:
        parser.error(f"not OpInfo names: {missing}")
    limit = 2 if args.quick else args.limit
    tasks = [(key, engines, kinds, limit) for key in keys]
    start = time.perf_counter()
    rows = _run(tasks, args.jobs, args.timeout, start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return report(rows, time.perf_counter() - start, engines, kinds)


def _choices(parser, what: str, text: str, allowed) -> tuple:
    chosen = tuple(m for m in text.split(",") if m)
    unknown = set(chosen) - set(allowed)
    if unknown:
        parser.error(f"unknown {what} {sorted(unknown)}; allowed: {', '.join(allowed)}")
    return chosen


def _run(tasks, jobs: int, timeout: float, start: float) -> list:
    """Every task's rows, each op in a worker process of its own pool slot, so a sweep is bounded:
    an op that runs past `timeout` seconds is killed and reported as hung, one whose worker dies
    (an abort in native code) as crashed; the sweep goes on with a fresh worker."""
    rows: list = []
    queue = list(reversed(tasks))
    workers: list[_Worker] = []
    done = 0
    while queue or workers:
        while queue and len(workers) < max(jobs, 1):
            workers.append(_Worker(queue.pop()))
        ready = multiprocessing.connection.wait([w.reader for w in workers], timeout=_POLL_SECONDS)
        for worker in list(workers):
            outcome = worker.collect(worker.reader in ready, timeout)
            if outcome is None:
                continue
            workers.remove(worker)
            rows.extend(outcome)
            done += 1
            _progress(done, len(tasks), start)
    return rows


_POLL_SECONDS = 1.0


class _Worker:
    """One op swept in a forked child process that sends its rows back through a pipe."""

    def __init__(self, task):
        self.task = task
        self.started = time.monotonic()
        self.reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
        self.process = multiprocessing.get_context("fork").Process(target=_child, args=(task, writer),
                                                                   daemon=True)
        self.process.start()
        writer.close()

    def collect(self, readable: bool, timeout: float):
        """The op's rows once the child has answered, died or overrun its time; None while it runs."""
        if readable:
            try:
                rows = self.reader.recv()
            except EOFError:
                self.process.join()
                return self._lost(f"crashed: the worker died (exit code {self.process.exitcode})")
            self.process.join()
            return rows
        if time.monotonic() - self.started > timeout:
            self.process.kill()
            self.process.join()
            return self._lost(f"hung: no result within {timeout:.0f} s, the worker was killed")
        return None

    def _lost(self, message: str) -> list:
        """One failure row per engine mode and applicable kind of an op that gave no result."""
        from tilewise.testing import conformance as c
        self.reader.close()
        key, engines, kinds, _ = self.task
        op = c.OPS[key]
        print(f"{key}: {message}", file=sys.stderr, flush=True)
        return [(key, engine, kind, c.FAIL, message, 0, "")
                for kind in kinds if c.applies(op, kind) for engine in engines]


def _child(task, writer) -> None:
    _one_thread()
    writer.send(sweep_op(task)[1])
    writer.close()


def _one_thread():
    import torch
    torch.set_num_threads(1)


def _progress(done: int, total: int, start: float) -> None:
    if done % 25 == 0 or done == total:
        print(f"[{done}/{total} ops, {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
