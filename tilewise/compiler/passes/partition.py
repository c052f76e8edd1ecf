"""Pass 2: partition the region into fusion groups, greedily in graph order.

A group iterates over a 2-D domain (rows R, cols C): every value in it is held either as a full
[rows x cols] tile or as a [rows x 1] "row" tile (constant along the free axis, e.g. a mean over
the last dim). A node joins the group of an input when it tiles the same way and the group stays
convex (no path leaves the group and comes back), which `_Groups` tracks with ancestor sets. The
graph keeps its order here; the schedule pass makes each kernel contiguous.
"""
from __future__ import annotations

import torch

from ...errors import CompileError
from ...reasons import Why
from .ops import (ARANGES, BROADCAST_IN_DIM, EMBEDDING, EXPAND, GATHER, ORDER_VIEWS, SCATTERS, Reason, category, matmul_dims, numel,
                  opaque_reason, reduced_dims, shape, strip, tensor_inputs)
from ..ir.region import Group, Region
from ..ir.sizes import same

FUSABLE = ("elementwise", "reduction", "matmul")
NOT_INLINED = frozenset({*SCATTERS, *ARANGES, EMBEDDING})


class _G:
    """A group while it grows (Group is the frozen result)."""

    def __init__(self, gid: int, kind: str, domain: tuple[int, int]):
        self.id, self.kind, self.domain = gid, kind, domain
        self.nodes: list = []
        self.names: set[str] = set()
        self.rows: set[str] = set()
        self.inlined: set[str] = set()
        self.anc: set[int] = set()


class _Groups:
    def __init__(self):
        self.groups: dict[int, _G] = {}
        self.owner: dict[str, int] = {}
        self.refused: list = []
        self._ids = 0

    def new(self, node, kind: str, domain=(1, 1), row: bool = False) -> _G:
        group = _G(self._ids, kind, domain)
        self._ids += 1
        self.groups[group.id] = group
        self._add(node, group, row)
        return group

    def inputs_of(self, node) -> set[int]:
        return {self.owner[a.name] for a in node.all_input_nodes if a.name in self.owner}

    def _add(self, node, group: _G, row: bool) -> None:
        fresh = set()
        for gid in self.inputs_of(node) - {group.id}:
            fresh |= self.groups[gid].anc | {gid}
        group.nodes.append(node)
        group.names.add(node.name)
        self.owner[node.name] = group.id
        if row:
            group.rows.add(node.name)
        self._grow_ancestors(group, fresh)

    def _grow_ancestors(self, group: _G, fresh: set[int]) -> None:
        if fresh - group.anc:
            group.anc |= fresh
            for other in self.groups.values():
                if group.id in other.anc:
                    other.anc |= group.anc

    def convex_with(self, node, group: _G) -> bool:
        return all(group.id not in self.groups[gid].anc for gid in self.inputs_of(node) - {group.id})

    def merge(self, keep: _G, gone: _G) -> None:
        keep.nodes = sorted(keep.nodes + gone.nodes, key=_position)
        keep.rows |= gone.rows
        keep.names |= gone.names
        keep.inlined |= gone.inlined
        for node in gone.nodes:
            self.owner[node.name] = keep.id
        del self.groups[gone.id]
        keep.anc = (keep.anc | gone.anc) - {keep.id, gone.id}
        for other in self.groups.values():
            if gone.id in other.anc:
                other.anc.discard(gone.id)
                other.anc |= {keep.id} | keep.anc
        if keep.id in keep.anc:
            raise CompileError(f"merging {gone.id} into {keep.id} made a cycle")

    def merge_inlined(self, keep: _G, gone: _G) -> None:
        names = set(gone.names)
        gone.rows = set()
        self.merge(keep, gone)
        keep.inlined |= names

    def can_merge(self, a: _G, b: _G) -> Reason | None:
        if {a.kind, b.kind} == {"matmul"} or {a.kind, b.kind} == {"matmul", "reduction"}:
            return Reason(Why.FUSION_KINDS, f"cannot fuse {a.kind}_{a.id} with {b.kind}_{b.id}")
        for mm, other in ((a, b), (b, a)):
            if mm.kind == "matmul" and other.id in mm.anc:
                return Reason(Why.PROLOGUE, f"{other.kind}_{other.id} feeds the matmul of {mm.kind}_{mm.id}")
        if _joint_domain(a.domain, b.domain) is None:
            return Reason(Why.DOMAIN, f"{a.domain} vs {b.domain}")
        if any(a.id in self.groups[x].anc for x in b.anc) or any(b.id in self.groups[x].anc for x in a.anc):
            return Reason(Why.CYCLE, f"a path leaves {a.kind}_{a.id} and re-enters {b.kind}_{b.id}")
        return None


def _position(node) -> int:
    return node.meta["_tw_pos"]


def _joint_domain(a: tuple[int, int], b: tuple[int, int]):
    # `same`: a domain that matches another only at the size lowered at is another domain
    if not same(a[0], b[0]):
        return None
    if same(a[1], b[1]) or b[1] == 1:
        return a
    return b if a[1] == 1 else None


def _elementwise_fit(node, group: _G):
    """(new domain, is_row) if `node` tiles like `group`, else a Reason."""
    out = shape(node)
    rows, cols = group.domain
    last = out[-1] if out else 1
    if last != 1 and numel(out) == rows * last and cols in (1, last):
        domain, row = (rows, last), False
    elif numel(out) == rows:
        domain, row = group.domain, True
    else:
        return Reason(Why.DOMAIN, f"{node.name} {list(out)} does not tile as {rows}x{cols}")
    for arg in tensor_inputs(node):
        if arg.name not in group.names:
            continue
        arg_row = arg.name in group.rows
        if row and not arg_row:
            return Reason(Why.DOMAIN, f"{arg.name} is a full tile but {node.name} is a row")
        expected = out[:-1] + (1,) if (arg_row and not row) else out
        if strip(shape(arg)) != strip(expected):
            return Reason(Why.BROADCAST, f"{arg.name} {list(shape(arg))} broadcasts across tiles of {node.name}")
    return domain, row


def _view_fit(node, group: _G):
    arg = node.args[0]
    arg_row = arg.name in group.rows
    out = shape(node)
    rows, cols = group.domain
    same_order = node.target in ORDER_VIEWS or (node.target is BROADCAST_IN_DIM and numel(out) == numel(shape(arg)))
    widens_row = node.target is EXPAND and strip(shape(arg)) == strip(out[:-1] + (1,)) if out else False
    if node.target is BROADCAST_IN_DIM and out and len(out) - 1 not in node.args[2]:
        widens_row = True
    if same_order:
        if arg_row:
            return group.domain, True
        if out and out[-1] == cols:
            return group.domain, False
        return Reason(Why.VIEW, f"{node.name} changes the free axis of {arg.name}")
    if widens_row and arg_row and out and out[-1] == 1 and numel(out) == rows:
        return group.domain, True  # widened to a width of 1: still one value per row
    if widens_row and arg_row and out and numel(out) == rows * out[-1] and cols in (1, out[-1]):
        return (rows, out[-1]), False
    return Reason(Why.VIEW, f"{node.target} does not keep tiles whole")


def _reduction_fit(node, group: _G):
    """A reduction of args[0]'s last dim; gather's index (args[2]) is a row operand beside it."""
    arg = node.args[0]
    dims, in_shape = reduced_dims(node), shape(arg)
    if not in_shape or dims != [len(in_shape) - 1]:
        return Reason(Why.REDUCTION, f"{node.name} reduces dims {dims} of {list(in_shape)}, not only the last")
    domain = (numel(in_shape) // max(in_shape[-1], 1), in_shape[-1])
    if group is None:
        return domain, True
    if group.kind == "matmul":
        return Reason(Why.FUSION_KINDS, f"reduction {node.name} after a matmul stays in its own kernel")
    if arg.name in group.rows and in_shape[-1] != 1:
        return Reason(Why.DOMAIN, f"{arg.name} is a row tile")
    index = node.args[2] if node.target is GATHER else None
    if index is not None and index.name in group.names and index.name not in group.rows:
        return Reason(Why.DOMAIN, f"index {index.name} of {node.name} is a full tile, not a row")
    joint = _joint_domain(group.domain, domain)  # the group may hold only the index, as rows
    if joint is None:
        return Reason(Why.DOMAIN, f"{node.name} reads rows of {list(in_shape)}, not {group.domain}")
    return joint, True


def _fit(node, cat: str, group: _G | None):
    if cat == "reduction":
        return _reduction_fit(node, group)
    if cat == "view":
        return _view_fit(node, group)
    if group is None:
        out = shape(node)
        last = out[-1] if out and out[-1] != 1 else 1
        return (numel(out) // last, last), last == 1
    return _elementwise_fit(node, group)


def _place(state: _Groups, node, cat: str) -> None:
    candidates = []
    for arg in tensor_inputs(node):
        gid = state.owner.get(arg.name)
        if gid is not None and state.groups[gid].kind in FUSABLE and gid not in candidates:
            candidates.append(gid)
    if cat == "view":
        candidates = candidates[:1] if node.args[0].name in state.owner else []
    if cat == "matmul":
        candidates = []  # no prologue fusion: a matmul loads its operands whole, per contraction tile
    for gid in candidates:
        group = state.groups[gid]
        fit = _fit(node, cat, group) if state.convex_with(node, group) else \
            Reason(Why.CYCLE, f"{node.name} would close a path through another kernel")
        if isinstance(fit, Reason):
            state.refused.append((f"{node.name} -> {group.kind}_{group.id}", fit))
            continue
        group.domain = fit[0]
        if cat == "reduction":
            group.kind = "reduction"
        state._add(node, group, fit[1])
        _merge_rest(state, group, candidates)
        return
    _seed(state, node, cat)


def _seed(state: _Groups, node, cat: str) -> None:
    if cat in ("view", "glue"):
        state.new(node, "glue")
        return
    if cat == "matmul":
        dims = matmul_dims(node)  # a batched matmul's rows run over its batches, as its output's do
        state.new(node, "matmul", (dims.batch * dims.m, dims.n), row=dims.n == 1)
        return
    fit = _fit(node, cat, None)
    if isinstance(fit, Reason):
        state.refused.append((node.name, fit))
        state.new(node, "opaque")
        return
    state.new(node, cat if cat == "reduction" else "elementwise", fit[0], row=fit[1])


def _merge_rest(state: _Groups, group: _G, candidates: list[int]) -> None:
    for gid in candidates:
        other = state.groups.get(gid)
        if other is None or other is group or other.kind not in FUSABLE:
            continue
        reason = state.can_merge(group, other)
        if reason is not None:
            state.refused.append((f"{other.kind}_{other.id} + {group.kind}_{group.id}", reason))
            continue
        group.domain = _joint_domain(group.domain, other.domain)
        if "matmul" in (group.kind, other.kind):
            group.kind = "matmul"
        elif "reduction" in (group.kind, other.kind):
            group.kind = "reduction"
        state.merge(group, other)


def partition(region: Region) -> Region:
    graph = region.gm.graph
    state = _Groups()
    for pos, node in enumerate(graph.nodes):
        node.meta["_tw_pos"] = pos
        cat = category(node)
        if cat in ("source", "output"):
            continue
        if cat == "opaque":
            state.refused.append((node.name, opaque_reason(node)))
            state.new(node, "opaque")
        elif cat == "glue":
            state.new(node, "glue")
        elif cat in ("concat", "scatter_add"):  # copy kernels of their own (parts side by side; rows added)
            out = shape(node)
            rows = out[0] if cat == "scatter_add" else numel(out) // max(out[-1], 1)
            state.new(node, cat, (rows, numel(out) // max(rows, 1)))
        else:
            _place(state, node, cat)
    _inline_broadcast_producers(state)
    _fuse_siblings(state, graph)
    groups = _freeze(state)
    groups = fuse_updates(groups, graph)
    for node in graph.nodes:  # positions were for this pass only
        node.meta.pop("_tw_pos", None)
    return region.replace(pass_name="partition", groups=tuple(g for g in groups if g.kind != "glue"),
                          refused=region.refused + tuple(state.refused))


def _inline_broadcast_producers(state: _Groups) -> None:
    """An element-wise group that only feeds broadcast operands of one kernel is recomputed in it.

    Element-wise ops commute with broadcasting, so the consumer loads the producer's inputs
    broadcast to its own tile and applies the ops there: one launch and no HBM round trip for the
    small tensor (e.g. `beta * bias` from addmm's decomposition).
    """
    for producer in list(state.groups.values()):
        if producer.kind != "elementwise" or producer.id not in state.groups:
            continue
        if any(category(n) != "elementwise" or n.target in NOT_INLINED for n in producer.nodes):
            continue  # they follow the tile they were lowered for: a scatter's index and a lookup's
            # rows are row tiles, a range runs along its own free axis
        users = {u for n in producer.nodes for u in n.users if u.name not in producer.names}
        owners = {state.owner.get(u.name) for u in users}
        if len(owners) != 1 or None in owners:
            continue
        consumer = state.groups[owners.pop()]
        if consumer.kind not in FUSABLE or not all(category(u) == "elementwise" for u in users):
            continue
        if consumer.id in producer.anc or any(producer.id in state.groups[x].anc for x in consumer.anc):
            continue  # a path leaves the producer and re-enters the consumer through another kernel
        state.merge_inlined(consumer, producer)


def _fuse_siblings(state: _Groups, graph: torch.fx.Graph) -> None:
    """Groups that read the same tensor over the same domain share one pass over it."""
    for node in graph.nodes:
        readers = []
        for user in node.users:
            gid = state.owner.get(user.name)
            if gid in state.groups and state.groups[gid].kind in ("elementwise", "reduction") \
                    and gid != state.owner.get(node.name) and gid not in readers:
                readers.append(gid)
        if len(readers) > 1:
            _merge_rest(state, state.groups[readers[0]], readers[1:])


def _freeze(state: _Groups) -> list[Group]:
    return [Group(id=g.id, kind=g.kind, nodes=tuple(n.name for n in g.nodes), domain=g.domain,
                  row_values=frozenset(g.rows), inlined=frozenset(g.inlined)) for g in state.groups.values()]


def fuse_updates(groups: list[Group], graph: torch.fx.Graph) -> list[Group]:
    """Optimizer steps: element-wise groups read only by write-backs to inputs run as ONE kernel."""
    nodes = {n.name: n for n in graph.nodes}
    updates = [g for g in groups if g.kind == "elementwise" and _only_written_back(g, nodes)]
    if len(updates) < 2:
        return groups
    fused = Group(id=min(g.id for g in updates), kind="optimizer",
                  nodes=tuple(sorted((n for g in updates for n in g.nodes), key=lambda n: _position(nodes[n]))),
                  parts=tuple(updates))
    chosen = {g.id for g in updates}
    return [g for g in groups if g.id not in chosen] + [fused]


def _only_written_back(group: Group, nodes: dict) -> bool:
    inside = set(group.nodes)
    users = [u for name in group.nodes for u in nodes[name].users if u.name not in inside]
    return bool(users) and any(u.target is torch.ops.aten.copy_.default for u in users) and \
        all(u.target is torch.ops.aten.copy_.default or u.op == "output" for u in users)
