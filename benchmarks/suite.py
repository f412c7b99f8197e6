"""Benchmark suite: autorecompute against √N checkpointing, per-block checkpointing and eager.

    python benchmarks/suite.py            # full suite (about 20 min on 2 cores; per phase in docs/benchmarks.md)
    python benchmarks/suite.py --quick    # 3 models, fewer points (3 min)
    python benchmarks/suite.py --models gpt mlp --merge   # rerun some models, keep the others' rows

Writes benchmarks/results/results.{json,csv} and floors.json, docs/benchmarks.md and
docs/benchmarks/pareto_<model>.png.
Memory is the live tensor-storage tracker's peak through forward and backward (plus resident state);
extra compute is FlopCounterMode's count against eager; wall time is the median ratio of interleaved runs.
"""
from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("AUTORECOMPUTE_CACHE", "off")   # benchmarks time and compare planning itself
sys.path.insert(0, str(ROOT / "tests"))

import autorecompute  # noqa: E402
import models  # noqa: E402
from autorecompute.baselines import SqrtNCheckpointed  # noqa: E402
from autorecompute.budget import format_bytes  # noqa: E402
from autorecompute.passes.build_problem import build_problem  # noqa: E402
from autorecompute.passes.capture import capture  # noqa: E402
from autorecompute.passes.profile import profile_step  # noqa: E402
from autorecompute.passes.rewrite_calls import rewrite_calls  # noqa: E402
from autorecompute.passes.verify import fake_step_memory  # noqa: E402
from autorecompute.runtime.memory import run_step  # noqa: E402
from compile_budget import NO_DROPOUT, make_case  # noqa: E402
from harness import measured_step, sqrt_n_rewrite  # noqa: E402
from report import LONGER_FACTOR, LONGER_SOLVE, compile_gradients_exact  # noqa: E402

SEQUENTIAL_BLOCKS = {"gpt": "blocks", "mlp": "layers", "resnet": "layers", "vgg": "features"}
RECOMPUTE = ("recompute",)
OFFLOAD = ("recompute", "offload")
COMPRESS = ("compress",)
HF = {"gpt2", "bert", "llama"}
FULL = ["gpt", "gpt2", "bert", "llama", "resnet", "unet", "mlp", "vgg"]
QUICK = ["gpt", "mlp", "vgg"]
MAX_BATCH_MODELS = {"gpt", "vgg", "mlp"}
QUICK_MAX_BATCH = "vgg"
# goal 5's side-by-side timing: steps differ by ~2% while single runs on this machine spread by ±5%, so the
# median of the paired ratio needs about a hundred repetitions to settle (31 moved it by ±0.1 between runs)
WALL_REPS, WALL_REPS_QUICK = 101, 15
PHASES: dict[str, float] = {}      # seconds per phase of the model being benchmarked (where the suite's time goes)


@contextmanager
def phase(name: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        PHASES[name] = PHASES.get(name, 0.0) + time.perf_counter() - started


def plan_status(plan) -> str:
    """The solver column of a row: the plan's solver status and how many tensors it stashes."""
    return plan.solver_status + (f"; {len(plan.stash)} stashed" if plan.stash else "")


def step_flops(module, case) -> int:
    case.model.zero_grad(set_to_none=True)      # every step starts as its plan was made: without gradients
    with FlopCounterMode(display=False) as counter:
        run_step(module, case.args, case.kwargs)
    return counter.get_total_flops()


def wall_ratio(reference, module, case, reps: int) -> float:
    """Median of (module time / reference time) over interleaved runs: robust to the machine's drift."""
    ratios = []
    for _ in range(reps):
        times = []
        for m in (reference, module):
            case.model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            run_step(m, case.args, case.kwargs)
            times.append(time.perf_counter() - started)
        ratios.append(times[1] / times[0])
    return statistics.median(ratios)


def head_to_head(reference, modules: dict, case, reps: int) -> dict:
    """Median ratio to ``reference`` of each module, all interleaved in every repetition (in rotating order),
    so the machine's drift cancels between the methods compared as well as against the reference; and the
    median of each later module's time over the first module's, paired per repetition."""
    ratios = {name: [] for name in modules}
    order = list(modules)
    for i in range(reps):
        case.model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        run_step(reference, case.args, case.kwargs)
        base = time.perf_counter() - started
        for name in order[i % len(order):] + order[:i % len(order)]:
            case.model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            run_step(modules[name], case.args, case.kwargs)
            ratios[name].append((time.perf_counter() - started) / base)
    out = {name: statistics.median(r) for name, r in ratios.items()}
    first = order[0]
    for other in order[1:]:       # each against the first, paired run by run
        between = sorted(b / a for a, b in zip(ratios[first], ratios[other]))
        out[f"{other} / {first}"] = statistics.median(between)
        out[f"{other} / {first} quartiles"] = (between[len(between) // 4], between[3 * len(between) // 4])
    out["reps"] = reps
    return out


def grad_diff(a, b) -> float:
    return max((float((a.grads[k] - b.grads[k]).abs().max()) for k in a.grads), default=0.0)


def scaled(case, k: int):
    """The case with every tensor input repeated k times along the batch dimension."""
    def rep(t):
        return t.repeat(k, *[1] * (t.dim() - 1)) if isinstance(t, torch.Tensor) else t
    return models.Case(case.name, case.model, tuple(rep(a) for a in case.args),
                       {n: rep(v) for n, v in case.kwargs.items()})


def sqrt_n_module(case):
    """√N segments over the graph's articulation points, run as our plans run (calls through eager's
    bindings, as eager code makes them): the two differ only in where they recompute."""
    gm = capture(case.model, case.args, case.kwargs)
    profile_step(gm, case.args, case.kwargs)
    problem = build_problem(gm)
    return rewrite_calls(sqrt_n_rewrite(gm, problem))


def minimum_peak(case, limit: float, actions: tuple[str, ...] = RECOMPUTE) -> int:
    return autorecompute.minimum_peak(case.model, *case.args,
                                      loss_reserve=0, solver_time_limit=limit, actions=actions, **case.kwargs)


def one_sample(case):
    """The case cut to its first sample (batch 1): max batch is searched in samples, not base batches."""
    def first(t):
        return t[:1] if isinstance(t, torch.Tensor) and t.dim() > 0 else t
    return models.Case(case.name, case.model, tuple(first(a) for a in case.args),
                       {n: first(v) for n, v in case.kwargs.items()})


def largest_fitting(peak_of, budget: int, start: int = 1, cap: int = 4096) -> int:
    """Largest batch ``k`` with ``peak_of(k) <= budget`` (0 if none), for a peak that grows with ``k``.

    Peaks grow about linearly in the batch, so each guess is the secant through the two tried batches
    nearest the budget, kept inside the bracket; a step that does not halve the bracket is followed by a
    bisection. Four or five minimum-peak solves where doubling then bisecting spends ten.
    """
    tried: dict[int, int] = {}
    low, high = 0, None          # low fits (0 trivially), high does not
    k, bisect = start, False
    while (high is None or high - low > 1) and low < cap:
        width = None if high is None else high - low
        tried[k] = peak_of(k)
        low, high = (k, high) if tried[k] <= budget else (low, k)
        if len(tried) == 1:
            guess = 2 * k if high is None else max(1, k // 2)
        else:
            (k1, p1), (k2, p2) = sorted(tried.items(), key=lambda kp: abs(kp[1] - budget))[:2]
            slope = (p2 - p1) / (k2 - k1)
            guess = int(k2 + (budget - p2) / slope) if slope > 0 else 2 * low
        if bisect and high is not None:
            guess = (low + high) // 2
        guess = min(max(guess, low + 1), cap if high is None else high - 1)   # strictly inside the bracket
        bisect = width is not None and high is not None and high - low > width // 2
        k = guess
    return low


def max_batch(case, budget: int, limit: float) -> dict:
    """Largest batch (in samples) whose fake-measured peak fits ``budget``, per method; each autorecompute
    answer is checked with one real measured step at that batch."""
    sample = one_sample(case)

    def eager_peak(k):
        c = scaled(sample, k)
        return autorecompute.plan(c.model, *c.args, budget=1.0,
                                  loss_reserve=0, solver_time_limit=limit, **c.kwargs).baseline_peak

    def sqrt_peak(k):
        c = scaled(sample, k)
        return fake_step_memory(sqrt_n_module(c), c.args, c.kwargs).peak

    def ours(actions):
        return lambda k: minimum_peak(scaled(sample, k), limit, actions)

    found = {}
    for name, peak_of in (("eager", eager_peak), ("sqrt_n", sqrt_peak), ("autorecompute", ours(RECOMPUTE)),
                          ("autorecompute+offload", ours(OFFLOAD))):
        # from the largest batch found so far: each method fits at least about the one before it (√N eager's,
        # recompute-only √N's, with offload recompute-only's), fewer minimum-peak solves than from eager's
        found[name] = largest_fitting(peak_of, budget, start=max([1, *found.values()]))
    for name, actions in (("autorecompute", RECOMPUTE), ("autorecompute+offload", OFFLOAD)):
        k = found[name]
        if k:     # one real step at that batch
            c = scaled(sample, k)
            compiled = autorecompute.compile(c.model, budget=budget,
                                             loss_reserve=0, solver_time_limit=limit, actions=actions)
            found[f"{name} verified_peak"] = measured_step(compiled, c.model, c.args, c.kwargs).peak
    found["budget"] = budget
    return found


COMPILE_BUDGET = ROOT / "benchmarks" / "results" / "compile_budget.json"


def compile_budget_rows(name: str) -> list[dict]:
    """torch.compile (aot_eager) points below the compiled baseline, as measured by compile_budget.py."""
    if not COMPILE_BUDGET.exists():
        return []
    rows = [r for r in json.loads(COMPILE_BUDGET.read_text()) if r["model"] == name and r["backend"] == "aot_eager"]
    return [r for r in rows if r["fraction"] < 1.0]


def comparable_compile_rows(name: str) -> list[dict]:
    """The points of :func:`compile_budget_rows` whose gradients are eager's: goal 3 compares at those only
    (the others are listed in the report from compile_budget.json, with how far off their gradients are)."""
    return [r for r in compile_budget_rows(name) if compile_gradients_exact(r)]


class Bench:
    """One model's reference (eager peak, gradients, FLOPs) and the rows measured against it."""

    def __init__(self, name: str, case, rows: list[dict], reps: int):
        self.name, self.case, self.model, self.rows, self.reps = name, case, case.model, rows, reps
        self.initial = copy.deepcopy(self.model.state_dict())
        self.modules: dict[str, torch.nn.Module] = {}
        self.eager = measured_step(self.model, self.model, case.args, case.kwargs, seed=1)
        self.eager_flops = step_flops(self.model, case)

    def reset(self):
        self.model.load_state_dict(self.initial)
        for p in self.model.parameters():
            p.grad = None

    def record(self, method, module, budget=None, plan_time=0.0, status=""):
        """Measures ``module`` (peak, extra FLOPs, wall ratio, gradient difference) and appends its row."""
        self.modules[method] = module
        self.reset()
        model, case = self.model, self.case
        try:
            result = measured_step(module, model, case.args, case.kwargs, seed=1)
        except RuntimeError as error:      # naive √N breaks on an in-place op at a segment boundary
            reason = str(error).splitlines()[0][:160]
            print(f"  {method:<28} FAILED: {reason}", flush=True)
            self.rows.append({"model": self.name, "method": method, "budget": budget, "peak": None,
                              "peak_ratio": None, "extra_flops": None, "extra_flops_ratio": None, "wall_ratio": None,
                              "plan_time": plan_time, "grad_max_abs_diff": None, "fits": False,
                              "status": f"failed: {reason}"})
            return None
        extra = step_flops(module, case) - self.eager_flops
        row = {"model": self.name, "method": method, "budget": budget, "peak": result.peak,
               "peak_ratio": result.peak / self.eager.peak, "extra_flops": extra,
               "extra_flops_ratio": extra / self.eager_flops,
               "wall_ratio": wall_ratio(model, module, case, self.reps), "plan_time": plan_time,
               "grad_max_abs_diff": grad_diff(self.eager, result), "fits": budget is None or result.peak <= budget,
               "status": status}
        self.rows.append(row)
        print(f"  {method:<28} peak {format_bytes(row['peak']):>11} ({row['peak_ratio']:.2f}x)  "
              f"+FLOPs {100 * row['extra_flops_ratio']:5.1f}%  wall {row['wall_ratio']:.2f}x  "
              f"grad diff {row['grad_max_abs_diff']:.1e} {status}", flush=True)
        return row

    def at_compile_peaks(self, compile_name: str, suffix: str, limit: float) -> None:
        """Least-FLOPs plans at the peaks torch.compile's activation_memory_budget reached on
        ``compile_name`` (benchmarks/compile_budget.py), measured on this bench's model."""
        for row in comparable_compile_rows(compile_name):
            budget = row["measured_peak_bytes"]
            self.reset()
            started = time.perf_counter()
            # goal 3 counts FLOPs, as torch.compile's partitioner does (it fuses the elementwise ops it recomputes)
            compiled = autorecompute.compile(self.model, budget=budget,
                                             loss_reserve=0, solver_time_limit=limit, actions=RECOMPUTE,
                                             objective="flops")
            try:
                compiled.prepare(*self.case.args, **self.case.kwargs)
            except autorecompute.InfeasibleBudgetError:
                continue
            plan = compiled.plan
            self.record(f"autorecompute (least FLOPs) @ torch.compile({row['fraction']}) peak{suffix}", compiled,
                        budget=budget, plan_time=time.perf_counter() - started,
                        status=plan_status(plan))


def bench_model(name: str, quick: bool, limit: float) -> tuple[list[dict], dict]:
    PHASES.clear()
    case = models.make(name, benchmark=True)
    model = case.model
    rows: list[dict] = []
    reps = 3 if quick else 7
    bench = Bench(name, case, rows, reps)
    eager, eager_flops, record, reset = bench.eager, bench.eager_flops, bench.record, bench.reset
    kept_modules = bench.modules

    print(f"{name}: eager peak {format_bytes(eager.peak)}", flush=True)
    rows.append({"model": name, "method": "eager", "budget": None, "peak": eager.peak, "peak_ratio": 1.0,
                 "extra_flops": 0, "extra_flops_ratio": 0.0, "wall_ratio": 1.0, "plan_time": 0.0,
                 "grad_max_abs_diff": 0.0, "fits": True, "status": ""})
    reference_sqrt = []
    if name in SEQUENTIAL_BLOCKS:
        blocks = SEQUENTIAL_BLOCKS[name]
        wrapper = SqrtNCheckpointed(model, blocks)
        reference_sqrt.append(record("sqrt_n checkpoint_sequential", wrapper))
        per_block = SqrtNCheckpointed(model, blocks)
        per_block.segments = len(per_block.blocks)
        record("per-block checkpoint", per_block)
    started = time.perf_counter()
    graph_sqrt = sqrt_n_module(case)
    reference_sqrt.append(record("sqrt_n articulation points", graph_sqrt, plan_time=time.perf_counter() - started))
    if name in HF:
        hf = copy.deepcopy(model)
        models.hf_layer_checkpointing(hf)
        reset()
        hf.load_state_dict(bench.initial)
        result = measured_step(hf, hf, case.args, case.kwargs, seed=1)
        extra = step_flops(hf, case) - eager_flops
        rows.append({"model": name, "method": "per-block (HF gradient_checkpointing)", "budget": None,
                     "peak": result.peak, "peak_ratio": result.peak / eager.peak, "extra_flops": extra,
                     "extra_flops_ratio": extra / eager_flops, "wall_ratio": wall_ratio(model, hf, case, reps),
                     "plan_time": 0.0, "grad_max_abs_diff": grad_diff(eager, result), "fits": True, "status": ""})
        print(f"  per-block (HF)               peak {format_bytes(result.peak):>11}", flush=True)
        del hf

    reset()
    baseline = eager.peak
    reference_sqrt = [r for r in reference_sqrt if r is not None]
    # the naive √N: checkpoint_sequential for sequential models (when it runs), the articulation-point
    # segments otherwise; the lowest of both is reported beside it
    reference = reference_sqrt[0]
    lowest = min(reference_sqrt, key=lambda r: r["peak"])
    sqrt_peak = reference["peak"]
    minimum = {}
    for tag, actions, points in (("autorecompute", RECOMPUTE, 3 if quick else 5),
                                 ("autorecompute+offload", OFFLOAD, 2 if quick else 3),
                                 ("autorecompute compress:bfloat16 (lossy)", COMPRESS, 1)):
        reset()       # no gradients left by the rows before: they would count as resident state
        with phase("minimum probes"):
            minimum[tag] = low = minimum_peak(case, limit, actions)
        budgets = [low + (baseline - low) * i // max(1, points - 1) for i in range(points)] if points > 1 else [low]
        extra = [(f"{tag} @ sqrt_n peak", sqrt_peak, "time")] if actions != COMPRESS else []
        if actions != COMPRESS and lowest is not reference:
            extra.append((f"{tag} @ lowest sqrt_n peak", lowest["peak"], "time"))
        if actions == RECOMPUTE:      # goal 1 counts FLOPs: the plan with the fewest, beside the fastest
            extra += [(f"{tag} (least FLOPs){label[len(tag):]}", budget, "flops") for label, budget, _ in extra]
        for label, budget, objective in [*[(tag, b, "time") for b in budgets], *extra]:
            reset()
            started = time.perf_counter()
            compiled = autorecompute.compile(model, budget=budget,
                                             loss_reserve=0, solver_time_limit=limit, actions=actions,
                                             objective=objective)
            try:
                with phase("sweep plans"):
                    compiled.prepare(*case.args, **case.kwargs)
            except autorecompute.InfeasibleBudgetError:
                print(f"  {label}: budget {budget} infeasible (minimum {low})")
                continue
            plan = compiled.plan
            with phase("sweep measurements"):
                record(label, compiled, budget=budget, plan_time=time.perf_counter() - started,
                       status=plan_status(plan))
    # goal 1 missed within the time limit: plan again with LONGER_FACTOR× the limit (both rows reported)
    least = next((r for r in rows if r["method"] == "autorecompute (least FLOPs) @ sqrt_n peak"), None)
    if not quick and least is not None and least["extra_flops"] > 0.5 * reference["extra_flops"]:
        reset()
        started = time.perf_counter()
        compiled = autorecompute.compile(model, budget=sqrt_peak,
                                         loss_reserve=0, solver_time_limit=LONGER_FACTOR * limit, actions=RECOMPUTE,
                                         objective="flops")
        compiled.prepare(*case.args, **case.kwargs)
        record(LONGER_SOLVE, compiled, budget=sqrt_peak, plan_time=time.perf_counter() - started,
               status=plan_status(compiled.plan))
    # at the peaks torch.compile's activation_memory_budget reached (benchmarks/compile_budget.py) with eager's
    # gradients; below 1.0 they differ where it redraws a dropout (pytorch#190758), so the same model without
    # dropout is measured too: there both sides compute eager's gradients
    with phase("torch.compile peaks"):
        bench.at_compile_peaks(name, "", limit)
        if compile_budget_rows(name + NO_DROPOUT):
            variant = Bench(name, make_case(name + NO_DROPOUT), rows, reps)
            variant.at_compile_peaks(name + NO_DROPOUT, " (no dropout)", limit)
            del variant
    # goal 5: √N and our plans at its peak — compile's default actions (recompute and offload) and recompute
    # only — timed side by side, interleaved with eager, more repetitions
    at_sqrt = {label: kept_modules[f"{method} @ sqrt_n peak"]
               for label, method in (("autorecompute", "autorecompute"), ("default actions", "autorecompute+offload"))
               if f"{method} @ sqrt_n peak" in kept_modules}
    wall = None
    if at_sqrt:
        reset()
        with phase("head to head"):
            wall = head_to_head(model, {"sqrt_n": kept_modules[reference["method"]], **at_sqrt},
                                case, reps=WALL_REPS_QUICK if quick else WALL_REPS)
        print(f"  wall head to head: {wall}", flush=True)
    kept_modules.clear()
    summary = {"model": name, "eager_peak": eager.peak, "wall_at_sqrt_n_peak": wall, "minimum_peak": minimum["autorecompute"],
               "minimum_peak_offload": minimum["autorecompute+offload"],
               "minimum_peak_compress": minimum["autorecompute compress:bfloat16 (lossy)"], "sqrt_n_peak": sqrt_peak,
               "sqrt_n_method": reference["method"], "lowest_sqrt_n_peak": lowest["peak"],
               "lowest_sqrt_n_method": lowest["method"]}
    if name in MAX_BATCH_MODELS and not quick or name == QUICK_MAX_BATCH:
        reset()
        # --quick: VGG only (Checkmate's model for goal 4, and the fastest search); half the solver time for
        # the dozen minimum-peak solves of the search, which the local search after each makes up for (GPT's
        # answers at 3 s equal those at 6 s, in 134 s instead of 174): the suite keeps under 30 min
        with phase("max batch"):
            summary["max_batch"] = max_batch(case, eager.peak, limit / 2)
        print(f"  max batch multiple at {format_bytes(eager.peak)}: {summary['max_batch']}", flush=True)
    return rows, summary


def pareto_plot(name: str, rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    rows = [r for r in rows if r["peak"] is not None]
    for method, color, label in (("autorecompute", "#e69138", "autorecompute, recompute only (budget sweep)"),
                                 ("autorecompute+offload", "#3c78d8", "autorecompute + offload (budget sweep)")):
        ours = sorted((r for r in rows if r["method"] == method), key=lambda r: r["extra_flops_ratio"])
        ax.plot([100 * r["extra_flops_ratio"] for r in ours], [r["peak"] / 2**20 for r in ours], "o-",
                color=color, label=label)
        for r in ours:
            ax.plot([100 * r["extra_flops_ratio"]], [r["budget"] / 2**20], "_", color="#cc0000", ms=12)
    markers = {"eager": ("s", "black"), "sqrt_n checkpoint_sequential": ("^", "#3d85c6"),
               "sqrt_n articulation points": ("v", "#6fa8dc"), "per-block checkpoint": ("D", "#674ea7"),
               "per-block (HF gradient_checkpointing)": ("D", "#674ea7"), "autorecompute @ sqrt_n peak": ("*", "#cc0000"),
               "autorecompute+offload @ sqrt_n peak": ("*", "#1155cc"),
               "autorecompute @ lowest sqrt_n peak": ("*", "#990000"),
               "autorecompute (least FLOPs) @ sqrt_n peak": ("P", "#cc0000"),
               "autorecompute compress:bfloat16 (lossy)": ("x", "#a64d79")}
    for r in rows:
        if r["method"] in markers:
            marker, color = markers[r["method"]]
            ax.plot([100 * r["extra_flops_ratio"]], [r["peak"] / 2**20], marker, color=color, ms=8, label=r["method"])
    if COMPILE_BUDGET.exists():
        points = sorted((r for r in json.loads(COMPILE_BUDGET.read_text())
                         if r["model"] == name and r["backend"] == "aot_eager"), key=lambda r: r["fraction"])
        if points:
            ax.plot([100 * r["extra_flops_ratio"] for r in points], [r["measured_peak_bytes"] / 2**20 for r in points],
                    "P--", color="#6aa84f", label="torch.compile activation_memory_budget 0-1 (aot_eager)")
            wrong = [r for r in points if not compile_gradients_exact(r)]
            if wrong:
                ax.plot([100 * r["extra_flops_ratio"] for r in wrong], [r["measured_peak_bytes"] / 2**20 for r in wrong],
                        "o", mfc="none", mec="#cc0000", ms=12,
                        label="torch.compile: gradients not eager's (dropout redrawn, pytorch#190758)")
    ax.set_xlabel("extra FLOPs over eager (%) — offload and compress cost transfers/casts, not FLOPs")
    ax.set_ylabel("measured peak (MiB)")
    ax.set_title(f"{name}: measured peak vs recompute (red dashes: budgets)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", nargs="*")
    parser.add_argument("--solver-time-limit", type=float, default=None)
    parser.add_argument("--merge", action="store_true",
                        help="keep the other models' rows of results.json (rerun some models after a change)")
    args = parser.parse_args(argv)
    names = args.models or (QUICK if args.quick else FULL)
    limit = args.solver_time_limit or (1.5 if args.quick else 6.0)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    started = time.perf_counter()
    all_rows, summaries = [], []
    for name in names:
        model_started = time.perf_counter()
        rows, summary = bench_model(name, args.quick, limit)
        summary["seconds"] = time.perf_counter() - model_started
        summary["phases"] = {phase_name: round(seconds, 1) for phase_name, seconds in PHASES.items()}
        print(f"  {name}: {summary['seconds']:.0f} s; phases {summary['phases']}", flush=True)
        all_rows += rows
        summaries.append(summary)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    seconds = time.perf_counter() - started
    benched = list(names)
    if args.merge and (out / "results.json").exists():
        previous = json.loads((out / "results.json").read_text())
        kept = [m["model"] for m in previous["models"] if m["model"] not in names]
        all_rows = [r for r in previous["rows"] if r["model"] in kept] + all_rows
        summaries = [m for m in previous["models"] if m["model"] in kept] + summaries
        order = {name: i for i, name in enumerate(FULL)}
        summaries.sort(key=lambda m: order.get(m["model"], len(order)))
        all_rows.sort(key=lambda r: order.get(r["model"], len(order)))     # stable: rows keep their order
        share = previous.get("seconds", 0.0) / max(1, len(previous["models"]))   # runs before per-model times
        seconds = sum(m.get("seconds", share) for m in summaries)
        names = [m["model"] for m in summaries]
    (out / "results.json").write_text(json.dumps({"rows": all_rows, "models": summaries, "seconds": seconds},
                                                 indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(all_rows[0]))
        writer.writeheader()
        writer.writerows(all_rows)
    plots = ROOT / "docs" / "benchmarks"
    plots.mkdir(parents=True, exist_ok=True)
    for name in names:
        pareto_plot(name, [r for r in all_rows if r["model"] == name], plots / f"pareto_{name}.png")
    from floors import floors       # the memory no plan removes, for the 2a/2b explanation
    floors_path = out / "floors.json"
    found = json.loads(floors_path.read_text()) if floors_path.exists() else {}
    stale = [name for name, value in found.items() if not isinstance(value, dict)]   # one floor a model: older
    found.update({name: floors(name) for name in dict.fromkeys([*benched, *stale])})
    floors_path.write_text(json.dumps(found, indent=1))
    from report import write_markdown

    write_markdown(all_rows, summaries, seconds, args.quick, ROOT / "docs" / "benchmarks.md")
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
