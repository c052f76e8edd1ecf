"""Simulated step time and communication share of DDP and FSDP2 on 1, 2 and 4 ranks.

    python benchmarks/distributed_scaling.py [--ranks 1 2 4] [--steps 12] [--batch 8] [--mode adaptive]

Runs examples/ddp.py and examples/fsdp.py under torchrun for each rank count (the global batch
fixed, split among the ranks) and prints, per step of the steady state (the second half of the
steps), rank 0's simulated device time, the part of it in collectives, and the compiled fraction.
The simulated timeline is one in-order queue per core: collectives do not overlap compute here.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(example: str, ranks: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "figures.json")
        env = dict(os.environ, TILEWISE_MODE=args.mode, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   os.path.join(ROOT, "examples", example), "--steps", str(args.steps), "--batch", str(args.batch),
                   "--json", out]
        subprocess.run(command, env=env, check=True, capture_output=True, timeout=900)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--mode", default="adaptive")
    args = parser.parse_args()
    print(f"TinyGPT (2 layers, dim 32), global batch {args.batch}, mode {args.mode}, trn2 spec; "
          f"per step over the last {args.steps - args.steps // 2} of {args.steps} steps, rank 0")
    print("| ranks | wrapper | sim ms/step | collectives ms/step | comm share | collectives/step | KiB/step "
          "| compiled |")
    print("|---|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        for wrapper, example in (("DDP", "ddp.py"), ("FSDP2", "fsdp.py")):
            f = measure(example, ranks, args)
            steps = f["steps"]
            print(f"| {ranks} | {wrapper} | {f['simulated_seconds'] / steps * 1e3:.4f} | "
                  f"{f['collective_seconds'] / steps * 1e3:.4f} | "
                  f"{100 * f['collective_seconds'] / f['simulated_seconds']:.1f}% | "
                  f"{f['collective_calls'] / steps:.1f} | {f['collective_bytes'] / steps / 1024:.1f} | "
                  f"{100 * f['compiled_fraction']:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
