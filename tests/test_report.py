"""Reading a plan: every dump format for three models, JSON round trip, the timeline picture."""
import dataclasses
import json
import shutil

import pytest
import torch

import autorecompute
import models
from autorecompute.plan import SCHEMA_VERSION, Plan
from autorecompute.report import GRAPHVIZ_MISSING
from autorecompute.report_html import plan_to_html
from conftest import SOLVER_TIME

MODELS = ("gpt", "resnet", "bert")


@pytest.fixture(scope="module", params=MODELS)
def plan(request):
    case = models.make(request.param)
    return autorecompute.plan(case.model, *case.args, budget=0.6, solver_time_limit=SOLVER_TIME, **case.kwargs)


@pytest.mark.slow
def test_json_round_trips_to_an_equal_plan(plan, tmp_path):
    path = plan.save(str(tmp_path / "plan.json"))
    text = open(path).read()
    assert json.loads(text)["schema_version"] == SCHEMA_VERSION
    assert Plan.from_json(text) == plan


def test_dot_has_clusters_colors_edges_and_legend(plan, tmp_path):
    dot = open(plan.save(str(tmp_path / "plan.dot"))).read()
    assert dot.startswith("digraph plan {")
    assert "subgraph cluster_0" in dot and "cluster_legend" in dot
    assert "#f6b26b" in dot and "#b6d7a8" in dot           # recompute and keep fills
    assert dot.count("->") == len(plan.edges) > 0
    assert " KiB" in dot or " MiB" in dot                   # sizes on nodes and edges


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' not installed")
def test_svg_renders_through_graphviz(plan, tmp_path):
    svg = open(plan.save(str(tmp_path / "plan.svg"))).read()
    assert "<svg" in svg and "recompute" in svg


def test_svg_without_graphviz_says_how_to_install(plan, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get install graphviz"):
        plan.save(str(tmp_path / "plan.svg"))
    assert "Graphviz" in GRAPHVIZ_MISSING


def test_html_is_one_self_contained_page(plan, tmp_path):
    page = open(plan.save(str(tmp_path / "plan.html"))).read()
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    assert "data:image/png;base64," in page                 # the timeline, inline
    assert "<table>" in page and plan.model_name in page
    assert "src='http" not in page and 'src="http' not in page


def test_timeline_png_and_its_peak_line(plan, tmp_path):
    import matplotlib.image

    ax = plan.plot_memory()
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert any(label.startswith("budget") for label in labels)
    peak_lines = [line for line in ax.get_lines() if "predicted peak" in str(line.get_label())]
    scale = {"MiB": 2**20, "GiB": 2**30, "KiB": 2**10}[ax.get_ylabel().split("(")[1].rstrip(")")]
    assert peak_lines and peak_lines[0].get_ydata()[0] * scale == pytest.approx(plan.predicted_peak)
    assert plan.model_name in ax.get_title()
    path = plan.save(str(tmp_path / "timeline.png"))
    assert matplotlib.image.imread(path).shape[0] > 300


def test_printed_plan_has_summary_and_a_folded_table(plan):
    text = str(plan)
    for word in ("budget", "predicted peak", "baseline peak", "minimum peak", "solver", "gap", "why"):
        assert word in text
    assert len(text.splitlines()) < 400
    # a plan no lower bound was proven for (local search, windows): its gap is unknown, not 100%
    unbounded = dataclasses.replace(plan, solver_gap=1.0).summary()
    assert "gap unknown (no lower bound proven)" in unbounded and "gap 100" not in unbounded
    rows = plan.table()
    assert len(rows) == len(plan.decisions)
    assert {"name", "module", "shape", "dtype", "bytes", "action", "why"} <= set(rows[0])
    by_action = plan.bytes_by_action()
    assert set(by_action) <= {"keep", "recompute", "rematerialize", "offload", "offload:late"}
    # every held byte is accounted for once: kept, recomputed or moved off the device
    assert sum(by_action.values()) == sum(r["held_bytes"] for r in rows)
    actions = {r["name"]: r["action"] for r in rows}
    for name, record in plan.stash.items():
        if name.startswith("grad:"):      # a parameter's gradient: listed apart, no op's held bytes
            assert "gradients" in text and record.owner == name
            continue
        assert record.action in actions[record.owner]
        assert record.action in text


def test_repr_is_one_line_naming_the_step_and_its_outcome(plan):
    """``repr`` (what a dict of plans prints) is one line: the dataclass's own spelled out every node record
    and the timeline (37 KB for a small GPT-2)."""
    text = repr(plan)
    assert "\n" not in text and len(text) < 300
    assert plan.signature in text and plan.model_name in text
    assert f"{plan.count('recompute')} of {len(plan.decisions)} ops recomputed" in text


def test_saving_an_unknown_format_is_an_error(plan, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"\.dot, \.svg, \.json, \.html or \.png"):
        plan.save(str(tmp_path / "plan.pdf"))
    with pytest.raises(ValueError, match=r"'.*out', which has no extension"):
        plan.save(str(tmp_path / "out"))
    monkeypatch.setenv("HOME", str(tmp_path))        # "~" is the home directory, as in a shell
    plan.save("~/plan.json")
    assert (tmp_path / "plan.json").exists()


def test_an_offload_only_plan_reports_what_it_moves():
    """Without "recompute" no op is decided; the table, the totals and the summary still show the offloaded
    tensors and what stays: bytes by action add up to what autograd holds."""
    case = models.make("mlp")
    plan = autorecompute.plan(case.model, *case.args, budget=0.7, actions=("offload",), solver_time_limit=1.0)
    moved = sum(r.saved_bytes for r in plan.stash.values())
    totals = plan.bytes_by_action()
    assert moved > 0 and totals.get("offload", 0) + totals.get("offload:late", 0) == moved
    assert sum(row["held_bytes"] for row in plan.table()) == sum(totals.values())
    assert any(row["action"].startswith("offload") for row in plan.table())
    assert "offload" in plan.summary().split("by action:")[1]


@pytest.mark.parametrize("text, says", [("[1, 2]", "must be an object"),
                                        (json.dumps({"schema_version": SCHEMA_VERSION, "decisions": {}}), "lacks")])
def test_a_file_that_is_not_a_plan_is_refused_clearly(text, says):
    with pytest.raises(ValueError, match=says):
        Plan.from_json(text)


def test_a_scalar_prints_as_a_scalar_and_an_op_without_a_tensor_as_a_dash():
    """A scalar's output shows the 4 bytes it holds, not what its op allocates; an op without a tensor of its
    own shows a dash (both hold or recompute something here, so both are listed)."""
    from autorecompute.report import format_table

    class Root:
        def table(self):
            return [{"name": name, "module": "", "shape": (), "dtype": dtype, "tensor_bytes": size, "bytes": nbytes,
                     "held_bytes": held, "action": action, "fates": (word,), "held_by": {word: held}, "why": "…"}
                    for name, dtype, size, nbytes, held, action, word in (
                        ("cross_entropy_loss", "float32", 4, 2 << 20, 2 << 20, "keep", "kept"),
                        ("flatten", "", 0, 0, 0, "recompute", "recomputed"))]

    lines = [line for line in format_table(Root()).splitlines() if line.startswith("    ")]
    rows = {line.split()[0]: line.split()[1] for line in lines}
    assert rows == {"cross_entropy_loss": "scalar", "flatten": "-"}
    assert "scalar float32 4 B" in lines[0] and "2.00 MiB" in lines[0].split("4 B")[1]


def test_graph_and_page_show_stash_only_plans_and_every_offloaded_gradient():
    """With offload alone there are no recompute decisions: the graph still draws the ops whose tensors the
    plan offloads (it drew none), and the HTML page lists every parameter gradient offloaded (the summary
    names four; the rest were on no page)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU()) for _ in range(8)])
    x = torch.randn(512, 128)
    offload_only = autorecompute.plan(model, x, budget=0.6, actions=("offload",), solver_time_limit=SOLVER_TIME)
    owners = {record.owner for name, record in offload_only.stash.items() if not name.startswith("grad:")}
    assert owners and not offload_only.decisions
    dot = offload_only.to_dot()
    assert all(f'"{owner}" [label=' in dot for owner in owners)
    plan = autorecompute.plan(model, x, budget=0.4, loss_reserve=0, solver_time_limit=SOLVER_TIME)
    gradients = plan.gradients_offloaded()
    assert len(gradients) > 4
    page = plan_to_html(plan)
    assert f"Parameter gradients offloaded ({len(gradients)})" in page
    assert all(f"<td>{name}</td>" in page for name in gradients)


@pytest.mark.parametrize("objective", ["time", "flops"])
def test_the_plan_says_the_extra_time_its_cost_model_prices(objective):
    """``extra_seconds`` is the plan's price at the ``TransferModel``'s speeds whatever the objective: with
    only FLOPs priced (1 GFLOP/s, calls, bytes and regions free) it is the extra FLOPs in nanoseconds; a plan
    that does nothing costs nothing; a schema-7 file reads as 0."""
    free_calls = autorecompute.TransferModel(
        flops_per_second=1e9, write_bytes_per_second=1e9, read_bytes_per_second=1e9, per_transfer_seconds=0.0,
        memory_bytes_per_second=1e30, random_bytes_per_second=1e30, op_seconds=0.0, region_seconds=0.0,
        stash_seconds=0.0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6)])
    x = torch.randn(2048, 64)
    plan = autorecompute.plan(model, x, budget=0.8, actions=("recompute",), transfer=free_calls,
                              objective=objective, solver_time_limit=SOLVER_TIME)
    assert plan.extra_flops > 0
    assert plan.extra_seconds == pytest.approx(plan.extra_flops / 1e9, rel=1e-3)
    assert "extra time" in plan.summary()
    kept = autorecompute.plan(model, x, budget=1.0, transfer=free_calls, solver_time_limit=SOLVER_TIME)
    assert kept.extra_seconds == 0.0
    old = json.loads(plan.to_json())
    old.pop("extra_seconds")
    old["schema_version"] = 7
    assert Plan.from_json(json.dumps(old)) == dataclasses.replace(plan, extra_seconds=0.0)


@pytest.mark.parametrize("damage", [
    lambda d: d.pop("nodes"), lambda d: d.update(nodes=None), lambda d: d.update(stash=[]),
    lambda d: d.update(actions="recompute"), lambda d: d.update(budget="12MB"), lambda d: d.update(decisions=[]),
    lambda d: d.update(schema_version=True), lambda d: d.update(edges=None),
    lambda d: next(iter(d["nodes"].values())).pop("shape"),
    lambda d: next(iter(d["nodes"].values())).update(an_extra_key=1),
])
def test_a_damaged_plan_file_is_refused_on_reading(plan, damage):
    """Read back, a damaged file raised KeyError/AttributeError/TypeError, or loaded and failed later in
    ``str(plan)`` (a budget of "12MB", decisions as a list), or turned "recompute" into its letters. A file
    without ``nodes`` (which has a default) reads."""
    data = json.loads(plan.to_json())
    assert Plan.from_json(json.dumps(data)) == plan
    damage(data)
    try:
        read = Plan.from_json(json.dumps(data))
    except ValueError as error:
        assert "plan JSON" in str(error)
        return
    assert "nodes" not in data and str(read) and read.nodes == {}


def test_saving_a_plan_leaves_the_callers_matplotlib_as_it_was(plan, tmp_path):
    """``save(".png")`` and ``.html`` called ``matplotlib.use("Agg")``: a notebook's inline backend was
    switched under it. They draw off screen now, leaving the backend and pyplot's figures alone."""
    pytest.importorskip("matplotlib")
    import matplotlib
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    matplotlib.use("svg")          # any backend but Agg (non-interactive: runs headless)
    try:
        figures = plt.get_fignums()
        plan.save(str(tmp_path / "plan.png"))
        plan.save(str(tmp_path / "plan.html"))
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == figures
        assert (tmp_path / "plan.png").stat().st_size > 10_000 and "image/png" in (tmp_path / "plan.html").read_text()
    finally:
        matplotlib.use(before)
