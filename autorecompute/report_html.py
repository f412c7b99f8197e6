"""A plan as one self-contained HTML page: summary, colour legend, timeline, a graph by module and the table.

No Graphviz and no script: the graph is nested ``<details>`` boxes (a module opens to its sub-modules and its
ops), alike layers are folded into one box and one table block (:mod:`autorecompute.report_fold`), and the
ops that hold nothing for backward (views, temporaries) are behind a checkbox that CSS alone acts on.
"""
from __future__ import annotations

import base64
import html
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING

from autorecompute.budget import format_bytes
from autorecompute.fates import FATES, NOTHING_HELD
from autorecompute.report import _blocks, _offscreen_axes, output_text, plot_memory, render_svg, row_label
from autorecompute.report_fold import Fold, fate_label, fold_layers, index_ranges, shows
from autorecompute.report_graph import chip, module_graph

if TYPE_CHECKING:
    from autorecompute.plan import Plan

STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1em auto;max-width:1340px;
 padding:0 16px;color:#222;font-size:14px}
h1{font-size:22px}h2{font-size:18px;margin-top:1.6em;border-bottom:1px solid #ddd}
pre{white-space:pre-wrap;overflow-wrap:anywhere;font-size:12px;background:#f7f7f7;padding:8px;border-radius:4px}
img{max-width:100%;height:auto}
table{border-collapse:collapse;font-size:12px;width:100%;table-layout:fixed}
td,th{border:1px solid #e3e3e3;padding:2px 6px;overflow-wrap:anywhere;vertical-align:top;text-align:left}
th.block{background:#eef2f7;font-weight:600}
td.num{text-align:right;white-space:nowrap}
.chip{display:inline-block;padding:0 5px;margin:1px 2px 1px 0;border-radius:3px;border:1px solid #0002;
 white-space:nowrap;font-size:12px}
td .chip{white-space:normal}
.legend{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:4px 24px;margin:.5em 0}
.legend .chip{min-width:7.5em;text-align:center}
tr.idle{display:none;color:#777}
#show-idle:checked~table tr.idle{display:table-row}
#show-idle:checked~div .op.idle{display:inline-block}
.box{border:1px solid #c9d1db;border-radius:6px;margin:4px 0;padding:2px 8px;background:#fff}
.box>summary{cursor:pointer;padding:2px 0}
.box .kids{margin-left:14px}
.meta{color:#555;font-size:12px}
.bar{display:inline-flex;width:160px;height:10px;vertical-align:middle;border:1px solid #0003;margin:0 6px}
.bar span{display:block;height:100%}
.arrow{color:#6b7785;font-size:12px;margin-left:22px}
.op.idle{display:none}
.ops{margin:2px 0 4px 0}
"""


def _legend(rows: list[dict]) -> str:
    used = {word for row in rows for word in row["fates"]}
    entries = [f"<div>{chip(word, word)} {html.escape(meaning)}</div>" for word, meaning in FATES.items()
               if word in used or word in ("kept", "recomputed")]
    entries.append(f"<div>{chip(NOTHING_HELD, NOTHING_HELD)} autograd keeps none of the op's tensors "
                   "(views, temporaries): hidden unless shown below</div>")
    return "<h2>What happens to each activation</h2><div class='legend'>" + "".join(entries) + "</div>"


def _timeline(plan: "Plan") -> str:
    try:
        buffer = io.BytesIO()
        ax = plot_memory(plan, ax=_offscreen_axes())
        ax.figure.savefig(buffer, format="png", bbox_inches="tight")
    except (ImportError, ValueError) as exc:       # no matplotlib; a plan read from a file without a timeline
        return f"<p>(timeline: {html.escape(str(exc))})</p>"
    return ("<h2>Memory over the step</h2><img alt='memory over the step' src='data:image/png;base64,"
            + base64.b64encode(buffer.getvalue()).decode() + "'>")


def _row_cells(label: str, row: dict, what: str, why: str) -> str:
    return (f"<td>{html.escape(label)}</td><td>{html.escape(output_text(row))}</td>"
            f"<td class='num'>{format_bytes(row['held_bytes'])}</td><td>{what}</td><td>{html.escape(why)}</td>")


def _fold_rows(fold: Fold) -> list[str]:
    out = [f"<tr><th class='block' colspan='5'>{html.escape(fold.label)}: {html.escape(fold.headline())}; "
           f"{format_bytes(fold.held_bytes())} held for backward a layer</th></tr>"]
    for position in fold.positions:
        row = position.usual
        label = f"{position.inner} · {position.kind}" if position.inner else position.kind
        what = chip(fate_label(row), fate_label(row), row["action"]) + "".join(
            chip(f"{word} in layer{'s' if len(indices) > 1 else ''} {index_ranges(indices)}", word)
            for word, indices in position.differences().items())
        idle = "" if position.shows() else " class='idle'"
        out.append(f"<tr{idle}>{_row_cells(label, row, what, row['why'])}</tr>")
    return out


def _table(items: list) -> str:
    out = ["<h2>Decisions, by module</h2><p class='meta'>Alike layers are one block, with the layers whose "
           "decisions differ named op by op.</p><table><colgroup><col style='width:24%'><col style='width:17%'>"
           "<col style='width:8%'><col style='width:19%'><col style='width:32%'></colgroup><tr><th>module · op</th>"
           "<th>output (bytes it holds)</th><th>held for backward</th><th>what happens</th><th>why</th></tr>"]
    for key, block in _blocks(items):
        if isinstance(block, Fold):
            out += _fold_rows(block)
            continue
        held = sum(row["held_bytes"] for row in block)
        idle = "" if any(shows(row) for row in block) else " class='idle'"
        out.append(f"<tr{idle}><th class='block' colspan='5'>{html.escape(key)}: {format_bytes(held)} held for "
                   f"backward</th></tr>")
        within = "" if key == "<root>" else key
        for row in block:
            idle = "" if shows(row) else " class='idle'"
            what = chip(fate_label(row), fate_label(row), row["action"])
            out.append(f"<tr{idle}>{_row_cells(row_label(row, within), row, what, row['why'])}</tr>")
    out.append("</table>")
    return "\n".join(out)


def _gradients(plan: "Plan") -> str:
    gradients = plan._gradient_records()
    if not gradients:      # the summary names the first few; every one here
        return ""
    rows = "".join(f"<tr><td>{html.escape(name)}</td><td>{format_bytes(record.nbytes)}</td></tr>"
                   for name, record in gradients.items())
    return (f"<h2>Parameter gradients offloaded ({len(gradients)})</h2><details><summary>From their accumulation "
            "to the end of backward, then back in <code>.grad</code>: the parameters</summary><table><tr>"
            "<th>parameter</th><th>bytes</th></tr>" + rows + "</table></details>")


def plan_to_html(plan: "Plan") -> str:
    """One self-contained page: summary, colour legend, timeline (PNG, with matplotlib), the graph by module
    and the table of decisions (alike layers folded), parameter gradients offloaded."""
    rows = plan.table()
    items = fold_layers(rows)
    title = html.escape(f"autorecompute plan: {plan.model_name}")
    hidden = sum(1 for row in rows if not shows(row))
    return "\n".join([
        f"<!doctype html><html><head><meta charset='utf-8'><meta name='viewport' content='width=device-width'>"
        f"<title>{title}</title><style>{STYLE}</style></head><body>", f"<h1>{title}</h1>",
        f"<pre>{html.escape(plan.summary())}</pre>", _legend(rows), _timeline(plan),
        # one checkbox before the graph and the table, its siblings: CSS shows the ops it hides in both
        f"<div><input type='checkbox' id='show-idle'><label for='show-idle'> show the {hidden} ops that hold "
        "nothing for backward (views, temporaries) in the graph and the table</label>",
        "<h2>Graph, by module</h2><p class='meta'>Forward order, top to bottom; a box opens to its sub-modules "
        "and ops; the bar splits what it holds for backward by fate; arrows carry the bytes one module passes "
        "the next; * marks an op of alike layers whose decision differs between them (hover for which).</p>",
        f"<div class='graph'>{module_graph(plan, items)}</div>",
        _table(items), "</div>", _gradients(plan), "</body></html>"])


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
