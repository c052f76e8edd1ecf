"""Pass 4: schedule the kernels into launches and keep what passes between them in SBUF.

A launch runs consecutive tile kernels back to back as one device program, the way one NEFF runs a
whole graph on hardware: one launch overhead for all of them. An opaque op has no tile program, so
it runs alone, as a launch of its own, and ends the launch before it; the graph is therefore
reordered first so that opaque kernels run as late as their users allow (fewer breaks).

Within a launch, a value that one kernel stores and a later kernel loads in the same 2-D layout
stays resident in SBUF instead of making an HBM round trip, as long as all resident values fit
beside each kernel's own live tiles (a value that does not fit goes through HBM, and the refusal
says so). A resident value is still written to HBM when anything outside the launch reads it.
"""
from __future__ import annotations

from ...device.spec import DeviceSpec
from .memory_plan import check_launch_limits
from ...reasons import Why
from .ops import Reason
from .order import contiguous_order
from ..ir.region import Region
from ..ir.sizes import frozen, largest_total, same, within
from ..ir.tile_ir import HbmRef, Kernel, Launch, Ops


def schedule(region: Region) -> Region:
    spec = region.spec
    unit_of = {name: kernel.name for kernel in region.kernels for name in kernel.nodes}
    late = frozenset(k.name for k in region.kernels if k.kind == "opaque")
    gm = contiguous_order(region.gm, unit_of, late)
    position = {node.name: index for index, node in enumerate(gm.graph.nodes)}
    kernels = sorted(region.kernels, key=lambda k: min(position[n] for n in k.nodes))
    users = {node.name: [u.name for u in node.users] for node in gm.graph.nodes}
    launches, refused = [], list(region.refused)
    for run in _runs(kernels):
        launch, spilled = _launch(run, f"launch_{len(launches)}", unit_of, users, spec)
        check_launch_limits(launch, spec)  # the plan, re-checked by the independent checker
        launches.append(launch)
        refused += spilled
    return region.replace(pass_name="schedule", gm=gm, kernels=tuple(kernels), launches=tuple(launches),
                          refused=tuple(refused))


def _runs(kernels: list[Kernel]) -> list[list[Kernel]]:
    """Maximal runs of consecutive tile kernels; every opaque kernel is a run of its own."""
    runs: list[list[Kernel]] = []
    for kernel in kernels:
        if kernel.kind != "opaque" and runs and runs[-1][-1].kind != "opaque":
            runs[-1].append(kernel)
        else:
            runs.append([kernel])
    return runs


def _launch(kernels: list[Kernel], name: str, unit_of: dict, users: dict, spec: DeviceSpec):
    if len(kernels) == 1:
        return Launch(kernels[0].name, tuple(kernels)), []
    index_of = {k.name: i for i, k in enumerate(kernels)}
    resident_sizes: list[list] = [[] for _ in kernels]  # per kernel, the values resident across it
    resident, stored, refused = [], set(), []
    for i, kernel in enumerate(kernels):
        for ref in kernel.outputs.values():
            readers = {index_of.get(unit_of.get(u), -1) for u in users[ref.node]} - {i}  # -1: outside
            direct = {j for j in readers if j > i and _reads_on_chip(kernels[j], ref)}
            if not direct:
                continue
            size, last = ref.sbuf_bytes_per_partition(spec.partitions), max(direct)
            span = range(i, last + 1)
            if not within([[kernels[k].sbuf_bytes_per_partition, *resident_sizes[k], size] for k in span],
                          spec.sbuf_partition_bytes):
                refused.append((f"{ref.node} -> SBUF", Reason(
                    Why.SBUF, f"{_kib(size)} KiB per partition does not fit beside the live tiles of "
                            f"{name}; it goes through HBM")))
                continue
            for k in span:
                resident_sizes[k].append(size)
            resident.append((ref.node, ref.rows_cols))
            if len(direct) < len(readers):
                stored.add(ref.node)
    launch = Launch(name, tuple(kernels), frozen(resident), frozenset(stored), largest_total(resident_sizes))
    return launch, refused


def _reads_on_chip(kernel: Kernel, produced: HbmRef) -> bool:
    """Whether `kernel` reads the value only in the layout `produced` wrote it in, untransposed."""
    names = [name for name, ref in kernel.inputs.items() if ref.node == produced.node]
    if not names or any(not same(kernel.inputs[n].rows_cols, produced.rows_cols)
                        or kernel.inputs[n].view != () and not same(kernel.inputs[n].view, produced.shape)
                        for n in names):
        return False
    return not any(op.op is Ops.LOAD and op.arg[0] in names and op.arg[1] for op in kernel.body)


def _kib(size) -> str:
    """Bytes as KiB text; a symbolic size as its expression (formatting it as a float would not
    take a SymFloat, and evaluating it would fix the size)."""
    return f"{size / 1024:.1f}" if isinstance(size, int) else f"({size}) / 1024"
