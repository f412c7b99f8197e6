"""Where the CUDA allocator and the plan's accounting part: one step, op by op.

    python benchmarks/cuda_gap.py [--model gpt] [--budget minimum]

Runs one training step of the model (eager, then autorecompute at ``budget``) under a tracker that, after
every op, compares ``torch.cuda.max_memory_allocated`` during the op with what the planner counts there:
resident bytes (other device allocations included) + live tensors made in the step + the op's measured
workspace. Prints the ops where the allocator is furthest above (a positive gap is memory the planner
does not see) and the gap at the step's peak. Needs CUDA.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("AUTORECOMPUTE_CACHE", "off")   # benchmarks time and compare planning itself
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import autorecompute  # noqa: E402
import models  # noqa: E402
from autorecompute.runtime.memory import LiveStorageTracker, resident_bytes, run_step  # noqa: E402
from autorecompute.runtime.workspaces import workspace_bytes  # noqa: E402
from cuda_budget import SCALE, minimum, on, scaled  # noqa: E402


class GapTracker(LiveStorageTracker):
    def __init__(self, base: int):
        super().__init__()
        self.base, self.rows = base, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        torch.cuda.synchronize()
        counted = self.base + self.current + workspace_bytes(func, args, kwargs or {})
        allocated = torch.cuda.max_memory_allocated()
        self.rows.append((allocated - counted, str(func), allocated, counted))
        return out


def report(label: str, module, case) -> None:
    case.model.zero_grad(set_to_none=True)
    tracker = GapTracker(resident_bytes(case.model, case.args, case.kwargs))
    torch.manual_seed(0)
    with tracker:
        run_step(module, case.args, case.kwargs)
    at_peak = max(tracker.rows, key=lambda r: r[2])
    print(f"{label}: allocator peak {at_peak[2] / 2**20:.2f} MiB at {at_peak[1]}, counted there "
          f"{at_peak[3] / 2**20:.2f} MiB (gap {at_peak[0] / 2**20:+.2f} MiB); largest gaps:")
    for gap, op, allocated, counted in sorted(tracker.rows, reverse=True)[:8]:
        print(f"   {gap / 2**20:+8.2f} MiB  {op}  (allocator {allocated / 2**20:.2f}, counted {counted / 2**20:.2f})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--budget", default="minimum")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to compare")
        return 0
    case = on(torch.device("cuda"), scaled(models.make(args.model), SCALE[args.model]))
    run_step(case.model, case.args, case.kwargs)        # warm-up
    report("eager", case.model, case)
    budget = minimum(case, ("recompute",)) if args.budget == "minimum" else float(args.budget)
    compiled = autorecompute.compile(case.model, budget=budget, actions=("recompute",),
                                     loss_reserve=0, solver_time_limit=5)
    compiled.prepare(*case.args, **case.kwargs)
    report(f"autorecompute at {args.budget}", compiled, case)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
