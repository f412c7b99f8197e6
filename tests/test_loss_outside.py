"""The step as users write it: the loss computed outside the compiled module, over its outputs.

The plan reserves what such a loss holds as backward starts (``loss_reserve="auto"``: cross-entropy's
log-softmax, its gradient and the logits' gradient, in float32), so the step fits its budget from the first
step on. Measured with ``autorecompute.measure_peak`` around the user's own step.
"""
import pytest
import torch
import torch.nn.functional as F

import autorecompute
import models
from conftest import SOLVER_TIME

# transformer (own GPT, HF GPT-2, HF BERT, HF Llama), CNN (ResNet), MLP
MODELS = ["gpt", "gpt2", "bert", "llama", "resnet", "mlp"]


def _logits(outputs) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    return outputs["logits"] if "logits" in outputs else outputs[0]


def cross_entropy(outputs) -> torch.Tensor:
    """Cross-entropy over every position's logits, computed in float32 (as LLM training loops do)."""
    logits = _logits(outputs)
    flat = logits.flatten(0, -2) if logits.dim() > 2 else logits
    targets = torch.arange(flat.shape[0]) % flat.shape[-1]
    return F.cross_entropy(flat.float(), targets)


def smooth_l1(outputs) -> torch.Tensor:
    """A regression loss of the user's own choosing."""
    logits = _logits(outputs)
    return F.smooth_l1_loss(logits, torch.full_like(logits, 0.5))


def _measured_step(step_module, case, loss_fn, measure=None):
    """(peak, loss, gradients) of one step from seed 1, its peak from ``measure_peak`` or ``measure(step)``."""
    case.model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    losses = []

    def step():
        loss = loss_fn(step_module(*case.args, **case.kwargs))
        loss.backward()
        losses.append(loss.detach())
    peak = measure(step) if measure else autorecompute.measure_peak(step, case.model, case.args, case.kwargs).peak
    grads = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
    return peak, losses[0], grads


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_a_loss_outside_the_model_fits_the_budget_from_the_first_step(name):
    """Halfway between the module's own minimum and eager's step with cross-entropy outside: every step measured
    (the first included), with cross-entropy and with a loss of the user's own, is within the budget, and
    losses and gradients are eager's bit for bit."""
    case = models.make(name)
    eager = {loss_fn: _measured_step(case.model, case, loss_fn) for loss_fn in (cross_entropy, smooth_l1)}
    case.model.zero_grad(set_to_none=True)
    module_minimum = autorecompute.minimum_peak(case.model, *case.args, **case.kwargs, loss_reserve=0,
                                                solver_time_limit=SOLVER_TIME)
    budget = (module_minimum + eager[cross_entropy][0]) // 2
    compiled = autorecompute.compile(case.model, budget=budget, solver_time_limit=SOLVER_TIME)
    for loss_fn in (cross_entropy, smooth_l1, cross_entropy):
        _, eager_loss, eager_grads = eager[loss_fn]
        peak, loss, grads = _measured_step(compiled, case, loss_fn)
        assert peak <= budget, f"{name}, {loss_fn.__name__}: measured {peak} over the budget {budget}"
        assert torch.equal(loss, eager_loss)
        assert grads.keys() == eager_grads.keys()
        assert all(torch.equal(grads[n], eager_grads[n]) for n in grads)
    assert compiled.plan.loss_reserve > 0


def wide_loss(outputs) -> torch.Tensor:
    """A loss of the user's own that holds more than cross-entropy's reserve: float64 temporaries."""
    error = _logits(outputs).double() - 0.5
    return (error * error).mean() + (error.abs() ** 1.5).mean()


class AllocatorReading:
    """What ``FirstStep`` reads on a GPU (the allocator's peak over the step), read here from the CPU
    allocator's events around the step (``_allocated_step``); ``FirstStep`` measures on CUDA only."""

    def __init__(self):
        self.peak = None

    @property
    def done(self):
        return self.peak is not None

    def watch(self, outputs):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_a_step_over_its_budget_is_planned_again_with_what_the_callers_code_held(name, monkeypatch):
    """The first step of a plan is measured as the caller runs it, loss included: where a loss holds more than
    the reserve, that step goes over its budget; the next forward says so (StepOverBudgetWarning) and plans
    again with the measured excess reserved, and every later step fits, with eager's gradients."""
    from autorecompute.runtime.first_step import FirstStep

    readings = []
    monkeypatch.setattr(FirstStep, "start", classmethod(
        lambda cls, model, args, kwargs: readings.append(AllocatorReading()) or readings[-1]))
    case = models.make(name)
    eager_peak, eager_loss, eager_grads = _measured_step(case.model, case, wide_loss)
    module_minimum = autorecompute.minimum_peak(case.model, *case.args, **case.kwargs, loss_reserve=0,
                                                solver_time_limit=SOLVER_TIME)
    budget = (module_minimum + eager_peak) // 2
    compiled = autorecompute.compile(case.model, budget=budget, solver_time_limit=SOLVER_TIME)
    first, _, _ = _allocated_step(compiled, case, wide_loss, readings)
    reserved = compiled.plan.loss_reserve
    assert first > budget                           # the reserve for cross-entropy is not enough for this loss
    with pytest.warns(autorecompute.StepOverBudgetWarning, match="Planning these inputs again"):
        peak, loss, grads = _allocated_step(compiled, case, wide_loss, readings)
    assert compiled.plan.loss_reserve > reserved
    for _ in range(2):
        assert peak <= budget
        assert torch.equal(loss, eager_loss)
        assert all(torch.equal(grads[n], eager_grads[n]) for n in eager_grads)
        peak, loss, grads = _allocated_step(compiled, case, wide_loss, readings)
    assert len(readings) == 2                       # the first step of each plan, and no other


def _allocated_step(step_module, case, loss_fn, readings):
    """``_measured_step`` with the peak from the CPU allocator's events, handed to the reading of the plan's
    first step if this was one."""
    from autorecompute.runtime.memory import allocated_peak, resident_bytes

    def measure(step):
        count = len(readings)
        peak = resident_bytes(case.model, case.args, case.kwargs) + allocated_peak(step)
        if len(readings) > count:
            readings[-1].peak = peak
        return peak
    return _measured_step(step_module, case, loss_fn, measure)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_at_the_modules_own_minimum_every_step_fits_or_the_refusal_names_a_budget_that_does(name):
    """At the least budget of the module alone the step with its loss fits, or is refused with a ``.minimum``
    that counts the loss; every step at the budget taken is within it, with cross-entropy and with a loss of
    the user's own, with eager's loss and gradients."""
    case = models.make(name)
    eager = {loss_fn: _measured_step(case.model, case, loss_fn) for loss_fn in (cross_entropy, smooth_l1)}
    case.model.zero_grad(set_to_none=True)
    module_minimum = autorecompute.minimum_peak(case.model, *case.args, **case.kwargs, loss_reserve=0,
                                                solver_time_limit=SOLVER_TIME)
    try:
        autorecompute.plan(case.model, *case.args, **case.kwargs, budget=module_minimum,
                           solver_time_limit=SOLVER_TIME)
        budget = module_minimum
    except autorecompute.InfeasibleBudgetError as refused:
        budget = refused.minimum
        assert budget > module_minimum
    compiled = autorecompute.compile(case.model, budget=budget, solver_time_limit=SOLVER_TIME)
    for loss_fn in (cross_entropy, smooth_l1, cross_entropy):
        _, eager_loss, eager_grads = eager[loss_fn]
        peak, loss, grads = _measured_step(compiled, case, loss_fn)
        assert peak <= budget, f"{name}, {loss_fn.__name__}: measured {peak} over the budget {budget}"
        assert torch.equal(loss, eager_loss) and all(torch.equal(grads[n], eager_grads[n]) for n in eager_grads)


def test_no_reserve_when_the_model_returns_its_loss():
    """A model that returns a scalar loss (or ``outputs["loss"]``) holds its loss inside the planned step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    x = torch.randn(256, 64)

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(x).pow(2).mean()

    kept = autorecompute.plan(model, x, budget=1.0, solver_time_limit=SOLVER_TIME)
    inside = autorecompute.plan(WithLoss(), x, budget=1.0, solver_time_limit=SOLVER_TIME)
    assert kept.loss_reserve == 3 * 4 * 256 * 32 - 4 * 256 * 32 + 16 and inside.loss_reserve == 0
    stated = autorecompute.plan(model, x, budget=1.0, loss_reserve=12345, solver_time_limit=SOLVER_TIME)
    assert stated.loss_reserve == 12345
    assert stated.baseline_peak - autorecompute.plan(model, x, budget=1.0, loss_reserve=0,
                                                     solver_time_limit=SOLVER_TIME).baseline_peak <= 12345
    with pytest.raises(ValueError, match="loss_reserve=-1 must be 'auto'"):
        autorecompute.plan(model, x, budget=1.0, loss_reserve=-1)


def _targets(case) -> torch.Tensor:
    logits = _logits(case.model(*case.args, **case.kwargs))
    rows = logits.flatten(0, -2).shape[0] if logits.dim() > 2 else logits.shape[0]
    return torch.arange(rows) % logits.shape[-1]


def cross_entropy_of(outputs, target) -> torch.Tensor:
    """:func:`cross_entropy` as a ``loss_fn``: the target passed in."""
    logits = _logits(outputs)
    return F.cross_entropy((logits.flatten(0, -2) if logits.dim() > 2 else logits).float(), target)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_loss_captured_with_loss_fn_fits_budgets_a_loss_outside_cannot(name):
    """``loss_fn=`` plans the loss with the model: its tensors counted, not reserved, and its cross-entropy
    lean, so the recompute-only minimum is below the one with the loss outside; at that minimum the step is
    measured within budget, the loss and the gradients bit for bit those of eager's step with the loss outside."""
    case = models.make(name)
    target = _targets(case)
    _, eager_loss, eager_grads = _measured_step(case.model, case, cross_entropy)
    case.model.zero_grad(set_to_none=True)
    recompute = {"actions": ("recompute",), "solver_time_limit": SOLVER_TIME}
    outside = autorecompute.minimum_peak(case.model, *case.args, **case.kwargs, **recompute)
    inside = autorecompute.minimum_peak(case.model, *case.args, **case.kwargs, target=target,
                                        loss_fn=cross_entropy_of, **recompute)
    assert inside < outside
    compiled = autorecompute.compile(case.model, budget=inside, loss_fn=cross_entropy_of, **recompute)
    peak, loss, grads = _measured_step(lambda *a, **k: compiled(*a, **k, target=target), case, lambda loss: loss)
    assert peak <= inside
    assert torch.equal(loss, eager_loss) and grads.keys() == eager_grads.keys()
    assert all(torch.equal(grads[n], eager_grads[n]) for n in grads)
    assert compiled.plan.loss_reserve == 0 and compiled.plan.model_name.endswith("with its loss")
    assert compiled.plan.signature.endswith("target=int64[256]@cpu)") or "target=" in compiled.plan.signature


def test_loss_fn_is_checked_at_once_and_its_target_asked_for():
    model, x = torch.nn.Linear(8, 3), torch.randn(4, 8)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        autorecompute.compile(model, budget=0.5, loss_fn="cross_entropy")

    class TakesTarget(torch.nn.Module):
        def forward(self, x, target):
            return x

    with pytest.raises(ValueError, match="takes a 'target' argument of its own"):
        autorecompute.compile(TakesTarget(), budget=0.5, loss_fn=F.mse_loss)
    compiled = autorecompute.compile(model, budget=1.0, loss_fn=torch.nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match=r"loss = compiled\(\*inputs, target=labels\)"):
        compiled(x)
    with pytest.raises(TypeError, match="pass the loss's target as the keyword target="):
        autorecompute.plan(model, x, budget=1.0, loss_fn=F.cross_entropy)
    with pytest.raises(TypeError, match="pass the loss's target as the keyword target="):
        compiled.prepare(x)
    y = torch.tensor([0, 2, 1, 0])
    assert torch.equal(compiled(x, target=y), F.cross_entropy(model(x), y))
    # the compiled module is the model's, as without a loss: its state, attributes and name
    assert compiled.model is model and compiled.weight is model.weight and compiled.in_features == 8
    assert compiled.state_dict().keys() == model.state_dict().keys()
    compiled.load_state_dict(model.state_dict())
