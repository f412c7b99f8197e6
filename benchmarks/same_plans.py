"""The plans the benchmark suite makes, as data: a refactoring that preserves behaviour keeps them equal.

    python benchmarks/same_plans.py --out before.json            # on the old code
    python benchmarks/same_plans.py --out after.json --check before.json

For each suite model (benchmark sizes) and each action set the suite sweeps, the minimum peak and the plans at
the budgets the suite plans (from the minimum to eager's peak), both objectives at the middle one: every
decision, stash action, region cut, softmax kept in place, and the predicted, model and minimum peaks and
extra FLOPs. ``--check`` names every plan that differs. Planning is deterministic (CP-SAT's deterministic
time, the local searches' work counts), so equal code makes equal plans.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("AUTORECOMPUTE_CACHE", "off")   # benchmarks time and compare planning itself
sys.path.insert(0, str(ROOT / "tests"))

import autorecompute  # noqa: E402
import models  # noqa: E402

MODELS = ["gpt", "gpt2", "bert", "llama", "resnet", "unet", "mlp", "vgg"]
ACTION_SETS = {"recompute": ("recompute",), "offload": ("recompute", "offload"), "compress": ("compress",)}
POINTS = {"recompute": 3, "offload": 2, "compress": 1}


def fingerprint(plan) -> dict:
    """What a plan decides and predicts (not its timings)."""
    return {"decisions": dict(plan.decisions), "stash": {n: r.action for n, r in plan.stash.items()},
            "region_starts": list(plan.region_starts), "region_remakes": list(plan.region_remakes),
            "lean_ops": list(plan.lean_ops), "predicted_peak": plan.predicted_peak,
            "model_peak": plan.model_peak, "minimum_peak": plan.minimum_peak, "extra_flops": plan.extra_flops,
            "status": plan.solver_status}


def model_plans(name: str, limit: float) -> dict:
    case = models.make(name, benchmark=True)
    out = {}
    for tag, actions in ACTION_SETS.items():
        options = dict(loss_reserve=0, solver_time_limit=limit, actions=actions)
        low = autorecompute.minimum_peak(case.model, *case.args, **options, **case.kwargs)
        baseline = autorecompute.plan(case.model, *case.args, budget=1.0, **options, **case.kwargs).baseline_peak
        points = POINTS[tag]
        budgets = [low + (baseline - low) * i // max(1, points - 1) for i in range(points)]
        out[f"{tag} minimum"] = low
        runs = [(b, "time") for b in budgets] + ([(budgets[len(budgets) // 2], "flops")] if points > 1 else [])
        for budget, objective in runs:
            plan = autorecompute.plan(case.model, *case.args, budget=budget, objective=objective, **options,
                                      **case.kwargs)
            out[f"{tag} @ {budget} {objective}"] = fingerprint(plan)
    return out


def differences(before: dict, after: dict) -> list[str]:
    found = []
    for model in before:
        for key, value in before[model].items():
            other = after.get(model, {}).get(key)
            if other != value:
                fields = [f for f in value if other is None or value[f] != other.get(f)] if isinstance(value, dict) \
                    else ["value"]
                found.append(f"{model} {key}: differs in {fields}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--check", help="a file written by an earlier run: report every plan that differs")
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--solver-time-limit", type=float, default=2.0)
    args = parser.parse_args(argv)
    result = {}
    for name in args.models:
        started = time.perf_counter()
        result[name] = model_plans(name, args.solver_time_limit)
        print(f"{name}: {len(result[name])} entries in {time.perf_counter() - started:.0f} s", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    if args.check:
        before = json.loads(Path(args.check).read_text())
        found = differences({m: v for m, v in before.items() if m in result}, result)
        print("\n".join(found) if found else "same plans", flush=True)
        return 1 if found else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
