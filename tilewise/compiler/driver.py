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
from .memory_plan import check_launch_limits, memory_plan
from .partition import partition
from .region import Region
from .schedule import schedule

COMPILER_VERSION = "tilewise-compiler-2"

PASSES = (
    ("decompose", None),          # PyTorch decompositions + functionalization (needs example inputs)
    ("partition", partition),     # fusion groups
    ("lower", lower),             # tile IR per group
    ("memory_plan", memory_plan), # SBUF/PSUM fit, tile-limit check
    ("schedule", schedule),       # kernels into launches, values kept in SBUF between kernels
    ("emit", emit),               # host executable
    ("cost", estimate_cost),      # per-launch simulated cost
)
_NEED_SPEC = (lower, memory_plan, schedule, estimate_cost)


class CompiledRegion:
    """A compiled region: a fast host executable, its tile kernels grouped into launches, their
    cost (one entry per launch) and the pass log."""

    def __init__(self, name: str, gm: torch.fx.GraphModule, launches, cost, refused, passes_text,
                 compile_seconds: float, spec: DeviceSpec):
        self.name, self.gm, self.spec = name, gm, spec
        self.launches = list(launches)
        self.kernels = [kernel for launch in self.launches for kernel in launch.kernels]
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
        return interpret(self.gm, self.launches, inputs)

    def charge(self, timeline, region: str | None = None) -> None:
        """Record one timeline kernel per launch."""
        for launch in self.cost:
            timeline.record(*launch, region=region or self.name)

    def check_tile_limits(self) -> None:
        for launch in self.launches:
            check_launch_limits(launch, self.spec)

    @property
    def hbm_bytes(self) -> int:
        return sum(launch.hbm_bytes for launch in self.cost)

    @property
    def seconds(self) -> float:
        return sum(launch.seconds for launch in self.cost)

    def __str__(self) -> str:
        return "\n\n".join(self.passes_text)

    def __repr__(self) -> str:
        return (f"CompiledRegion({self.name!r}, kernels={len(self.kernels)}, launches={len(self.launches)}, "
                f"refused={len(self.refused)})")


def run_passes(gm: torch.fx.GraphModule, example_inputs, spec: DeviceSpec, name: str) -> tuple[Region, list[str]]:
    region = decompose(gm, example_inputs, name)
    texts = [str(region)]
    for _, pass_fn in PASSES[1:]:
        region = pass_fn(region, spec) if pass_fn in _NEED_SPEC else pass_fn(region)
        texts.append(str(region))
    return region, texts


def compile_graph(gm: torch.fx.GraphModule, example_inputs, spec: DeviceSpec | None = None,
                  name: str = "region") -> CompiledRegion:
    from . import cache
    if spec is None:
        from ..device.runtime import DEVICE
        spec = DEVICE.spec
    _check_arguments(gm, example_inputs, spec, name)
    return cache.compile_cached(gm, list(example_inputs), spec, name)


def _check_arguments(gm, example_inputs, spec, name) -> None:
    """Bad arguments are ConfigErrors that say what was expected, before any pass runs; a graph
    no tile program can express is a CompileError."""
    from ..errors import CompileError, ConfigError
    if not isinstance(gm, torch.fx.GraphModule):
        raise ConfigError(f"compile_graph expects a torch.fx.GraphModule (e.g. from make_fx); got {type(gm).__name__}")
    if not isinstance(example_inputs, (list, tuple)):
        raise ConfigError(f"compile_graph expects example_inputs as a list or tuple; got {type(example_inputs).__name__}")
    bad = [type(v).__name__ for v in example_inputs if not isinstance(v, (torch.Tensor, int, float, bool, torch.SymInt))]
    if bad:
        raise ConfigError(f"example_inputs must be tensors or numbers; got {', '.join(bad)}")
    placeholders = sum(1 for node in gm.graph.nodes if node.op == "placeholder")
    if placeholders != len(example_inputs):
        raise ConfigError(f"the graph takes {placeholders} inputs; got {len(example_inputs)} example inputs")
    dynamic = sorted({str(n.target) for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
                      and torch.Tag.dynamic_output_shape in n.target.tags})
    if dynamic:
        raise CompileError(f"the graph has ops whose output shape depends on data ({', '.join(dynamic)}): "
                           "tile programs need static shapes; run them eagerly")
    if not isinstance(spec, DeviceSpec):
        raise ConfigError(f"spec must be a DeviceSpec (tilewise.device.PRESETS: trn2, trn3) or None; got {spec!r}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"name must be a non-empty string; got {name!r}")


def compile_uncached(gm: torch.fx.GraphModule, example_inputs, spec: DeviceSpec, name: str) -> CompiledRegion:
    start = time.perf_counter()
    region, texts = run_passes(gm, example_inputs, spec, name)
    compiled = CompiledRegion(name, region.gm, region.launches, region.cost,
                              [(what, str(reason)) for what, reason in region.refused], texts,
                              time.perf_counter() - start, spec)
    _smoke_run(compiled, example_inputs)
    return compiled


def _smoke_run(compiled: CompiledRegion, example_inputs) -> None:
    """Run the executable once on copies of the example inputs: a decomposition that cannot run
    for these shapes and dtypes (PyTorch's log_softmax of an empty int64 tensor makes a
    full(-inf, dtype=int64)) is a compile failure, which callers handle, not a failure later at a
    cache hit. Skipped for fake, meta and symbolic inputs (tracing-time compiles)."""
    from ..errors import CompileError
    if not all(type(t) is torch.Tensor and t.device.type == "cpu" if isinstance(t, torch.Tensor)
               else isinstance(t, (int, float, bool)) for t in example_inputs):
        return
    try:
        compiled.run(*[_zeros_like_layout(t) if isinstance(t, torch.Tensor) else t for t in example_inputs])
    except Exception as error:
        raise CompileError(f"the compiled region fails on its example inputs: {type(error).__name__}: "
                           f"{error}") from error


def _zeros_like_layout(t: torch.Tensor) -> torch.Tensor:
    """Zeros with the input's size, strides and storage offset. Zeros, not a copy: the inputs of a
    region compiled before it runs may not be computed yet, and zero is a valid index anywhere."""
    base = torch.zeros(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype)
    return base.as_strided(t.size(), t.stride(), t.storage_offset())
