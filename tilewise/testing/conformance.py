"""Conformance against PyTorch's OpInfo database: run each sample on CPU and on neuron, compare.

Shared by tests/eager/test_opinfo.py (a deterministic subset, in CI) and scripts/opinfo_sweep.py (every
op, every sample). Two axes: the sample's kind (float32, grad, bfloat16, float16, int64: the dtype
of its tensors, and gradients or not) and the engine mode the neuron side runs in (eager,
adaptive, compiled). In the lazy modes adaptive's threshold is 1, so the sample's ops are
recorded, compiled as a region where the compiler can, and run from the compiled region at the
first read of a result; the caches are reset before each sample (`fresh`), or by the caller (the
sweep resets them per op, so an op's samples meet each other's cached plans and metadata, as a
program's steps do). A sample's outcome is one of:
  PASS      neuron agrees with CPU (values, dtype, shape; gradients in grad mode): bitwise in
            eager mode, which runs CPU's kernels on the same values (but where NOT_BITWISE says
            why not), within the dtype's tolerance in the lazy modes, whose regions may run C
  FAIL      neuron disagrees or raises where CPU does not
  EXCLUDED  the op is listed in tilewise/testing/opinfo_exclusions.py (the reason says why)
  NOT_RUN   the sample does not run on CPU either, or has nothing to differentiate: not counted
"""
from __future__ import annotations

import itertools
import threading
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

import tilewise

from .opinfo_exclusions import (COMPARE_METADATA_ONLY, ENGINE_MODES, EXCLUDED, KINDS, KNOWN_FAILURES, NOT_BITWISE,
                                TOLERANCES, category_of)

from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

PASS, FAIL, EXCLUDED_, NOT_RUN = "pass", "fail", "excluded", "not_run"
KIND_DTYPES = {"float32": torch.float32, "grad": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16, "int64": torch.int64}
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)
NEURON = torch.device("neuron")
SEED = 1234


def op_key(op) -> str:
    """The op's name in reports and in the exclusion list: `name` or `name.variant`."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


OPS = {op_key(op): op for op in op_db}


def applies(op, kind: str) -> bool:
    """Whether the kind is meaningful for the op on CPU (its dtype is supported, it has autograd)."""
    if KIND_DTYPES[kind] not in op.supported_dtypes("cpu"):
        return False
    return op.supports_autograd if kind == "grad" else True


def exclusion(key: str, kind: str, engine: str = "eager", table: dict = EXCLUDED) -> str | None:
    """The reason the op is excluded (or, table=KNOWN_FAILURES, known to fail) for this kind in
    this engine mode, or None."""
    for name in (f"{key}@{engine}@{kind}", f"{key}@{kind}", f"{key}@{engine}", key):
        if name in table:
            return table[name]
    return None


def known_failure(key: str, kind: str, engine: str) -> str | None:
    return exclusion(key, kind, engine, KNOWN_FAILURES)


# atol and rtol of a bitwise comparison
BITWISE = (0.0, 0.0)


def tolerance_of(key: str, kind: str, engine: str) -> tuple | None:
    """(atol, rtol) a sample's values are compared with: none in eager mode, which runs CPU's own
    kernels (NOT_BITWISE lists where it cannot), the op's TOLERANCES entry or the dtype's default
    (None) in the lazy modes."""
    if engine == "eager" and exclusion(key, kind, engine, NOT_BITWISE) is None:
        return BITWISE
    return TOLERANCES.get(key)


def samples(op, kind: str, limit: int | None = None) -> list:
    """The op's samples of a kind, generated under a fixed seed so every run sees the same ones.

    Generated on a fresh thread: PyTorch's sample tracker walks the caller's stack with
    inspect.stack() on every call, which under pytest collection costs ~60 ms a call; a new
    thread's stack is two frames deep."""
    result: list = []

    def generate():
        try:
            torch.manual_seed(SEED)
            generated = op.sample_inputs("cpu", KIND_DTYPES[kind], requires_grad=(kind == "grad"))
            result.append(list(itertools.islice(generated, limit)))
        except BaseException as error:  # noqa: BLE001  (re-raised on the caller's thread)
            result.append(error)

    worker = threading.Thread(target=generate)
    worker.start()
    worker.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


class Outcome(NamedTuple):
    status: str
    message: str = ""
    ops_compiled: int = 0        # ops that ran in a compiled region (lazy modes; compiled or cached)
    compile_failure: str = ""    # the first "compile failed" fallback reason, if any


# ------------------------------------------------------------------------------------------------
# Moving a sample to the device

# Arguments PyTorch requires on the host whatever the device (as on CUDA): they stay on CPU.
HOST_ARGUMENTS = {"tensor_split": "split points (tensor_indices_or_sections) must be a CPU tensor"}


def to_neuron(sample, key: str = ""):
    """A copy of the sample's (input, args, kwargs) on neuron, keeping strides, storage offsets,
    aliasing between arguments and requires_grad. Tensors that are views of a larger storage
    become views of one device copy of that storage, so an op sees the layout the CPU op saw."""
    bases: dict = {}
    if key in HOST_ARGUMENTS:
        return _move_tensor(sample.input, bases), tuple(sample.args), dict(sample.kwargs)

    def move(value):
        if isinstance(value, torch.Tensor):
            return _move_tensor(value, bases)
        if (isinstance(value, torch.device) and value.type == "cpu") or value == "cpu":
            return NEURON  # the sample's device is the device under test
        return value

    kwargs = {key: NEURON if key == "device" and value is not None else tree_map(move, value)
              for key, value in sample.kwargs.items()}
    return tree_map(move, sample.input), tree_map(move, tuple(sample.args)), kwargs


def _move_tensor(t: torch.Tensor, bases: dict) -> torch.Tensor:
    if t.device.type != "cpu" or t.is_sparse or t.layout != torch.strided:
        return t
    storage = t.untyped_storage()
    whole = t.storage_offset() == 0 and t.is_contiguous() and storage.nbytes() == t.numel() * t.element_size()
    if whole and storage.data_ptr() not in bases:
        moved = t.detach().to(NEURON)
    else:
        base = bases.get(storage.data_ptr())
        if base is None:
            flat = torch.empty(0, dtype=t.dtype).set_(storage)
            base = bases[storage.data_ptr()] = flat.detach().to(NEURON)
        moved = base.as_strided(t.size(), t.stride(), t.storage_offset()).detach()
    return moved.requires_grad_(t.requires_grad)


# ------------------------------------------------------------------------------------------------
# Comparing

def _compare(actual, expected, what: str, metadata_only: bool, on_device: bool = True,
             tolerance: tuple | None = None) -> None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{what}: expected a tensor, got {type(actual).__name__}")
        if on_device and what.startswith("output") and actual.device.type != "neuron":
            raise AssertionError(f"{what}: result is on {actual.device}, expected neuron")
        actual = actual.detach().cpu()
        expected = expected.detach()
        if metadata_only:
            if (actual.shape, actual.dtype) != (expected.shape, expected.dtype):
                raise AssertionError(f"{what}: got {actual.dtype}{list(actual.shape)}, expected "
                                     f"{expected.dtype}{list(expected.shape)}")
            return
        floats = (torch.float32, *_SIXTEEN_BIT)
        if tolerance == BITWISE:
            atol, rtol = BITWISE
        else:
            atol, rtol = tolerance[:2] if tolerance and expected.dtype in floats else (None, None)
            if tolerance and expected.dtype in _SIXTEEN_BIT:
                atol, rtol = atol * 100, rtol * 100
        torch.testing.assert_close(actual, expected, equal_nan=True, atol=atol, rtol=rtol,
                                   msg=lambda m: f"{what}: {m}")
    elif isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise AssertionError(f"{what}: expected a sequence of {len(expected)}, got {actual!r:.80}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            _compare(a, e, f"{what}[{i}]", metadata_only, on_device, tolerance)
    elif isinstance(expected, float) and expected != expected:
        if not (isinstance(actual, float) and actual != actual):
            raise AssertionError(f"{what}: expected nan, got {actual!r}")
    elif actual != expected:
        raise AssertionError(f"{what}: expected {expected!r:.80}, got {actual!r:.80}")


def _run(func, args, kwargs):
    torch.manual_seed(SEED)  # random ops draw from the CPU default generator on both devices
    return func(*args, **kwargs)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


# ------------------------------------------------------------------------------------------------
# Running one sample

def _expected_forward(op, sample):
    return _run(op, (sample.input, *sample.args), sample.kwargs)


def _check_forward(op, sample, moved, expected, tolerance: tuple | None) -> None:
    """Run the sample's copy on neuron, `moved`, and compare with CPU's `expected`; raises on a
    difference."""
    metadata_only = op_key(op) in COMPARE_METADATA_ONLY
    device_input, device_args, device_kwargs = moved
    actual = _run(op, (device_input, *device_args), device_kwargs)
    # A factory given neither a tensor nor a device (torch.arange(3)) rightly returns a CPU tensor.
    on_device = isinstance(sample.input, torch.Tensor) or "device" in sample.kwargs
    _compare(actual, expected, "output", metadata_only, on_device, tolerance)
    # In-place ops and out= write their arguments: the writes must land on the device too.
    if not metadata_only:
        _compare(_tensors([device_input, *device_args]), _tensors([sample.input, *sample.args]),
                 "inputs after", False, tolerance=BITWISE if tolerance == BITWISE else None)


def _tensors(values) -> list:
    return [v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)]


def _differentiable(outputs) -> list:
    return [o for o in tree_flatten(outputs)[0]
            if isinstance(o, torch.Tensor) and o.requires_grad and o.dtype.is_floating_point]


def _grads(op, sample_input, args, kwargs, process, cotangent_device):
    out = _run(op.gradcheck_wrapper, (op.get_op(), sample_input, *args), kwargs)
    outputs = _differentiable(process(out))
    inputs = [t for t in tree_flatten((sample_input, args, kwargs))[0]
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outputs or not inputs:
        return None
    generator = torch.Generator().manual_seed(SEED)
    cotangents = [torch.randn(o.shape, dtype=o.dtype, generator=generator).to(cotangent_device)
                  for o in outputs]
    return torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)


def _expected_grads(op, sample):
    grads = _grads(op, sample.input, sample.args, sample.kwargs, sample.output_process_fn_grad, "cpu")
    # A zero gradient (sgn's, say) is a ZeroTensor, which an op inside any TorchDispatchMode
    # (the comparison runs inside the engine block) crashes the process with (PyTorch 2.13).
    return grads if grads is None else tuple(
        torch.zeros(g.shape, dtype=g.dtype) if isinstance(g, torch.Tensor) and g._is_zerotensor() else g
        for g in grads)


def _check_grads(op, sample, moved, expected, tolerance: tuple | None) -> None:
    device_input, device_args, device_kwargs = moved
    actual = _grads(op, device_input, device_args, device_kwargs, sample.output_process_fn_grad, NEURON)
    if actual is None:
        raise AssertionError("no differentiable outputs on neuron")
    _compare(list(actual), list(expected), "grad", False, tolerance=tolerance)


def _on_engine(engine: str, fresh: bool, check, *args) -> Outcome:
    """Run `check(*args)` inside an engine block of the given mode, from empty caches if `fresh`,
    and say how many ops ran in compiled regions. The comparison reads the results back inside the block: that
    read is the flush that compiles and runs the recorded ops."""
    if fresh:
        tilewise.reset_caches()
    stats = tilewise.stats()
    stats.reset()
    try:
        with tilewise.engine(mode=engine, threshold=1):
            check(*args)
        status, message = PASS, ""
    except Exception as error:  # noqa: BLE001
        status, message = FAIL, _first_line(error)
    failures = [reason for (_, reason), _ in stats.fallbacks.most_common() if reason.startswith("compile failed")]
    return Outcome(status, message, stats.ops_compiled, failures[0] if failures else "")


def run_sample(op, sample, kind: str, engine: str = "eager", fresh: bool = True) -> Outcome:
    """Run one sample of a kind in one engine mode. The CPU side runs first: a sample that fails on
    CPU is not run; excluded ops still run on CPU, to know whether they count. The sample is copied
    to neuron before: an in-place op changes the CPU sample."""
    grad = kind == "grad"
    moved = to_neuron(sample, op_key(op))
    try:
        expected = _expected_grads(op, sample) if grad else _expected_forward(op, sample)
    except Exception as error:  # noqa: BLE001
        return Outcome(NOT_RUN, f"fails on CPU: {_first_line(error)}")
    if grad and expected is None:
        return Outcome(NOT_RUN, "nothing to differentiate")
    reason = exclusion(op_key(op), kind, engine)
    if reason is not None:
        return Outcome(EXCLUDED_, reason)
    return _on_engine(engine, fresh, _check_grads if grad else _check_forward, op, sample, moved, expected,
                      tolerance_of(op_key(op), kind, engine))


__all__ = ["ENGINE_MODES", "EXCLUDED", "FAIL", "KINDS", "NOT_RUN", "known_failure", "OPS", "Outcome", "PASS", "applies",
           "category_of", "exclusion", "op_key", "run_sample", "samples"]


def assert_compiled_if_lazy(mode: str) -> None:
    stats = tilewise.stats()
    compiled = stats.compiles >= 1 and stats.ops_compiled > 0
    if mode == "eager" and (stats.compiles or stats.ops_compiled) or mode != "eager" and not compiled:
        raise AssertionError(f"{mode} mode: {stats.compiles} compiles, {stats.ops_compiled} ops compiled\n{stats.report()}")
