"""Every sweep program in every mode, each in a child process (bounded by a timeout), one line each:
OK / MISMATCH (max abs diff) / ERROR (exception), with the compiled fraction overall and after the
program's warm-up steps, and the compiles after warm-up.

    python tests/sweep/run_all.py [--programs gpt2,cnn] [--modes adaptive] [--timeout 900] [-v]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAMS = ("gpt2", "llama", "cnn", "rnn", "mixed_precision", "manual_updates", "interrupts",
            "interrupts_handler", "bert", "vit")
MODES = ("eager", "adaptive", "compiled")


def run_one(program: str, mode: str, timeout: float) -> tuple[dict, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), HF_HUB_OFFLINE="1")
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "tests/sweep/harness.py", program, mode], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "ERROR", "detail": f"timed out after {timeout:.0f} s"}, time.monotonic() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"status": "ERROR", "detail": f"exit {done.returncode}: {tail}"}, time.monotonic() - start
    return json.loads(lines[-1]), time.monotonic() - start


def summary(program: str, mode: str, verdict: dict, seconds: float) -> str:
    status = verdict["status"]
    if status == "MISMATCH":
        status += f" ({verdict['max_abs_diff']:.3g})"
    elif status == "ERROR":
        status += f" ({verdict['detail'].splitlines()[0][:110]})"
    line = f"{program:<16} {mode:<9} {status:<40}"
    if "total" in verdict and mode != "eager":
        total, after = verdict["total"], verdict["after_warmup"]
        frac = lambda c: 100 * c["ops_compiled"] / max(1, c["ops_compiled"] + c["ops_eager"])  # noqa: E731
        line += (f" compiled {frac(total):5.1f}% (after warm-up {frac(after):5.1f}%),"
                 f" compiles {total['compiles']} ({after['compiles']} after warm-up)")
    return line + f"  [{seconds:.0f} s]"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("-v", "--verbose", action="store_true", help="print each failure's detail")
    args = parser.parse_args()
    for program in args.programs.split(","):
        for mode in args.modes.split(","):
            verdict, seconds = run_one(program, mode, args.timeout)
            print(summary(program, mode, verdict, seconds), flush=True)
            if args.verbose and verdict["status"] != "OK":
                print("    " + verdict["detail"].replace("\n", "\n    "), flush=True)


if __name__ == "__main__":
    main()
