"""The compiler driver: the passes in order, and the CompiledRegion they produce."""
from __future__ import annotations

import time

import torch

from ..device.spec import DeviceSpec
from .cost import estimate_cost
from .decompose import decompose
from .emit import emit
from .interpreter import interpret
from .lower import lower
from .memory_plan import check_tile_limits, memory_plan
from .partition import partition
from .region import Region

COMPILER_VERSION = "tilewise-compiler-1"

PASSES = (
    ("decompose", None),          # PyTorch decompositions + functionalization (needs example inputs)
    ("partition", partition),     # fusion groups
    ("lower", lower),             # tile IR per group
    ("memory_plan", memory_plan), # SBUF/PSUM fit, tile-limit check
    ("emit", emit),               # host executable
    ("cost", estimate_cost),      # per-kernel simulated cost
)


class CompiledRegion:
    """A compiled region: a fast host executable, its tile kernels, their cost and the pass log."""

    def __init__(self, name: str, gm: torch.fx.GraphModule, kernels, cost, refused, passes_text,
                 compile_seconds: float, spec: DeviceSpec):
        self.name, self.gm, self.spec = name, gm, spec
        self.kernels = list(kernels)
        self.cost = list(cost)
        self.refused = list(refused)
        self.passes_text = list(passes_text)
        self.compile_seconds = compile_seconds
        self._forward = gm.forward

    def run(self, *inputs) -> tuple:
        """Whole-tensor host execution; applies in-place updates of inputs like the source graph."""
        return self._forward(*inputs)

    def interpret(self, *inputs) -> tuple:
        """Reference execution of the tile programs, tile by tile, with poisoned buffers."""
        return interpret(self.gm, self.kernels, inputs)

    def charge(self, timeline, region: str | None = None) -> None:
        """Record one timeline kernel per launched kernel."""
        for name, engine, seconds, hbm_bytes, flops in self.cost:
            timeline.record(name, engine, seconds, hbm_bytes, flops, region=region or self.name)

    def check_tile_limits(self) -> None:
        for kernel in self.kernels:
            check_tile_limits(kernel, self.spec)

    @property
    def hbm_bytes(self) -> int:
        return sum(entry[3] for entry in self.cost)

    @property
    def seconds(self) -> float:
        return sum(entry[2] for entry in self.cost)

    def __str__(self) -> str:
        return "\n\n".join(self.passes_text)

    def __repr__(self) -> str:
        return f"CompiledRegion({self.name!r}, kernels={len(self.kernels)}, refused={len(self.refused)})"


def run_passes(gm: torch.fx.GraphModule, example_inputs, spec: DeviceSpec, name: str) -> tuple[Region, list[str]]:
    region = decompose(gm, example_inputs, name)
    texts = [str(region)]
    for _, pass_fn in PASSES[1:]:
        region = pass_fn(region, spec) if pass_fn in (lower, memory_plan, estimate_cost) else pass_fn(region)
        texts.append(str(region))
    return region, texts


def compile_graph(gm: torch.fx.GraphModule, example_inputs, spec: DeviceSpec | None = None,
                  name: str = "region") -> CompiledRegion:
    from . import cache
    if spec is None:
        from ..device.runtime import DEVICE
        spec = DEVICE.spec
    return cache.compile_cached(gm, list(example_inputs), spec, name)


def compile_uncached(gm: torch.fx.GraphModule, example_inputs, spec: DeviceSpec, name: str) -> CompiledRegion:
    start = time.perf_counter()
    region, texts = run_passes(gm, example_inputs, spec, name)
    return CompiledRegion(name, region.gm, region.kernels, region.cost,
                          [(what, str(reason)) for what, reason in region.refused], texts,
                          time.perf_counter() - start, spec)
