"""tilewise.kernels (`import tilewise.kernels as tk`): tile kernels written by hand, NKI-style, on the
simulated NeuronCore.

A `@tk.kernel` function is traced once per input signature into the compiler's tile IR (loops
unrolled), checked against the tile rules (an error names the rule and the kernel's line), run by
the tile interpreter (uninitialised SBUF/PSUM reads as NaN) and costed per engine. `tk.custom_op`
registers a kernel as a torch.library custom op that runs on `neuron` tensors in every mode.
"""
from .compute import (abs, add, affine_range, copy, divide, exp, full, gelu, log, matmul, max, maximum, min,
                      minimum, multiply, ndarray, negative, num_programs, power, program_id, reciprocal, relu,
                      rsqrt, sequential_range, sigmoid, silu, sqrt, square, static_range, subtract, sum, tanh,
                      tile_size, transpose, zeros)
from . import isa
from .kernel import KernelFunction, benchmark, kernel, simulate
from .op import custom_op
from .language import arange, hbm, load, mgrid, psum, sbuf, store
from .rules import KernelRuleError
from .timing import Report

__all__ = [
    "abs", "add", "affine_range", "arange", "benchmark", "copy", "custom_op", "divide", "exp", "full", "gelu", "hbm", "isa",
    "kernel", "KernelFunction", "KernelRuleError", "load", "log", "matmul", "max", "maximum", "mgrid", "min",
    "minimum", "multiply", "ndarray", "negative", "num_programs", "power", "program_id", "psum", "reciprocal",
    "relu", "Report", "rsqrt", "sbuf", "sequential_range", "sigmoid", "silu", "simulate", "sqrt", "square",
    "static_range", "store", "subtract", "sum", "tanh", "tile_size", "transpose", "zeros",
]
