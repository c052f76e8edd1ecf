"""The one list of OpInfo ops that the conformance tests do not compare on neuron, each with why.

Keys are OpInfo names (`name` or `name.variant`); `name@kind` excludes one sample kind only
(KINDS: float32, grad, bfloat16, float16, int64), `name@engine` one engine mode only (ENGINE_MODES),
`name@engine@kind` one engine mode and kind. A reason starts with its category, the words before
the colon.
"""
from __future__ import annotations

KINDS = ("float32", "grad", "bfloat16", "float16", "int64")
ENGINE_MODES = ("eager", "adaptive", "compiled")

_SPARSE = ("sparse layout: neuron tensors are strided (dense) only; a sparse result or argument "
           "has no HBM buffer to wrap")

EXCLUDED: dict[str, str] = {
    "to_sparse": _SPARSE + " (returns a sparse COO tensor)",
    "sparse.sampled_addmm": _SPARSE + " (takes a sparse CSR tensor)",
    "sparse.mm.reduce": _SPARSE + " (takes a sparse CSR tensor)",
}

# Ops compared with wider float32 tolerances (atol, rtol, reason); bfloat16 and float16 get 100x these.
TOLERANCES: dict[str, tuple] = {
    "nn.functional.scaled_dot_product_attention": (1e-4, 1e-4, (
        "device-dependent algorithm: PyTorch picks the fused flash kernel for CPU tensors and the "
        "math composite for other devices; they differ by ~1.4e-5 in float32")),
    **{name: (1e-4, 1.6e-4, (
        "device-dependent algorithm: with chunking_method='auto' some bfloat16 samples differ from "
        "CPU by 1-2 bf16 ulps (CPU against CPU is bitwise stable)"))
       for name in ("nn.functional.linear_cross_entropy.chunked",
                    "nn.functional.linear_cross_entropy.chunked_none")},
}

# Ops whose results are uninitialised memory: only shape and dtype are comparable.
COMPARE_METADATA_ONLY: dict[str, str] = {
    name: "uninitialised memory: values are whatever the allocator returned"
    for name in ("empty", "empty_like", "empty_permuted", "empty_strided", "new_empty",
                 "new_empty_strided")
}


def category_of(reason: str) -> str:
    return reason.split(":", 1)[0]


# Samples that fail for a known engine bug, reported to the layer that owns it, with a minimal
# repro. They still run and count as failures in the sweep's pass rate; the CI tests mark them
# expected failures (keys as in EXCLUDED: `name`, `name@kind`, `name@engine`, `name@engine@kind`).
_UPLOAD_IN_ENGINE = (
    "engine bug (device/eager): inside any TorchDispatchMode, so in every tilewise.engine() block, "
    "torch.tensor(data, device='neuron') raises 'func != nullptr INTERNAL ASSERT FAILED' "
    "(python_dispatch.cpp:1054) before any tilewise kernel runs: the factory reaches PrivateUse1 "
    "through the boxed fallback; a kernel registered for aten.empty_strided.default and "
    "aten.empty.memory_format (as for arange) makes it work")
_METADATA = (
    "engine bug (adaptive): the output metadata recorded from the meta kernel disagrees with CPU's "
    "kernel, and the region's result is copied into it")
KNOWN_FAILURES: dict[str, str] = {
    **{name: _UPLOAD_IN_ENGINE for name in (
        "__getitem__", "masked.amax", "masked.amin", "masked.argmax", "masked.argmin", "masked.cumprod",
        "masked.cumsum", "masked.log_softmax", "masked.logaddexp", "masked.logsumexp", "masked.mean",
        "masked.median", "masked.norm", "masked.prod", "masked.softmax", "masked.softmin", "masked.std",
        "masked.sum", "masked.var", "signal.windows.blackman", "signal.windows.general_cosine",
        "signal.windows.general_hamming", "signal.windows.hamming", "signal.windows.hann",
        "signal.windows.kaiser", "signal.windows.nuttall", "unravel_index")},
    **{f"{name}@{engine}": _METADATA + (
        ": an eval-mode batch norm after a training one of the same shapes gets save_mean/save_invstd "
        "of shape [C] where CPU returns [0]; in 16 bits the meta kernel says float32 where CPU's "
        "kernel returns the input's dtype")
       for name in ("native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update")
       for engine in ("adaptive", "compiled")},
    **{f"native_layer_norm@{engine}@{kind}": _METADATA + (
        ": for a 16-bit input the meta kernel gives float32 mean/rstd, CPU's kernel the input's dtype")
       for engine in ("adaptive", "compiled") for kind in ("bfloat16", "float16")},
    **{f"empty_strided@{engine}": (
        "engine bug (adaptive): empty_strided with overlapping strides ((5, 5, 5), (2, 0, 1)) in a "
        "region: regions.py copies the result into the recorded output with copy_, which refuses a "
        "destination whose elements share memory") for engine in ("adaptive", "compiled")},
    **{f"nn.functional.fractional_max_pool{d}d@{engine}": (
        "engine bug (adaptive): a guard miss on a plan whose region was compiled before "
        "tilewise.stats().reset() raises AttributeError: 'CompiledEntry' object has no attribute "
        "'misses' (runtime.py _forget falls back to the entry when stats.regions no longer has it); "
        "the sweep resets the statistics per sample and keeps the caches per op")
       for d in (2, 3) for engine in ("adaptive", "compiled")},
    **{f"nn.functional.ctc_loss@{engine}@grad": (
        "open: the first grad sample's gradient differs from CPU in a compiled region (eager agrees); "
        "not reproduced outside the OpInfo sample yet: scripts/opinfo_sweep.py --ops "
        "nn.functional.ctc_loss --kinds grad --limit 1") for engine in ("adaptive", "compiled")},
}
