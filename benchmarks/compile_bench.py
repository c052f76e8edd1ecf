"""Median compile time per representative region (target: < 1 s each), three ways: cold (the
in-memory cache cleared before every compile, no disk cache: every pass runs), cold with the disk
cache on (the default: every pass runs, then the entry is written) and loaded from the disk cache
(what a program's second run pays).

    python benchmarks/compile_bench.py
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import tilewise
from tilewise.compiler.cache import regions as cache
from tilewise.compiler import compile_graph

REPEATS = 5


def gelu_norm(x):
    y = 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))
    m = y.mean(-1, keepdim=True)
    return (y - m) / torch.sqrt(((y - m) ** 2).mean(-1, keepdim=True) + 1e-5)


def mlp_fwd_bwd(x, w1, b1, g, b, w2):
    x, *ps = [t.detach().requires_grad_() for t in (x, w1, b1, g, b, w2)]
    h = F.layer_norm(F.gelu(F.linear(x, ps[0], ps[1])), (ps[0].shape[0],), ps[2], ps[3])
    loss = torch.softmax(h @ ps[4], -1).sum()
    return (loss, *torch.autograd.grad(loss, [x, *ps]))


def adamw(*flat):
    n = len(flat) // 4
    p, g, m, v = (list(flat[i * n:(i + 1) * n]) for i in range(4))
    torch._foreach_mul_(m, 0.9); torch._foreach_add_(m, g, alpha=0.1)
    torch._foreach_mul_(v, 0.999); torch._foreach_addcmul_(v, g, g, value=0.001)
    d = torch._foreach_sqrt(v); torch._foreach_add_(d, 1e-8)
    torch._foreach_mul_(p, 1 - 1e-4); torch._foreach_addcdiv_(p, m, d, value=-1e-3)


def regions():
    x = torch.randn(256, 1024)
    yield "gelu+norm 256x1024", gelu_norm, [x]
    yield "softmax+layernorm", lambda x, w, b: (torch.softmax(x, -1), F.layer_norm(x, (1024,), w, b)), \
        [x, torch.randn(1024), torch.randn(1024)]
    yield "linear+bias+gelu", lambda x, w, b: F.gelu(F.linear(x, w, b)), [x, torch.randn(512, 1024), torch.randn(512)]
    yield "mlp fwd+bwd", mlp_fwd_bwd, [torch.randn(64, 32), torch.randn(128, 32), torch.randn(128),
                                       torch.randn(128), torch.randn(128), torch.randn(128, 16)]
    shapes = [(256, 256), (256,), (1024, 256), (256,)] * 4
    yield "adamw 16 params", adamw, [torch.randn(s).abs() for _ in range(4) for s in shapes]


def _median_ms(compile_once) -> float:
    times = []
    for _ in range(REPEATS):
        cache.clear_memory()
        start = time.perf_counter()
        compile_once()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    print(f"{'region':<24}{'ops':>6}{'kernels':>9}{'launches':>10}{'cold':>12}{'cold, kept on disk':>20}"
          f"{'from disk':>12}")
    for name, fn, inputs in regions():
        gm = make_fx(fn)(*[t.clone() for t in inputs])
        with tilewise.config.patch(cache_dir=""):
            compiled = compile_graph(gm, inputs)
            cold = _median_ms(lambda: compile_graph(gm, inputs))
        with tempfile.TemporaryDirectory() as directory, \
                tilewise.config.patch(cache_dir=os.path.join(directory, "cache"),
                                      cache_key_file=os.path.join(directory, "cache.key")):
            def kept():  # every compile cold: an empty cache directory each time
                shutil.rmtree(tilewise.config.cache_dir, ignore_errors=True)
                compile_graph(gm, inputs)
            written = _median_ms(kept)
            loaded = _median_ms(lambda: compile_graph(gm, inputs))  # what the last compile kept
        ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        print(f"{name:<24}{ops:>6}{len(compiled.kernels):>9}{len(compiled.launches):>10}"
              f"{cold:>9.1f} ms{written:>17.1f} ms{loaded:>9.1f} ms")


if __name__ == "__main__":
    main()
