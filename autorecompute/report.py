"""Reading a plan: a folded table, a Graphviz graph, a memory timeline, one HTML page."""
from __future__ import annotations

import base64
import html
import importlib.util
import io
import os
import shutil
import subprocess
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from autorecompute.budget import format_bytes

if TYPE_CHECKING:
    from autorecompute.plan import Plan

COLORS = {"keep": "#b6d7a8", "recompute": "#f6b26b", "rematerialize": "#ffe599", "offload": "#9fc5e8",
          "compress": "#d5a6bd"}


def color(action: str) -> str:
    """Fill color of an action ("compress:bfloat16" → compress; a mix → its first action)."""
    return COLORS.get(action.split("+")[0].split(":")[0], COLORS["keep"])
MAX_GROUPS = 24
GRAPHVIZ_MISSING = ("rendering SVG needs the Graphviz 'dot' program, which is not on PATH. Install it "
                    "(Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz; conda: conda install "
                    "graphviz), or save as .dot and render it elsewhere")


def _group_key(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth]) if module else "<root>"


def group_depth(modules: list[str], max_groups: int = MAX_GROUPS, min_group_size: int = 4) -> int:
    """Module-path depth for grouping rows: deeper while that keeps at most ``max_groups`` groups of, on
    average, at least ``min_group_size`` rows (so a table is neither one blob nor one row per group)."""
    depth = 1
    while depth < 12:
        deeper = {_group_key(m, depth + 1) for m in modules}
        if len(deeper) > max_groups or len(modules) < min_group_size * len(deeper) \
                or deeper == {_group_key(m, depth) for m in modules}:
            break
        depth += 1
    return depth


def format_table(plan: "Plan", max_rows_per_group: int = 6) -> str:
    """Rows grouped by module path (folded to at most MAX_GROUPS groups), largest tensors first within a group."""
    rows = plan.table()
    depth = group_depth([r["module"] for r in rows])
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[_group_key(row["module"], depth)].append(row)
    width = max([9] + [len(r["action"]) for r in rows])
    lines = [f"  {'tensor':<26} {'shape':<20} {'dtype':<8} {'bytes':>11} {'action':<{width}} why"]
    for module, members in groups.items():
        recomputed = _recomputed_bytes(members)
        lines.append(f"  [{module}] {len(members)} ops" + (f", {format_bytes(recomputed)} recomputed instead of held"
                                                           if recomputed else ""))
        parts: dict[str, list[dict]] = defaultdict(list)
        for row in members:
            parts[_group_key(row["module"], depth + 1)].append(row)
        if len(members) > 4 * max_rows_per_group and len(parts) > 1:
            # a group folded from many blocks (a 24-layer model's layers): one line per block, so what each
            # layer does stays readable; plan.table() has every row
            for part, rows_of in parts.items():
                again = _recomputed_bytes(rows_of)
                counts = Counter(r["action"] for r in rows_of)
                lines.append(f"    {part} {len(rows_of)} ops: " + ", ".join(f"{a} {n}" for a, n in counts.items())
                             + (f"; {format_bytes(again)} recomputed" if again else ""))
            continue
        shown = sorted(members, key=lambda r: -r["bytes"])[:max_rows_per_group]
        for r in sorted(shown, key=members.index):
            shape = "x".join(map(str, r["shape"])) or ("scalar" if r["dtype"] else "-")   # "-": no tensor
            lines.append(f"    {_cut(r['name'], 24):<24} {_cut(shape, 20):<20} {r['dtype'][:8]:<8} "
                         f"{format_bytes(r['bytes']):>11} {r['action']:<{width}} {r['why']}")
        if len(members) > len(shown):
            lines.append(f"    ... {len(members) - len(shown)} smaller ops")
    return "\n".join(lines)


def _recomputed_bytes(rows: list[dict]) -> int:
    """Bytes autograd would hold of the recomputed rows' ops (what recomputing them takes off the device)."""
    return sum(r["held_bytes"] for r in rows if r["action"] == "recompute")


def _cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, a cut marked with "…"."""
    return text if len(text) <= width else text[:width - 1] + "…"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def plan_to_dot(plan: "Plan") -> str:
    """Graphviz DOT: the ops the plan decides or stashes activations of (every row of :meth:`Plan.table`:
    with offload or compress alone there are no recompute decisions) clustered by module, filled by action,
    bytes on edges, and a legend."""
    depth = group_depth([n.module for n in plan.nodes.values()])
    clusters: dict[str, list[str]] = defaultdict(list)
    for name in plan._ops():
        node = plan.nodes.get(name)
        clusters[_group_key(node.module if node else "", depth)].append(name)
    lines = ["digraph plan {",
             f"  label={_quote(f'{plan.model_name}: budget {format_bytes(plan.budget)}, predicted peak {format_bytes(plan.predicted_peak)}')};",
             "  labelloc=t; rankdir=TB; node [shape=box, style=filled, fontsize=10, fontname=Helvetica];",
             "  edge [fontsize=8, color=gray40, fontname=Helvetica];"]
    for k, (module, names) in enumerate(clusters.items()):
        lines.append(f"  subgraph cluster_{k} {{ label={_quote(module)}; style=rounded; color=gray70;")
        for name in names:
            node = plan.nodes.get(name)
            size = format_bytes(node.nbytes) if node else ""
            lines.append(f"    {_quote(name)} [label={_quote(name + chr(10) + size)}, "
                         f"fillcolor={_quote(color(plan.action_of(name)))}];")
        lines.append("  }")
    for src, dst, nbytes in plan.edges:
        lines.append(f"  {_quote(src)} -> {_quote(dst)} [label={_quote(format_bytes(nbytes))}];")
    lines.append("  subgraph cluster_legend { label=\"legend\"; style=dashed;")
    for action in COLORS:
        if action in ("keep", "recompute") or plan.count(action):
            lines.append(f"    {_quote('legend: ' + action)} [label={_quote(action)}, fillcolor={_quote(COLORS[action])}];")
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines)


def render_svg(dot_source: str) -> str:
    """SVG text of a DOT graph, through the Graphviz ``dot`` program."""
    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError(GRAPHVIZ_MISSING)
    done = subprocess.run([dot, "-Tsvg"], input=dot_source.encode(), capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"Graphviz failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout.decode()


def _unit(nbytes: float) -> tuple[float, str]:
    return (2**30, "GiB") if nbytes >= 2**30 else (2**20, "MiB") if nbytes >= 2**20 else (2**10, "KiB")


def plot_memory(plan: "Plan", path: str | None = None, ax=None):
    """Memory over the step (forward, then backward), stacked by kind, with budget, peak and the
    unoptimized step for comparison. Returns the Axes; saves a PNG to ``path`` when given (drawn off screen:
    the caller's matplotlib backend and figures are left as they were), else draws a pyplot figure."""
    _require_matplotlib()
    t = plan.timeline
    if not t:
        raise ValueError("this plan has no timeline (made by an older autorecompute): plan again")
    scale, unit = _unit(max(max(t["baseline"]), plan.budget))
    xs = list(range(len(t["fixed"])))
    resident = [v / scale for v in t["resident"]]
    other = [max(0, f - r) / scale for f, r in zip(t["fixed"], t["resident"])]
    held = [v / scale for v in t["held"]]
    recomputed = [v / scale for v in t["recomputed"]]
    stashed = [v / scale for v in t.get("stashed") or [0] * len(xs)]
    if ax is None and path:
        ax = _offscreen_axes()
    elif ax is None:
        import matplotlib.pyplot as plt
        ax = plt.subplots(figsize=FIGURE_SIZE, dpi=FIGURE_DPI)[1]
    ax.stackplot(xs, resident, other, held, recomputed, stashed,
                 colors=["#cccccc", "#e0e0e0", COLORS["keep"], COLORS["recompute"], COLORS["compress"]],
                 labels=["parameters, buffers, inputs", "gradients, temporaries, live activations",
                         "activations held for backward", "recomputed in backward",
                         "compressed copies; restored, decompressed and rematerialized activations"], alpha=0.9)
    ax.plot(xs, [v / scale for v in t["baseline"]], color="black", lw=1, ls="--", label="unoptimized step")
    ax.axhline(plan.budget / scale, color="#cc0000", lw=1.5, label=f"budget {format_bytes(plan.budget)}")
    ax.axhline(plan.predicted_peak / scale, color="#cc0000", lw=0.8, ls=":",
               label=f"predicted peak {format_bytes(plan.predicted_peak)} (verified)")
    total = [a + b + c + d + e for a, b, c, d, e in zip(resident, other, held, recomputed, stashed)]
    peak_at = max(xs, key=total.__getitem__)
    ax.plot([peak_at], [total[peak_at]], marker="v", color="#cc0000", ms=8)
    ax.axvline(plan.num_forward - 0.5, color="gray", lw=0.8)
    where = ax.get_xaxis_transform()     # x in data, y in axes fraction
    ax.text(plan.num_forward * 0.5, 0.02, "forward", ha="center", va="bottom", color="dimgray", transform=where)
    ax.text(plan.num_forward + (len(xs) - plan.num_forward) * 0.5, 0.02, "backward", ha="center", va="bottom",
            color="dimgray", transform=where)
    ax.set_xlim(0, len(xs) - 1)
    ax.set_xlabel("step position (forward ops, then backward events)")
    ax.set_ylabel(f"memory ({unit})")
    gradients = plan.gradients_offloaded()
    details = [f"{plan.count('recompute')} of {len(plan.decisions)} ops recomputed",
               f"+{100 * plan.extra_flops_ratio:.0f}% FLOPs"]
    if moved := len(plan.stash) - len(gradients):
        details.append(f"{moved} tensors offloaded/compressed/rematerialized")
    if gradients:
        details.append(f"{len(gradients)} gradients offloaded")
    # two lines: one would run past the figure's edge with every part present
    ax.set_title(f"{plan.model_name or 'model'}: budget {format_bytes(plan.budget)}\n" + ", ".join(details),
                 fontsize=10)
    ax.legend(loc="upper right", fontsize=7, framealpha=0.9)
    if path:
        ax.figure.tight_layout()
        ax.figure.savefig(path)
    return ax


FIGURE_SIZE, FIGURE_DPI = (10, 4.8), 120


def _require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError("plot_memory needs matplotlib: pip install 'autorecompute[plot]'")


def _offscreen_axes():
    """Axes of a figure pyplot does not manage, drawn by Agg: saving a plan neither switches the caller's
    backend (it called ``matplotlib.use("Agg")``) nor leaves a figure open."""
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIGURE_SIZE, dpi=FIGURE_DPI)
    FigureCanvasAgg(figure)
    return figure.add_subplot()


def plan_to_html(plan: "Plan") -> str:
    """One self-contained page: summary, table, graph (SVG if Graphviz is installed), timeline (PNG if
    matplotlib is installed)."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>autorecompute plan: "
             f"{html.escape(plan.model_name)}</title><style>body{{font-family:sans-serif;margin:2em}}"
             f"table{{border-collapse:collapse;font-size:12px}}td,th{{border:1px solid #ddd;padding:2px 6px}}"
             f"</style></head><body>", f"<h1>autorecompute plan: {html.escape(plan.model_name)}</h1>",
             f"<pre>{html.escape(plan.summary())}</pre>"]
    try:
        buffer = io.BytesIO()
        ax = plot_memory(plan, ax=_offscreen_axes())
        ax.figure.tight_layout()
        ax.figure.savefig(buffer, format="png")
        parts.append("<h2>Memory over the step</h2><img alt='timeline' src='data:image/png;base64,"
                     + base64.b64encode(buffer.getvalue()).decode() + "'>")
    except ImportError as exc:
        parts.append(f"<p>(timeline: {html.escape(str(exc))})</p>")
    parts.append("<h2>Decisions</h2><table><tr><th>tensor</th><th>module</th><th>shape</th><th>dtype</th>"
                 "<th>bytes</th><th>action</th><th>why</th></tr>")
    for row in plan.table():
        parts.append(f"<tr style='background:{color(row['action'])}'><td>{html.escape(row['name'])}</td>"
                     f"<td>{html.escape(row['module'])}</td><td>{'x'.join(map(str, row['shape']))}</td>"
                     f"<td>{row['dtype']}</td><td>{format_bytes(row['bytes'])}</td><td>{row['action']}</td>"
                     f"<td>{html.escape(row['why'])}</td></tr>")
    parts.append("</table>")
    gradients = plan._gradient_records()
    if gradients:    # the summary names the first few; every one here
        parts.append(f"<h2>Parameter gradients offloaded ({len(gradients)})</h2><p>From their accumulation to the "
                     "end of backward, then back in <code>.grad</code>.</p><table><tr><th>parameter</th>"
                     "<th>bytes</th></tr>")
        parts += [f"<tr><td>{html.escape(name)}</td><td>{format_bytes(record.nbytes)}</td></tr>"
                  for name, record in gradients.items()]
        parts.append("</table>")
    parts.append("<h2>Graph</h2>")
    try:
        parts.append(render_svg(plan.to_dot()))
    except RuntimeError as exc:
        parts.append(f"<p>{html.escape(str(exc))}</p><pre>{html.escape(plan.to_dot())}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


SAVE_FORMATS = (".dot", ".svg", ".json", ".html", ".png")    # what :func:`save_plan` writes, by suffix


def save_plan(plan: "Plan", path: str) -> str:
    """Writes ``plan`` in the format its suffix names (:data:`SAVE_FORMATS`)."""
    path = os.path.expanduser(path) if isinstance(path, (str, os.PathLike)) else path
    suffix = Path(path).suffix.lower()
    writers = {".dot": plan.to_dot, ".json": plan.to_json, ".svg": lambda: render_svg(plan.to_dot()),
               ".html": lambda: plan_to_html(plan)}
    if suffix not in SAVE_FORMATS:
        what = f"as {suffix!r}" if suffix else f"to {str(path)!r}, which has no extension"
        raise ValueError(f"cannot save a plan {what}: use {', '.join(SAVE_FORMATS[:-1])} or {SAVE_FORMATS[-1]}")
    if suffix == ".png":
        plot_memory(plan, path)
        return path
    Path(path).write_text(writers[suffix]())
    return path
