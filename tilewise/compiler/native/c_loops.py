"""The loops of a kernel's C function as text: partition loops (`for p`) whose blocks are runs of
lines or element loops (`for f`), and the scratch rows they read and write.

Consecutive instructions over the same partitions share one partition loop, and consecutive
element-wise statements over the same elements one element loop (`ElementLoop`): an element's chain
of values is computed in one go. Once the function's lines are written, a value only its own
element loop reads becomes a C local there (`scalarise`), and every other buffer a static array:
one row where one partition loop writes it before reading it, else the whole tile
(`declarations`).
"""
from __future__ import annotations

import collections
import re
from dataclasses import dataclass

# A buffer's row inside a partition loop, `name[p * pitch...`, and a statement writing it first (to
# its whole row or element by element, or an MKL function's output row); compiled once, the name and
# pitch compared per buffer.
_INDEXED = re.compile(r"\b(\w+)\[")  # a name indexed as an array
_ROW_INDEX = re.compile(r"\b(\w+)\[p \* (\d+)\b")
_ROW_WRITE = re.compile(r"\b(\w+)\[p \* (\d+)(?: \+ f)?\] = |^vm[sd]\w+\(.*, &(\w+)\[p \* (\d+)\], \d+LL\);$")


@dataclass
class ElementLoop:
    """`for f < count` over statements that each write element f of a row (element_loop).

    Several statements are marked `ivdep`: GCC cannot tell the HBM pointers (addresses passed as
    integers) from the scratch rows, needs more run-time alias checks than it will version a loop
    for, and leaves the loop scalar (AdamW's update, two stores and six rows, was). No iteration
    reads what another writes: scratch rows are read at f or at a broadcast element 0 that no
    statement of the loop writes, and the kernel loads no tensor it stores (fuses_partitions)."""
    count: str
    statements: list[str]

    def lines(self) -> list[str]:
        if len(self.statements) == 1:
            return [f"for (int64_t f = 0; f < {self.count}; f++) {self.statements[0]}"]
        return ["#pragma GCC ivdep", f"for (int64_t f = 0; f < {self.count}; f++) {{",
                *(f"  {s}" for s in self.statements), "}"]


class LoopWriter:
    """A kernel function's lines and the scratch buffers they use. `fuse`: whether instructions may
    run partition by partition (codegen_c.fuses_partitions); `pointers`: the names of the HBM
    tensors' pointers (a statement that reads only these reads no scratch row)."""

    def __init__(self, fuse: bool, pointers: set[str]):
        self.fuse, self.pointers = fuse, pointers
        self.lines: list[str] = []
        self.declared: list[tuple[str, str, int, int]] = []  # (C type, name, rows, cols) of each buffer
        self.runs: list[range] = []  # the lines of each partition loop
        self.chains: list[range] = []  # the statement lines of each element loop of several statements
        self.depth = 1
        # the partition loop being filled: its count, depth and blocks (lines, or an ElementLoop)
        self.pending: tuple[str, int, list] | None = None

    def emit(self, text: str) -> None:
        self.flush()
        self.lines.append("  " * self.depth + text)

    def partition_loop(self, count: str, body) -> None:
        """`for p < count: body` (lines, or an ElementLoop). Consecutive ones over the same
        partitions become one loop, each statement a block of its own: an instruction reads and
        writes only its partition's rows, so partition p runs the instructions in program order on
        rows that stay in L1, instead of every instruction streaming a whole tile (128 x 1024
        floats is 512 KB) through the cache."""
        if not self.joins(count):
            self.flush()
            self.pending = (count, self.depth, [])
        self.pending[2].append(body)

    def element_loop(self, count: str, f_count: str, written: str, statement: str) -> None:
        """`for p < count: for f < f_count: statement`, a statement that writes element f of
        `written` (a buffer or an HBM pointer) and reads element f (or a broadcast element 0
        written before the loop) of each row. Consecutive ones over the same elements share one f
        loop: one pass over the row for the chain of them. A statement whose buffer the loop
        touched already starts a loop of its own (a write at f must not precede a read of
        element 0). A row's broadcast element (`f_count` 1) that reads only the kernel's inputs
        (Adam's step size) is written before the loop instead, which the chain then goes on in:
        it reads nothing the loop writes, and the loop does not touch its buffer."""
        if self.joins(count) and self.pending[2]:
            last = self.pending[2][-1]
            if isinstance(last, ElementLoop) and not any(f"{written}[" in earlier for earlier in last.statements):
                if last.count == f_count:
                    last.statements.append(statement)
                    return
                if f_count == "1" and set(_INDEXED.findall(statement)) <= {written, *self.pointers}:
                    self.pending[2].insert(len(self.pending[2]) - 1, ElementLoop(f_count, [statement]))
                    return
        self.partition_loop(count, ElementLoop(f_count, [statement]))

    def joins(self, count: str) -> bool:
        """Whether an instruction over `count` partitions joins the partition loop being filled."""
        return self.fuse and self.pending is not None and self.pending[:2] == (count, self.depth)

    def flush(self) -> None:
        if self.pending is None:
            return
        (count, depth, blocks), self.pending = self.pending, None
        indent = "  " * depth
        first = len(self.lines)
        self.lines.append(f"{indent}for (int64_t p = 0; p < {count}; p++) {{")
        for block in blocks:
            lines = block.lines() if isinstance(block, ElementLoop) else block
            start = len(self.lines) + 3  # after "{", the pragma and the loop's head
            self.lines.extend(f"{indent}  {line}" for line in ["{", *(f"  {line}" for line in lines), "}"])
            if isinstance(block, ElementLoop) and len(block.statements) > 1:
                self.chains.append(range(start, start + len(block.statements)))
        self.lines.append(f"{indent}}}")
        self.runs.append(range(first, len(self.lines)))

    def lines_using(self) -> dict[str, list[int]]:
        """name -> the lines indexing it as an array, in order."""
        lines_using = collections.defaultdict(list)
        for i, line in enumerate(self.lines):
            for used in dict.fromkeys(_INDEXED.findall(line)):
                lines_using[used].append(i)
        return lines_using

    def scalarise(self) -> set[str]:
        """The buffers that become C locals: a value an element loop writes at element f and that
        only that loop's later statements read, at element f, lives in a register for the one
        iteration. Kept as a row, every such value of a chain is stored and loaded again (AdamW's
        update: ten of its fourteen rows, a row each too many to stay in L1). Returns their names."""
        lines_using, scalars = self.lines_using(), set()
        for ctype, name, rows, cols in self.declared:
            uses = lines_using[name]
            chain = next((c for c in self.chains if uses and uses[0] in c and uses[-1] in c), None)
            element = f"{name}[p * {cols} + f]"
            first = self.lines[uses[0]].lstrip() if chain else ""
            if not first.startswith(element + " = ") or any(
                    line.count(f"{name}[") != line.count(element) for line in (self.lines[i] for i in uses)) \
                    or any(self.lines[i].lstrip().startswith(element + " = ") for i in uses[1:]):
                continue
            indent = self.lines[uses[0]][:len(self.lines[uses[0]]) - len(first)]
            self.lines[uses[0]] = f"{indent}const {ctype} {name} = {first[len(element) + 3:]}"
            for i in uses[1:]:
                self.lines[i] = self.lines[i].replace(element, name)
            scalars.add(name)
        return scalars

    def declarations(self) -> list[str]:
        """Each buffer not made a local (`scalarise`) as a static array: a whole tile, or one row
        where the tile is a value of one partition loop that writes it before reading it (each
        partition's row is dead once the loop moves on), so the chain of a fused kernel's values
        stays in L1."""
        scalars = self.scalarise()
        declared, lines_using = [], self.lines_using()
        for ctype, name, rows, cols in self.declared:
            if name in scalars:
                continue
            uses = lines_using[name]
            run = next((r for r in self.runs if uses and uses[0] in r and uses[-1] in r), None)
            row = (name, str(cols))
            if run is not None and rows > 1 and any(row in (m.groups()[:2], m.groups()[2:]) for m in _ROW_WRITE.finditer(self.lines[uses[0]].lstrip())):
                for i in uses:
                    self.lines[i] = _ROW_INDEX.sub(lambda m: f"{name}[0" if m.groups() == row else m.group(0), self.lines[i])
                rows = 1
            declared.append(f"  static {ctype} {name}[{rows * cols}] TW_ALIGN;")
        return declared
