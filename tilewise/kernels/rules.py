"""The tile rules a hand-written kernel is held to, checked while it is traced, and the error that
names the rule broken and the kernel's source line that broke it."""
from __future__ import annotations

import os
import sys

from ..device.spec import DeviceSpec
from ..errors import TilewiseError

_HERE = os.path.dirname(os.path.abspath(__file__))
_LIBRARY = os.path.join(_HERE, "library") + os.sep


class KernelRuleError(TilewiseError):
    """A kernel broke a tile rule: which rule, where in the kernel, what was expected and what came."""

    def __init__(self, kernel: str, line: str, rule: str, detail: str):
        self.kernel, self.line, self.rule = kernel, line, rule
        super().__init__(f"kernel {kernel}, {line}: {rule}: {detail}")


_names: dict = {}  # code object -> its file's base name, or None for tilewise.kernels' own code


def _name_of(code) -> str | None:
    name = _names.get(code, _names)
    if name is _names:
        path = os.path.abspath(code.co_filename)
        own = path.startswith(_HERE + os.sep) and not path.startswith(_LIBRARY)
        name = _names[code] = None if own else os.path.basename(path)
    return name


def user_line() -> str:
    """file:line of the innermost frame outside tilewise.kernels (its library is user code): the
    kernel's own line. Run for every instruction a trace emits, so code objects are looked up once."""
    frame = sys._getframe(1)
    while frame is not None:
        name = _name_of(frame.f_code)
        if name is not None:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def partition_dim(spec: DeviceSpec, rows: int, what: str) -> str | None:
    if rows > spec.partitions:
        return f"partition dim <= {spec.partitions}: {what} has {rows} partitions"
    return None


def partition_start(p0: int, rows: int) -> str | None:
    """An engine instruction on more than 64 partitions starts at partition 0; on 33-64 at 0 or 64;
    on at most 32 at a multiple of 32."""
    allowed = (0,) if rows > 64 else (0, 64) if rows > 32 else (0, 32, 64, 96)
    if p0 not in allowed:
        return f"partition start alignment: an access of {rows} partitions starts at one of {allowed}, got {p0}"
    return None


def psum_tile(spec: DeviceSpec, free_bytes: int) -> str | None:
    if free_bytes > spec.psum_bank_bytes:
        return (f"PSUM tile <= one {spec.psum_bank_bytes} B bank per partition: the tile takes {free_bytes} B "
                f"per partition")
    return None


def matmul(spec: DeviceSpec, stationary: tuple, moving: tuple, dtypes: tuple) -> str | None:
    """stationary [K, M], moving [K, N]: K on the partitions, M <= 128, N <= 512, float operands."""
    (k, m), (k2, n) = stationary, moving
    if k != k2:
        return f"matmul contraction on the partition dim: stationary has {k} partitions, moving {k2}"
    if k > spec.partitions:
        return f"matmul contraction <= {spec.partitions}, got {k}"
    if m > spec.matmul_stationary_free:
        return f"matmul stationary free size <= {spec.matmul_stationary_free}, got {m}"
    if n > spec.matmul_moving_free:
        return f"matmul moving free size <= {spec.matmul_moving_free}, got {n}"
    if any(not d.is_floating_point for d in dtypes):
        return (f"no integer matmul on the TensorEngine: got {', '.join(map(str, dtypes))} (dequantise on the "
                f"VectorEngine first, as the Neuron compiler does)")
    return None


def capacity(space: str, high: int, limit: int) -> str:
    return f"{space.upper()} capacity {limit} B per partition: live tiles reach {high} B per partition"
