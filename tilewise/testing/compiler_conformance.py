"""PyTorch's OpInfo samples through the compiler: each sample's op traced with make_fx, compiled
with `compile_graph`, then its host executable and its tile interpreter held to plain CPU PyTorch.

Shared by tests/compiler/test_compiler_opinfo.py (the ops the compiler lowers, in CI) and
scripts/compiler_opinfo_sweep.py (every op). A sample's outcome is one of:
  PASS        executable and interpreter agree with CPU (values, dtypes, shapes)
  FAIL        they disagree, or compiling raises something else than the cases below
  NOT_RUN     the sample does not run on CPU either
  EAGER_ONLY  the engine never compiles it: a data-dependent op (make_fx cannot trace a read of
              data, an output shape that depends on it), a random op (drawn eagerly, in eager's
              order) or an uninitialised allocation (`empty`: its values are garbage)
  NEEDS_DATA  the smoke run on zeros (`check_decomposition`, which the C tier's build runs first)
              fails for the decomposed graph but not for the recorded ops, so the region keeps
              its recorded graph and builds no C (as where the recorded ops refuse zeros too, a
              Cholesky of a zero matrix, lu_solve's zero pivots)
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from tilewise.compiler import compile_graph
from tilewise.device.spec import TRN2
from tilewise.errors import CompileError

PASS, FAIL, NOT_RUN, EAGER_ONLY, NEEDS_DATA = "pass", "fail", "not_run", "eager_only", "needs_data"
SEED = 1234
UNINITIALISED = ("empty", "new_empty")  # allocations whose values are whatever memory held
TOLERANCE = dict(atol=1e-4, rtol=1e-4, equal_nan=True)  # decompositions reorder float arithmetic


def op_key(op) -> str:
    """`name` or `name.variant`, as in tilewise/testing/conformance.py."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def samples(op, dtype=torch.float32, limit: int | None = None) -> list:
    torch.manual_seed(SEED)
    found = []
    for sample in op.sample_inputs("cpu", dtype, requires_grad=False):
        if limit is not None and len(found) >= limit:
            break
        found.append(sample)
    return found


NATIVE_TIMEOUT = 120  # seconds a sample's C may take to build


def outcome(op, sample, native: bool = False) -> tuple[str, str]:
    """(status, message) of one sample. With `native`, the region's C kernels are built and their
    executable is held to CPU as well (and must really run: a failed build is a FAIL)."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def fn(*tensors):
        values = list(leaves)
        for i, tensor in zip(where, tensors):
            values[i] = tensor
        inp, args, kwargs = pytree.tree_unflatten(values, spec)
        return op.op(inp, *args, **kwargs)

    tensors = [leaves[i] for i in where]
    fresh = lambda: [t.clone() for t in tensors]  # noqa: E731
    try:
        expected = [t for t in pytree.tree_leaves(fn(*fresh())) if isinstance(t, torch.Tensor)]
    except Exception as error:
        return NOT_RUN, f"{type(error).__name__} on CPU"
    if not expected:
        return NOT_RUN, "no tensor result (shapes, numbers)"
    try:
        gm = make_fx(fn)(*fresh())
    except Exception as error:
        return EAGER_ONLY, f"data-dependent ({type(error).__name__})"
    if _eager_only(gm):
        return EAGER_ONLY, "random, data-dependent output shape or uninitialised"
    try:
        compiled = compile_graph(gm, fresh(), spec=TRN2)
    except CompileError as error:
        if "depends on data" in str(error):
            return EAGER_ONLY, str(error).splitlines()[0]
        return FAIL, f"CompileError: {str(error).splitlines()[0]}"
    except Exception as error:
        return FAIL, f"{type(error).__name__}: {str(error).splitlines()[0]}"
    try:
        compiled.check_decomposition()  # what the C tier's build runs first
    except CompileError as error:
        return NEEDS_DATA, str(error).splitlines()[0]
    runs = [("run", compiled.run), ("interpret", compiled.interpret)]
    if native:
        compiled.start_native()
        tier = compiled.wait_native(NATIVE_TIMEOUT)
        if tier.value == "failed":
            return FAIL, f"native: {compiled.native_failure}"
    if compiled.host_tier.value == "native":  # `run` is the C: hold PyTorch's executable to CPU too
        runs.append(("torch", compiled.run_torch))
    try:
        for what, got in ((what, fn(*fresh())) for what, fn in runs):
            if len(got) != len(expected):
                return FAIL, f"{what}: {len(got)} outputs, expected {len(expected)}"
            for g, e in zip(got, expected):
                if g.dtype != e.dtype or g.shape != e.shape:
                    return FAIL, f"{what}: {g.dtype}{tuple(g.shape)}, expected {e.dtype}{tuple(e.shape)}"
                if g.dtype.itemsize == 1 and g.dtype.is_floating_point:  # float8: compare as float32
                    g, e = g.float(), e.float()
                torch.testing.assert_close(g, e, **TOLERANCE)
    except Exception as error:
        return FAIL, f"{type(error).__name__}: {str(error).splitlines()[0]}"
    ran = "; native" if len(runs) == 3 else "; no kernel in C" if native else ""
    return PASS, ",".join(sorted({k.kind for k in compiled.kernels})) + ran


def _eager_only(gm: torch.fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            continue
        tags = target.tags
        if torch.Tag.nondeterministic_seeded in tags or torch.Tag.dynamic_output_shape in tags \
                or target._overloadpacket.__name__.startswith(UNINITIALISED):
            return True
    return False


# -- one function through the compiler, held to eager ------------------------------------------

def _clone(values):
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]


def check(fn, inputs, kernels=None, atol=1e-5, rtol=1e-4):
    """Compile fn's graph; run, interpret and eager must agree on outputs and on mutated inputs."""
    gm = make_fx(fn)(*_clone(inputs))
    compiled = compile_graph(gm, inputs, spec=TRN2)
    eager_in, run_in, tile_in = _clone(inputs), _clone(inputs), _clone(inputs)
    expected = fn(*eager_in)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    got, tiles = compiled.run(*run_in), compiled.interpret(*tile_in)
    _expect(len(got) == len(expected) == len(tiles),
             f"outputs: {len(got)} run, {len(tiles)} interpreted, {len(expected)} eager")
    for e, g, t in zip(expected, got, tiles):
        if e is None:
            _expect(g is None and t is None, "an output eager returns as None is not None compiled")
            continue
        _expect(g.dtype == e.dtype and g.shape == e.shape, f"{g.dtype} {tuple(g.shape)} != eager's {e.dtype} {tuple(e.shape)}")
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol)
        torch.testing.assert_close(t, g, atol=atol, rtol=rtol)
    for e, g, t in zip(eager_in, run_in, tile_in):  # in-place updates applied the same way
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol)
        torch.testing.assert_close(t, e, atol=atol, rtol=rtol)
    compiled.check_tile_limits()
    if kernels is not None:
        _expect(len(compiled.kernels) == kernels, f"{len(compiled.kernels)} kernels, expected {kernels}:\n{compiled}")
    return compiled


def _expect(holds: bool, message: str) -> None:
    """A failed check of the harness (raised under python -O too, unlike an assert statement)."""
    if not holds:
        raise AssertionError(message)
