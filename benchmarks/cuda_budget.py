"""CUDA budget check: does the allocator's real peak stay under the budget, across models and budgets?

    python benchmarks/cuda_budget.py [--models gpt llama] [--out benchmarks/results/cuda_budget.json]

For each model of the benchmark zoo (batch scaled up so activations, not the allocator's rounding, set the
peak) and each budget (fractions of the unoptimized peak, and the minimum the planner reports), recompute
only and with offload: one step on the device, ``torch.cuda.max_memory_allocated`` against the budget,
gradients against eager, and the step time against eager's (median of interleaved runs).

The budget covers everything allocated on the device during the step, what was allocated before it
(parameters, inputs, a cuBLAS workspace) included: the peak compared is the allocator's absolute peak.
Without CUDA it runs on the CPU with the live-storage tracker (a dry run of this script).
Writes one JSON row per point as it goes (a crash keeps the rows before it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("AUTORECOMPUTE_CACHE", "off")   # benchmarks time and compare planning itself
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import autorecompute  # noqa: E402
import models  # noqa: E402
from autorecompute.runtime.memory import LiveStorageTracker, output_tensors_for_backward, tensor_bytes  # noqa: E402
from suite import scaled  # noqa: E402

# batch multiplier per model: activations of tens to hundreds of MB on the device
SCALE = {"gpt": 16, "gpt2": 16, "llama": 16, "bert": 16, "resnet": 8, "vgg": 16, "unet": 8, "mlp": 64}
BUDGETS = (0.6, "minimum")
ACTIONS = {"recompute": ("recompute",), "offload": ("recompute", "offload")}


def on(device, case):
    def move(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t
    return models.Case(case.name, case.model.to(device), tuple(move(a) for a in case.args),
                       {k: move(v) for k, v in case.kwargs.items()})


def step(module, case) -> None:
    out = module(*case.args, **case.kwargs)
    tensors = output_tensors_for_backward(out)
    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def peak_of_step(module, case, cuda: bool) -> int:
    """The absolute peak of one step (gradients cleared first): the allocator's on CUDA, the tracker's
    plus resident state on the CPU."""
    case.model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        step(module, case)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    resident = tensor_bytes([*case.model.parameters(), *case.model.buffers(), case.args, case.kwargs])
    tracker = LiveStorageTracker()
    torch.manual_seed(0)
    with tracker:
        step(module, case)
    return resident + tracker.peak


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def time_ratio(reference, module, case, cuda: bool, reps: int) -> float:
    ratios = []
    for _ in range(reps):
        times = []
        for m in (reference, module):
            case.model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            step(m, case)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        ratios.append(times[1] / times[0])
    return statistics.median(ratios)


def minimum(case, actions) -> int:
    case.model.zero_grad(set_to_none=True)      # planned as the compiled steps run: without gradients
    return autorecompute.minimum_peak(case.model, *case.args, actions=actions,
                                      loss_reserve=0, solver_time_limit=5, **case.kwargs)


def bench(name: str, cuda: bool, reps: int, emit) -> None:
    device = torch.device("cuda" if cuda else "cpu")
    case = on(device, scaled(models.make(name), SCALE[name] if cuda else 1))
    step(case.model, case)                       # warm-up: kernels, cuBLAS workspace
    case.model.zero_grad(set_to_none=True)
    base = torch.cuda.memory_allocated() if cuda else 0
    eager_peak = peak_of_step(case.model, case, cuda)
    expected = grads(case.model)
    resident = tensor_bytes([*case.model.parameters(), *case.model.buffers(), case.args, case.kwargs])
    emit({"model": name, "method": "eager", "peak": eager_peak, "allocated_before": base,
          "resident_tensors": resident})
    for label, actions in ACTIONS.items():
        for budget in BUDGETS:
            row = {"model": name, "method": label, "budget_arg": budget}
            try:
                b = minimum(case, actions) if budget == "minimum" else budget
                compiled = autorecompute.compile(case.model, budget=b, actions=actions,
                                                 loss_reserve=0, solver_time_limit=5)
                case.model.zero_grad(set_to_none=True)
                started = time.perf_counter()
                plan = compiled.prepare(*case.args, **case.kwargs)
                row["plan_s"] = time.perf_counter() - started
                peak = peak_of_step(compiled, case, cuda)
                got = grads(case.model)
                row.update(budget=plan.budget, predicted=plan.predicted_peak, peak=peak, fits=peak <= plan.budget,
                           over=peak - plan.budget, vs_eager=peak / eager_peak,
                           grad_diff=max(float((got[k] - expected[k]).abs().max()) for k in expected),
                           recompute=plan.count("recompute"), offload=plan.count("offload"),
                           time_vs_eager=time_ratio(case.model, compiled, case, cuda, reps))
            except autorecompute.InfeasibleBudgetError as error:   # below this model's minimum: no point
                row["refused"] = error.minimum
            except Exception as error:  # one failing point must not hide the others
                row["error"] = f"{type(error).__name__}: {error}"[:2000]
                traceback.print_exc()
            emit(row)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "vgg", "llama", "resnet"])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cuda_budget.json")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    # cuDNN's default convolution-backward algorithms add with atomics (two eager VGG steps differ by
    # ~1e-3): deterministic ones make the gradient column show what a plan changes, not that noise
    torch.backends.cudnn.deterministic = True
    rows = []
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run: live-storage tracker)",
            "torch": torch.__version__, "cudnn_deterministic": True}
    print(info, flush=True)

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))

    for name in args.models:
        try:
            bench(name, cuda, args.reps, emit)
        except Exception:
            traceback.print_exc()
    bad = [r for r in rows if r.get("fits") is False or "error" in r]
    print(f"{len(rows)} rows, {len(bad)} over budget or failed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
