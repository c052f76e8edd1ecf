"""A segment's op graph as inline SVG: regions drawn as boxes holding their ops, eager ops between.

Layout: each region instance is contracted to one block (regions are convex, so the contracted
graph stays acyclic); blocks go in columns by topological generation, left to right, ordered in a
column by where their producers sit; inside a region box its ops are laid out the same way.
"""
from __future__ import annotations

import collections
import html
import re

import networkx as nx

from .summary import status

MAX_NODES = 160            # ops drawn per segment; a bigger segment is cut with a note
NODE_W, NODE_H = 128, 20
COL_GAP, ROW_GAP = 30, 6
PAD, LABEL_H = 6, 14       # region box padding and the height of its name
LABEL_CHARS = 19           # what fits in NODE_W at the page's 10px monospace
PALETTE = ("#2f9e44", "#1971c2", "#9c36b5", "#e8590c", "#0c8599", "#c2255c", "#846358", "#3b5bdb",
           "#495057", "#a07800")  # distinct hues, dark enough for text on white


def region_color(name: str) -> str:
    digits = re.findall(r"\d+", name)
    return PALETTE[(int(digits[-1]) if digits else len(name)) % len(PALETTE)]


def segment_svg(nodes: list[dict], edges: list, max_nodes: int = MAX_NODES) -> str:
    """The graph of the first `max_nodes` ops of a segment as an <svg> element."""
    shown = nodes[:max_nodes]
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(shown)))
    graph.add_edges_from((u, v) for u, v in edges if u < len(shown) and v < len(shown))
    blocks = _blocks(graph, shown)
    pos, boxes, width, height = _layout(graph, blocks)
    parts = [f'<svg class="graph" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">']
    parts += [_region_box(name, box) for name, box in boxes]
    parts.append('<g class="edges">')
    parts += [_edge(pos[u], pos[v]) for u, v in graph.edges]
    parts.append("</g>")
    parts += [_node(i, node, pos[i]) for i, node in enumerate(shown)]
    parts.append("</svg>")
    return "\n".join(parts)


def _blocks(graph: nx.DiGraph, nodes: list[dict]) -> list[tuple[str | None, list[int]]]:
    """(region name or None, member ops): one block per connected region instance, one per other op."""
    by_region = collections.defaultdict(list)
    for i, node in enumerate(nodes):
        if node["region"] is not None:
            by_region[node["region"]].append(i)
    blocks = [(name, sorted(part)) for name, members in by_region.items()
              for part in nx.weakly_connected_components(graph.subgraph(members))]
    blocks += [(None, [i]) for i, node in enumerate(nodes) if node["region"] is None]
    if not nx.is_directed_acyclic_graph(_contracted(graph, blocks)):
        # Not convex after all (a cut segment can do this): draw every op on its own.
        return [(None, [i]) for i in range(len(nodes))]
    return blocks


def _contracted(graph: nx.DiGraph, blocks) -> nx.DiGraph:
    owner = {i: b for b, (_, members) in enumerate(blocks) for i in members}
    contracted = nx.DiGraph()
    contracted.add_nodes_from(range(len(blocks)))
    contracted.add_edges_from((owner[u], owner[v]) for u, v in graph.edges if owner[u] != owner[v])
    return contracted


def _inner(graph: nx.DiGraph, members: list[int]) -> tuple[dict, int, int]:
    """Positions of a block's ops relative to the block, and the block's size."""
    generations = list(nx.topological_generations(graph.subgraph(members)))
    offsets = {}
    for column, generation in enumerate(generations):
        for row, i in enumerate(sorted(generation)):
            offsets[i] = (column * (NODE_W + COL_GAP), row * (NODE_H + ROW_GAP))
    width = len(generations) * (NODE_W + COL_GAP) - COL_GAP
    height = max(len(g) for g in generations) * (NODE_H + ROW_GAP) - ROW_GAP
    return offsets, width, height


def _layout(graph: nx.DiGraph, blocks):
    contracted = _contracted(graph, blocks)
    inner = [_inner(graph, members) for _, members in blocks]
    framed = [(w + 2 * PAD, h + 2 * PAD + LABEL_H) if name else (w, h)
              for (name, _), (_, w, h) in zip(blocks, inner)]
    centre, pos, boxes, x, bottom = {}, {}, [], PAD, 0
    for generation in nx.topological_generations(contracted):
        order = sorted(generation, key=lambda b: (_barycentre(contracted, b, centre), blocks[b][1][0]))
        y = PAD
        for b in order:
            name, members = blocks[b]
            offsets, (w, h) = inner[b][0], framed[b]
            origin = (x + PAD, y + PAD + LABEL_H) if name else (x, y)
            for i in members:
                pos[i] = (origin[0] + offsets[i][0], origin[1] + offsets[i][1])
            if name:
                boxes.append((name, (x, y, w, h)))
            centre[b] = y + h / 2
            y += h + ROW_GAP * 2
        x += max(framed[b][0] for b in generation) + COL_GAP
        bottom = max(bottom, y)
    return pos, boxes, max(x, NODE_W), max(bottom, NODE_H + PAD)


def _barycentre(graph: nx.DiGraph, block: int, centre: dict) -> float:
    ys = [centre[p] for p in graph.predecessors(block) if p in centre]
    return sum(ys) / len(ys) if ys else float("inf")


def _region_box(name: str, box) -> str:
    x, y, w, h = box
    color, label = region_color(name), html.escape(name)
    return (f'<g class="region" data-region="{label}"><rect x="{x}" y="{y}" width="{w}" height="{h}" rx="6" '
            f'style="stroke:{color}"/><text x="{x + PAD}" y="{y + LABEL_H - 2}" style="fill:{color}">'
            f'{label}</text></g>')


def _edge(source, target) -> str:
    x1, y1 = source[0] + NODE_W, source[1] + NODE_H / 2
    x2, y2 = target[0], target[1] + NODE_H / 2
    bend = max((x2 - x1) / 2, COL_GAP / 2)
    return f'<path d="M{x1},{y1} C{x1 + bend},{y1} {x2 - bend},{y2} {x2},{y2}"/>'


def _node(index: int, node: dict, xy) -> str:
    x, y = xy
    state = status(node)
    op = node["op"]
    label = op if len(op) <= LABEL_CHARS else op[:LABEL_CHARS - 1] + "\u2026"
    shapes = ", ".join("x".join(map(str, s)) or "scalar" for s in node.get("shapes") or [])
    why = f"in {node['region']}" if node["region"] else f"eager: {node['why_eager']}"
    tip = html.escape(f"#{index} {op} ({node['kind']})\nout: {shapes or '-'}\n{why}")
    region = html.escape(node["region"] or "")
    stroke = f' style="stroke:{region_color(node["region"])}"' if node["region"] else ""
    return (f'<g class="node {state} {html.escape(node["kind"])}" data-region="{region}" '
            f'transform="translate({x},{y})"><title>{tip}</title>'
            f'<rect width="{NODE_W}" height="{NODE_H}" rx="3"{stroke}/>'
            f'<text x="{NODE_W / 2}" y="{NODE_H / 2 + 3.5}">{html.escape(label)}</text></g>')
