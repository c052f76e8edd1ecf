"""Every replacement tilewise makes of a torch internal, as one manifest.

The `neuron` device needs PyTorch to answer some questions otherwise than its own Python does (where
a backward runs, how a module moves its parameters, which optimizer kernels a device takes, ...).
Each such place is a `Patch` below: its target, why, and `checked`, the fingerprint of the torch
original it was written against (`fingerprint`: a hash of its source, or what a C function or an
absent name is). The module that needs a patch installs it with `replace(target, make)`, which
refuses a target missing here and replaces each one once per process. tests/test_patches.py
fingerprints every target on the installed torch and fails, naming the target and its reason,
where torch changed underneath one: re-read the new original, re-check the patch, then update
`checked` and `CHECKED_ON`.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

from .errors import TilewiseError

CHECKED_ON = ("2.13.0",)  # the torch releases every `checked` fingerprint was taken on
ABSENT = "absent"  # the fingerprint of a name torch does not define (tilewise adds it)


class PatchError(TilewiseError):
    """A replacement that is not in the manifest, or whose target torch does not lay out as
    checked."""


@dataclass(frozen=True)
class Patch:
    target: str        # "module:attribute.path", or "module:TABLE[aten.op.overload]" for a table entry
    why: str
    checked: str       # fingerprint(original) on CHECKED_ON
    also: tuple = ()   # other names bound to the same original, which take the same replacement


_ACCELERATOR = ("the torch.accelerator API answers for neuron when it is the current accelerator "
                "(PyTorch's C entries know only the accelerators built into it)")
_DATA_PARALLEL = "nn.DataParallel's scatter/gather across NeuronCores (torch._C has them only in CUDA builds)"
_NESTED = "a nested tensor cannot live on neuron: its constructors raise DeviceError instead of crashing"
_FOREACH = ("for neuron parameters the optimizer picks what it picks for CPU's (the per-parameter loop), "
            "so the update rounds as on CPU")

MANIFEST = (
    Patch("torch.autograd.graph:_engine_run_backward",
          "backward runs on the calling thread: PyTorch's engine keeps one ready queue per device "
          "index for a PrivateUse1 device and asserts on a second NeuronCore", "1b7afb8f026f",
          also=("torch.autograd:_engine_run_backward",)),
    Patch("torch.nn.modules.module:Module._apply",
          "Module.to/.half keeps each Parameter object when it moves to or within neuron (tied "
          "weights stay one Parameter), as for CUDA", "e50d01ca9c5c"),
    Patch("torch.nn.modules.module:is_traceable_wrapper_subclass",
          "Module._apply swaps whole tensors for traceable wrapper subclasses (ours is one): a swap "
          "refuses a parameter that a live output references", "1d97b30149f2"),
    Patch("torch:Generator", "torch.Generator(device='neuron') makes the device's generator", "35484cbe0499"),
    Patch("torch._utils:_rebuild_tensor",
          "torch.load puts a tensor saved from neuron back on neuron (map_location aside)", "f5acf47aa0dc"),
    Patch("torch:UntypedStorage.__new__",
          "torch.UntypedStorage(device='neuron') raises DeviceError (the device keeps tensors, not storages)",
          "04ae0ff087b6"),
    *(Patch(f"torch._C:{name}", _ACCELERATOR, checked) for name, checked in (
        ("_accelerator_synchronizeDevice", "265bd33b0cdf"),
        ("_accelerator_getDeviceCapability", "d7963ded1b43"),
        ("_accelerator_isAllocatorInitialized", "6e27769f05cc"),
        ("_accelerator_emptyCache", "29267ceab655"),
        ("_accelerator_emptyHostCache", "547b1e4f4512"),
        ("_accelerator_getDeviceStats", "cf93196f1f09"),
        ("_accelerator_resetAccumulatedStats", "edc078c5f4b5"),
        ("_accelerator_resetPeakStats", "44aa645ac051"),
        ("_accelerator_getMemoryInfo", "24c159c0e244"),
    )),
    *(Patch(f"torch._C:{name}", _DATA_PARALLEL, ABSENT) for name in (
        "_broadcast", "_broadcast_out", "_broadcast_coalesced", "_scatter", "_scatter_out", "_gather", "_gather_out")),
    *(Patch(f"torch.nested:{name}", _NESTED, checked) for name, checked in (
        ("nested_tensor", "89ac20df5b84"),
        ("as_nested_tensor", "dc90d1122a5c"),
        ("nested_tensor_from_jagged", "d85c0b443724"),
        ("narrow", "3afb6c2d6cf6"),
    )),
    Patch("torch.nested._internal.ops:JAGGED_OPS_TABLE[aten._to_copy.default]",
          "moving a jagged nested tensor to neuron raises DeviceError", "0e1f8dd77dcf"),
    Patch("torch:_nested_tensor_from_mask", _NESTED, "130fbee1e807"),
    Patch("torch.nn:TransformerEncoder.forward",
          "nn.TransformerEncoder's fast path packs a nested tensor: with a padding mask on neuron it "
          "runs on the host buffers and wraps the result", "638beba2868f"),
    Patch("torch.nn.modules.linear_cross_entropy_options:LinearCrossEntropyOptions._adjust",
          "F.linear_cross_entropy chooses its kernel for neuron inputs as for CPU's", "760bccb6599a"),
    *(Patch(f"torch.optim.{module}:_default_to_fused_or_foreach", _FOREACH, "2867120ebdb0") for module in (
        "adadelta", "adagrad", "adam", "adamax", "asgd", "nadam", "radam", "rmsprop", "rprop", "sgd")),
    Patch("torch.optim.swa_utils:_get_foreach_kernels_supported_devices", _FOREACH, "6282c34a599c"),
    Patch("torch._decomp.decompositions:_upsample_linear_vec",
          "F.interpolate under deterministic algorithms runs CPU's kernel for a neuron input, as on CPU", "ed547db51adc"),
    Patch("torch._dynamo.eval_frame:_callback_from_stance",
          "a torch.compile'd function called inside tilewise.engine() runs through the engine", "da2006022db8"),
    Patch("torch.distributed.tensor._random:is_rng_supported_mesh",
          "DTensor's random ops on a neuron mesh draw as on a CPU mesh (no Philox tracker)", "8a934c6b38df",
          also=("torch.distributed.tensor._dispatch:is_rng_supported_mesh",)),
    Patch("torch.distributed.fsdp._fully_shard._fsdp_param:alloc_storage",
          "FSDP2 allocates and frees a neuron tensor's host buffer", "918a53bd448f",
          also=("torch.distributed.fsdp._fully_shard._fsdp_param_group:alloc_storage",)),
    Patch("torch.distributed.fsdp._fully_shard._fsdp_param:free_storage",
          "FSDP2 allocates and frees a neuron tensor's host buffer", "535dcc371456"),
)

_BY_TARGET = {patch.target: patch for patch in MANIFEST}
_ORIGINALS: dict[str, object] = {}


def _owner_and_key(target: str):
    """The object holding the target and its name (an attribute), or its key (a table entry)."""
    module_name, _, path = target.partition(":")
    owner = importlib.import_module(module_name)
    path, _, item = path.partition("[")
    *parents, last = path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    if not item:
        return owner, last, False
    key = importlib.import_module("torch").ops
    for name in item.rstrip("]").split("."):
        key = getattr(key, name)
    return getattr(owner, last), key, True


def current(target: str):
    """What the target is bound to now (ABSENT where torch does not define it)."""
    owner, key, is_item = _owner_and_key(target)
    if is_item:
        return owner.get(key, ABSENT)
    return owner.__dict__[key] if isinstance(owner, type) and key in owner.__dict__ else getattr(owner, key, ABSENT)


def fingerprint(value) -> str:
    """Twelve hex digits of a hash of a Python function's or class's source; for what has no Python
    source (a C function, a builtin method) its type and qualified name; ABSENT for ABSENT."""
    if value is ABSENT:
        return ABSENT
    value = getattr(value, "__func__", value)
    try:
        text = inspect.getsource(value)
    except (OSError, TypeError):
        text = f"{type(value).__name__} {getattr(value, '__qualname__', repr(value))}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def original(target: str):
    """Torch's own object at a replaced target."""
    return _ORIGINALS[target]


def installed() -> set:
    return set(_ORIGINALS)


def replace(target: str, make: Callable) -> None:
    """Bind `target` (and the names in its `also`) to `make(original)`; once per process: later
    calls leave the first replacement in place."""
    patch = _BY_TARGET.get(target)
    if patch is None:
        raise PatchError(f"{target} is not in tilewise/patches.py's MANIFEST: every replacement of a torch "
                         "internal is listed there, with why and the torch it was checked on")
    if target in _ORIGINALS:
        return
    was = current(target)
    for alias in patch.also:
        if current(alias) is not was:
            raise PatchError(f"{alias} is no longer {target} on torch {importlib.import_module('torch').__version__}; "
                             f"re-check the patch ({patch.why})")
    replacement = make(was)
    for name in (target, *patch.also):
        owner, key, is_item = _owner_and_key(name)
        if is_item:
            owner[key] = replacement
        else:
            setattr(owner, key, replacement)
    _ORIGINALS[target] = was
