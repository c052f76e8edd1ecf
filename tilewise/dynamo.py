"""What Dynamo may trace of tilewise: the programs it runs (workloads), never the engine itself.
Two rules, installed when Dynamo is imported (an import hook; at once if it is loaded already):
`import tilewise` does not import Dynamo, which takes seconds.

- Every module of the package but the `workloads` ones (models and training loops written as a
  user writes them, which benchmarks/run.py compiles with inductor) is in Dynamo's skip list
  (`torch._dynamo.trace_rules.add`). Dynamo runs a skipped file's frames as plain Python, and
  frames it intercepts there (an op's handler, a kernel registered from Python, the backward
  hook) are not compiled either. Without it, a frame of the engine that Dynamo met outside a
  compiled graph was compiled and resumed at graph breaks: the executor's wrapping of an op's
  output (device/tensor.py's `tensor._data = data`) ran as Dynamo-compiled code and failed
  (`'NeuronTensor' object has no attribute '_data'`).
- A torch.compile'd function or module called inside `tilewise.engine()` runs as plain Python
  under the engine, as Dynamo itself does under a TorchDispatchMode, but without Dynamo seeing
  its frames: Dynamo skips a frame it finds under a dispatch mode and marks its code skipped for
  good (torch/_dynamo/types.py, ConvertFrameReturn.apply_to_code), so one call of a model inside
  a block made every later call of that model class's forward, outside any block too, run
  uncompiled. Dynamo reads the callback a compiled call installs through
  `eval_frame._callback_from_stance` (the `torch.compiler.set_stance` hook), which is global;
  the engine's dispatch modes are per thread, so the hook answers "no compile" only on a thread
  inside an engine block.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import pathlib
import sys

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from . import patches

_ROOT = pathlib.Path(__file__).parent
_PACKAGE = _ROOT.name
TRACEABLE = frozenset({"workloads"})  # module names Dynamo traces, wherever they are in the package
_DYNAMO = "torch._dynamo"


def install() -> None:
    """The rules now if Dynamo is loaded, else when it is; idempotent."""
    if _DYNAMO in sys.modules and hasattr(sys.modules[_DYNAMO], "eval_frame"):
        _install_rules()
    elif not any(isinstance(finder, _WhenLoaded) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenLoaded())


def engine_modules() -> list[str]:
    """The import names of the package's modules Dynamo skips (a package whose modules are all
    skipped as its directory)."""
    names = []
    for path in sorted(_ROOT.iterdir()):
        if path.is_dir() and (path / "__init__.py").exists():
            if any((path / f"{name}.py").exists() for name in TRACEABLE):
                names += [f"{_PACKAGE}.{path.name}.{p.stem}" for p in sorted(path.glob("*.py"))
                          if p.stem not in TRACEABLE and p.stem != "__init__"]
            else:
                names.append(f"{_PACKAGE}.{path.name}")
        elif path.suffix == ".py" and path.stem not in TRACEABLE and path.stem != "__init__":
            names.append(f"{_PACKAGE}.{path.stem}")
    return names


def _install_rules() -> None:
    from torch._dynamo import trace_rules
    if "torch._dynamo.eval_frame:_callback_from_stance" in patches.installed():
        return
    for name in engine_modules():
        trace_rules.add(name)
    patches.replace("torch._dynamo.eval_frame:_callback_from_stance", _eager_in_engine_blocks)


def _in_engine_block() -> bool:
    from .adaptive.tracer import Tracer
    return any(isinstance(mode, Tracer) for mode in _get_current_dispatch_mode_stack())


def _eager_in_engine_blocks(callback_from_stance):
    @functools.wraps(callback_from_stance)
    def _callback_from_stance(callback):
        if callback not in (False, None) and _in_engine_block():
            return None
        return callback_from_stance(callback)

    return _callback_from_stance


class _WhenLoaded(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for Dynamo's package it hands back the real spec with a loader that
    installs the rules once the package has run, then leaves sys.meta_path."""

    def find_spec(self, name, path=None, target=None):
        if name != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _InstallingLoader(spec.loader)
        return spec


class _InstallingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _install_rules()
