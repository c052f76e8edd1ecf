"""A pytest plugin that runs every compiled region on its native executable: each compile builds
the region's C at once, waits for it and keeps it (no trial against the recorded graph), so
`CompiledRegion.run` is the native tier in whatever test calls it, and the tests hold the C to CPU
as they hold the PyTorch executable:

    python -m pytest -p native_everywhere tests/test_compiler_lowering.py -q
"""
from __future__ import annotations

import pytest

from tilewise.compiler import cache, native
from tilewise.compiler.native import Tier

BUILD_TIMEOUT = 120  # seconds one region's C may take to build


@pytest.fixture(autouse=True)
def _native_regions(monkeypatch):
    original = cache.compile_cached
    monkeypatch.setattr(native, "CHOOSE_BY_MEASUREMENT", False)  # the C runs, never traded for the recorded graph

    def compile_cached(*args, **kwargs):
        compiled = original(*args, **kwargs)
        compiled.start_native()
        if compiled.wait_native(BUILD_TIMEOUT) is Tier.FAILED:
            pytest.fail(f"native build failed: {compiled.native_failure}")
        return compiled

    monkeypatch.setattr(cache, "compile_cached", compile_cached)

