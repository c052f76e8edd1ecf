"""Region graph -> fusion groups -> tile IR -> memory plan -> executable kernels, plus the tile
interpreter and the torch.compile backend."""
from .driver import COMPILER_VERSION, PASSES, CompiledRegion
from .entry import compile_graph, compile_in_background, finish
from .memory_plan import check_launch_limits, check_tile_limits

__all__ = ["COMPILER_VERSION", "PASSES", "CompiledRegion", "check_launch_limits", "check_tile_limits", "compile_graph",
           "compile_in_background", "finish"]

from .backend import backend_stats, register as _register_backend  # noqa: E402

_register_backend()
__all__ += ["backend_stats"]
