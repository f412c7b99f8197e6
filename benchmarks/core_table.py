"""Core-pipeline figures for docs/design-notes.md: baseline and minimum peak per zoo model, and the
measured-vs-predicted check at four budgets. Run: python benchmarks/core_table.py (about 3 minutes)."""
from __future__ import annotations

import copy
import os
import sys

os.environ.setdefault("AUTORECOMPUTE_CACHE", "off")   # benchmarks time and compare planning itself
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import autorecompute  # noqa: E402
import models  # noqa: E402
from autorecompute.budget import format_bytes  # noqa: E402
from harness import assert_bitwise_equal, measured_step  # noqa: E402


def main() -> None:
    print("| model | baseline peak | minimum peak | min / baseline | budgets ok | max |pred-meas|/meas | bitwise |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in models.ZOO:
        case = models.make(name)
        model = case.model
        initial = copy.deepcopy(model.state_dict())
        eager = measured_step(model, model, case.args, case.kwargs, seed=1)
        for p in model.parameters():   # plan a fresh step: no gradients left from the eager one
            p.grad = None
        baseline = autorecompute.plan(model, *case.args, budget=1.0,
                                      loss_reserve=0, solver_time_limit=1.0, **case.kwargs).baseline_peak
        minimum = autorecompute.minimum_peak(model, *case.args, loss_reserve=0, solver_time_limit=1.0, **case.kwargs)
        budgets = [baseline, minimum, minimum + (baseline - minimum) // 3, minimum + 2 * (baseline - minimum) // 3]
        ok, worst, bitwise = 0, 0.0, True
        for budget in budgets:
            model.load_state_dict(initial)
            compiled = autorecompute.compile(model, budget=budget, loss_reserve=0, solver_time_limit=1.0)
            result = measured_step(compiled, model, case.args, case.kwargs, seed=1)
            ok += result.peak <= budget
            worst = max(worst, abs(compiled.plan.predicted_peak - result.peak) / result.peak)
            try:
                assert_bitwise_equal(eager, result)
            except AssertionError:
                bitwise = False
        print(f"| {name} | {format_bytes(baseline)} | {format_bytes(minimum)} | {minimum / baseline:.2f} | "
              f"{ok}/4 | {100 * worst:.3f}% | {'yes' if bitwise else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
