"""The trace a kernel's Python function is run under: the tile IR it emits, each instruction's source
line, the HBM tensors it reads and writes, and the rules checked on the way and at the end."""
from __future__ import annotations

import threading

from ..compiler.ir.tile_ir import Ops, TileOp
from ..device.spec import DeviceSpec
from .rules import KernelRuleError, capacity, user_line

_current = threading.local()


class Trace:
    def __init__(self, name: str, spec: DeviceSpec):
        self.name, self.spec = name, spec
        self.body: list[TileOp] = []
        self.lines: dict[int, str] = {}   # id(instruction) -> the kernel's file:line that emitted it
        self.hbm: dict = {}               # name -> HbmTensor, the kernel's arguments and outputs
        self.outputs: list = []           # HbmTensors made by ndarray(buffer=hbm), in order
        self.program: tuple[int, ...] = ()
        self.grid: tuple[int, ...] = ()
        self.hbm_made = 0                 # ndarrays in hbm made by the current program
        self._names: dict[str, int] = {}

    def __enter__(self) -> "Trace":
        _current.trace = self
        return self

    def __exit__(self, *exc) -> None:
        _current.trace = None

    def fresh_name(self, stem: str) -> str:
        count = self._names.get(stem, 0)
        self._names[stem] = count + 1
        return f"{stem}{count}"

    def emit(self, op: TileOp) -> TileOp:
        self.body.append(op)
        self.lines[id(op)] = user_line()
        return op

    def check(self, problem: str | None) -> None:
        """Raise the rule `problem` states ("rule: detail"), naming the kernel's current line."""
        if problem:
            rule, _, detail = problem.partition(": ")
            raise KernelRuleError(self.name, user_line(), rule, detail)

    def high_water(self) -> dict[str, int]:
        """Peak bytes per partition of the live SBUF and PSUM buffers: a buffer lives from its
        ALLOC to the last instruction that names it. Raises where a space overflows the spec."""
        last = {}
        for index, op in enumerate(self.body):
            for src in op.srcs:
                last[id(src)] = index
        limits = {"sbuf": self.spec.sbuf_partition_bytes, "psum": self.spec.psum_bytes // self.spec.partitions}
        live, high, ends = {"sbuf": 0, "psum": 0}, {"sbuf": 0, "psum": 0}, {}
        for index, op in enumerate(self.body):
            if op.op is Ops.ALLOC:
                size = self.partition_bytes(op)
                live[op.space] += size
                high[op.space] = max(high[op.space], live[op.space])
                if live[op.space] > limits[op.space]:
                    raise KernelRuleError(self.name, self.lines[id(op)], *capacity(
                        op.space, live[op.space], limits[op.space]).partition(": ")[::2])
                ends.setdefault(last.get(id(op), index), []).append(op)
            for done in ends.pop(index, ()):
                live[done.space] -= self.partition_bytes(done)
        return high

    def partition_bytes(self, alloc: TileOp) -> int:
        """A PSUM buffer takes a whole bank (accumulation is per bank); an SBUF one its free size."""
        if alloc.space == "psum":
            return self.spec.psum_bank_bytes
        return alloc.shape[1][1] * alloc.dtype.itemsize


def current() -> Trace:
    trace = getattr(_current, "trace", None)
    if trace is None:
        raise RuntimeError("tilewise.kernels: this call is made inside a @tk.kernel function while it runs")
    return trace
