"""Registers the `neuron` device with PyTorch (PrivateUse1, pure Python)."""
from __future__ import annotations

import functools
import os
import sys
import threading

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from .. import patches
from . import backward_errors, neuron_module

_PACKAGE = __name__.split(".")[0] + "."  # "tilewise.": the engine's modes are defined under it


def register() -> None:
    """Idempotent; must run before anything names torch.device("neuron")."""
    if getattr(torch, "neuron", None) is neuron_module:
        return
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", "neuron"):
        raise RuntimeError(f"PrivateUse1 is already registered as {current!r}; tilewise needs it for 'neuron'")
    _start_autograd_without_device_threads()
    _setup_privateuseone_for_python_backend("neuron" if current != "neuron" else None,
                                            backend_module=neuron_module)
    sys.modules["torch.neuron"] = neuron_module


def _start_autograd_without_device_threads() -> None:
    """The autograd engine starts its device threads once, at a process's first backward, one per
    device index the registered device guards report, and from then on marks every fork of the
    process as unable to run backward. The guard registered below reports one neuron device
    whether or not a neuron tensor exists, so a CPU-only program's forked children could not run
    backward once tilewise was imported. A backward before the guard exists lets the engine count
    only the devices PyTorch itself has; neuron's backward needs no device thread (it runs on the
    calling thread: backward_on_calling_thread)."""
    with torch.inference_mode(False), torch.enable_grad():
        leaf = torch.zeros((), requires_grad=True)
        torch.autograd.grad(leaf * 2.0, leaf)


def backward_on_calling_thread() -> None:
    """Backward through neuron tensors runs on the thread that calls it, as it does for CPU tensors.

    The autograd engine gives each accelerator index a worker thread, so that a real device's
    backward can overlap the host's work; a simulated device has nothing to overlap, and handing
    each backward to that thread and back cost ~12% of an MLP training step (measured alternating
    steps in one process). It is also required beyond neuron:0: the engine has as many device
    threads as the device guard reports devices, and the guard that
    _setup_privateuseone_for_python_backend registers (C++ PythonDeviceGuard,
    torch/csrc/acc/Module.cpp) reports one, fixed in C++; a backward op on neuron:1 would fail the
    engine's INTERNAL ASSERT (device_ready_queues_ index). With multithreading disabled the engine
    runs every backward op on the calling thread's queue: the same ops, in an order the graph
    allows, so the same gradients. PyTorch's own torch.compiler patches the same two names.
    An error an op raises inside it reaches the caller as itself (backward_errors.py).
    """
    def run_on_calling_thread(original):
        @functools.wraps(original)
        def run_backward(*args, **kwargs):
            with torch.autograd.set_multithreading_enabled(False):
                return backward_errors.run_backward(original, *args, **kwargs)

        return run_backward

    patches.replace("torch.autograd.graph:_engine_run_backward", run_on_calling_thread)


def use_foreach_optimizers(tensor_type: type) -> None:
    """torch.optim picks its foreach (multi-tensor) update only for plain tensors on foreach
    devices; our device tensor is a subclass, so without this a user moving from CUDA would get
    the slower for-loop update (bitwise the same results on CPU, but one op per parameter)."""
    from torch.optim import optimizer

    supported = optimizer._foreach_supported_types
    if tensor_type not in supported:
        supported.append(tensor_type)


def convert_modules_in_place(tensor_type: type) -> None:
    """Module.to/.half/.cpu of a model with neuron parameters keeps each Parameter object, as for
    CUDA, so tied weights (GPT-2's lm_head and embedding) stay one Parameter.

    nn.Module._apply swaps whole tensor objects (torch.utils.swap_tensors) whenever the converted
    tensor is a traceable wrapper subclass, which ours is so that torch.compile can see through it.
    A swap keeps the Parameter object but refuses one that anything else references (a live
    output's autograd graph), so `out = model(x); model.half()` failed. Where the parameter is a
    neuron tensor already, `param.data = new` keeps the object without that limit, as CUDA's
    conversions do. Between host and device the two tensor types are not shallow-copy compatible,
    so a parameter moving there is swapped where swap_tensors will take it, and otherwise (a live
    graph holds it) replaced by a new Parameter, as _apply does for other incompatible types.
    _apply asks its module's global about `param_applied` only: the parameter it converts is the
    tensor its `fn` was last applied to on this thread, which _apply, wrapped, notes.
    """
    def noting_each_tensor(apply):
        @functools.wraps(apply)
        def _apply(self, fn, recurse=True):
            def noted(tensor):
                _converting.tensor = tensor
                return fn(tensor)

            try:
                return apply(self, noted, recurse)
            finally:
                _converting.tensor = None

        return _apply

    def unless_ours(swaps):
        def swaps_unless_ours(tensor) -> bool:
            param = getattr(_converting, "tensor", None)
            moved_from, moved_to = isinstance(param, tensor_type), isinstance(tensor, tensor_type)
            if param is None or not (moved_from or moved_to):
                return swaps(tensor)
            if moved_from and moved_to:
                return False  # neuron to neuron: param.data = new
            # between host and device: a swap keeps the Parameter object where swap_tensors takes it
            # (nothing but its gradient accumulator references it); else a new Parameter (ties split)
            uses = param._use_count()
            return uses == 1 or uses == 2 and param.grad is not None

        return swaps_unless_ours

    patches.replace("torch.nn.modules.module:Module._apply", noting_each_tensor)
    patches.replace("torch.nn.modules.module:is_traceable_wrapper_subclass", unless_ours)


_converting = threading.local()  # .tensor: what Module._apply's fn was last applied to on this thread


def share_between_processes(tensor_type: type, reduce) -> None:
    """DataLoader workers (and torch.multiprocessing) with neuron tensors.

    - Sending one to another process goes through `reduce`: it hands over the host buffer (CPU
      tensors travel in shared memory) and a call that wraps it on the device again there.
      Without it the tensor would pickle as for torch.save, whose rebuild leaves to map_location.
    - default_collate, in a worker, stacks tensors into a shared-memory storage that it allocates
      on the tensor's device: a pure-Python device has no allocator there, and PyTorch crashes in
      C++. Ours stack normally; the batch then travels as above.
    """
    from multiprocessing.reduction import ForkingPickler

    from torch.utils.data._utils.collate import default_collate_fn_map

    ForkingPickler.register(tensor_type, reduce)
    default_collate_fn_map[tensor_type] = _stack_batch


def fork_safely(device) -> None:
    """DataLoader workers are forked, typically inside an engine block. The child inherits the
    engine's dispatch mode but not its threads (the lazy engine compiles on one), so a lazy op in
    the child would wait forever. Pending lazy work is computed before the fork, and the child, a
    data-loading process, runs its device ops eagerly: the engine's modes are dropped there."""
    os.register_at_fork(before=device.synchronize, after_in_child=_drop_engine_modes)


def _drop_engine_modes() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    kept = [mode for mode in _get_current_dispatch_mode_stack()
            if not type(mode).__module__.startswith(_PACKAGE)]
    while _get_current_dispatch_mode_stack():
        _pop_mode()
    for mode in kept:
        _push_mode(mode)


def _stack_batch(batch, *, collate_fn_map=None):
    return torch.stack(batch, 0)


_pinning_library = None


def treat_host_memory_as_pinned(device_type: str) -> None:
    """`pin_memory=True` DataLoaders and `t.pin_memory()` with this device as the accelerator.

    Pinned (page-locked) host memory exists so that a device's DMA engines can read it; the
    simulated device reads any host memory, so for it every CPU tensor counts as pinned and
    pin_memory() returns the tensor itself. Without this, PyTorch asks the PrivateUse1 hooks for a
    pinned-memory allocator, which a pure-Python backend cannot provide (NotImplementedError).
    Questions about another device go to PyTorch's own kernel.
    """
    global _pinning_library
    if _pinning_library is not None:
        return
    own_kernel = torch.library.get_kernel("aten::is_pinned", "CPU")

    def is_pinned(keyset, tensor, device=None):
        if device is None:
            accelerator = torch.accelerator.current_accelerator()
            target = accelerator.type if accelerator is not None else None
        else:
            target = torch.device(device).type
        if target == device_type:
            return True
        return own_kernel.call_boxed(keyset, tensor, device)

    _pinning_library = torch.library.Library("aten", "IMPL")
    _pinning_library.impl("is_pinned", is_pinned, "CPU", with_keyset=True)


def allow_loading(*callables) -> None:
    """torch.load(weights_only=True) rebuilds device tensors only through allowlisted callables."""
    torch.serialization.add_safe_globals(list(callables))
