"""`@tk.kernel`: a Python function traced once per input signature (and grid, and device spec) into
a tile IR Kernel, run by the tile interpreter on CPU tensors, costed by timing.py."""
from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass

import torch

from ..compiler.ir.interpreter import poisoned, run_hand_written
from ..compiler.ir.tile_ir import HbmRef, Kernel
from ..device.runtime import DEVICE
from ..host_threads import kernels_serially
from . import timing
from .language import HbmTensor
from .trace import Trace


@dataclass(frozen=True)
class Traced:
    """One signature's kernel: its tile IR, the names of its outputs, its cost report."""
    kernel: Kernel
    outputs: tuple[str, ...]
    single: bool            # the function returned one tensor, not a tuple
    report: timing.Report
    lines: dict             # id(instruction) -> the kernel's source line

    def run(self, tensors: dict) -> tuple[torch.Tensor, ...]:
        """Run on `tensors` (argument name -> CPU tensor); outputs start poisoned (NaN)."""
        hbm = {name: t.detach().contiguous() for name, t in tensors.items()}
        for name in self.outputs:
            ref = self.kernel.outputs[name]
            hbm[name] = poisoned(ref.shape, ref.dtype)
        with kernels_serially():
            run_hand_written(self.kernel, hbm)
        return tuple(hbm[name] for name in self.outputs)


def _signature(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    return ("const", value)


class KernelFunction:
    """A kernel: call it on CPU tensors to run it, `kernel[grid](...)` for an SPMD launch."""

    def __init__(self, fn, grid: tuple = ()):
        self.fn, self.grid, self.name = fn, grid, fn.__name__
        self.params = list(inspect.signature(fn).parameters)
        self._traces: dict = {}
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid) -> "KernelFunction":
        launch = KernelFunction.__new__(KernelFunction)
        launch.__dict__.update(self.__dict__)
        launch.grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        return launch

    def bind(self, args, kwargs) -> dict:
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def trace(self, args: tuple, kwargs: dict | None = None) -> Traced:
        values = self.bind(args, kwargs or {})
        spec = DEVICE.spec
        key = (self.grid, spec, tuple((n, _signature(v)) for n, v in values.items()))
        traced = self._traces.get(key)
        if traced is None:
            traced = self._traces[key] = self._trace(values, spec)
        return traced

    def _trace(self, values: dict, spec) -> Traced:
        trace = Trace(self.name, spec)
        inputs = {n: HbmTensor(n, v.shape, v.dtype) for n, v in values.items() if isinstance(v, torch.Tensor)}
        trace.hbm.update(inputs)
        call = {n: inputs.get(n, v) for n, v in values.items()}
        trace.grid = self.grid
        returned = None
        with trace:
            for program in itertools.product(*(range(g) for g in self.grid)):
                trace.program, trace.hbm_made = program, 0
                returned = self.fn(**call)
            high = trace.high_water()
        single = isinstance(returned, HbmTensor)
        outs = (returned,) if single else tuple(returned or ())
        if not outs or not all(o in trace.outputs for o in outs):
            raise TypeError(f"kernel {self.name} returns the tensors it made with tk.ndarray(..., buffer=tk.hbm)")
        kernel = Kernel(self.name, "hand-written", tuple(o.name for o in outs),
                        inputs={n: _ref(t) for n, t in inputs.items()},
                        outputs={o.name: _ref(o) for o in trace.outputs}, body=tuple(trace.body),
                        sbuf_bytes_per_partition=high["sbuf"])
        return Traced(kernel, tuple(o.name for o in outs), single, timing.report(kernel, spec, high), trace.lines)

    def run(self, *args, **kwargs):
        traced = self.trace(args, kwargs)
        values = self.bind(args, kwargs)
        outs = traced.run({n: v for n, v in values.items() if isinstance(v, torch.Tensor)})
        return (outs[0] if traced.single else outs), traced.report

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)[0]

    def __str__(self) -> str:
        return f"@tk.kernel {self.name}{list(self.grid) if self.grid else ''}"


def _ref(tensor: HbmTensor) -> HbmRef:
    stride = torch.empty(tensor.shape, device="meta").stride()
    return HbmRef(tensor.name, tensor.shape, stride, tensor.dtype, rows_cols=tensor.shape)


def kernel(fn) -> KernelFunction:
    """Make `fn` a tile kernel: its tensor arguments are HBM tensors, its other arguments constants
    of the trace; it returns the HBM tensors it made (tk.ndarray(..., buffer=tk.hbm))."""
    return KernelFunction(fn)


def simulate(kernel_fn: KernelFunction):
    """simulate(kernel)(*cpu_tensors) -> (outputs, Report)."""
    return kernel_fn.run


def benchmark(kernel_fn: KernelFunction):
    """benchmark(kernel)(*cpu_tensors) -> the Report of its simulated run (no values computed)."""
    def measure(*args, **kwargs) -> timing.Report:
        return kernel_fn.trace(args, kwargs).report
    return measure
