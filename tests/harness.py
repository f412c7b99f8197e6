"""Measured training steps for the tests: real tensors, live-storage tracker, gradients collected; and the
√N baseline they are held against."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from autorecompute.memory_model import rewrite_of
from autorecompute.passes.apply_plan import clone_graph_module
from autorecompute.passes.rewrite_recompute import rewrite_recompute
from autorecompute.problem import Problem
from autorecompute.runtime.memory import (LiveStorageTracker, hold_while_alive, output_tensors_for_backward,
                                          tensor_bytes)
from autorecompute.solvers.segment_plans import sqrt_n_plan


def sqrt_n_rewrite(gm: torch.fx.GraphModule, problem: Problem) -> torch.fx.GraphModule:
    """√N segments over the graph's articulation points (``segment_plans.sqrt_n_plan``) on a copy of the
    captured and profiled ``gm`` whose problem is ``problem``."""
    return rewrite_recompute(clone_graph_module(gm), rewrite_of(problem, sqrt_n_plan(problem)).words)


@dataclass
class StepResult:
    peak: int
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def measured_step(module: torch.nn.Module, model: torch.nn.Module, args: tuple, kwargs: dict,
                  seed: int = 0) -> StepResult:
    """One forward + backward (unit gradient on every differentiable output) with ``module``; gradients are
    read from ``model``'s parameters (the same objects when ``module`` is a compiled ``model``)."""
    for p in model.parameters():
        p.grad = None
    if hasattr(module, "prepare"):      # plan outside the measured window, as a warm-up call would
        module.prepare(*args, **kwargs)
    resident = tensor_bytes([*model.parameters(), *model.buffers(), args, kwargs])
    torch.manual_seed(seed)
    tracker = LiveStorageTracker()
    with tracker:
        out = module(*args, **kwargs)
        tensors = output_tensors_for_backward(out)
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
        outputs = [t.detach() for t in tensors]
        del out, tensors
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return StepResult(resident + tracker.peak, outputs, grads, buffers)


def assert_bitwise_equal(a: StepResult, b: StepResult) -> None:
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs):
        assert torch.equal(x, y), "outputs differ"
    assert a.grads.keys() == b.grads.keys()
    for name in a.grads:
        assert torch.equal(a.grads[name], b.grads[name]), f"gradient of {name} differs"


@contextlib.contextmanager
def rng_states_counted() -> Iterator[None]:
    """Inside the block each ``torch.get_rng_state()`` (what ``torch.utils.checkpoint`` keeps for a region with
    dropout, made where no tracker sees it) counts in the active trackers while it lives: how a model's own
    checkpoints are measured beside a plan's regions, whose runtime counts theirs."""
    original = torch.get_rng_state

    def counted():
        state = original()
        hold_while_alive(state, state.untyped_storage().nbytes())
        return state

    torch.get_rng_state = counted
    try:
        yield
    finally:
        torch.get_rng_state = original
