"""The compiler's entry points: check the arguments, compile through the cache (memory, then disk,
then the passes, here or in the compile process), and arm the region's native tier."""
from __future__ import annotations

import torch

from ..config import config
from ..device.spec import DeviceSpec
from ..errors import CompileError, ConfigError
from .process import background
from .cache import regions as cache
from .driver import CompiledRegion


def compile_graph(gm: torch.fx.GraphModule, example_inputs, spec: DeviceSpec | None = None,
                  name: str = "region", native_after_runs: int | None = None) -> CompiledRegion:
    """The region compiled (or from the cache); with host_backend=native its C is built in the
    background once it has run `native_after_runs` times (None: NATIVE_AFTER_RUNS)."""
    if spec is None:
        from ..device.runtime import DEVICE
        spec = DEVICE.spec
    _check_arguments(gm, example_inputs, spec, name)
    return _armed(cache.compile_cached(gm, list(example_inputs), spec, name), native_after_runs)


def compile_in_background(gm: torch.fx.GraphModule, example_inputs, spec: DeviceSpec, name: str,
                          native_after_runs: int | None = None) -> CompiledRegion | background.Job:
    """The region from the compiler's cache, else the Job compiling it in the compile process
    (`finish` it once done); compiled here, as `compile_graph` does, when the process is unusable
    or the graph cannot go to it."""
    _check_arguments(gm, example_inputs, spec, name)
    key, compiled = cache.lookup(gm, list(example_inputs), spec, name)
    if compiled is None:
        job = background.PROCESS.submit(key, gm, example_inputs, spec, name)
        if job is not None:
            return job
        compiled = cache.compile_cached(gm, list(example_inputs), spec, name)
    return _armed(compiled, native_after_runs)


def finish(job: background.Job, gm: torch.fx.GraphModule, spec: DeviceSpec,
           native_after_runs: int | None = None) -> CompiledRegion:
    """The region a done job compiled, cached as if compiled here; a CompileError if it failed."""
    if job.error is not None:
        raise CompileError(job.error)
    return _armed(cache.adopt(job.key, job.payload, spec, gm, job.name, job.example_inputs), native_after_runs)


def _armed(compiled: CompiledRegion, native_after_runs: int | None) -> CompiledRegion:
    if config.host_backend == "native":
        compiled.arm_native(native_after_runs)
    return compiled


def _check_arguments(gm, example_inputs, spec, name) -> None:
    """Bad arguments are ConfigErrors that say what was expected, before any pass runs (a graph
    whose sizes come from data is refused by the decomposing trace: decompose.py)."""
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
    if not isinstance(spec, DeviceSpec):
        raise ConfigError(f"spec must be a DeviceSpec (tilewise.device.PRESETS: trn2, trn3) or None; got {spec!r}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"name must be a non-empty string; got {name!r}")
