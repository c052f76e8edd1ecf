"""The memory fit: whether a kernel's live tiles stay within SBUF and PSUM, and the TensorEngine
tile limits. The lower pass asks `fits` while it picks each group's free size (so every group is
lowered once); the schedule checks every launch with `check_launch_limits`.

Live bytes are counted per partition (every tile spans the partitions), from a tile's definition to
its last use in the body; DMA-loaded tiles count twice because they are double-buffered so the next
tile's load overlaps this tile's compute.
"""
from __future__ import annotations

from ...device.spec import DeviceSpec
from ...errors import TileLimitError
from ..ir.sizes import at_most, size_max
from ..ir.tile_ir import Kernel, Launch, Ops


def live_bytes(kernel: Kernel) -> tuple[int, int]:
    """Peak (SBUF bytes per partition, PSUM banks) over the kernel body."""
    last_use: dict[int, int] = {}
    for index, op in enumerate(kernel.body):
        for src in op.srcs:
            last_use[id(src)] = index
    sbuf = psum = peak_sbuf = peak_psum = 0
    ending: dict[int, list] = {}
    for index, op in enumerate(kernel.body):
        if op.space and op.op is not Ops.MATMUL:  # MATMUL accumulates into its ZERO's bank
            size = op.tile_bytes_per_partition() * (2 if op.op is Ops.LOAD else 1)
            end = max(last_use.get(id(op), index), _matmul_end(kernel, op, last_use, index))
            ending.setdefault(end, []).append((op.space, size))
            if op.space == "sbuf":
                sbuf += size
            else:
                psum += 1
        peak_sbuf, peak_psum = size_max(peak_sbuf, sbuf), max(peak_psum, psum)
        for space, size in ending.pop(index, []):
            if space == "sbuf":
                sbuf -= size
            else:
                psum -= 1
    return peak_sbuf, peak_psum


def _matmul_end(kernel: Kernel, op, last_use: dict, index: int) -> int:
    if op.op is not Ops.ZERO:
        return index
    accumulates = [i for i, o in enumerate(kernel.body) if o.op is Ops.MATMUL and o.srcs[0] is op]
    return max([last_use.get(id(kernel.body[i]), i) for i in accumulates] or [index])


def fits(kernel: Kernel, spec: DeviceSpec) -> bool:
    sbuf, banks = live_bytes(kernel)
    return at_most(sbuf, spec.sbuf_partition_bytes) and banks <= spec.psum_banks


def check_tile_limits(kernel: Kernel, spec: DeviceSpec) -> None:
    """Raise TileLimitError if any tile breaks a DeviceSpec limit; the message says expected vs got."""
    for op in kernel.body:
        if op.shape and not at_most(op.shape[0][1], spec.partitions):
            _fail(kernel, op, f"partition dim <= {spec.partitions}", op.shape[0][1])
        if op.space == "psum" and not at_most(op.tile_bytes_per_partition(), spec.psum_bank_bytes):
            _fail(kernel, op, f"PSUM tile <= {spec.psum_bank_bytes} B per partition (one bank)",
                  op.tile_bytes_per_partition())
        if op.op is Ops.MATMUL:
            _, lhs_t, rhs = op.srcs
            _check(kernel, op, "contraction", lhs_t.shape[0][1], spec.partitions)
            _check(kernel, op, "stationary free", lhs_t.shape[1][1], spec.matmul_stationary_free)
            _check(kernel, op, "moving free", rhs.shape[1][1], spec.matmul_moving_free)
    sbuf, banks = live_bytes(kernel)
    _check(kernel, None, "live SBUF bytes per partition", sbuf, spec.sbuf_partition_bytes)
    _check(kernel, None, "live PSUM banks", banks, spec.psum_banks)


def _check(kernel, op, what: str, got: int, limit: int) -> None:
    if not at_most(got, limit):
        _fail(kernel, op, f"{what} <= {limit}", got)


def _fail(kernel, op, expected: str, got) -> None:
    where = f" at {op.name or op.op.value}" if op is not None else ""
    raise TileLimitError(f"kernel {kernel.name}{where}: expected {expected}, got {got}")


def check_launch_limits(launch: Launch, spec: DeviceSpec) -> None:
    """Every kernel's tile limits, and at every kernel its live tiles plus the values the launch
    keeps resident at that point fit in SBUF (re-derived from the launch, not taken from the
    schedule's bookkeeping)."""
    live = [0] * len(launch.kernels)
    for node, rows_cols in launch.resident:
        made = [i for i, k in enumerate(launch.kernels)
                if any((r.node, r.rows_cols) == (node, rows_cols) for r in k.outputs.values())]
        read = [i for i, k in enumerate(launch.kernels)
                if any(launch.on_chip(r) for r in k.inputs.values() if r.node == node)]
        if len(made) != 1 or not read:
            raise TileLimitError(f"launch {launch.name}: resident value {node} must be written by one kernel "
                                 f"and read by another; written by {len(made)}, read by {len(read)}")
        ref = next(r for r in launch.kernels[made[0]].outputs.values() if r.node == node)
        for i in range(made[0], max(read) + 1):
            live[i] += ref.sbuf_bytes_per_partition(spec.partitions)
    for kernel, resident in zip(launch.kernels, live):
        check_tile_limits(kernel, spec)
        _check(kernel, None, "live SBUF bytes per partition with the launch's resident values",
               live_bytes(kernel)[0] + resident, spec.sbuf_partition_bytes)
