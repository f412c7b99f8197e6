"""CUDA offload check: the allocator's peak against the budget, and how much of the copying overlaps compute.

    python benchmarks/cuda_offload.py [--batch 256] [--budget 0.5]

Needs a CUDA device (exits with a message otherwise). For the GPT-style decoder of tests/models.py:

* eager step: time, ``torch.cuda.max_memory_allocated``;
* autorecompute with ``actions=("offload",)`` at ``budget`` × the eager peak: the allocator's peak
  against the budget (the plan bounds tensor storage; cuBLAS workspaces come on top), gradients against
  eager, step time;
* overlap: the bytes offloaded per step (both directions) at the pinned-copy bandwidth measured here give
  the time the copies take; ``overlap = 1 − (offload step − eager step) / copy time`` (1: fully hidden
  behind compute, 0: fully exposed).

Writes benchmarks/results/cuda_offload.json; docs/benchmarks.md records the figures when a GPU was lent.
"""
from __future__ import annotations

import argparse
import json
import statistics
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("AUTORECOMPUTE_CACHE", "off")   # benchmarks time and compare planning itself
sys.path.insert(0, str(ROOT / "tests"))

import autorecompute  # noqa: E402
import models  # noqa: E402


def step(module, ids) -> None:
    torch.manual_seed(0)         # the same dropout masks in every step: gradients comparable with eager's
    module(ids).float().sum().backward()


def allocator_peak(module, model, ids) -> int:
    """``torch.cuda.max_memory_allocated`` of one step, gradients cleared first."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(module, ids)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def timed(module, ids, reps: int = 10) -> float:
    times = []
    for _ in range(reps):
        module.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        started = time.perf_counter()
        step(module, ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def pinned_bandwidth(nbytes: int = 256 << 20) -> float:
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(4):
        host.copy_(device, non_blocking=True)
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 8 * nbytes / (time.perf_counter() - started)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--budget", type=float, default=0.5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    torch.manual_seed(0)
    model = models.GPT().cuda()
    ids = torch.randint(0, 256, (args.batch, 64), device="cuda")
    step(model, ids)
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    eager_peak = allocator_peak(model, model, ids)
    model.zero_grad(set_to_none=True)
    eager_time = timed(model, ids)

    model.zero_grad(set_to_none=True)
    budget = int(args.budget * eager_peak)
    compiled = autorecompute.compile(model, budget=budget, actions=("offload",), loss_reserve=0, solver_time_limit=2)
    compiled.prepare(ids)
    peak = allocator_peak(compiled, model, ids)
    grad_diff = max(float((p.grad - expected[n]).abs().max()) for n, p in model.named_parameters())
    model.zero_grad(set_to_none=True)
    offload_time = timed(compiled, ids)
    moved = 2 * sum(r.nbytes for r in compiled.plan.stash.values())
    bandwidth = pinned_bandwidth()
    copy_time = moved / bandwidth
    overlap = 1 - (offload_time - eager_time) / copy_time if copy_time else 1.0
    result = {"device": torch.cuda.get_device_name(), "batch": args.batch, "eager_peak": eager_peak,
              "budget": budget, "max_memory_allocated": peak, "fits": peak <= budget,
              "plan_predicted_peak": compiled.plan.predicted_peak, "offloaded_tensors": compiled.plan.count("offload"),
              "bytes_moved_per_step": moved, "pinned_bandwidth": bandwidth, "eager_step_s": eager_time,
              "offload_step_s": offload_time, "copy_time_s": copy_time, "overlap": overlap,
              "grad_max_abs_diff": grad_diff}
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda_offload.json").write_text(json.dumps(result, indent=1))
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    return 0 if peak <= budget else 1


if __name__ == "__main__":
    raise SystemExit(main())
