"""The outputs' real lifetime: a step that drops the outputs backward does not start from (the logits beside the
loss a Hugging Face model returns, ``loss = model(**batch).loss``, the Trainer's step) holds one logits tensor
less than one that keeps them (``out = model(**batch); out.loss.backward()``). Plans are made for the one the
step runs: said (``outputs=``) or learned at the first step (``compile``'s ``"auto"``)."""
from __future__ import annotations

import pytest
import torch

import autorecompute
import models
from autorecompute.errors import PartialBackwardWarning


def _case():
    case = models.gpt2()
    return case.model, case.args[0]


def _eager_peak(model, ids, keep: bool) -> int:
    """The measured peak of eager's step written either way."""
    def step():
        out = model(ids, labels=ids)
        if keep:
            out.loss.backward()
        else:
            loss = out.loss
            del out
            loss.backward()
    model.zero_grad(set_to_none=True)
    return autorecompute.measure_peak(step, model, (ids,), {"labels": ids}).peak


def test_the_unoptimized_peak_is_eagers_step_for_outputs_kept_and_dropped():
    model, ids = _case()
    logits = ids.numel() * model.config.vocab_size * 4
    planned = {keep: autorecompute.plan(model, ids, labels=ids, budget=1.0, outputs=keep).baseline_peak
               for keep in ("kept", "dropped")}
    assert planned["kept"] - planned["dropped"] == logits
    for keep in ("kept", "dropped"):
        eager = _eager_peak(model, ids, keep == "kept")
        assert abs(planned[keep] - eager) <= 0.01 * eager, (keep, planned[keep], eager)


def _train(compiled, model, ids, steps: int, keep: bool) -> tuple[list[int], list[dict]]:
    """``steps`` steps written with the outputs kept or dropped: each one's measured peak and gradients."""
    peaks, grads = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)

        def step():
            if keep:
                out = compiled(ids, labels=ids)
                out.loss.backward()
            else:
                compiled(ids, labels=ids).loss.backward()
        peaks.append(autorecompute.measure_peak(step, model, (ids,), {"labels": ids}).peak)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return peaks, grads


def test_compile_learns_at_the_first_step_that_the_outputs_are_dropped():
    """``outputs="auto"``: the first plan keeps the outputs (the safe side: that step fits too); the first step
    drops them, so the next is planned for that, in the budget, with eager's gradients."""
    model, ids = _case()
    budget = int(0.7 * _eager_peak(model, ids, keep=True))
    compiled = autorecompute.compile(model, budget=budget)
    peaks, grads = _train(compiled, model, ids, steps=3, keep=False)
    assert compiled.plan.outputs == "dropped" and compiled.plan.budget == budget
    assert max(peaks) <= budget
    _, eager = _train(model, model, ids, steps=1, keep=False)
    for got in grads:
        assert all(torch.equal(got[n], eager[0][n]) for n in got)


def test_outputs_kept_stay_planned_kept():
    model, ids = _case()
    compiled = autorecompute.compile(model, budget=0.7)
    peaks, _ = _train(compiled, model, ids, steps=2, keep=True)
    assert compiled.plan.outputs == "kept" and max(peaks) <= compiled.plan.budget


def test_outputs_said_dropped_but_kept_are_told_and_planned_kept():
    model, ids = _case()
    compiled = autorecompute.compile(model, budget=0.7, outputs="dropped")
    _train(compiled, model, ids, steps=1, keep=True)
    with pytest.warns(PartialBackwardWarning, match="held them through its backward"):
        peaks, _ = _train(compiled, model, ids, steps=1, keep=True)
    assert compiled.plan.outputs == "kept" and max(peaks) <= compiled.plan.budget


def test_outputs_is_checked():
    with pytest.raises(ValueError, match="outputs='later'"):
        autorecompute.plan(torch.nn.Linear(2, 2), torch.randn(1, 2), budget=1.0, outputs="later")
