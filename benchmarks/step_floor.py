"""What any engine built on a Python tensor subclass costs a training step, against tilewise.

Issue 14 asks for adaptive host time per step <= 1.5x CPU eager on the MLP and TinyGPT steps. An
engine that sees ops through `__torch_dispatch__` pays, on every op, PyTorch's call into Python and
a wrapper tensor per output before it does anything of its own. This benchmark measures that floor
on whole training steps: a device made of nothing but a wrapper subclass whose handler unwraps the
arguments, runs PyTorch's CPU kernel and wraps the outputs (no bookkeeping, no cost model, no
recording), next to plain CPU eager and tilewise eager and adaptive (its compiled region serving
every step). The contenders alternate step by step in one process (shared, noisy machines);
medians are reported, of the wall clock and of this thread's CPU time (the second leaves out
other processes' load and the intra-op threads spinning between PyTorch's parallel kernels).

    python benchmarks/step_floor.py [--quick]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import tilewise
from tilewise.workloads import MLP, TinyGPT, text_batches


class Wrapped(torch.Tensor):
    """The thinnest device: a CPU tensor inside a wrapper subclass."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        wrapper = torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(),
                                                       storage_offset=data.storage_offset(), dtype=data.dtype,
                                                       requires_grad=data.requires_grad)
        wrapper.data_ = data
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*[_unwrap(a) for a in args], **{k: _unwrap(v) for k, v in (kwargs or {}).items()})
        if func._schema.is_mutable:  # in place: the inputs written are the wrappers returned
            return args[0] if isinstance(out, torch.Tensor) else None
        return _wrap(out)


def _unwrap(value):
    if type(value) is Wrapped:
        return value.data_
    if type(value) is list or type(value) is tuple:
        return [_unwrap(v) for v in value]
    return value


def _wrap(value):
    if type(value) is torch.Tensor:
        return Wrapped(value)
    if type(value) is list or type(value) is tuple:
        return type(value)(_wrap(v) for v in value)
    return value


def to_wrapped(module: torch.nn.Module) -> torch.nn.Module:
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, torch.nn.Parameter(Wrapped(param.detach()), param.requires_grad))
        for name, buffer in list(sub.named_buffers(recurse=False)):
            sub.register_buffer(name, Wrapped(buffer))
    return module


# -- the steps: each builds its model on one device ("cpu", "wrapped" or "neuron") ----------------
def _mover(device: str):
    return Wrapped if device == "wrapped" else (lambda t: t.to(device))


def _on(module: torch.nn.Module, device: str) -> torch.nn.Module:
    return to_wrapped(module) if device == "wrapped" else module.to(device)


def mlp_step(device: str):
    torch.manual_seed(0)
    model = _on(MLP(), device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = [(torch.randn(64, 32), torch.randint(0, 10, (64,))) for _ in range(8)]
    move = _mover(device)

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        loss = F.cross_entropy(model(move(x)), move(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def gpt_step(device: str):
    torch.manual_seed(0)
    model = _on(TinyGPT(), device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = text_batches(8)
    move = _mover(device)

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        logits = model(move(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), move(y).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


WORKLOADS = {"mlp": mlp_step, "gpt": gpt_step}
CONTENDERS = ("cpu eager", "wrapper subclass (floor)", "tilewise eager", "tilewise adaptive")


def _timed(step, i: int, engine_mode: str | None) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    if engine_mode is None:
        step(i)
    else:
        with tilewise.engine(mode=engine_mode):
            step(i)
    return time.perf_counter() - wall, time.thread_time() - cpu


def measure(workload: str, rounds: int, warmup: int) -> dict[str, tuple[float, float]]:
    """Median (wall ms, thread CPU ms) per step of each contender, steps alternating."""
    build = WORKLOADS[workload]
    runs = {"cpu eager": (build("cpu"), None), "wrapper subclass (floor)": (build("wrapped"), None),
            "tilewise eager": (build("neuron"), "eager"), "tilewise adaptive": (build("neuron"), "adaptive")}
    for i in range(warmup):  # the adaptive region compiles; every contender warms its caches
        for step, mode in runs.values():
            _timed(step, i, mode)
    samples = {name: ([], []) for name in runs}
    for i in range(rounds):
        for name, (step, mode) in runs.items():
            wall, cpu = _timed(step, i, mode)
            samples[name][0].append(wall)
            samples[name][1].append(cpu)
    return {name: (1e3 * statistics.median(w), 1e3 * statistics.median(c)) for name, (w, c) in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, for a smoke test")
    args = parser.parse_args()
    rounds, warmup = (4, tilewise.config.threshold + 2) if args.quick else (200, 40)
    print(f"{rounds} interleaved rounds per workload, medians; x: times CPU eager's figure")
    print(f"{'workload':<9}{'contender':<27}{'wall ms':>9}{'x':>7}{'thread cpu ms':>15}{'x':>7}")
    for workload in WORKLOADS:
        result = measure(workload, rounds, warmup)
        base_wall, base_cpu = result["cpu eager"]
        for name in CONTENDERS:
            wall, cpu = result[name]
            print(f"{workload:<9}{name:<27}{wall:>9.3f}{wall / base_wall:>6.2f}x{cpu:>15.3f}{cpu / base_cpu:>6.2f}x")
    stats = tilewise.stats()
    # the statistics are the process's, tilewise eager's ops included: compiles and hits are adaptive's
    print(f"tilewise adaptive: compiles {stats.compiles}, cache hits {stats.cache_hits}")


if __name__ == "__main__":
    main()
