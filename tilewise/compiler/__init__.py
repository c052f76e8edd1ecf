"""Region graph -> fusion groups -> tile IR -> memory plan -> executable kernels, plus the tile
interpreter and the torch.compile backend.

The torch.compile backend (`backend.py`) imports Dynamo, so it is not imported here:
`torch.compile(..., backend="tilewise")` finds it through the package's `torch_dynamo_backends`
entry point (pyproject.toml), and `backend_stats` loads it on first use."""
from .driver import COMPILER_VERSION, PASSES, CompiledRegion
from .entry import compile_graph, compile_in_background, finish
from .passes.memory_plan import check_launch_limits, check_tile_limits

__all__ = ["COMPILER_VERSION", "PASSES", "CompiledRegion", "backend_stats", "check_launch_limits", "check_tile_limits",
           "compile_graph", "compile_in_background", "finish"]


def __getattr__(name: str):
    if name == "backend_stats":
        from .backend import backend_stats
        return backend_stats
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
