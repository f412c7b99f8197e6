"""Reading a plan: a folded table, a Graphviz graph, a memory timeline, one HTML page."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from autorecompute.budget import format_bytes
from autorecompute.fates import FATES, NOTHING_HELD, fate, plural
from autorecompute.report_fold import Fold, fate_label, fold_layers, index_ranges, layer_of, shows

if TYPE_CHECKING:
    from autorecompute.plan import Plan

COLORS = {"keep": "#b6d7a8", "recompute": "#f6b26b", "rematerialize": "#ffe599", "offload": "#9fc5e8",
          "compress": "#d5a6bd"}


# the same colours by the plan's words (FATES), and for ops that hold nothing for backward
FATE_COLORS = {**{fate(action): fill for action, fill in COLORS.items()}, NOTHING_HELD: "#f3f3f3"}


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


def output_text(row: dict) -> str:
    """The op's output as people read it: shape, dtype and the bytes the tensor holds ("view": it allocates
    nothing; "-": it makes no tensor)."""
    if not row["dtype"]:
        return "- (no tensor of its own)"
    shape = "x".join(map(str, row["shape"])) or "scalar"
    size = format_bytes(row.get("tensor_bytes", 0)) if row.get("bytes", 1) else "view"
    return f"{shape} {row['dtype']} {size}"


def row_label(row: dict, within: str) -> str:
    """Module first, then the op: ``attn.c_attn · addmm`` for a row of module ``<within>.attn.c_attn``."""
    module = row["module"]
    inner = module[len(within) + 1:] if within and module.startswith(within + ".") else \
        ("" if module == within else module)
    return f"{inner} · {row['name']}" if inner else row["name"]


def _blocks(items: list) -> list[tuple[str, object]]:
    """The table's blocks in graph order: each fold alone; between folds, the other rows by layer
    (``layers.2``: a numbered module of two ops or more), else by module path at the depth that keeps at most
    MAX_GROUPS groups."""
    plain = [item for item in items if not isinstance(item, Fold)]
    sizes = Counter(where[:2] for where in map(layer_of, (row["module"] for row in plain)) if where)

    def layer(row: dict) -> str | None:
        where = layer_of(row["module"])
        if where is None:
            return None
        return ".".join(filter(None, [where[0], str(where[1])])) if sizes[where[:2]] >= 2 else (where[0] or "<root>")

    depth = group_depth([row["module"] for row in plain if layer(row) is None])
    blocks: dict[tuple[int, str], object] = {}
    folds = 0
    for item in items:
        if isinstance(item, Fold):
            folds += 1
            blocks[(folds, item.label)] = item
        else:
            blocks.setdefault((folds, layer(item) or _group_key(item["module"], depth)), []).append(item)
    return [(key, block) for (_, key), block in blocks.items()]


def format_table(plan: "Plan", max_rows_per_group: int = 8) -> str:
    """The plan's rows by module, alike layers folded into one (:mod:`autorecompute.report_fold`), the ops
    holding most first within a group; ops that hold nothing for backward are counted, not listed."""
    items = fold_layers(plan.table())
    lines = [f"  {'module · op':<36} {'output (bytes it holds)':<30} {'held':>11}  {'what happens':<24} why"]
    for key, block in _blocks(items):
        if isinstance(block, Fold):
            lines += _fold_lines(block)
            continue
        shown = [row for row in block if shows(row)]
        held = sum(row["held_bytes"] for row in block)
        hidden = len(block) - len(shown)
        lines.append(f"  [{key}] {format_bytes(held)} held for backward by {plural(len(shown), 'op')}"
                     + (f"; {hidden} more holding nothing not listed" if hidden else ""))
        top = sorted(shown, key=lambda row: -row["held_bytes"])[:max_rows_per_group]
        within = "" if key == "<root>" else key
        lines += [_line(row_label(row, within), row, fate_label(row), row["why"])
                  for row in sorted(top, key=block.index)]
        if len(shown) > len(top):
            rest = sum(row["held_bytes"] for row in shown if row not in top)
            lines.append(f"    ... {len(shown) - len(top)} smaller ops holding {format_bytes(rest)}")
    return "\n".join(lines)


def _fold_lines(fold: Fold) -> list[str]:
    lines = [f"  [{fold.label}] {fold.headline()}; {format_bytes(fold.held_bytes())} held for backward a layer"]
    hidden = 0
    for position in fold.positions:
        if not position.shows():
            hidden += 1
            continue
        row = position.usual
        label = f"{position.inner} · {position.kind}" if position.inner else position.kind
        lines.append(_line(label, row, fold_fate_text(position), row["why"]))
    if hidden:
        lines.append(f"    ({plural(hidden, 'more op')} a layer holding nothing not listed)")
    return lines


def fold_fate_text(position) -> str:
    """The usual fate of a folded op, and the layers where it differs: "offloaded; kept in layers 0–1"."""
    return "; ".join([fate_label(position.usual)] + [
        f"{label} in layer{'s' if len(indices) > 1 else ''} {index_ranges(indices)}"
        for label, indices in position.differences().items()])


def _line(label: str, row: dict, what: str, why: str) -> str:
    return (f"    {_cut(label, 34):<34} {_cut(output_text(row), 30):<30} {format_bytes(row['held_bytes']):>11}  "
            f"{what:<24} {why}")


def _cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, a cut marked with "…"."""
    return text if len(text) <= width else text[:width - 1] + "…"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def plan_to_dot(plan: "Plan") -> str:
    """Graphviz DOT: the ops the plan decides or stashes activations of (every row of :meth:`Plan.table`:
    with offload or compress alone there are no recompute decisions) clustered by module, filled by what
    happens to what they hold (:data:`~autorecompute.plan.FATES`), bytes on edges, and a legend."""
    depth = group_depth([n.module for n in plan.nodes.values()])
    rows = {row["name"]: row for row in plan.table()}
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
            row = rows[name]
            label = f"{row_label(row, '' if module == '<root>' else module)}\nholds {format_bytes(row['held_bytes'])}"
            lines.append(f"    {_quote(name)} [label={_quote(label)}, "
                         f"fillcolor={_quote(FATE_COLORS[(row['fates'] or (NOTHING_HELD,))[0]])}];")
        lines.append("  }")
    for src, dst, nbytes in plan.edges:
        lines.append(f"  {_quote(src)} -> {_quote(dst)} [label={_quote(format_bytes(nbytes))}];")
    lines.append("  subgraph cluster_legend { label=\"legend\"; style=dashed;")
    used = {word for row in rows.values() for word in row["fates"]}
    for word in [*FATES, NOTHING_HELD]:
        if word in used or word in ("kept", "recomputed", NOTHING_HELD):
            lines.append(f"    {_quote('legend: ' + word)} [label={_quote(word)}, "
                         f"fillcolor={_quote(FATE_COLORS[word])}];")
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
    """Memory over the step (forward, then backward), stacked by kind, the unoptimized step dashed, the budget
    and the verified peak as lines labelled at the right edge, what the plan saved annotated, the legend
    below the plot. Returns the Axes; saves a PNG to ``path`` when given (drawn off screen: the caller's
    matplotlib backend and figures are left as they were), else draws a pyplot figure."""
    _require_matplotlib()
    t = plan.timeline
    if not t:
        raise ValueError("this plan has no timeline (made by an older autorecompute): plan again")
    if ax is None and path:
        ax = _offscreen_axes()
    elif ax is None:
        import matplotlib.pyplot as plt
        ax = plt.subplots(figsize=FIGURE_SIZE, dpi=FIGURE_DPI)[1]
    scale, unit = _unit(max(max(t["baseline"]), plan.budget))
    xs = list(range(len(t["fixed"])))
    total = _stack(ax, plan, xs, scale)
    baseline = [v / scale for v in t["baseline"]]
    ax.plot(xs, baseline, color="black", lw=1, ls="--", label="unoptimized step")
    ax.set_xlim(0, len(xs) - 1)
    ax.set_ylim(0, 1.16 * max(max(baseline), max(total), plan.budget / scale))
    _limit_lines(ax, plan, scale)
    _saved(ax, plan, baseline, scale)
    ax.axvline(plan.num_forward - 0.5, color="gray", lw=0.8)
    where = ax.get_xaxis_transform()     # x in data, y in axes fraction
    ax.text(plan.num_forward * 0.5, 0.02, "forward", ha="center", va="bottom", color="dimgray", transform=where)
    ax.text(plan.num_forward + (len(xs) - plan.num_forward) * 0.5, 0.02, "backward", ha="center", va="bottom",
            color="dimgray", transform=where)
    ax.set_xlabel("step position (forward ops, then backward events)")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(_timeline_title(plan), fontsize=10)
    # below the plot, where it covers no curve (inside, the unoptimized step's peak is often under it)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=8, frameon=False)
    if path:
        ax.figure.tight_layout()
        ax.figure.savefig(path, bbox_inches="tight")
    return ax


FIGURE_SIZE, FIGURE_DPI = (10, 5.6), 120
BUDGET_COLOR, PEAK_COLOR = "#cc0000", "#1f4e99"


def _stack(ax, plan: "Plan", xs: list[int], scale: float) -> list[float]:
    """The stacked kinds of memory, each in its fate's colour and named in the plan's words; kinds the plan
    has none of stay out of the legend. Returns the stack's top."""
    t = plan.timeline
    words = [word for word in ("offloaded", "rematerialized", "compressed") if plan.fates()[word]["tensors"]]
    series = [("parameters, buffers, inputs", "#cccccc", t["resident"]),
              ("gradients, temporaries, activations in use", "#e0e0e0",
               [max(0, f - r) for f, r in zip(t["fixed"], t["resident"])]),
              ("activations kept for backward", FATE_COLORS["kept"], t["held"]),
              ("recomputed activations, in backward", FATE_COLORS["recomputed"], t["recomputed"]),
              (" and ".join(words) + " activations back on the device" if words else "stashed activations",
               FATE_COLORS[words[0]] if words else FATE_COLORS["offloaded"], t.get("stashed") or [0] * len(xs))]
    values = [[v / scale for v in kind] for _, _, kind in series]
    ax.stackplot(xs, *values, colors=[c for _, c, _ in series], alpha=0.9,
                 labels=[label if any(kind) else "_" + label for (label, _, kind) in series])
    return [sum(parts) for parts in zip(*values)]


def _limit_lines(ax, plan: "Plan", scale: float) -> None:
    """The budget (solid red) and the predicted peak (dashed blue), each labelled past the right edge: the
    higher one's label above its line, the lower one's below its own, so they never overlap however close the
    lines are."""
    budget, peak = plan.budget / scale, plan.predicted_peak / scale
    ax.axhline(budget, color=BUDGET_COLOR, lw=1.6, label=f"budget {format_bytes(plan.budget)}")
    ax.axhline(peak, color=PEAK_COLOR, lw=1.3, ls=(0, (5, 3)),
               label=f"predicted peak {format_bytes(plan.predicted_peak)} (verified)")
    for value, text, tint, above in ((budget, f"budget\n{format_bytes(plan.budget)}", BUDGET_COLOR, budget >= peak),
                                     (peak, f"peak\n{format_bytes(plan.predicted_peak)}", PEAK_COLOR, peak > budget)):
        ax.annotate(text, xy=(1, value), xycoords=ax.get_yaxis_transform(), xytext=(5, 1 if above else -1),
                    textcoords="offset points", va="bottom" if above else "top", ha="left", fontsize=8,
                    color=tint, annotation_clip=False, linespacing=1.0)


def _saved(ax, plan: "Plan", baseline: list[float], scale: float) -> None:
    """An arrow from the unoptimized step's peak down to the plan's: what was saved, in the picture."""
    at = max(range(len(baseline)), key=baseline.__getitem__)
    top, peak = baseline[at], plan.predicted_peak / scale
    ax.plot([at], [top], marker="v", color="black", ms=6)
    if top <= peak:
        return
    ax.annotate("", xy=(at, peak), xytext=(at, top), arrowprops={"arrowstyle": "->", "color": "black", "lw": 1.2})
    right = at < 0.6 * len(baseline)
    ax.annotate(f"peak {format_bytes(plan.baseline_peak)} → {format_bytes(plan.predicted_peak)}\n"
                f"(−{100 * (1 - plan.predicted_peak / plan.baseline_peak):.0f}%)", xy=(at, (top + peak) / 2),
                xytext=(8 if right else -8, 0), textcoords="offset points", ha="left" if right else "right",
                va="center", fontsize=9, bbox={"boxstyle": "round", "fc": "white", "ec": "#999999", "alpha": 0.9})


def _timeline_title(plan: "Plan") -> str:
    stats = plan.fates()
    done = [plural(plan.count("recompute"), "op") + " recomputed"] if "recompute" in plan.actions else []
    done += [f"{plural(stats[word]['tensors'], 'tensor')} {word}" for word in ("rematerialized", "offloaded",
                                                                               "compressed") if stats[word]["tensors"]]
    if gradients := plan.gradients_offloaded():
        done.append(plural(len(gradients), "gradient") + " offloaded")
    done += [f"+{100 * plan.extra_flops_ratio:.0f}% FLOPs", f"+{1e3 * plan.extra_seconds:.3g} ms priced"]
    # two lines: one would run past the figure's edge with every part present
    return (f"{plan.model_name or 'model'}: peak {format_bytes(plan.baseline_peak)} → "
            f"{format_bytes(plan.predicted_peak)} under a budget of {format_bytes(plan.budget)}\n" + ", ".join(done))


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
