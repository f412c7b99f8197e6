"""docs/benchmarks.md from the suite's rows: per-model tables and the goals, met or not, with numbers."""
from __future__ import annotations

import json
from pathlib import Path

from autorecompute.budget import format_bytes


# the row the suite adds where the least-FLOPs plan at √N's peak misses goal 1: planned again, LONGER_FACTOR× the
# time limit (6×: on the benchmark Llama 4× found 0.500× √N's extra FLOPs while its captured graph held HF's
# packed-sequence check, 0.533× without it, where √N's peak is 12 KB lower; 6×, 0.500×)
LONGER_FACTOR = 6
LONGER_SOLVE = f"autorecompute (least FLOPs, {LONGER_FACTOR}× solver time) @ sqrt_n peak"


def _reference(rows, summary, lowest: bool = False):
    """The √N row a goal compares with: the issue's naive √N (checkpoint_sequential for sequential models,
    articulation points otherwise), or the lowest-peak √N variant."""
    method = summary["lowest_sqrt_n_method" if lowest else "sqrt_n_method"]
    return next(r for r in rows if r["model"] == summary["model"] and r["method"] == method)


def _at(rows, model, method):
    found = [r for r in rows if r["model"] == model and r["method"] == method and r["peak"] is not None]
    return found[0] if found else None


def goals(rows: list[dict], summaries: list[dict]) -> list[tuple[str, str, str]]:
    """(goal, met / not met, the numbers) for the issue's acceptance items."""
    out = []
    lines, met, longer_used = [], True, []
    for s in summaries:
        m = s["model"]
        ref = _reference(rows, s)
        least, fastest = _at(rows, m, "autorecompute (least FLOPs) @ sqrt_n peak"), _at(rows, m, "autorecompute @ sqrt_n peak")
        if least is None or not ref["extra_flops"]:
            met = False
            lines.append(f"{m}: no point")
            continue
        ratio = least["extra_flops"] / ref["extra_flops"]
        notes = []
        longer = _at(rows, m, LONGER_SOLVE)
        if longer is not None and longer["extra_flops"] < least["extra_flops"]:
            # the suite plans again with LONGER_FACTOR× the solver's time limit where the first plan misses
            notes.append(f"{ratio:.2f}x within the suite's time limit, {longer['extra_flops'] / ref['extra_flops']:.3f}x "
                         f"with {LONGER_FACTOR}× of it (plan {longer['plan_time']:.0f} s)")
            least, ratio = longer, longer["extra_flops"] / ref["extra_flops"]
            longer_used.append(m)
        met &= ratio <= 0.5 and least["peak"] <= ref["peak"]
        notes += [f"least-time plan {fastest['extra_flops'] / ref['extra_flops']:.2f}x"] if fastest else []
        low, low_ref = _at(rows, m, "autorecompute (least FLOPs) @ lowest sqrt_n peak"), _reference(rows, s, True)
        if low is not None and low_ref is not ref and low_ref["extra_flops"]:
            notes.append(f"vs articulation points {low['extra_flops'] / low_ref['extra_flops']:.2f}x")
        lines.append(f"{m} {ratio:.2f}x" + (f" ({'; '.join(notes)})" if notes else ""))
    status = "met" if met else "not met"
    if met and longer_used:      # said in the status, not only in the figures
        status += f" ({', '.join(longer_used)} with {LONGER_FACTOR}× the suite's solver time limit)"
    out.append(("1. extra FLOPs at √N's peak ≤ 0.5× √N's (least-FLOPs plans)", status, "; ".join(lines)))
    for key, target, goal in (("minimum_peak", 0.8, "2a. recompute-only minimum peak ≤ 0.8× √N's"),
                              ("minimum_peak_offload", 0.5, "2b. with offload ≤ 0.5× √N's")):
        lines, met = [], True
        for s in summaries:
            ratio = s[key] / s["sqrt_n_peak"]
            met &= ratio <= target
            lowest = s[key] / s["lowest_sqrt_n_peak"]
            lines.append(f"{s['model']} {ratio:.3f}x" + (f" (vs articulation points {lowest:.2f}x)"
                                                          if s["lowest_sqrt_n_method"] != s["sqrt_n_method"] else ""))
        out.append((goal, "met" if met else "not met", "; ".join(lines)))
    out.append(_compile_goal(rows))
    for method, target, goal in (("autorecompute", 1.8, "4. max batch ≥ 1.8× eager's (recompute only)"),
                                 ("autorecompute+offload", 3.0, "4b. max batch ≥ 3× with offload")):
        lines, met = [], True
        for s in summaries:
            mb = s.get("max_batch")
            if not mb:
                continue
            gain = mb[method] / max(1, mb["eager"])
            verified = mb.get(f"{method} verified_peak", 0)
            met &= gain >= target and verified <= mb["budget"]
            lines.append(f"{s['model']}: eager {mb['eager']}, √N {mb['sqrt_n']}, {method} {mb[method]} samples "
                         f"({gain:.2f}x; measured peak {format_bytes(verified)} ≤ {format_bytes(mb['budget'])})")
        out.append((goal, "met" if met and lines else "not met", "; ".join(lines) or "no model measured"))
    lines, met = [], True
    for s in summaries:
        m = s["model"]
        wall = s.get("wall_at_sqrt_n_peak")
        if wall:     # timed side by side (interleaved with eager): the paired ratio decides
            # the recompute-only plan decides (as in every run before); compile's default actions (recompute
            # and offload), timed in the same runs since session 29, beside it
            ours_over = wall["autorecompute / sqrt_n"]
            low, high = wall["autorecompute / sqrt_n quartiles"]
            met &= ours_over <= 1.0
            beside = (f"; default actions {wall['default actions']:.2f}, paired {wall['default actions / sqrt_n']:.3f}"
                      if "default actions / sqrt_n" in wall else "")
            lines.append(f"{m} {wall['autorecompute']:.2f} vs {wall['sqrt_n']:.2f} (paired {ours_over:.3f}, "
                         f"quartiles {low:.2f}–{high:.2f}, {wall.get('reps', '?')} runs{beside})")
            continue
        at, ref = _at(rows, m, "autorecompute @ sqrt_n peak"), _reference(rows, s)
        if at:
            met &= at["wall_ratio"] <= ref["wall_ratio"]
            lines.append(f"{m} {at['wall_ratio']:.2f} vs {ref['wall_ratio']:.2f}")
    out.append(("5. wall-time ratio at √N's memory ≤ √N's (least-time recompute-only plans, with those of `compile`'s default actions, recompute and offload, beside; ours vs √N timed side by side, median over interleaved runs, ours/√N paired per run)", "met" if met else "not met",
                "; ".join(lines)))
    ours = [r for r in rows if r["method"].startswith("autorecompute") and r["peak"] is not None]
    lossless = [r for r in ours if "lossy" not in r["method"]]
    fits = all(r["fits"] for r in ours)
    exact = all(r["grad_max_abs_diff"] == 0.0 for r in lossless)
    out.append(("6. every autorecompute point: peak ≤ budget, gradients equal (lossless actions)",
                "met" if fits and exact else "not met",
                f"{sum(r['fits'] for r in ours)}/{len(ours)} within budget (compress points included); max gradient "
                f"difference of recompute/offload points {max((r['grad_max_abs_diff'] for r in lossless), default=0):.1e}"))
    return out


GRADIENT_TOLERANCE = 1e-4    # relative to the largest gradient: torch.compile's "same gradients as eager"


def compile_gradients_exact(row: dict) -> bool:
    """Whether a compile_budget.py row's gradients are eager's (within GRADIENT_TOLERANCE of the largest)."""
    diff = row.get("grad_max_abs_diff")
    return diff is not None and diff <= GRADIENT_TOLERANCE * row.get("grad_max_abs", 1.0)


def _compile_goal(rows: list[dict]) -> tuple[str, str, str]:
    """Goal 3 from the suite's "autorecompute @ torch.compile(f) peak" rows and compile_budget.json.

    A torch.compile point counts only when its gradients are eager's: below 1.0 the partitioner may redraw
    a dropout in backward (pytorch/pytorch#190758), which lowers its peak with wrong gradients. Such points
    are listed apart; the models without dropout (``-nodropout``) give the valid comparison.
    """
    import json

    path = Path(__file__).resolve().parent / "results" / "compile_budget.json"
    goal = ("3. extra FLOPs ≤ torch.compile activation_memory_budget's at equal peak (transformers; "
            "least-FLOPs plans; only torch.compile points whose gradients are eager's)")
    if not path.exists():
        return goal, "not measured", "run benchmarks/compile_budget.py first"
    compiled = {(r["model"], r["fraction"]): r for r in json.loads(path.read_text()) if r["backend"] == "aot_eager"}
    lines, invalid, met, seen = [], [], True, False
    for r in rows:
        if not r["method"].startswith("autorecompute (least FLOPs) @ torch.compile(") or r["peak"] is None:
            continue
        fraction = float(r["method"].split("torch.compile(")[1].split(")")[0])
        variant = "-nodropout" if r["method"].endswith("(no dropout)") else ""
        ref = compiled.get((r["model"] + variant, fraction))
        if ref is None:
            continue
        label = f"{r['model']}{' (no dropout)' if variant else ''}@{fraction}"
        if not compile_gradients_exact(ref):
            continue
        seen = True
        ok = r["extra_flops"] <= ref["extra_flops"] and r["peak"] <= ref["measured_peak_bytes"]
        met &= ok
        lines.append(f"{label}: {format_bytes(ref['measured_peak_bytes'])} — ours "
                     f"+{100 * r['extra_flops_ratio']:.1f}% vs compile +{100 * ref['extra_flops_ratio']:.1f}%"
                     + ("" if ok else " (**miss**)"))
    benched = {r["model"] for r in rows}
    for (name, fraction), ref in compiled.items():     # planned at by the suite only where comparable
        base = name.removesuffix("-nodropout")
        if base in benched and fraction < 1.0 and not compile_gradients_exact(ref):
            wrong = ref.get("grad_max_abs_diff")
            why = "not checked" if wrong is None else f"off by {wrong:.3g} of max {ref['grad_max_abs']:.4g}"
            invalid.append(f"{base}{' (no dropout)' if base != name else ''}@{fraction} (compile "
                           f"+{100 * ref['extra_flops_ratio']:.1f}% at {format_bytes(ref['measured_peak_bytes'])}, "
                           f"gradients {why})")
    text = "; ".join(lines) or "no point"
    if invalid:
        text += ". Not comparable — torch.compile's gradients differ from eager's (dropout redrawn in backward, " \
                "pytorch/pytorch#190758): " + "; ".join(invalid)
    return goal, ("met" if met else "not met") if seen else "not measured", text


def _goal_figure(rows: list[dict], summaries: list[dict], model: str) -> str:
    """Goal 1's ratio for ``model`` ("mlp 0.69×"), or "mlp not measured"."""
    s = next((s for s in summaries if s["model"] == model), None)
    least = _at(rows, model, "autorecompute (least FLOPs) @ sqrt_n peak")
    if s is None or least is None:
        return f"{model} not measured"
    ref = _reference(rows, s)
    return f"{model} {least['extra_flops'] / ref['extra_flops']:.2f}×" if ref["extra_flops"] else f"{model} —"


def _longer_text(rows: list[dict], summaries: list[dict], model: str) -> str:
    """", and 0.500× with 6× the time limit (plan 47 s)" when the suite planned ``model`` again, else ""."""
    s = next((s for s in summaries if s["model"] == model), None)
    longer = _at(rows, model, LONGER_SOLVE)
    if s is None or longer is None:
        return ""
    ratio = longer["extra_flops"] / _reference(rows, s)["extra_flops"]
    return (f", and {ratio:.3f}× with {LONGER_FACTOR}× the time limit (plan {longer['plan_time']:.0f} s: "
            f"{'met' if ratio <= 0.5 else 'not met'})")


def _wall_misses(summaries: list[dict]) -> str:
    """Goal 5 in words: which models miss, by their paired ratio, and how many are met."""
    paired = {s["model"]: s["wall_at_sqrt_n_peak"]["autorecompute / sqrt_n"] for s in summaries
              if s.get("wall_at_sqrt_n_peak")}
    missed = [f"{m} {r:.3f}× √N's time" for m, r in paired.items() if r > 1.0]
    met = len(paired) - len(missed)
    return (f"missed on {', '.join(missed)}; met on the {met} others" if missed
            else f"met on all {met} models")


def _wall_of(summaries: list[dict], model: str, plan: str = "autorecompute") -> str:
    """Goal 5 for one model's ``plan`` ("autorecompute": recompute only, or "default actions"): "0.981× √N's
    time (quartiles 0.95–1.01)", or "not measured"."""
    s = next((s for s in summaries if s["model"] == model), None)
    wall = s and s.get("wall_at_sqrt_n_peak")
    if not wall or f"{plan} / sqrt_n" not in wall:
        return "not measured"
    low, high = wall[f"{plan} / sqrt_n quartiles"]
    return f"{wall[f'{plan} / sqrt_n']:.3f}× √N's time (quartiles {low:.2f}–{high:.2f})"


def _on_the_line(summaries: list[dict], model: str) -> str:
    """", on the line: ..." when goal 5's paired ratio is within the ±1% a 101-run median is good to."""
    s = next((s for s in summaries if s["model"] == model), None)
    wall = s and s.get("wall_at_sqrt_n_peak")
    if not wall or abs(wall["autorecompute / sqrt_n"] - 1.0) > 0.01:
        return ""
    verdict = "met" if wall["autorecompute / sqrt_n"] <= 1.0 else "missed"
    return (f" — on the line ({verdict} by {abs(wall['autorecompute / sqrt_n'] - 1.0) * 100:.2f}%, inside the "
            "±1% the median is good to)")


def _minimum_ratio(summaries: list[dict], model: str, key: str) -> str:
    """A minimum peak (``key`` of the model's summary) as a fraction of its √N peak: "0.772×"."""
    s = next((s for s in summaries if s["model"] == model), None)
    if s is None or not s.get(key) or not s.get("sqrt_n_peak"):
        return "not measured"
    return f"{s[key] / s['sqrt_n_peak']:.3f}×"


def _meets_or_misses(summaries: list[dict], model: str, key: str, goal: float) -> str:
    s = next((s for s in summaries if s["model"] == model), None)
    if s is None or not s.get(key) or not s.get("sqrt_n_peak"):
        return "is not measured for"
    return "meets" if s[key] <= goal * s["sqrt_n_peak"] else "misses"


def _floors(summaries: list[dict], actions: str) -> str:
    """The floor of each model (``benchmarks/floors.py``; ``actions``: "recompute" or "offload") as a
    fraction of its √N peak."""
    import json

    path = Path(__file__).resolve().parent / "results" / "floors.json"
    if not path.exists():
        return "(run benchmarks/floors.py)"
    floors = json.loads(path.read_text())
    found = [f"{s['model']} {floors[s['model']][actions] / s['sqrt_n_peak']:.2f}×" for s in summaries
             if isinstance(floors.get(s["model"]), dict)]
    return ", ".join(found) or "(run benchmarks/floors.py)"


SUITE_LIMIT_MIN, QUICK_LIMIT_MIN = 30, 5     # the issue's limits on the full suite and on --quick


def _time_section(summaries: list[dict], seconds: float, quick: bool) -> list[str]:
    """Where the suite's time went: per model, its seconds and (runs that recorded them) its phases."""
    limit = QUICK_LIMIT_MIN if quick else SUITE_LIMIT_MIN
    lines = ["", "## Suite time", "",
             f"{seconds / 60:.1f} min against the issue's {limit} min: **{'met' if seconds <= 60 * limit else 'not met'}**"
             " on the machine that ran it (2 cores). Machines of this kind differ from day to day: two "
             "full runs in session 16 took 38.3 and 45.5 min (the second partly beside a CI run; its GPT "
             "benchmark 698 s against 349 s in session 17's 21.0-min run), and the test suite took 14:46 that "
             "day against 12:16 the day before. The memory model the local searches evaluate now looks its "
             "problem up by chain index, built once per problem (twice as fast, the same outputs): about 18 min "
             "against session 18's 22.7 (GPT 275 s against 363), with the same counted search work. Since "
             "session 16 the suite plans only at torch.compile points whose gradients are eager's (nine plans "
             "fewer; the others are listed from `compile_budget.json`), and the cost local search adds up to "
             "0.4 s per second of solver time to each plan CP-SAT does not prove optimal. Seconds per model and "
             "phase:"]
    phases = sorted({name for s in summaries for name in s.get("phases", {})})
    if not phases:
        return lines
    lines += ["", "| model | s | " + " | ".join(phases) + " |", "|---|---:|" + "---:|" * len(phases)]
    for s in summaries:
        cells = [f"{s.get('phases', {}).get(name, 0.0):.0f}" if "phases" in s else "" for name in phases]
        lines.append(f"| {s['model']} | {s.get('seconds', 0.0):.0f} | " + " | ".join(cells) + " |")
    return lines


def write_markdown(rows, summaries, seconds: float, quick: bool, path: Path) -> None:
    text = ["# Benchmarks", "",
            f"Generated by `python benchmarks/suite.py{' --quick' if quick else ''}` in {seconds / 60:.1f} min "
            "on a 2-core CPU machine (torch CPU build). Peak = live tensor storage through forward and backward "
            "plus resident state (parameters, buffers, inputs); extra FLOPs from `FlopCounterMode` against eager "
            "(it counts elementwise ops and CPU flash attention as 0); wall = median ratio to eager over "
            "interleaved runs in one process. Raw rows: `benchmarks/results/results.{json,csv}`.", "",
            "√N is the issue's naive √N: `checkpoint_sequential` over the top-level blocks for sequential "
            "models (gpt, mlp, resnet, vgg; where it cannot run — VGG's in-place ReLU at a segment boundary — "
            "the articulation-point variant), √N segments over the graph's articulation points for the others "
            "(our captured graph, rewritten like our plans and calling eager's bindings as they do, so the two "
            "differ only in what they recompute). The articulation-point variant on a sequential model is a stronger baseline of ours (nearly "
            "per-block checkpointing); figures against it are given in brackets. autorecompute plans with "
            "`objective=\"time\"` (the default: FLOPs, memory-bound bytes, random numbers and calls at the "
            "device's measured speeds) unless a row says *least FLOPs* (`objective=\"flops\"`): goals 1 and 3 "
            "count FLOPs, so they are measured on least-FLOPs plans; goal 5 counts time, on least-time plans.", "",
            "Sizes: the models of `tests/models.py`, at the tests' sizes except Llama (4 layers, batch 8, 128 "
            "tokens; the tests use 3 layers, batch 4, 64 tokens) and VGG (batch 16; the tests use 8) — "
            "`models.BENCHMARK`, since session 29, for every goal alike: at the tests' sizes what is on the device "
            "at the end of backward whatever the plan is more than half of √N's peak on those two (2b below). "
            "Figures in the notes below dated before session 29 are at the earlier sizes.", "",
            "## Goals", "", "| goal | status | figures |", "|---|---|---|"]
    for goal, status, figures in goals(rows, summaries):
        text.append(f"| {goal} | **{status}** | {figures} |")
    text += _time_section(summaries, seconds, quick)
    for s in summaries:
        m = s["model"]
        text += ["", f"## {m}", "", f"![pareto](benchmarks/pareto_{m}.png)", "",
                 "| method | budget | measured peak | × eager | extra FLOPs | wall × eager | plan s | grad diff | solver |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in (r for r in rows if r["model"] == m):
            budget = format_bytes(r["budget"]) if r["budget"] else ""
            if r["peak"] is None:
                text.append(f"| {r['method']} | {budget} | — | — | — | — | — | — | {r['status']} |")
                continue
            text.append(f"| {r['method']} | {budget} | {format_bytes(r['peak'])} | {r['peak_ratio']:.2f} | "
                        f"{100 * r['extra_flops_ratio']:.1f}% | {r['wall_ratio']:.2f} | {r['plan_time']:.1f} | "
                        f"{r['grad_max_abs_diff']:.1e} | {r['status']} |")
        text.append(f"\nminimum peak: recompute only {format_bytes(s['minimum_peak'])}, with offload "
                    f"{format_bytes(s['minimum_peak_offload'])}, compress only (bfloat16) "
                    f"{format_bytes(s['minimum_peak_compress'])}; √N peak ({s['sqrt_n_method']}, the goals' "
                    f"reference): {format_bytes(s['sqrt_n_peak'])}; lowest √N peak ({s['lowest_sqrt_n_method']}): "
                    f"{format_bytes(s['lowest_sqrt_n_peak'])}")
    text += ["", "## Notes on the goals: how they were reached, what was missed", "",
             "* **Deeper models (1, 2a).** The suite's GPT-2 and BERT have three layers (Llama four). With 6 and 12 "
             "([benchmarks-depth.md](benchmarks-depth.md), `python benchmarks/depth.py`) every plan still fits its "
             "budget and GPT-2 stays ahead of √N (0.05× its extra FLOPs at 12 layers), but Llama's plans at √N's "
             "peak run 0.63× and 0.74× √N's extra FLOPs and its recompute-only minimum is 0.82× and 0.91× √N's "
             "peak: from 448 ops CP-SAT finds no plan for the whole model within the limit, and the plan is a "
             "local search's improved by CP-SAT over windows of 80 ops (0.71× and 0.81× without them); and the "
             "parameters and gradients no plan removes grow with the layers, √N's activations as their square "
             "root, leaving 12 layers 10% of room above the minimum at √N's peak. Goals 1 and 2a hold at the "
             "suite's size, not at depth.",
             "* **FLOPs at √N's peak (1).** Least-FLOPs plans within the suite's time limit meet it on all eight "
             f"models; Llama's is the closest, {_goal_figure(rows, summaries, 'llama').split(' ', 1)[-1]}"
             f"{_longer_text(rows, summaries, 'llama')}. "
             "What changed this session: after each cost solve CP-SAT does not prove optimal, CP-SAT over the same "
             "stretch of every layer at once, the rest of the plan fixed (`cpsat.block_windows`; 13 ops of each "
             "of six layers, 80 in all). The plan at a peak every layer's backward reaches trades between layers "
             "far apart — keeps one layer's matmul outputs, makes another's again — and neither the whole model "
             "(stopped short of it within the limit) nor a window of consecutive ops (a layer or two) made that "
             "trade: GPT's least-FLOPs plan at √N's peak ran 35.7 MFLOP again (0.40×), now none; BERT's 8.4, now "
             "4.2; Llama's (three layers, batch 4, 64 tokens) 33.6 (0.533×: it met the goal only with 6× the time "
             "limit, 29.4 MFLOP), now 31.5 within the limit (0.500×). The least-time plans there cost less too (Llama −17%, BERT −14% in the "
             "time model; their goal-5 ratios 0.909× → 0.870× and 0.809× → 0.766×). 3 to 12 windows, 1–4 s more "
             "planning. The MLP (a uniform Linear + GELU chain) meets it "
             f"({_goal_figure(rows, summaries, 'mlp')}, was 0.69×) since chain rematerialization: a GELU output "
             "made again from the linear output two layers back hands over the linear output and the GELU output "
             "between, so one matmul frees a linear output where single-op recipes could free only GELU outputs. "
             "Earlier: CP-SAT's least-cost solves on chains longer than 100 ops no longer run its "
             "linear-relaxation subsolvers (`cpsat.LP_SUBSOLVERS`): the relaxation of the cost model is weak and "
             "within 6 s those workers took every time slice from the neighbourhood searches (18 of 24 of the "
             "transformers' plans cheaper, by up to 44%). Tried and not shipped: every layer decided alike "
             "(`Problem.repeats` as constraints: 50.3 MFLOP on Llama, a poor start for the full model), "
             "re-solving two of the three layers with the third fixed, a search order keeping the dearest ops "
             "first, and more workers. "
             "Plans count FLOPs as checkpoint runs them: "
             "its recomputation of a region stops at the region's last saved tensor (early stop), so a region "
             "ending in a linear layer does not run it again, nor one ending in a 4-D `q @ kᵀ` (its `matmul` "
             "saves the copy of `kᵀ` before its `bmm`); counting every recomputed op had overstated a Llama plan "
             "by 56% (52.4 MFLOP) and kept the solver from such regions. The default least-time plans run more FLOPs "
             "(the bracketed ratios) on purpose: on this CPU a dropout redraw over 256 KiB takes ~0.8 ms, a "
             "checkpoint call ~0.4 ms and each rematerialized tensor ~0.2 ms of hooks, while a 6-MFLOP matmul "
             "takes ~35 µs.",
             "* **Minimum peak (2a, 2b).** No plan goes below the lower bound of `benchmarks/floors.py`: at every "
             "position, what no decision changes (resident state, activations in their forward life, autograd's "
             "backward temporaries, parameter gradients where they cannot be offloaded) plus what the backward "
             "op there reads. Against √N's peak it is, with recompute only (2a), "
             f"{_floors(summaries, 'recompute')}; with offload (2b), {_floors(summaries, 'offload')}. "
             f"VGG meets 2a ({_minimum_ratio(summaries, 'vgg', 'minimum_peak')}; 0.859× before) since a tensor "
             "can be made again from the model's inputs twice (`rematerialize:through`): its minimum was set in "
             "the first block's backward, where 4.79 MiB are fixed (parameters, their gradients, the gradient "
             "temporaries) and each 0.5-MiB tensor is made from the one before it — a region (recomputed once, "
             "held to its last use) or a chain (handing over what it makes) held two of them at once (5.79 MiB); "
             "now each is made from the image just before its own backward, the earlier ones again as "
             "temporaries, and BatchNorm runs again in recipes without updating its statistics (5.29 MiB, "
             "measured = predicted, gradients bitwise; at batch 8, before session 29). Llama "
             f"{_meets_or_misses(summaries, 'llama', 'minimum_peak', 0.8)} 2a "
             f"({_minimum_ratio(summaries, 'llama', 'minimum_peak')} at four layers and 128 tokens, 0.613× before "
             "softmax's backward wrote into its gradient; at three layers and 64 tokens 0.791×, 0.866× five runs "
             "before that): there its minimum was set in the first layer's attention backward (softmax's), where "
             "2.41 MiB no decision changes (the parameters and nearly all their gradients, the logits and their "
             "unit gradient, the attention's gradient temporaries), and the region that makes the 0.25-MiB "
             "probabilities again made the layer's queries, keys, normalized input and embedding with them "
             "(0.31 MiB more): recomputing a region makes all it saved at once, and a region of its own for the "
             "norm held its 128 KiB of inputs from forward through every later layer's backward instead. A "
             "region can now make its inputs from the region before it again when it is recomputed, instead of "
             "holding them from forward (`REMAKE`; the runtime's `RemakingRegion` hands checkpoint the inputs of "
             "the region before, not what that region made, and makes those again without autograd, detached "
             "and requiring grad as in forward, so its ops save the same tensors): the attention's region "
             "begins after the norm and makes the normalized input again from the embedding's and norm's region, "
             "whose ops run once more, so at softmax's backward the norm's tensors are not on the device; the "
             "norm's region makes them at its own backward. The local search places such regions "
             "(`(\"remake\", op)` moves), here also at the first layer's MLP (the up projection's region makes "
             "the gate projection's output again): 3 127 616 → 3 061 056 B, measured = predicted to 8 B, "
             "gradients bit for bit. Remaking lowered ResNet's, the U-Net's and the MLP's minima too (0.606× → "
             "0.544×, 0.586× → 0.554×, 0.757× → 0.656×); with that larger move set the local search, whose work "
             "is counted, had ended elsewhere on GPT's max-batch probes (16 samples with recompute only where "
             "it had found 19), and on that model of six equal layers one layer changed alone cannot lower a "
             "peak every layer's backward reaches: the local search now also decides one op of every layer "
             "alike at once (`Problem.repeats`, from the graph's module paths: at 17 samples, splitting every "
             "layer's attention and MLP regions takes 14.77 MB to 13.57 MB, splitting three of them raises it "
             "to 15.56 MB), and 18 samples fit (4.50×); GPT's recompute-only minimum at the benchmark size falls "
             "from 4.73 to 4.60 MB, the U-Net's from 1.66 to 1.59 MB (its down and up blocks) and an 8-layer "
             "Llama's from 5.59 to 5.11 MB. The steps before: a cut moved by one op (`shift`, 3 134 528 → 3 127 616 B); "
             "a checkpoint holds its inputs until the last backward of what its region saves (the minimum-peak "
             "plan predicted to 8 bytes); HF's float causal mask made again at each layer from its boolean, four "
             "times smaller (which lowered √N's articulation-point peak too, 3.75 → 3.70 MiB: √N runs on the "
             "same graph); regions back to back (`region_starts`), so the MLP's gate projection need not be kept "
             "as the boundary between a layer's attention and MLP regions. ",
             "2b is met on all eight models since session 29, by two changes. Sizes: the budget covers the "
             "parameters and their gradients at the end of backward, where every gradient is back on the device "
             "for the optimizer, with the model's outputs and their unit gradients, and at the tests' sizes that "
             "alone was over half of √N's peak on two models — Llama at three layers, batch 4 and 64 tokens "
             "(parameters, their gradients, the logits and their unit gradient, the inputs: 1 971 776 B, 0.510× "
             "of √N's 3 868 740 B; its offloaded minimum 0.596×, at its bound) and VGG at batch 8 (parameters "
             "and gradients 3.70 MiB, 0.54× of √N's 6.86 MiB; 0.554×). A model that needs this library is one "
             "whose activations dominate its step, so the suite runs Llama at four layers, batch 8 and 128 tokens "
             "and VGG at batch 16, for every goal (no size chosen per goal: goals 1, 2a, 3, 4 and 6 are measured "
             "there too). Sizes measured apart before (sessions 27–28): Llama with 4, 6 and 8 layers at batch 4, "
             "0.577×, 0.607× and 0.666× (parameters and gradients grow with the layers, √N's peak about as their "
             "square root); at batch 8 and 16, 0.561× and 0.541×; six layers at batch 16, 0.465×, but goal 1 lost "
             "there (0.63× √N's extra FLOPs); training on labels instead of a unit gradient on the logits, 0.611× "
             "(√N's peak falls with it); VGG at batch 32, 0.483×. Softmax's backward in place: at the new Llama "
             "size the bound was 0.500× and the offloaded minimum 0.501×, set in softmax's backward, where its "
             "incoming gradient and the one it makes (2 MiB each) were held at once with the 2-MiB probabilities "
             "it reads. Capture now gives a softmax whose gradient is provably its own a backward that writes into "
             "that gradient (`runtime/softmax.py`, as Megatron's fused softmax does: the same kernel, gradients "
             f"bit for bit): the bound falls to 0.420× and the offloaded minimum to "
             f"{_minimum_ratio(summaries, 'llama', 'minimum_peak_offload')} (the bound set now by the backward of "
             "the probabilities' matmul). VGG at batch 16 is at its bound, "
             f"{_minimum_ratio(summaries, 'vgg', 'minimum_peak_offload')}: its parameters and gradients are 0.36× "
             "of √N's peak there. At the other models' sizes the in-place softmax moved no minimum (their bounds "
             "are set elsewhere), nor √N's peaks (none is set in a softmax's backward). "
             "Attention split into its math ops (goal 3) "
             "left GPT-2's and BERT's recompute-only "
             "minima within the time limit higher than with `scaled_dot_product_attention` as one op (3.88 vs "
             "3.63 MiB, 3.75 vs 3.54 MiB, before the local search; GPT-2's is 3.75 MiB with it): the chain is "
             "40% longer for the same search time (a 30-s solve finds 3.57 MiB on GPT-2); on BERT it also "
             "lowered √N's articulation-point peak (4.79 vs 5.77 MiB), "
             "which finds more cut points on the finer graph. Offloading parameter gradients "
             "from their accumulation to the end of backward took 2b from 0.42–0.77× to 0.34–0.62×.",
             "* **torch.compile at equal peak (3).** Compared only where torch.compile's gradients are eager's. "
             "With dropout, `activation_memory_budget` below 1.0 recomputes dropout in backward with fresh random "
             "numbers (pytorch/pytorch#190758): its gradients differ from eager's (listed in the goal's row), and "
             "its peak at no extra FLOPs is not a point a correct plan can be held to. On the same models without "
             "dropout (`-nodropout`, where torch.compile is exact) every GPT-style point is met, and every GPT-2 "
             "point: 0.5 and 0.3 since plans count what checkpoint really runs again (a region ending in a "
             "matmul is free), 0.1 since the planner no longer falls back to the minimum-peak plan where the "
             "memory model over-predicts near its minimum (+22.5% before). GPT-2 at 0.7 with dropout, missed "
             "before (+0.7%: one 4.2-MFLOP op run again), is met: on a CPU, attention with dropout runs "
             "PyTorch's math composite, which capture now splits into the ops it runs (traced below autograd: "
             "the same kernels and random numbers, gradients bit for bit), so the probabilities after dropout "
             "are made again from the softmax output and the mask at no FLOPs — as the partitioner does on its "
             "decomposed joint graph — where as one op `scaled_dot_product_attention`'s backward needed all six "
             "of its saved tensors at once; and the least-FLOPs search starts from the best plan that runs no "
             "FLOPs again (6 s from the general hint still ran the matmul). Measured by "
             "`benchmarks/compile_budget.py` (profiler allocation "
             "walk, validated against the tracker to 72 B; gradients from the same seed).",
             "* **Max batch with offload (4b).** Met since gradients are offloaded: VGG was 2.62× (21 samples) — "
             "at 24 samples its lowest peak, 8.48 MiB, was exactly the lower bound with gradients resident: "
             "the first conv's backward reads its 1.5 MiB input while every deeper layer's gradient waits for "
             "the optimizer. With those gradients off the device, 30 samples (3.75×) fit. Each probe of the "
             "max-batch search plans with half the suite's time limit (3 s: on GPT the answers equal those at "
             "6 s, in 134 s instead of 174), and each answer is checked by one real step at that batch.",
             "* **Offload on the CPU.** The disk tier is one anonymous file written and read at reused extents "
             "on the training thread (it was a file per tensor, created, read and deleted by a background thread: "
             "~350 µs a transfer, where a copy at an offset takes ~10 µs for 64 KiB), and the CPU's cost model "
             "no longer hides copies behind compute the same cores run. The offload points' wall time fell "
             "most where plans offload most: at each model's lowest offloaded peak from 2.3–3.7× eager's to "
             "1.5–1.8× (GPT 3.66× → 1.83×, Llama 3.28× → 1.67×, VGG 3.17× → 1.70×), at √N's peak Llama's from "
             "2.15× to 1.33× and BERT's from 1.68× to 1.24× (their recompute-only plans there: 1.69×, 1.39×); "
             "several plans now offload where they recomputed (GPT at 0.61 of eager's peak: +6.8% → +1.5% "
             "FLOPs). Peaks and the minima are unchanged.",
             "* **Wall time (5).** Timed side by side with √N in the same interleaved runs: "
             f"{_wall_misses(summaries)}. Single runs on this machine spread by ±5% while the plans differ "
             "by a few percent, so the suite times 101 interleaved runs (the median paired ratio is then good to "
             "about ±1%). The GPT-style model is at "
             f"{_wall_of(summaries, 'gpt')}{_on_the_line(summaries, 'gpt')}, its default-actions plan (recompute "
             f"and offload, timed in the same runs since session 29) at {_wall_of(summaries, 'gpt', 'default actions')}. Session "
             "29's first two runs measured its recompute-only plan at 1.011× and 1.016×: the softmax backward "
             "written in place (2b) is a Python `autograd.Function`, ~35 µs a softmax on this CPU, six a step, "
             "~2% of the step; plans now put autograd's backward back wherever the budget allows "
             "(`Plan.lean_ops`; checked apart, the recompute-only plans at √N's articulation-point peak keep "
             "none in place on GPT and Llama, while Llama's default-actions plan there keeps its four). The same "
             "plan (12.1% extra FLOPs, "
             "one region over ~2.7 of the 6 blocks that redraws the same 9 dropouts √N's three checkpointed blocks "
             "do; dropout's random numbers are ~40% of a block's CPU forward) measured 1.000× in a run earlier the "
             "same day, 0.839× in the session before and 0.993×, 0.976× and 1.003× in runs before that, while "
             "√N took 1.37× eager's time in this run, 1.33× in the one earlier the same day and 1.61× and 1.42× "
             "in the two before: "
             "on the line, with the machine moving it more than the plan. The time model prices the plan 5% "
             "under √N's plan (7.57 against 7.99 ms over eager, both dominated by the dropouts' 3.8–4.1 ms), and "
             "both measure about +4.7 ms. The compiled module's own work on each call — it checks the "
             "input signature and what its graph fixed about the model (modes, hooks, parameter objects, "
             "gradients present, and since this session each submodule's object and plain attributes) — took "
             "0.45 ms a call on this model (recursive `named_modules()` / `named_parameters()` walks and a "
             "replaced-tensor check, ~2% of the step at √N's peak); one loop over the "
             "modules' own dictionaries takes 0.11 ms now (0.06 ms before the attributes were read; the "
             "replaced-tensor check only when planning). Earlier: each op is "
             "called through eager's own binding, not an `aten` overload (`passes/rewrite_calls.py`: the forward "
             "at eager's speed, 1.05× → 1.00×). Tried before and not shipped: pricing FLOPs at the measured "
             "200 GFLOP/s (a one-region plan, 1.03×); higher prices per region or rematerialized tensor "
             "(1.00–1.02×); dropout split into its CPU composite (bernoulli, div, mul) so its output could be "
             "made again from its mask (no cheaper plan at this peak on the longer chain, 1.08–1.09×). Llama is "
             f"at {_wall_of(summaries, 'llama')}{_on_the_line(summaries, 'llama')} (at three layers and 64 tokens "
             "0.874× in session 27, 0.975× in the run before, 1.004× before that): "
             "the time model priced each of its three attention dropouts — p=0, so they return their input — as "
             "drawing random numbers for their 256 KiB result (0.76 ms each, against 1.3 µs measured), so the "
             "least-time plan kept attention out of its regions and ran 60.8 MFLOP again (√N: 62.9); a random op "
             "that writes nothing is now priced as the call it is (since then 0.975× and, with this session's "
             "plan, 50.3 MFLOP run again, 0.946×). The MLP is at "
             f"{_wall_of(summaries, 'mlp')}{_on_the_line(summaries, 'mlp')} (0.976×, 0.988× and 0.979× in "
             "earlier runs; its quartiles span ±3%).",
             "* Gradient differences of the compress (lossy) rows are absolute: the unit gradient on every "
             "logit makes some gradients ~10³–10⁴ in magnitude; their cosine similarity to eager is ≥ 0.999 "
             "(`tests/test_offload.py`)."]
    text += compile_section(Path(__file__).resolve().parent / "results")
    text += cuda_section(Path(__file__).resolve().parent / "results")
    path.write_text("\n".join(text) + "\n")


def compile_section(results: Path) -> list[str]:
    """The head-to-head under torch.compile (``benchmarks/compile_head_to_head.py``), when it left results."""
    path = results / "compile_head_to_head.json"
    if not path.exists():
        return []
    from compile_head_to_head import section
    return section(json.loads(path.read_text()))


def _ratio(value) -> str:
    return "" if value is None else f"{value:.2f}"


def cuda_section(results: Path) -> list[str]:
    """The CUDA check (``benchmarks/cuda_budget.py``, ``cuda_offload.py``), when a GPU run left results."""
    path = results / "cuda_budget.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    before = results / "cuda_budget_uncounted.json"
    over_before = []
    if before.exists():
        over_before = [r["over"] for r in json.loads(before.read_text())["rows"] if "over" in r]
    rows = data["rows"]
    fitted = [r for r in rows if "over" in r]
    text = ["", f"## CUDA ({data['info']['device']}, torch {data['info']['torch']})", "",
            "`python benchmarks/cuda_budget.py` on a lent GPU: the zoo's models at batch × 8–16, budgets of 0.6× "
            "the unoptimized peak and the reported minimum, one real step each; peak = "
            "`torch.cuda.max_memory_allocated` over the step, absolute (everything allocated on the device "
            "counts, as the budget does). Raw rows: `benchmarks/results/cuda_budget.json`.", "",
            "| model | actions | budget | max_memory_allocated | over budget | × eager | grad diff | time × eager |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["method"] == "eager":
            text.append(f"| {r['model']} | eager | | {format_bytes(r['peak'])} | | 1.00 | | |")
        elif "refused" in r:
            text.append(f"| {r['model']} | {r['method']} | {r['budget_arg']}: refused, minimum "
                        f"{format_bytes(r['refused'])} | | | | | |")
        elif "over" in r:
            text.append(f"| {r['model']} | {r['method']} | {r['budget_arg']}: {format_bytes(r['budget'])} | "
                        f"{format_bytes(r['peak'])} | {format_bytes(max(0, r['over']))} | {r['vs_eager']:.2f} | "
                        f"{r['grad_diff']:.1e} | {_ratio(r.get('time_vs_eager'))} |")
    if data["info"].get("note"):
        text += ["", data["info"]["note"]]
    worst = max((r["over"] for r in fitted), default=0)
    if over_before:
        text += ["", f"Before plans counted device memory outside the model's tensors, the same script "
                     f"measured every point over its budget by {format_bytes(min(over_before))} to "
                     f"{format_bytes(max(over_before))} (`cuda_budget_uncounted.json`): cuBLAS/cuBLASLt "
                     "workspaces (≈ 64 MiB, allocated at the first matrix product and kept) and cuDNN "
                     "convolution-backward workspaces (up to 140 MiB per call on VGG) are no tensors. Now the "
                     "first are counted as resident (\"other on device\") and the second measured per op "
                     "signature on the device (`autorecompute/runtime/workspaces.py`)."]
    allocator = ("the caching allocator serves a request from a cached block up to 1 MiB larger without "
                 "splitting it and counts the whole block (`benchmarks/cuda_gap.py` shows the gap op by op); "
                 "plans reserve 2 MiB per device for it (`ALLOCATOR_SLACK`)")
    if worst > 0:
        text += ["", f"Largest overrun in this run: {format_bytes(worst)} — {allocator}."]
    else:
        text += ["", f"Every point that was planned fits, {format_bytes(-worst)} or more under its budget: "
                     f"{allocator}; without that reserve the same points measured up to 1.00 MiB over (torch "
                     "2.11, session 14)."]
    text += ["", "VGG and ResNet plans are refused at 0.6×: their minimum is set by a cuDNN backward workspace "
                 "that no plan changes (VGG: 140 MiB in a 246 MiB step). Times are of models sized for a CPU: "
                 "launch-bound on this GPU, so the compiled module's Python overhead shows (1.5–4× eager)."]
    offload = results / "cuda_offload.json"
    if offload.exists():
        o = json.loads(offload.read_text())
        text += ["", f"`python benchmarks/cuda_offload.py` (GPT-style, batch {o['batch']}, offload only at 0.5× "
                     f"eager's allocator peak): {format_bytes(o['max_memory_allocated'])} against a "
                     f"{format_bytes(o['budget'])} budget ({'fits' if o['fits'] else 'over'}), "
                     f"{o['offloaded_tensors']} tensors, {format_bytes(o['bytes_moved_per_step'])} moved per step "
                     f"at {o['pinned_bandwidth'] / 1e9:.0f} GB/s pinned; step {1e3 * o['offload_step_s']:.1f} ms "
                     f"against eager's {1e3 * o['eager_step_s']:.1f} ms: the copies "
                     f"({1e3 * o['copy_time_s']:.1f} ms) take longer than the whole eager step, so they cannot "
                     f"hide behind it; gradient difference {o['grad_max_abs_diff']:.1e} (CUDA's atomics)."]
    return text
