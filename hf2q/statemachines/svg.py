"""A small SVG renderer for state machines, used when Graphviz's ``dot`` is not installed.

Layout: states go into columns by their shortest distance from the initial state
(a left-to-right reading order like ``rankdir=LR``), stacked within a column. Edges
are quadratic curves bent away from the straight line so opposite edges (``a ⇄ b``)
do not overlap; self-loops are small arcs above the node. Labels sit at the curve's
middle. No dependencies: plain string building, deterministic output.
"""

from __future__ import annotations

from collections import deque
from html import escape

from hf2q.statemachines.base import MachineSpec

NODE_W, NODE_H, COL_GAP, ROW_GAP, MARGIN = 130, 36, 90, 50, 40


def _edges(spec: MachineSpec) -> list[tuple[str, str, str]]:
    out = []
    for r in spec.rows:
        srcs = spec.state_names if r.sources == ("*",) else r.sources
        for s in srcs:
            if s == r.dest and r.sources == ("*",):
                continue
            out.append((s, r.dest, r.trigger))
    return out


def _layout(spec: MachineSpec, edges) -> dict[str, tuple[float, float]]:
    depth = {spec.initial.name: 0}
    queue = deque([spec.initial.name])
    while queue:
        s = queue.popleft()
        for a, b, _ in edges:
            if a == s and b not in depth:
                depth[b] = depth[s] + 1
                queue.append(b)
    last = max(depth.values(), default=0)
    for name in spec.state_names:  # unreachable states go to a final column
        depth.setdefault(name, last + 1)
    columns: dict[int, list[str]] = {}
    for name in spec.state_names:
        columns.setdefault(depth[name], []).append(name)
    pos = {}
    for col, names in columns.items():
        for row, name in enumerate(names):
            pos[name] = (MARGIN + 30 + col * (NODE_W + COL_GAP) + NODE_W / 2,
                         MARGIN + 30 + row * (NODE_H + ROW_GAP) + NODE_H / 2)
    return pos


def to_svg(spec: MachineSpec) -> str:
    edges = _edges(spec)
    pos = _layout(spec, edges)
    width = max(x for x, _ in pos.values()) + NODE_W / 2 + MARGIN
    height = max(y for _, y in pos.values()) + NODE_H / 2 + MARGIN + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="11">',
           f'<title>{escape(spec.name)}</title>',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z"/></marker></defs>',
           f'<text x="{MARGIN}" y="{MARGIN - 15}" font-size="14" font-weight="bold">{escape(spec.name)}</text>']
    ix, iy = pos[spec.initial.name]
    out.append(f'<circle cx="{ix - NODE_W / 2 - 25}" cy="{iy}" r="5"/>')
    out.append(f'<line x1="{ix - NODE_W / 2 - 20}" y1="{iy}" x2="{ix - NODE_W / 2}" y2="{iy}" '
               'stroke="black" marker-end="url(#arrow)"/>')
    seen: dict[tuple[str, str], int] = {}
    for a, b, label in edges:
        k = seen[(a, b)] = seen.get((a, b), -1) + 1
        (x1, y1), (x2, y2) = pos[a], pos[b]
        if a == b:
            top = y1 - NODE_H / 2
            lift = 30 + 14 * k
            out.append(f'<path d="M{x1 - 15},{top} C{x1 - 30},{top - lift} {x1 + 30},{top - lift} {x1 + 15},{top}" '
                       'fill="none" stroke="black" marker-end="url(#arrow)"/>')
            out.append(f'<text x="{x1}" y="{top - lift + 8}" text-anchor="middle">{escape(label)}</text>')
            continue
        dx, dy = x2 - x1, y2 - y1
        dist = max((dx * dx + dy * dy) ** 0.5, 1.0)
        ux, uy = dx / dist, dy / dist
        # start and end on the node borders (ellipse-ish approximation), bent to the left
        sx, sy = x1 + ux * NODE_W / 2 * 0.9, y1 + uy * NODE_H / 2 * 1.2
        ex, ey = x2 - ux * NODE_W / 2 * 0.9, y2 - uy * NODE_H / 2 * 1.2
        bend = 25 + 18 * k
        cx, cy = (sx + ex) / 2 + uy * bend, (sy + ey) / 2 - ux * bend
        out.append(f'<path d="M{sx:.1f},{sy:.1f} Q{cx:.1f},{cy:.1f} {ex:.1f},{ey:.1f}" fill="none" '
                   'stroke="black" marker-end="url(#arrow)"/>')
        mx, my = (sx + 2 * cx + ex) / 4, (sy + 2 * cy + ey) / 4
        out.append(f'<text x="{mx:.1f}" y="{my - 3:.1f}" text-anchor="middle">{escape(label)}</text>')
    for name, (x, y) in pos.items():
        out.append(f'<g class="state" id="state-{escape(name)}"><rect x="{x - NODE_W / 2:.1f}" '
                   f'y="{y - NODE_H / 2:.1f}" width="{NODE_W}" height="{NODE_H}" rx="10" fill="#eef3ff" '
                   f'stroke="black"/><text x="{x:.1f}" y="{y + 4:.1f}" text-anchor="middle">{escape(name)}</text></g>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
