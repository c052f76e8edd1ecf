"""Pass 4: keep every live tile within SBUF and PSUM, and check the TensorEngine tile limits.

Live bytes are counted per partition (every tile spans the partitions), from a tile's definition to
its last use in the body; DMA-loaded tiles count twice because they are double-buffered so the next
tile's load overlaps this tile's compute. A kernel that does not fit gets a smaller free size; a
reduction needs whole rows, so one that does not fit is split into single-op kernels, and a single
reduction that still does not fit runs opaque.
"""
from __future__ import annotations

from ..device.spec import DeviceSpec
from ..errors import TileLimitError
from .lower import default_free, lower_group, opaque_kernel
from ..reasons import Why
from .ops import Reason, category, numel, shape
from .region import Group, Region
from .tile_ir import Kernel, Launch, Ops


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
        peak_sbuf, peak_psum = max(peak_sbuf, sbuf), max(peak_psum, psum)
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
    return sbuf <= spec.sbuf_partition_bytes and banks <= spec.psum_banks


def _planned(group: Group, nodes: dict, spec: DeviceSpec) -> Kernel | None:
    free = default_free(group)
    while True:
        kernel = lower_group(group, nodes, spec, free)
        if fits(kernel, spec):
            return kernel.replace(sbuf_bytes_per_partition=live_bytes(kernel)[0])
        if group.kind == "reduction" or free == 1:
            return None
        free = max(1, free // 2)


def _singletons(group: Group, nodes: dict, next_id: int) -> list[Group]:
    out = []
    for name in group.nodes:
        node = nodes[name]
        cat = category(node)
        if cat == "view":
            continue  # a view outside a kernel is host metadata, no kernel
        if cat == "reduction":
            in_shape = shape(node.args[0])
            domain, kind = (numel(in_shape) // max(in_shape[-1], 1), in_shape[-1]), "reduction"
        else:
            out_shape = shape(node)
            last = out_shape[-1] if out_shape and out_shape[-1] != 1 else 1
            domain, kind = (numel(out_shape) // last, last), "elementwise"
        out.append(Group(id=next_id + len(out), kind=kind, nodes=(name,), domain=domain,
                         row_values=frozenset({name}) if cat == "reduction" else frozenset()))
    return out


def memory_plan(region: Region) -> Region:
    spec = region.spec
    nodes = {n.name: n for n in region.gm.graph.nodes}
    groups, kernels, refused = [], [], list(region.refused)
    pending = list(region.groups)
    next_id = max((g.id for g in pending), default=0) + 1
    while pending:
        group = pending.pop(0)
        kernel = opaque_kernel(group, nodes) if group.kind == "opaque" else _planned(group, nodes, spec)
        if kernel is not None:
            groups.append(group)
            kernels.append(kernel)
        elif len(group.nodes) > 1:
            refused.append((group.name, Reason(Why.SBUF, f"rows of {group.domain[1]} elements do not fit SBUF; split")))
            parts = _singletons(group, nodes, next_id)
            next_id += len(parts)
            pending = parts + pending
        else:
            refused.append((group.name, Reason(Why.SBUF, f"a row of {group.domain[1]} elements does not fit SBUF")))
            opaque = group.__class__(id=group.id, kind="opaque", nodes=group.nodes)
            groups.append(opaque)
            kernels.append(opaque_kernel(opaque, nodes))
    for kernel in kernels:
        check_tile_limits(kernel, spec)
    return region.replace(pass_name="memory_plan", groups=tuple(groups), kernels=tuple(kernels),
                          refused=tuple(refused))


def check_tile_limits(kernel: Kernel, spec: DeviceSpec) -> None:
    """Raise TileLimitError if any tile breaks a DeviceSpec limit; the message says expected vs got."""
    for op in kernel.body:
        if op.shape and op.shape[0][1] > spec.partitions:
            _fail(kernel, op, f"partition dim <= {spec.partitions}", op.shape[0][1])
        if op.space == "psum" and op.tile_bytes_per_partition() > spec.psum_bank_bytes:
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
    if got > limit:
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
