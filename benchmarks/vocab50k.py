"""A 50k vocabulary on real tensors: Hugging Face GPT-2 with its loss, outputs kept and outputs dropped.

    python benchmarks/vocab50k.py       # about 4 min on 2 cores, 4 GB; writes benchmarks/results/vocab50k.json

GPT-2 with 6 layers, 512 wide, vocabulary 50257, batch 4 × 512 tokens, ``labels=`` (the model returns its loss),
on the CPU. For each way a step treats the logits beside the loss — kept through backward (``out = model(...);
out.loss.backward()``) or dropped before it (``model(...).loss.backward()``, Hugging Face Trainer's step):

* eager's step measured (``measure_peak``) against the plan's unoptimized peak;
* ``compile(budget=0.6, outputs=...)``: two steps measured against the prediction, loss and every gradient
  against eager's, bit for bit;
* the recompute-only minimum against Hugging Face's per-layer checkpointing, measured.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

os.environ.setdefault("AUTORECOMPUTE_CACHE", "off")   # benchmarks plan, they do not load plans
import autorecompute  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "vocab50k.json"


def gpt2():
    transformers = __import__("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=50257, n_positions=512,
                                     use_cache=False)
    return transformers.GPT2LMHeadModel(config), torch.randint(0, 50257, (4, 512))


def measured(module, model, ids, kept: bool) -> tuple[int, torch.Tensor, dict]:
    """(peak, loss, gradients) of one step of ``module`` from seed 1, the logits kept or dropped."""
    losses = []

    def step():
        if kept:
            out = module(ids, labels=ids)
            out.loss.backward()
            losses.append(out.loss.detach())
        else:
            loss = module(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    peak = autorecompute.measure_peak(step, model, (ids,), {"labels": ids}).peak
    return peak, losses[0], {name: p.grad.clone() for name, p in model.named_parameters()}


def row(model, ids, outputs: str) -> dict:
    kept = outputs == "kept"
    eager_peak, eager_loss, eager_grads = measured(model, model, ids, kept)
    model.zero_grad(set_to_none=True)     # planned for the step that starts without gradients, as measured
    unoptimized = autorecompute.plan(model, ids, labels=ids, budget=1.0, outputs=outputs).baseline_peak
    compiled = autorecompute.compile(model, budget=0.6, outputs=outputs)
    runs = [measured(compiled, model, ids, kept) for _ in range(2)]
    bitwise = all(torch.equal(loss, eager_loss) and all(torch.equal(grads[n], eager_grads[n]) for n in eager_grads)
                  for _, loss, grads in runs)
    model.zero_grad(set_to_none=True)
    minimum = autorecompute.minimum_peak(model, ids, labels=ids, actions=("recompute",), outputs=outputs)
    plan = compiled.plan
    return {"outputs": outputs, "eager": eager_peak, "unoptimized": unoptimized, "budget": plan.budget,
            "predicted": plan.predicted_peak, "measured": [peak for peak, _, _ in runs], "bitwise": bitwise,
            "lean_ops": list(plan.lean_ops), "extra_flops_ratio": plan.extra_flops_ratio,
            "plan_seconds": plan.plan_time, "recompute_minimum": minimum}


def per_layer_checkpointing(model, ids, rows: list[dict]) -> None:
    """Hugging Face's per-layer checkpointing measured for each row's step; our minimum against it."""
    name = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    getattr(model, f"{name}_checkpointing_enable")(**{f"{name}_checkpointing_kwargs": {"use_reentrant": False}})
    for r in rows:
        r["per_layer_peak"] = measured(model, model, ids, r["outputs"] == "kept")[0]
        r["minimum_vs_per_layer"] = r["recompute_minimum"] / r["per_layer_peak"]
    getattr(model, f"{name}_checkpointing_disable")()


def main() -> None:
    model, ids = gpt2()
    rows = [row(model, ids, outputs) for outputs in ("kept", "dropped")]
    per_layer_checkpointing(model, ids, rows)
    RESULTS.write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
