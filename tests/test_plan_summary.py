"""Reading the plan of a deep model: a summary whose lines are the table's totals (and the JSON's), alike
layers folded into one, a page without Graphviz, a timeline whose legend and labels leave the curves alone."""
import dataclasses
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

import autorecompute
import models
from autorecompute.budget import format_bytes
from autorecompute.plan import FATES, NOTHING_HELD, Plan, fate, tensor_bytes
from autorecompute.report import format_table
from autorecompute.report_html import plan_to_html
from autorecompute.report_fold import Fold, fold_layers, index_ranges, layer_of
from conftest import SOLVER_TIME

# every fate among them: recompute with offload (gpt, llama), recompute alone (rematerialize, chains), compress
CASES = {"gpt": ("gpt", 0.6, None), "llama": ("llama", 0.6, None), "resnet-recompute": ("resnet", 0.6, ("recompute",)),
         "mlp-compress": ("mlp", 0.75, ("compress",))}


@pytest.fixture(scope="module", params=list(CASES))
def plan(request):
    name, budget, actions = CASES[request.param]
    case = models.make(name)
    extra = {"actions": actions} if actions else {}
    return autorecompute.plan(case.model, *case.args, budget=budget, solver_time_limit=SOLVER_TIME, **extra,
                              **case.kwargs)


def _fate_lines(summary: str) -> dict[str, tuple[str, str]]:
    """fate → (bytes, count) as the summary prints them."""
    lines = {}
    for line in summary.splitlines():
        match = re.match(r"^    (\w+) +(\d+(?:\.\d+)? \w+)  (\d.*? ops?)(?:\s|$)", line)
        if match and match[1] in FATES:
            lines[match[1]] = (match[2], match[3].strip())
    return lines


@pytest.mark.slow
def test_the_summary_says_what_the_table_and_the_json_say(plan):
    """Every fate line of the summary is the total of the table's rows — bytes, ops, tensors — for the plan and
    for the plan read back from JSON; the fates' bytes add up to what autograd holds; no line leaves out a fate
    the table uses."""
    for reading in (plan, Plan.from_json(plan.to_json())):
        rows, summary = reading.table(), reading.summary()
        stats, printed = reading.fates(), _fate_lines(summary)
        assert set(printed) >= {word for row in rows for word in row["fates"]}
        for word in FATES:
            named = [row for row in rows if word in row["fates"]]
            stashed = [r for key, r in reading.stash.items() if not key.startswith("grad:") and fate(r.action) == word]
            assert stats[word] == {"ops": len(named), "bytes": sum(row["held_by"][word] for row in named),
                                   "tensors": len(stashed)}
            if word in printed:
                ops = f"{len(named)} op" + ("" if len(named) == 1 else "s")
                tensors = f"{len(stashed)} tensor" + ("" if len(stashed) == 1 else "s")
                count = {"kept": ops, "recomputed": f"{len(named)} of {len(reading.decisions)} ops"}
                assert printed[word] == (format_bytes(stats[word]["bytes"]), count.get(word, f"{tensors} of {ops}"))
        held = sum(row["held_bytes"] for row in rows)
        assert sum(stat["bytes"] for stat in stats.values()) == held
        assert all(sum(row["held_by"].values()) == row["held_bytes"] for row in rows)
        holding = sum(1 for row in rows if row["held_bytes"])
        assert f"{format_bytes(held)} held for backward by {holding} of {len(rows)} ops" in summary
        # recomputing is one thing in every view: the table's recomputed rows are the plan's recompute count
        recomputed = [row for row in rows if row["action"].split("+")[0] == "recompute"]
        assert len(recomputed) == reading.count("recompute") == stats["recomputed"]["ops"]
        off = sum(n for action, n in reading.bytes_by_action().items() if action != "keep")
        assert f"{format_bytes(off)} of it off the device by action" in summary


def test_extra_flops_and_time_each_say_what_they_count(plan):
    """The FLOPs line splits the extra FLOPs into recomputing and rematerializing, which add up; the time line
    names the copies and codecs it prices beside the ops run again."""
    summary = plan.summary()
    flops = next(line for line in summary.splitlines() if line.startswith("  extra FLOPs"))
    time = next(line for line in summary.splitlines() if line.startswith("  extra time"))
    rematerializing = plan.rematerialize_flops()
    assert f"{plan.extra_flops - rematerializing:.3g} recomputing" in flops
    assert (f"{rematerializing:.3g} rematerializing" in flops) == bool(plan.count("rematerialize"))
    assert "matmuls, convolutions" in flops and "ops run again" in time
    assert ("offloaded tensor" in time) == bool(plan.fates()["offloaded"]["tensors"])
    assert ("encoding and decoding" in time) == bool(plan.fates()["compressed"]["tensors"])


def test_a_scalar_loss_shows_the_bytes_its_tensor_holds():
    """A loss computed in the model is a 4-byte scalar whose op allocates (and autograd keeps) its
    log-softmax: the table says 4 B for the tensor and the log-softmax's bytes as held for backward, and the
    bytes the op allocates are labelled as such in ``bytes``. (Label smoothing keeps autograd's cross-entropy:
    capture makes an unsmoothed one lean, holding the logits instead.)"""
    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 512)

        def forward(self, x, target):
            return F.cross_entropy(torch.tanh(self.fc(x)), target, label_smoothing=0.1)

    torch.manual_seed(0)
    plan = autorecompute.plan(Loss(), torch.randn(256, 64), torch.randint(0, 512, (256,)), budget=1.0,
                              solver_time_limit=SOLVER_TIME)
    loss = next(row for row in plan.table() if row["name"].startswith("cross_entropy"))
    assert loss["shape"] == () and loss["tensor_bytes"] == 4 == tensor_bytes((), "float32")
    assert loss["bytes"] >= 256 * 512 * 4 and loss["held_bytes"] >= 256 * 512 * 4
    line = next(line for line in format_table(plan).splitlines() if "cross_entropy" in line)
    assert "scalar float32 4 B" in line and format_bytes(loss["held_bytes"]) in line


def _rows(layers: int, decide, ops=(("ln", "layer_norm"), ("attn", "matmul"), ("attn", "view"), ("mlp", "gelu"))):
    """Table rows of ``layers`` alike layers of ``model.layers``: ``decide(layer, op)`` → "keep" / "recompute"
    / "offload:late" for the ops that hold bytes; the views hold nothing."""
    rows = []
    for layer in range(layers):
        for k, (module, kind) in enumerate(ops):
            held = 0 if kind == "view" else 1 << 20
            action = decide(layer, k) if held else "keep"
            fates = (fate(action),) if held or action == "recompute" else ()
            rows.append({"name": f"{kind}_{layer * len(ops) + k}" if layer or k else kind, "module":
                         f"model.layers.{layer}.{module}", "shape": (8, 128), "dtype": "float32",
                         "tensor_bytes": 4096, "bytes": held, "held_bytes": held, "action": action, "fates": fates,
                         "held_by": {word: held for word in fates}, "flops": 0, "why": f"{action} because"})
    return rows


def test_alike_layers_fold_into_one_with_their_differences_listed():
    """Twelve layers of the same ops fold into one, found from the module paths (``layers.3``) and the op
    kinds (FX's numbers stripped); a layer whose decision differs is named beside the op; a layer with
    other ops (one more op) stays apart; numbered modules of one op each (a Sequential stem) do not fold."""
    rows = _rows(12, lambda layer, k: "offload:late" if (layer == 3 and k == 1) else "keep")
    odd = _rows(1, lambda layer, k: "keep", ops=(("ln", "layer_norm"), ("attn", "matmul"), ("attn", "softmax")))
    for row in odd:
        row["module"] = row["module"].replace("layers.0", "layers.12")
    stem = [{**rows[0], "name": f"conv_{k}", "module": f"stem.{k}"} for k in range(3)]
    items = fold_layers(stem + rows + odd)
    folds = [item for item in items if isinstance(item, Fold)]
    assert len(folds) == 1 and folds[0].indices == tuple(range(12)) and folds[0].label == "model.layers.0–11"
    assert [item["name"] for item in items if not isinstance(item, Fold)] == ["conv_0", "conv_1", "conv_2",
                                                                              *(row["name"] for row in odd)]
    (differing,) = folds[0].differing()
    assert (differing.inner, differing.kind) == ("attn", "matmul")
    assert differing.differences() == {"offloaded": [3]} and differing.usual["action"] == "keep"
    assert folds[0].headline() == "12 layers alike, 4 ops each: decisions differ between layers in 1 of the 4 ops"
    text = format_table(type("Rows", (), {"table": lambda self: stem + rows + odd})())
    assert "[model.layers.0–11] 12 layers alike" in text and "kept; offloaded in layer 3" in text
    assert "model.layers.5" not in text and "[model.layers.12]" in text
    same = fold_layers(_rows(12, lambda layer, k: "recompute"))
    assert same[0].headline().endswith("the same decisions in every layer")


def test_a_deep_model_prints_one_block_for_its_layers():
    """48 layers, every other one recomputed: one block whose ops name the recomputed layers; the table is
    short; the views that hold nothing are counted, not listed; long names end in "…"."""
    rows = _rows(48, lambda layer, k: "recompute" if layer % 2 else "keep")
    text = format_table(type("Deep", (), {"table": lambda self: rows})())
    assert "[model.layers.0–47] 48 layers alike, 4 ops each" in text
    assert "kept; recomputed in layers 1, 3, …, 47" in text and "model.layers.47" not in text
    assert "(1 more op a layer holding nothing not listed)" in text and text.count("\n") < 12
    assert index_ranges([0, 1, 2, 5, 7, 8]) == "0–2, 5, 7–8"
    assert layer_of("transformer.h.3.attn") == ("transformer.h", 3, "attn")
    long = [{**rows[0], "name": "scaled_dot_product_attention_for_a_long_time", "module": "model.layers.0.attn.inner"}]
    assert "0.attn.inner · scaled_dot_product…" in format_table(type("One", (), {"table": lambda self: long})())


def test_the_page_folds_layers_hides_views_and_needs_no_graphviz(plan, monkeypatch):
    """Without Graphviz (and with no program to run) the page draws the graph itself: module boxes that open
    (``<details>``), no DOT text, no SVG from Graphviz, nothing fetched, no script; alike layers are one box
    and one table block; the ops that hold nothing are rows CSS hides until the checkbox is ticked; every
    fate the plan uses is in the colour legend."""
    monkeypatch.setattr(shutil, "which", lambda name: None)

    def no_program(*args, **kwargs):
        raise AssertionError("the page ran a program")

    monkeypatch.setattr(subprocess, "run", no_program)
    page = plan_to_html(plan)
    rows = plan.table()
    assert "digraph" not in page and "subgraph" not in page and "<svg" not in page and "<script" not in page
    assert not re.search(r"(src|href)=['\"]?https?:", page)
    assert "<details class='box'" in page and "<summary>" in page
    folds = [item for item in fold_layers(rows) if isinstance(item, Fold)]
    for fold in folds:
        assert f"{fold.label}: {fold.headline()}" in page
        assert re.search(rf"<b>[^<]*{re.escape(fold.label.split('.')[-1])}</b>", page)
    hidden = sum(1 for row in rows if not row["fates"])
    assert f"show the {hidden} ops that hold nothing" in page and "#show-idle:checked~table tr.idle" in page
    table = page.split("<h2>Decisions, by module</h2>")[1].split("</table>")[0]
    listed = table.count("<tr class='idle'><td>") + table.count("<tr><td>")
    assert listed == len(rows) - sum(len(f.layers[0]) * (len(f.indices) - 1) for f in folds)
    legend = page.split("What happens to each activation</h2>")[1].split("</div></div>")[0]
    for word in {w for row in rows for w in row["fates"]} | {NOTHING_HELD}:
        assert f">{word}</span> " in legend


def test_the_timeline_legend_and_labels_leave_the_curves_alone(plan):
    """The legend is below the axes (it covered the unoptimized step's peak); budget and predicted peak are
    two line styles labelled past the right edge, the labels apart even when the lines nearly coincide; the
    picture says what was saved."""
    pytest.importorskip("matplotlib")
    from autorecompute.report import _offscreen_axes, plot_memory

    close = dataclasses.replace(plan, predicted_peak=plan.budget - 1)
    for reading in (plan, close):
        ax = plot_memory(reading, ax=_offscreen_axes())
        ax.figure.tight_layout()
        renderer = ax.figure.canvas.get_renderer()
        frame, legend = ax.get_window_extent(renderer), ax.get_legend().get_window_extent(renderer)
        assert not frame.overlaps(legend) and legend.y1 <= frame.y0
        lines = {str(line.get_label()).split()[0]: line for line in ax.get_lines() if line.get_label()[0] != "_"}
        assert lines["budget"].get_linestyle() != lines["predicted"].get_linestyle()
        assert lines["budget"].get_color() != lines["predicted"].get_color()
        labels = [text for text in ax.texts if text.get_text().startswith(("budget\n", "peak\n"))]
        boxes = [text.get_window_extent(renderer) for text in labels]
        assert len(boxes) == 2 and not boxes[0].overlaps(boxes[1])
        assert all(box.x0 >= frame.x1 for box in boxes)
        saved = f"peak {format_bytes(reading.baseline_peak)} → {format_bytes(reading.predicted_peak)}"
        assert saved in ax.get_title() and any(text.get_text().startswith(saved) for text in ax.texts)
