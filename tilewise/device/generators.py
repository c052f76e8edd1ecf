"""`torch.Generator(device="neuron")`: a generator that draws what a CPU generator seeded alike draws.

PyTorch makes a device generator through the PrivateUse1 hooks' getNewGenerator, which falls back
to a factory a C++ library registers (at::_GeneratorRegister); the Python hooks that
tilewise registers cannot supply one. So `csrc/neuron_generator.cpp` is built with
torch.utils.cpp_extension the first time a program asks for a neuron generator (a few seconds,
once per machine: torch's extensions directory keeps it, and its file lock lets processes building
at once wait for one build), never at `import tilewise`. Its generator is CPU's generator on device
neuron:<index>. `torch.Generator` becomes a subclass whose constructor loads the library first;
every generator, however made, is still an instance of it.

Random ops on neuron tensors run CPU's kernels, which take only CPU generators: `host_twin` gives
the kernel a CPU generator holding the neuron generator's state, and `write_back` returns the state
the draw left, so the neuron generator advances exactly as a CPU generator would.
"""
from __future__ import annotations

import os
import threading
import warnings

import torch

from .. import patches
from ..errors import DeviceError

NAME = "tilewise_neuron_generator"
SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "neuron_generator.cpp")
_BASE = torch._C.Generator
_LOCK = threading.Lock()
_loaded = False


def load() -> None:
    """Build (first time on a machine) and load the library that registers neuron's generator."""
    global _loaded
    if _loaded:
        return
    with _LOCK:
        if _loaded:
            return
        from torch.utils import cpp_extension
        try:
            cpp_extension.load(name=NAME, sources=[SOURCE], extra_cflags=["-O2"], is_python_module=False,
                               verbose=False)
        except Exception as error:
            raise DeviceError(
                f"torch.Generator(device='neuron') needs a small C++ library built on first use, and building it "
                f"failed ({type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}); "
                "a C++ compiler (g++) and ninja are needed. Without them, pass a CPU torch.Generator() to neuron's "
                "random ops: it draws the same numbers") from error
        _quietly(torch.ops.tilewise_generator.install)
        _loaded = True


def _quietly(register) -> None:
    """The registration, without the note PyTorch's C++ prints on stderr that the registration
    function is deprecated (it names its replacement, the C++ hooks interface, which a Python
    backend cannot derive): the only thing the call writes there."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            register()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class _GeneratorType(type(_BASE)):
    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, _BASE)

    def __subclasscheck__(cls, subclass) -> bool:
        return issubclass(subclass, _BASE)


class Generator(_BASE, metaclass=_GeneratorType):
    """torch.Generator, which also makes neuron generators (the library is loaded first)."""

    def __new__(cls, device=None):
        if device is not None and torch.device(device).type == "neuron":
            load()
            with warnings.catch_warnings():  # PyTorch's note that the registration macro is old
                warnings.filterwarnings("ignore", message=".*GetGeneratorForPrivateuse1.*")
                return super().__new__(cls, device)
        return super().__new__(cls) if device is None else super().__new__(cls, device)


def install() -> None:
    """torch.Generator becomes the subclass above (idempotent)."""
    Generator.__module__, Generator.__qualname__ = "torch", "Generator"
    patches.replace("torch:Generator", lambda pytorch: Generator)


def is_neuron(value) -> bool:
    return isinstance(value, _BASE) and value.device.type == "neuron"


def host_twin(generator: torch.Generator) -> torch.Generator:
    """A CPU generator in the neuron generator's state, for CPU's kernel."""
    twin = _BASE()
    twin.set_state(generator.get_state())
    return twin


def write_back(generator: torch.Generator, twin: torch.Generator) -> None:
    """The neuron generator takes the state its twin's draw left."""
    generator.set_state(twin.get_state())
