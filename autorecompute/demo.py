"""``autorecompute demo``: a small GPT trained under half its unoptimized peak, beside √N checkpointing.

Peaks are measured with the live-storage tracker (the number a budget bounds); step times are medians of
untracked steps run in turns (eager, √N, the plan), since wall time on a shared machine drifts within seconds.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

import autorecompute
from autorecompute._demo_model import GPT
from autorecompute.baselines import SqrtNCheckpointed
from autorecompute.budget import format_bytes
from autorecompute.runtime.memory import measure_peak

LAYERS, WIDTH, HEADS, VOCAB, BATCH, TOKENS = 6, 128, 4, 512, 8, 128


class WithLoss(torch.nn.Module):
    """The demo's model and its loss in one module: what the compiled module runs is the whole step, so the
    plan counts the loss's memory too."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, targets):
        logits = self.model(tokens)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def run(steps: int, solver_time_limit: float) -> int:
    """Trains ``steps`` steps of the plan, prints peaks and step times; 0 when every step fit its budget."""
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, d=WIDTH, heads=HEADS, vocab=VOCAB, seq=TOKENS)
    tokens = torch.randint(0, VOCAB, (BATCH, TOKENS))
    targets = torch.roll(tokens, -1, dims=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # stateless: all memory of a step is measured

    def step(module: torch.nn.Module) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = module(tokens, targets)
        loss.backward()
        optimizer.step()
        return loss.item()

    def peak_of(module: torch.nn.Module) -> tuple[float, int]:
        optimizer.zero_grad(set_to_none=True)
        losses = []
        memory = measure_peak(lambda: losses.append(step(module)), model, tokens, targets)
        return losses[0], memory.peak

    eager = WithLoss(model)
    eager_peak = peak_of(eager)[1]
    budget = eager_peak // 2
    print(f"demo model: {LAYERS}-layer GPT, batch {BATCH} x {TOKENS} tokens; eager step peak "
          f"{format_bytes(eager_peak)}")
    print(f"budget: half of it, {format_bytes(budget)}\n")
    compiled = autorecompute.compile(WithLoss(model), budget=budget, solver_time_limit=solver_time_limit)
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)          # plan the state each step starts from: no gradients
    compiled.prepare(tokens, targets)
    print(compiled.plan)
    print(f"\nplanned in {time.perf_counter() - started:.1f} s; training {steps} steps:")
    worst = 0
    for i in range(steps):
        loss, peak = peak_of(compiled)
        worst = max(worst, peak)
        print(f"  step {i + 1}: loss {loss:.4f}, measured peak {format_bytes(peak)} "
              f"({'<=' if peak <= budget else '>'} budget {format_bytes(budget)})")
    sqrt_n = WithLoss(SqrtNCheckpointed(model, "blocks"))
    rows = {"eager": eager, f"sqrt(N) checkpointing ({LAYERS} blocks in {sqrt_n.model.segments} segments)": sqrt_n,
            "autorecompute plan": compiled}
    peaks = {"eager": eager_peak, "autorecompute plan": worst}
    peaks.update({name: peak_of(module)[1] for name, module in rows.items() if name not in peaks})
    _print_comparison(rows, peaks, _median_step_seconds(rows, step), budget)
    ok = worst <= budget
    print("OK: measured peak <= budget" if ok else "FAILED: measured peak above budget")
    return 0 if ok else 1


def _median_step_seconds(rows: dict[str, torch.nn.Module], step: Callable[[torch.nn.Module], float],
                         rounds: int = 5) -> dict[str, float]:
    """Median wall time of a step of each module, the modules run in turns after one warm-up step each."""
    times: dict[str, list[float]] = {name: [] for name in rows}
    for round_ in range(rounds + 1):
        for name, module in rows.items():
            started = time.perf_counter()
            step(module)
            if round_:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def _print_comparison(rows: dict, peaks: dict[str, int], seconds: dict[str, float], budget: int) -> None:
    width = max(map(len, rows))
    print(f"\n{'':<{width}}  {'measured peak':>13}  {'step time':>9}  (median of 5, run in turns)")
    for name in rows:
        ratio = seconds[name] / seconds["eager"]
        print(f"{name:<{width}}  {format_bytes(peaks[name]):>13}  {1e3 * seconds[name]:>6.0f} ms  "
              f"{ratio:.2f}x eager's time" + (f"; budget {format_bytes(budget)}" if name.startswith("auto") else ""))
