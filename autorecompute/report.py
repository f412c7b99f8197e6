"""Reading a plan: a table grouped by module, and a Graphviz DOT dump."""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from autorecompute.budget import format_bytes

if TYPE_CHECKING:
    from autorecompute.plan import Plan

COLORS = {"keep": "#d9ead3", "recompute": "#f9cb9c", "offload": "#9fc5e8", "compress": "#d5a6bd"}


def format_table(plan: "Plan", max_rows_per_module: int = 6) -> str:
    """Rows grouped by module path; long groups are folded to their largest tensors."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in plan.table():
        groups[row["module"] or "<root>"].append(row)
    lines = [f"  {'tensor':<28} {'shape':<22} {'dtype':<9} {'bytes':>11} {'action':<10}"]
    for module, rows in groups.items():
        recomputed = sum(r["held_bytes"] for r in rows if r["action"] == "recompute")
        lines.append(f"  [{module}]  {len(rows)} ops" + (f", {format_bytes(recomputed)} not held" if recomputed
                                                          else ""))
        shown = sorted(rows, key=lambda r: -r["bytes"])[:max_rows_per_module]
        for r in sorted(shown, key=lambda r: rows.index(r)):
            shape = "x".join(map(str, r["shape"])) or "-"
            lines.append(f"    {r['name'][:26]:<26} {shape[:22]:<22} {r['dtype']:<9} "
                         f"{format_bytes(r['bytes']):>11} {r['action']:<10}")
        if len(rows) > len(shown):
            lines.append(f"    ... {len(rows) - len(shown)} smaller ops")
    return "\n".join(lines)


def plan_to_dot(plan: "Plan") -> str:
    """Graphviz DOT: one node per decided op, clustered by module, filled by action, with a legend."""
    clusters: dict[str, list[str]] = defaultdict(list)
    for name in plan.decisions:
        node = plan.nodes.get(name)
        clusters[node.module if node else ""].append(name)
    lines = ["digraph plan {", "  rankdir=TB; node [shape=box, style=filled, fontsize=10];"]
    for k, (module, names) in enumerate(clusters.items()):
        lines.append(f"  subgraph cluster_{k} {{ label=\"{module or 'root'}\";")
        for name in names:
            node = plan.nodes.get(name)
            size = format_bytes(node.nbytes) if node else ""
            lines.append(f"    \"{name}\" [label=\"{name}\\n{size}\", fillcolor=\"{COLORS[plan.decisions[name]]}\"];")
        lines.append("  }")
    names = list(plan.decisions)
    for a, b in zip(names, names[1:]):
        lines.append(f"  \"{a}\" -> \"{b}\" [color=gray];")
    lines.append("  subgraph cluster_legend { label=\"legend\";")
    for action in sorted({*plan.decisions.values()}):
        lines.append(f"    \"legend_{action}\" [label=\"{action}\", fillcolor=\"{COLORS[action]}\"];")
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines)
