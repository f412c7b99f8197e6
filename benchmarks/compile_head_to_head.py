"""Under torch.compile, head to head: ``torch.compile(autorecompute.compile(model, budget))`` against
``torch.compile(model)`` with ``torch._functorch.config.activation_memory_budget``, on the suite's transformers.

    python benchmarks/compile_head_to_head.py [--models gpt gpt2] [--backend aot_eager]

For each model, in one process: the peer at fractions 1.0 … 0.0 and autorecompute at budgets 0.8 … 0.4 of the
eager step, each compiled by the same backend. Per point: the measured peak (``allocated_peak``, one warm step),
the extra FLOPs of the compiled forward and backward graphs over eager's (``compile_budget.Recorder``), the
largest gradient difference from eager's (same seed), and the step time over the plain compiled model's
(``activation_memory_budget`` 1.0), medians of interleaved runs. Writes
benchmarks/results/compile_head_to_head.json and the table in docs/benchmarks.md between its markers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import torch._functorch.config as functorch_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_budget import NO_CACHE, ROOT, Recorder, eager_reference, gradients, make_case, step  # noqa: E402

import autorecompute  # noqa: E402
from autorecompute.runtime.memory import allocated_peak  # noqa: E402

PEER_FRACTIONS = [1.0, 0.7, 0.5, 0.3, 0.1, 0.0]
BUDGETS = [0.8, 0.6, 0.5, 0.4]
REPEATS = 11
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- compile_head_to_head: begin -->", "<!-- compile_head_to_head: end -->"


def time_ratio(run, baseline) -> float:
    """Median step time of ``run`` over ``baseline``'s, the two interleaved."""
    times: dict = {run: [], baseline: []}
    for _ in range(REPEATS):
        for fn in (run, baseline):
            started = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - started)
    return statistics.median(times[run]) / statistics.median(times[baseline])


def point(case, ref, method: str, setting: float, compiled, recorder: Recorder, baseline) -> dict:
    """One row: ``compiled`` (warmed: planned and compiled) measured."""
    model, args, kwargs = case.model, case.args, case.kwargs
    peak = ref["resident"] + allocated_peak(lambda: step(compiled, args, kwargs))
    model.zero_grad(set_to_none=True)
    grads = gradients(model, compiled, args, kwargs)
    flops = recorder.flops["fw"] + recorder.flops["bw"]

    def one(module):
        def run():
            step(module, args, kwargs)
            model.zero_grad(set_to_none=True)
        return run
    return {"model": case.name, "method": method, "setting": setting, "peak": peak,
            "peak_vs_eager": round(peak / ref["eager_peak"], 4),
            "extra_flops_ratio": round((flops - ref["eager_flops"]) / ref["eager_flops"], 4),
            "grad_max_abs_diff": max(float((grads[n] - g).abs().max()) for n, g in ref["grads"].items()),
            "time_vs_compiled": round(time_ratio(one(compiled), one(baseline)), 3)}


def warmed(module, case, steps: int = 2):
    for _ in range(steps):
        step(module, case.args, case.kwargs)
        case.model.zero_grad(set_to_none=True)
    return module


def rows_of(name: str, backend: str) -> list[dict]:
    case = make_case(name)
    ref = eager_reference(case)
    rows = []
    for fraction in PEER_FRACTIONS:
        torch._dynamo.reset()
        recorder = Recorder(backend)
        with functorch_config.patch(activation_memory_budget=fraction, **NO_CACHE):
            peer = warmed(torch.compile(case.model, backend=recorder), case, 1)
        baseline = warmed(torch.compile(case.model, backend=backend), case, 1) if fraction != 1.0 else peer
        rows.append(point(case, ref, "activation_memory_budget", fraction, peer, recorder, baseline))
        print(rows[-1], flush=True)
        if fraction == 1.0:
            plain = peer
    for budget in BUDGETS:
        torch._dynamo.reset()
        plain = warmed(plain, case, 1)
        recorder = Recorder(backend)
        opt = autorecompute.compile(case.model, budget=budget, loss_reserve=0)
        try:
            with functorch_config.patch(**NO_CACHE):
                ours = warmed(torch.compile(opt, backend=recorder), case)
        except autorecompute.InfeasibleBudgetError as error:      # below the compiled step's minimum: at it
            case.model.zero_grad(set_to_none=True)
            torch._dynamo.reset()
            plain = warmed(plain, case, 1)
            recorder = Recorder(backend)
            budget = error.minimum
            opt = autorecompute.compile(case.model, budget=budget, loss_reserve=0)
            with functorch_config.patch(**NO_CACHE):
                ours = warmed(torch.compile(opt, backend=recorder), case)
        row = point(case, ref, "autorecompute", budget, ours, recorder, plain)
        (plan,) = opt.plans.values()
        row.update(budget_bytes=plan.budget, predicted_peak=plan.predicted_peak)
        rows.append(row)
        print(rows[-1], flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Each autorecompute point beside the fastest correct peer point at or under its measured peak."""
    lines = ["| model | budget | measured peak (× eager) | within budget | step time (× plain compile) | +FLOPs | "
             "grads vs eager | `activation_memory_budget` at ≤ that peak: fraction, peak, step time, +FLOPs |",
             "|---|---|---|---|---|---|---|---|"]
    for ours in (r for r in rows if r["method"] == "autorecompute"):
        scale = max(1.0, ours["grad_max_abs_diff"])
        peers = [r for r in rows if r["method"] != "autorecompute" and r["model"] == ours["model"]
                 and r["peak"] <= ours["peak"]]
        best = min(peers, key=lambda r: r["time_vs_compiled"], default=None)
        peer = ("none reaches it" if best is None else
                f"{best['setting']}: {best['peak_vs_eager']:.2f}×, {best['time_vs_compiled']:.2f}×, "
                f"{100 * best['extra_flops_ratio']:+.1f}%" +
                ("" if best["grad_max_abs_diff"] <= 1e-6 * scale else
                 f" (gradients off by {best['grad_max_abs_diff']:.3g})"))
        setting = ours["setting"] if ours["setting"] <= 1 else f"its minimum, {ours['setting'] / 2**20:.2f} MiB"
        lines.append(f"| {ours['model']} | {setting} | {ours['peak_vs_eager']:.2f}× | "
                     f"{'yes' if ours['peak'] <= ours['budget_bytes'] else 'NO'} | {ours['time_vs_compiled']:.2f}× | "
                     f"{100 * ours['extra_flops_ratio']:+.1f}% | "
                     f"{'bitwise' if ours['grad_max_abs_diff'] == 0 else format(ours['grad_max_abs_diff'], '.3g')} | "
                     f"{peer} |")
    return "\n".join(lines)


def section(rows: list[dict]) -> list[str]:
    """docs/benchmarks.md's section (written by this script and kept by ``benchmarks/report.py``)."""
    backends = sorted({r.get("backend", "aot_eager") for r in rows})
    return ["", "## Under torch.compile, against `activation_memory_budget`", "", BEGIN,
            "`python benchmarks/compile_head_to_head.py`: `torch.compile(autorecompute.compile(model, budget))` "
            "against `torch.compile(model)` with `torch._functorch.config.activation_memory_budget` (the peer most "
            f"users reach for), backend {', '.join(backends)}, 2-core CPU. Peak: the allocator's events over one "
            "warm step (`allocated_peak`), × the eager step's; step time: × the plain compiled model's "
            f"(`activation_memory_budget` 1.0), medians of {REPEATS} interleaved runs; +FLOPs: the compiled "
            "graphs' over eager's. For each autorecompute budget the peer column is its fastest point at or "
            "under the same measured peak. Raw rows: `benchmarks/results/compile_head_to_head.json`.", "",
            table(rows), END]


def write_section(rows: list[dict]) -> None:
    text = DOCS.read_text()
    new = "\n".join(section(rows))
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        head = head[:head.rindex("\n## Under torch.compile")]
        text = head + new + rest.split(END, 1)[1]
    elif "\n## CUDA" in text:
        head, rest = text.split("\n## CUDA", 1)
        text = head + new + "\n\n## CUDA" + rest
    else:
        text = text.rstrip("\n") + "\n" + new + "\n"
    DOCS.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "gpt2"])
    parser.add_argument("--backend", default="aot_eager", choices=["aot_eager", "inductor"])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile_head_to_head.json"))
    opts = parser.parse_args()
    rows = [dict(row, backend=opts.backend) for name in opts.models for row in rows_of(name, opts.backend)]
    Path(opts.out).write_text(json.dumps(rows, indent=1) + "\n")
    write_section(rows)
    print(table(rows))


if __name__ == "__main__":
    main()
