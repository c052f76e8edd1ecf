"""Real model sizes (issue 46): GPT-2 124M and a Llama of similar size, trained and generating,
in each mode against CPU eager and inductor, at 1x, 2x and 4x depth.

Per workload and contender, each in a fresh process (its own caches, its own peak RSS): cold
compile seconds (tilewise: the compiles' seconds from `stats()`, on the steps' path unless
`background_compile` sends them to the compile process, whose seconds the JSON's
`background_compile_s` holds; inductor: the first step's time less a steady step's), the slowest
region's compile seconds, compiles, the seconds waited after the first half of the steps for the C
builds still under way in the background (tilewise), steady host seconds per step (median of the
last half of the steps, which run what those builds made), simulated device seconds per steady
step, peak RSS and the resident memory after the last step (the JSON's `emptied_rss_mb`: after
`torch.neuron.empty_cache()` too), and the largest difference of the losses (or generated tokens)
from CPU eager's run in the same table. Ratios are to CPU eager's figures of the same run.

    python benchmarks/scale.py [--workloads gpt2,llama] [--tasks train,generate] [--depths 1,2,4]
                               [--contenders cpu,cpu-caching,inductor,eager,adaptive,compiled] [--steps N]
                               [--json PATH] [--tiny]

Training: batch 2, sequence 64, AdamW, one torch thread, a loss read every step. Generating: a
step is one `generate` call of 16 new tokens, greedy, with the KV cache, from a prompt of 16.
`--tiny` shrinks the models (2 layers, width 64) for a smoke run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# cpu-caching: CPU eager in a process that imported tilewise, whose host allocator keeps freed
# blocks for reuse (host_allocator=caching): how much of a ratio to CPU eager that setting makes
CONTENDERS = ("cpu", "cpu-caching", "inductor", "eager", "adaptive", "compiled")
BATCH, LENGTH, PROMPT, NEW_TOKENS = 2, 64, 16, 16


def _config(workload: str, depth: int, tiny: bool):
    from transformers import GPT2Config, LlamaConfig
    if workload == "gpt2":
        if tiny:
            return GPT2Config(n_layer=2 * depth, n_embd=64, n_head=4, vocab_size=512, n_positions=128)
        return GPT2Config(n_layer=12 * depth)
    if tiny:
        return LlamaConfig(hidden_size=64, num_hidden_layers=2 * depth, num_attention_heads=4, num_key_value_heads=4,
                           intermediate_size=128, vocab_size=512, max_position_embeddings=128)
    return LlamaConfig(hidden_size=768, num_hidden_layers=12 * depth, num_attention_heads=12, num_key_value_heads=12,
                       intermediate_size=2048, vocab_size=32000, max_position_embeddings=512)


def _model(workload: str, depth: int, tiny: bool):
    import torch
    from transformers import GPT2LMHeadModel, LlamaForCausalLM
    torch.manual_seed(0)
    config = _config(workload, depth, tiny)
    return (GPT2LMHeadModel if workload == "gpt2" else LlamaForCausalLM)(config).eval(), config.vocab_size


def _steps(workload, task, depth, tiny, contender, steps):
    """(step function returning a float or a list to compare, model) on the contender's device."""
    import torch
    model, vocab = _model(workload, depth, tiny)
    device = "cpu" if contender in ("cpu", "cpu-caching", "inductor") else "neuron"
    model = model.to(device)
    if contender == "inductor":
        model.forward = torch.compile(model.forward)
    generator = torch.Generator().manual_seed(1)
    if task == "train":
        model.train()
        batches = [torch.randint(0, vocab, (BATCH, LENGTH), generator=generator) for _ in range(steps)]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(i):
            x = batches[i].to(device)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()
        return step
    prompt = torch.randint(0, vocab, (1, PROMPT), generator=generator).to(device)

    def generate(i):
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        return out[0, PROMPT:].tolist()
    return generate


def _resident_mb() -> float:
    """Resident memory now (the peak is `ru_maxrss`), in MB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def worker(args) -> dict:
    """One contender's run, in this process."""
    import torch
    torch.set_num_threads(1)
    contender = args.contender
    block = stats = None
    if contender in ("eager", "adaptive", "compiled"):  # CPU's contenders run without tilewise imported
        import tilewise
        block, stats = tilewise.engine(mode=contender), tilewise.stats()
    elif contender == "cpu-caching":
        import tilewise  # noqa: F401  (its import sets the host allocator)
    step = _steps(args.workload, args.task, args.depth, args.tiny, contender, args.steps)
    times, results, simulated = [], [], []
    waited = 0.0
    if block is not None:
        block.__enter__()
    try:
        for i in range(args.steps):
            if block is not None and i == args.steps // 2:  # the steady steps run what the C builds made
                started = time.perf_counter()
                tilewise.wait_for_compiles()
                waited = time.perf_counter() - started
            before = stats.simulated_seconds if stats else 0.0
            started = time.perf_counter()
            results.append(step(i))
            times.append(time.perf_counter() - started)
            simulated.append((stats.simulated_seconds if stats else 0.0) - before)
    finally:
        if block is not None:
            block.__exit__(None, None, None)
    end_rss = _resident_mb()
    if block is not None:
        torch.neuron.empty_cache()  # what the host allocator kept for reuse, given back
    steady = times[len(times) // 2:]
    record = {"workload": args.workload, "task": args.task, "depth": args.depth, "contender": contender,
              "mode": contender if block is not None else None, "steps": args.steps,
              "step_s": times, "steady_step_s": statistics.median(steady), "results": results,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "end_rss_mb": end_rss,
              "emptied_rss_mb": _resident_mb()}
    if block is not None:
        record.update(cold_compile_s=stats.compile_seconds, background_compile_s=stats.background_seconds,
                      compiles=stats.compiles, build_wait_s=waited,
                      slowest_region_s=max((r.compile_seconds for r in stats.regions.values()), default=0.0),
                      simulated_step_s=statistics.median(simulated[len(simulated) // 2:]),
                      compiled_fraction=stats.compiled_fraction)
    elif contender == "inductor":
        record.update(cold_compile_s=max(0.0, times[0] - record["steady_step_s"]), compiles=None, simulated_step_s=None)
    else:
        record.update(cold_compile_s=0.0, compiles=0, simulated_step_s=None)
    return record


def _run_one(args, workload, task, depth, contender) -> dict:
    command = [sys.executable, __file__, "--worker", "--workload", workload, "--task", task, "--depth", str(depth),
               "--contender", contender, "--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
    env = dict(os.environ, TILEWISE_CACHE_DIR=os.environ.get("TILEWISE_CACHE_DIR", "off"))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"workload": workload, "task": task, "depth": depth, "contender": contender, "error": "timed out"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"workload": workload, "task": task, "depth": depth, "contender": contender,
                "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(lines[-1])


def _difference(record: dict, reference: dict | None):
    if reference is None or "results" not in record or "results" not in reference:
        return None
    got, want = record["results"], reference["results"]
    if record["task"] == "generate":
        return sum(a != b for g, w in zip(got, want) for a, b in zip(g, w))  # tokens that differ
    return max(abs(a - b) for a, b in zip(got, want))


def _row(record: dict, reference: dict | None) -> str:
    name = f"{record['workload']} x{record['depth']} {record['task']:<8} {record['contender']:<11}"
    if "error" in record:
        return f"{name} {record['error']}"
    ratio = record["steady_step_s"] / reference["steady_step_s"] if reference and "error" not in reference else float("nan")
    rss = record["peak_rss_mb"] / reference["peak_rss_mb"] if reference and "error" not in reference else float("nan")
    end_rss = record["end_rss_mb"] / reference["end_rss_mb"] if reference and "error" not in reference else float("nan")
    simulated = record.get("simulated_step_s")
    compiles = record.get("compiles")
    wait = record.get("build_wait_s")
    slowest = record.get("slowest_region_s")
    return (f"{name} {record['cold_compile_s']:>8.2f} {'-' if slowest is None else f'{slowest:.2f}':>7} "
            f"{'-' if compiles is None else compiles:>8} "
            f"{'-' if wait is None else f'{wait:.2f}':>8} "
            f"{record['steady_step_s']:>8.3f} {ratio:>6.2f}x "
            f"{'-' if simulated is None else f'{simulated * 1e3:.2f}':>10} {record['peak_rss_mb']:>8.0f} {rss:>5.2f}x "
            f"{record['end_rss_mb']:>7.0f} {end_rss:>5.2f}x "
            f"{_difference(record, reference)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="gpt2,llama")
    parser.add_argument("--tasks", default="train,generate")
    parser.add_argument("--depths", default="1,2,4")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per contender's run")
    parser.add_argument("--json", default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    contenders = args.contenders.split(",")
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose from {list(CONTENDERS)}")
    records = []
    print(f"{'workload':<10} {'task':<8} {'contender':<11} {'compile s':>9} {'slowest':>7} {'compiles':>8} {'C wait s':>8} {'step s':>8} "
          f"{'vs cpu':>7} {'sim ms':>10} {'peak MB':>8} {'vs cpu':>6} {'end MB':>7} {'vs cpu':>6} max diff from cpu")
    for workload in args.workloads.split(","):
        for task in args.tasks.split(","):
            for depth in (int(d) for d in args.depths.split(",")):
                reference = None
                for contender in contenders:
                    record = _run_one(args, workload, task, depth, contender)
                    if contender == "cpu":
                        reference = record
                    records.append(record)
                    print(_row(record, reference), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump([{k: v for k, v in r.items() if k not in ("results",)} for r in records], out, indent=1)


if __name__ == "__main__":
    main()
