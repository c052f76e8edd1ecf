"""Dynamo never traces the engine's own code. A function compiled with `torch.compile` (any backend)
runs what it cannot compile eagerly, with Dynamo's frame callback on: every Python frame it calls is
compiled too, unless its file is one Dynamo skips. tilewise's dispatch, wrappers and recorder were
such frames, and Dynamo compiled them into resume functions that broke at their first attribute
write (`'NeuronTensor' object has no attribute '_data'`). The package's directory is added to
Dynamo's skipped files when Dynamo is imported, without importing it here: it takes seconds, and
`import tilewise` stays light."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_RULES = "torch._dynamo.trace_rules"


def skip_tilewise() -> None:
    """Add this package to Dynamo's skipped files now if Dynamo is loaded, else when it is."""
    if _RULES in sys.modules:
        _add(sys.modules[_RULES])
    elif not any(isinstance(finder, _WhenLoaded) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenLoaded())


def _add(rules) -> None:
    rules.add(__name__.partition(".")[0])


class _WhenLoaded(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for Dynamo's trace rules it hands back the real spec with a loader
    that adds the package once the module has run, then leaves sys.meta_path."""

    def find_spec(self, name, path=None, target=None):
        if name != _RULES:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _AddingLoader(spec.loader)
        return spec


class _AddingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _add(module)
