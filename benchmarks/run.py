"""Every workload under every contender, side by side: host and simulated time per step, kernel
launches per step, compiles and the median cold compile time per region (ms/compile), cache hits,
time until the first compiled step and the total time including compilation.

Workloads: an MLP training step, a small GPT training step (AdamW), a memory-bound elementwise
chain (GELU written out as 8 ops, then mean/variance normalisation over the last dim of a
4096 x 1024 float32 tensor), a sequence model whose batch length cycles (seq) or is new most steps
(varlen), and MLP inference whose batch size changes every step (infer).
Contenders: plain CPU eager, torch.compile with inductor (CPU), tilewise eager / adaptive / compiled.

The engine's caches and statistics are process-wide, so each contender runs in a worker process of
its own (two tilewise modes in one process would share compiled regions). The coordinator asks the
workers for one step each in turn, in alternating order, so the load of this shared machine falls
on all of them alike; per-step figures are medians over all steps, compilation included.

    python benchmarks/run.py                     # full setting, the README table (~10 min here)
    python benchmarks/run.py --quick --json out.json   # smoke test: few steps, smaller sizes, no inductor
    python benchmarks/run.py --background-compile      # adds adaptive mode compiling in a compile process
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import tempfile
import time
import traceback
from typing import NamedTuple

import torch
import torch.nn.functional as F

CONTENDERS = ("cpu eager", "inductor", "tilewise eager", "tilewise adaptive", "tilewise compiled")
TILEWISE_MODES = {"tilewise eager": "eager", "tilewise adaptive": "adaptive", "tilewise compiled": "compiled"}
# With --host-backends, the compiling modes also run once per listed host backend (config.host_backend),
# as contenders of their own: "tilewise adaptive [torch host]".
HOST_BACKEND_MODES = ("tilewise adaptive", "tilewise compiled")


class Contender(NamedTuple):
    """Who runs a workload: one of CONTENDERS and, for a tilewise mode, the settings its block
    patches (host_backend, background_compile), which its label names."""
    base: str
    host_backend: str | None = None
    background_compile: bool = False

    @property
    def label(self) -> str:
        return self.base + (f" [{self.host_backend} host]" if self.host_backend else "") + \
            (" [background compile]" if self.background_compile else "")

    @property
    def tilewise_mode(self) -> str | None:
        return TILEWISE_MODES.get(self.base)

    def settings(self) -> dict:
        """What the block patches: no disk cache (every compile cold), and the contender's own."""
        return {"cache_dir": ""} | ({"host_backend": self.host_backend} if self.host_backend else {}) | \
            ({"background_compile": "on"} if self.background_compile else {})
# Steps per workload: (full, quick). The full setting must finish within 15 minutes on 2 loaded cores.
STEPS = {"mlp": (60, 4), "gpt": (30, 5), "chain": (20, 3), "seq": (40, 5), "readloss": (40, 6), "cnn": (30, 6),
         "varlen": (50, 6), "infer": (50, 6)}
INDUCTOR_SKIPPED = "skipped in --quick: inductor compiles for 17-40 s cold per graph here (run without --quick)"


# -- workloads: each builds its model and data, and returns one training (or forward) step ---------
def _sync(device: str) -> None:
    if device == "neuron":
        import tilewise
        tilewise.sync()


def mlp(device: str, wrap, steps: int, quick: bool):
    from tilewise.workloads import MLP
    torch.manual_seed(0)
    model = MLP().to(device)
    forward = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = [(torch.randn(64, 32), torch.randint(0, 10, (64,))) for _ in range(steps)]
    return _classifier_step(forward, opt, data, device)


def _classifier_step(forward, opt, data, device: str):
    """The usual step on batch i: cross-entropy, backward, step, zero_grad, read the loss."""
    def step(i: int) -> float:
        x, y = data[i]
        loss = F.cross_entropy(forward(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def gpt(device: str, wrap, steps: int, quick: bool):
    from tilewise.workloads import TinyGPT, text_batches
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    forward = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = text_batches(steps)

    def step(i: int) -> float:
        x, y = data[i]
        logits = forward(x.to(device))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def gelu_norm(x):
    y = 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))
    mean = y.mean(-1, keepdim=True)
    return (y - mean) / torch.sqrt(((y - mean) ** 2).mean(-1, keepdim=True) + 1e-5)


def chain(device: str, wrap, steps: int, quick: bool):
    torch.manual_seed(0)
    x = torch.randn(512 if quick else 4096, 1024).to(device)
    forward = wrap(gelu_norm)

    def step(i: int) -> None:
        out = forward(x)
        _sync(device)  # while `out` is alive: the engine computes what is still referenced
        del out

    return step


def seq(device: str, wrap, steps: int, quick: bool):
    from tilewise.workloads import SeqClassifier, seq_batches
    torch.manual_seed(0)
    model = SeqClassifier().to(device)
    forward = wrap(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = seq_batches(steps)

    def step(i: int) -> float:
        tokens, labels = data[i]
        loss = F.cross_entropy(forward(tokens.to(device)), labels.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def varlen(device: str, wrap, steps: int, quick: bool):
    """The sequence classifier with a new batch length most steps (random in 4..64, seeded)."""
    from tilewise.workloads import SeqClassifier, random_lengths, seq_batches
    torch.manual_seed(0)
    model = SeqClassifier().to(device)
    forward = wrap(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = seq_batches(steps, random_lengths(steps))
    return _classifier_step(forward, opt, data, device)


def infer(device: str, wrap, steps: int, quick: bool):
    """MLP inference under inference_mode, the batch size random in 1..64 every step (seeded)."""
    from tilewise.workloads import MLP, random_lengths
    torch.manual_seed(0)
    model = MLP().eval().to(device)
    forward = wrap(model)
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(n, 32, generator=generator) for n in random_lengths(steps, 1, 64)]

    def step(i: int) -> torch.Tensor:
        with torch.inference_mode():
            return forward(data[i].to(device)).cpu()

    return step


def readloss(device: str, wrap, steps: int, quick: bool):
    """The MLP step with the loss read before backward(): two segments per step."""
    from tilewise.workloads import MLP
    torch.manual_seed(0)
    model = MLP().to(device)
    forward = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [(torch.randn(64, 32), torch.randint(0, 10, (64,))) for _ in range(steps)]

    def step(i: int) -> float:
        x, y = data[i]
        loss = F.cross_entropy(forward(x.to(device)), y.to(device))
        value = loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return value

    return step


def cnn(device: str, wrap, steps: int, quick: bool):
    """A small CNN with BatchNorm, SGD with momentum and a cosine learning-rate schedule."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10)).to(device)
    forward = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    data = [(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))) for _ in range(steps)]

    def step(i: int) -> float:
        x, y = data[i]
        loss = F.cross_entropy(forward(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        return loss.item()

    return step


WORKLOADS = {
    "mlp": (mlp, "MLP 32-64-10 training step, batch 64, SGD"),
    "gpt": (gpt, "TinyGPT (2 layers, dim 32, 2 heads, len 16) training step, batch 4, AdamW"),
    "chain": (chain, "GELU as 8 ops + mean/variance norm over the last dim, {rows}x1024 f32, forward"),
    "seq": (seq, "sequence classifier, batch length 5/9/12/7 in turn, Adam training step"),
    "readloss": (readloss, "MLP 32-64-10 step reading the loss before backward(), AdamW"),
    "varlen": (varlen, "sequence classifier, batch length random in 4..64 every step, Adam training step"),
    "infer": (infer, "MLP 32-64-10 inference under inference_mode, batch size random in 1..64 every step"),
    "cnn": (cnn, "CNN (2 conv+BatchNorm, 16 ch, 16x16) step, SGD momentum, cosine LR schedule, batch 8"),
}


# -- one contender in its own process ---------------------------------------------------------------
class Meter:
    """Times steps and reads the engine's counters around each one."""

    def __init__(self, contender: Contender):
        self.tilewise = contender.tilewise_mode is not None
        self.inductor = contender.base == "inductor"
        self.samples: list[dict] = []

    def step(self, step, i: int) -> dict:
        before = self._counters()
        started = time.perf_counter()
        step(i)
        seconds = time.perf_counter() - started
        after = self._counters()
        sample = {"host_s": seconds, **{k: after[k] - before[k] for k in after}}
        self.samples.append(sample)
        return sample

    def _counters(self) -> dict:
        if not self.tilewise:
            return {}
        import tilewise
        s = tilewise.stats()
        return {"simulated_s": s.simulated_seconds, "kernels": s.kernels, "ops_compiled": s.ops_compiled}

    def totals(self) -> dict:
        if not self.tilewise:
            from torch._dynamo.utils import counters
            return {"compiles": counters["stats"]["unique_graphs"]} if self.inductor else {}
        import tilewise
        s = tilewise.stats()
        per_region = [r.compile_seconds for r in s.regions.values() if r.compile_seconds > 0]
        return {"compiles": s.compiles, "compile_s": s.compile_seconds, "specialisations": s.specialisations,
                "specialise_s": s.specialise_seconds, "evaluated_sizes": s.evaluated_sizes,
                "evaluate_s": s.evaluate_seconds, "cache_hits": s.cache_hits,
                "cache_misses": s.cache_misses, "compiled_fraction": s.compiled_fraction,
                "median_compile_ms_per_region": 1e3 * statistics.median(per_region) if per_region else None}


def _contender_setup(contender: Contender):
    """(device, how the model is wrapped, the block the steps run in) for one contender."""
    if contender.base == "cpu eager":
        return "cpu", (lambda fn: fn), contextlib.nullcontext()
    if contender.base == "inductor":
        return "cpu", torch.compile, contextlib.nullcontext()
    import tilewise  # noqa: F401  registers the neuron device before the workload moves data there
    return "neuron", (lambda fn: fn), _tilewise_block(contender)


@contextlib.contextmanager
def _tilewise_block(contender: Contender):
    import tilewise
    with tilewise.config.patch(**contender.settings()), tilewise.engine(mode=contender.tilewise_mode):
        yield


def _start_cold(contender: Contender) -> None:
    """Forget what an earlier workload compiled, so every workload starts cold for every contender."""
    if contender.base == "inductor":
        import torch._functorch.config
        import torch._inductor.config
        from torch._dynamo.utils import counters
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
        torch._dynamo.reset()
        counters.clear()
    elif contender.tilewise_mode is not None:
        import tilewise
        tilewise.reset_caches()
        tilewise.stats().reset()


def worker(conn, contender: Contender, threads: int) -> None:
    """One contender, for every workload the coordinator sends: set up, then one step per request."""
    torch.set_num_threads(threads)
    for workload, steps, quick in iter(conn.recv, None):
        try:
            _start_cold(contender)
            device, wrap, block = _contender_setup(contender)
            step = WORKLOADS[workload][0](device, wrap, steps, quick)
            meter = Meter(contender)
            conn.send("ready")
            with block:
                for i in range(steps):
                    conn.recv()
                    conn.send(meter.step(step, i))
            conn.send(meter.totals())
        except Exception:  # the coordinator reports it in the table and the JSON, and goes on
            conn.send({"error": traceback.format_exc()})


# -- the coordinator --------------------------------------------------------------------------------
@contextlib.contextmanager
def workers(contenders: list[Contender], threads: int):
    """A process per contender: the engine's caches and statistics are process-wide."""
    context = multiprocessing.get_context("spawn")
    pipes, processes = {}, []
    # inductor's kernel cache in a fresh directory: its compiles are as cold as tilewise's
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="tilewise-bench-inductor-")
    for contender in contenders:
        parent, child = context.Pipe()
        process = context.Process(target=worker, args=(child, contender, threads), daemon=True)
        process.start()
        pipes[contender] = parent
        processes.append(process)
    try:
        yield pipes
    finally:
        for pipe in pipes.values():
            pipe.send(None)
        for process in processes:
            process.join(timeout=30)
        shutil.rmtree(os.environ.pop("TORCHINDUCTOR_CACHE_DIR"), ignore_errors=True)


def run_workload(pipes: dict, workload: str, steps: int, quick: bool) -> dict[str, dict]:
    for pipe in pipes.values():
        pipe.send((workload, steps, quick))
    first = {c: pipe.recv() for c, pipe in pipes.items()}  # "ready", or the error of a failed set-up
    live = [c for c in pipes if first[c] == "ready"]
    results = {c: first[c] for c in pipes if c not in live}
    samples = {c: [] for c in live}
    for i in range(steps):
        for contender in (list(live) if i % 2 == 0 else list(reversed(live))):
            pipes[contender].send(i)
            answer = pipes[contender].recv()
            if "error" in answer:
                results[contender] = answer
                live.remove(contender)
            else:
                samples[contender].append(answer)
    for contender in live:
        totals = pipes[contender].recv()
        results[contender] = totals if "error" in totals else summarise(samples[contender], totals)
    return results


def summarise(samples: list[dict], totals: dict) -> dict:
    host = [s["host_s"] for s in samples]
    result = {"steps": len(samples), "host_ms_per_step": 1e3 * statistics.median(host),
              "total_s": sum(host), "first_compiled_s": _first_compiled(samples, totals), **totals}
    if "simulated_s" in samples[0]:
        result["simulated_ms_per_step"] = 1e3 * statistics.median(s["simulated_s"] for s in samples)
        result["launches_per_step"] = statistics.median(s["kernels"] for s in samples)
        lookups = totals["cache_hits"] + totals["cache_misses"]
        result["cache_hit_rate"] = totals["cache_hits"] / lookups if lookups else None
    return result


def _first_compiled(samples: list[dict], totals: dict) -> float | None:
    """Host seconds from the first step to the end of the first step that ran compiled code."""
    elapsed = 0.0
    for sample in samples:
        elapsed += sample["host_s"]
        if sample.get("ops_compiled", 0) > 0 or ("ops_compiled" not in sample and totals.get("compiles")):
            return elapsed
    return None


# -- output -----------------------------------------------------------------------------------------
COLUMNS = ("contender", "host ms/step", "vs cpu", "sim ms/step", "launches/step", "compiles", "ms/compile",
           "cache hits", "1st compiled s", "total s")


def table(results: dict[str, dict]) -> str:
    base = results.get("cpu eager", {}).get("host_ms_per_step")
    widths = (40, 13, 8, 12, 14, 9, 11, 11, 15, 9)
    lines = ["".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(COLUMNS, widths)))]
    for contender, r in results.items():
        if "error" in r or "skipped" in r:
            why = r.get("skipped") or r["error"].strip().splitlines()[-1]
            lines.append(f"{contender:<40} {why}")
            continue
        cells = (r["host_ms_per_step"], r["host_ms_per_step"] / base if base else None,
                 r.get("simulated_ms_per_step"), r.get("launches_per_step"), r.get("compiles"),
                 r.get("median_compile_ms_per_region"), r.get("cache_hit_rate"), r["first_compiled_s"], r["total_s"])
        formats = ("{:.2f}", "{:.2f}x", "{:.3f}", "{:.0f}", "{}", "{:.0f}", "{:.0%}", "{:.2f}", "{:.2f}")
        lines.append(f"{contender:<40}" + "".join(
            f"{'-' if v is None else f.format(v):>{w}}" for v, f, w in zip(cells, formats, widths[1:])))
    return "\n".join(lines)


def machine() -> dict:
    return {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "date": datetime.date.today().isoformat()}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: few steps, small sizes, no inductor")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of "
                        + ", ".join(WORKLOADS))
    parser.add_argument("--steps", type=int, help="steps per workload (default: per workload, see STEPS)")
    parser.add_argument("--inductor", action="store_true", help="run inductor even with --quick")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per contender (default 1: on a shared machine a parallel op "
                             "waits for its slowest thread, and the contenders' ratios drown in that noise)")
    parser.add_argument("--host-backends", default="",
                        help="comma-separated host backends (native, torch) the compiling modes also run under, "
                             "side by side (default: only the configured one)")
    parser.add_argument("--background-compile", action="store_true",
                        help="also run adaptive mode compiling in the background (background_compile=on), "
                             "side by side")
    return parser.parse_args(argv)


def contenders_asked(args) -> list[Contender]:
    backends = [b.strip() for b in args.host_backends.split(",") if b.strip()]
    return [Contender(base) for base in CONTENDERS] + \
        [Contender(mode, host_backend=backend) for backend in backends for mode in HOST_BACKEND_MODES] + \
        ([Contender("tilewise adaptive", background_compile=True)] if args.background_compile else [])


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; expected some of {list(WORKLOADS)}")
    with_inductor = args.inductor or not args.quick
    report = {"machine": machine(), "quick": args.quick, "threads": args.threads, "inductor_note": None if with_inductor else INDUCTOR_SKIPPED,
              "workloads": {}}
    print(f"tilewise benchmarks ({'quick' if args.quick else 'full'}; {report['machine']['cores']} cores, "
          f"torch {torch.__version__}, {report['machine']['date']}, {args.threads} intra-op thread(s) per contender); "
          "contenders alternate step by step, "
          "each in its own process; per-step figures are medians over all steps, compilation included")
    if not with_inductor:
        print(f"inductor: {INDUCTOR_SKIPPED}")
    started = time.perf_counter()
    contenders = contenders_asked(args)
    with workers([c for c in contenders if with_inductor or c.base != "inductor"], args.threads) as pipes:
        for name in names:
            steps = args.steps or STEPS[name][args.quick]
            results = run_workload(pipes, name, steps, args.quick)
            if not with_inductor:
                results[Contender("inductor")] = {"skipped": INDUCTOR_SKIPPED}
            results = {c.label: results[c] for c in contenders}
            description = WORKLOADS[name][1].format(rows=512 if args.quick else 4096)
            report["workloads"][name] = {"description": description, "steps": steps, "contenders": results}
            print(f"\n{name}: {description}; {steps} steps\n{table(results)}", flush=True)
    report["wall_s"] = time.perf_counter() - started
    print(f"\nwall time {report['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
