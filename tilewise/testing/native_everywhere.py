"""A pytest plugin that runs every compiled region on its native executable: each compile builds
the region's C at once, waits for it and keeps it (no trial against the recorded graph), so
`CompiledRegion.run` is the native tier in whatever test calls it, and the tests hold the C to CPU
as they hold the PyTorch executable:

    python -m pytest -p tilewise.testing.native_everywhere tests/compiler/test_compiler_lowering.py -q
"""
from __future__ import annotations

import pytest

from tilewise.compiler.cache import regions as cache
from tilewise.compiler.native import tiers
from tilewise.compiler.native.tiers import Tier

BUILD_TIMEOUT = 120  # seconds one region's C may take to build


def force_native(setattr) -> None:
    """Every compile from now on builds its region's C, waits for it and keeps it; `setattr` is
    how the two patches are applied (pytest's monkeypatch.setattr, or plain setattr for a script)."""
    original = cache.compile_cached
    setattr(tiers, "CHOOSE_BY_MEASUREMENT", False)  # the C runs, never traded for the recorded graph

    def compile_cached(*args, **kwargs):
        compiled = original(*args, **kwargs)
        compiled.start_native()
        if compiled.wait_native(BUILD_TIMEOUT) is Tier.FAILED:
            raise RuntimeError(f"native build failed: {compiled.native_failure}")
        return compiled

    setattr(cache, "compile_cached", compile_cached)


@pytest.fixture(autouse=True)
def _native_regions(monkeypatch):
    force_native(monkeypatch.setattr)
