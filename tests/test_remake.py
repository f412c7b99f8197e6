"""Regions that make their inputs from the region before them again (``memory_model.REMAKE``)."""
import pytest
import torch
import torch.fx

from autorecompute.memory_model import (NEW_REGION, REMAKE, extra_cost, memory_timeline, region_ids, remakes,
                                        rerun_ops)
from autorecompute.passes.rewrite_recompute import rewrite_recompute
from autorecompute.problem import Activation, Problem
from autorecompute.runtime.memory import LiveStorageTracker


def two_regions() -> Problem:
    """``a`` makes ``h`` (100 B, read by ``b``), ``b`` makes ``g`` (10 B), which ``b``'s backward keeps;
    forward is positions 0-1, backward of ``b`` 2, of ``a`` 3; ``h`` stays held in forward (position 1)
    by a region of ``b`` that holds its inputs."""
    h = Activation("h", owner="a", nbytes=100, hold_start=1, savers=(), readers=("b",), save_end=-1, read_end=3)
    g = Activation("g", owner="b", nbytes=10, hold_start=2, savers=("b",), readers=(), save_end=2, read_end=2)
    return Problem(chain=("a", "b"), recomputable=frozenset({"a", "b"}), cost={"a": 7, "b": 5},
                   flops={"a": 70, "b": 50}, activations=(h, g), fixed=(0, 0, 0, 0), num_forward=2,
                   backward_op={2: "b", 3: "a"}, saves={"b": True})


def test_a_remaking_region_holds_nothing_the_region_before_made():
    """Cut before ``b``, ``b``'s checkpoint holds ``h`` from forward until ``b``'s backward (100 B at
    positions 1-2). Remaking it, ``h`` is made again by ``a`` when ``b``'s region is recomputed, and
    dropped after ``b`` ran (100 B while it runs, at ``b``'s backward); ``a`` runs again for it."""
    problem = two_regions()
    cut, remade = {"a": True, "b": NEW_REGION}, {"a": True, "b": REMAKE}
    assert remakes(problem, cut, region_ids(problem, cut)) == {}
    assert remakes(problem, remade, region_ids(problem, remade)) == {1: 0}
    assert memory_timeline(problem, cut) == [0, 100, 110, 0]
    assert memory_timeline(problem, remade) == [0, 0, 110, 0]
    assert rerun_ops(problem, cut) == ["b"] and rerun_ops(problem, remade) == ["b", "a"]
    assert extra_cost(problem, remade) == extra_cost(problem, cut) + problem.cost["a"]


def test_a_remaking_after_a_kept_op_or_a_random_region_is_a_plain_cut():
    """Only a region right after another one remakes, and only from a region it can run again exactly."""
    problem = two_regions()
    kept_before = {"a": False, "b": REMAKE}
    assert remakes(problem, kept_before, region_ids(problem, kept_before)) == {}
    from dataclasses import replace
    random = replace(problem, unremakeable=frozenset({"a"}))
    remade = {"a": True, "b": REMAKE}
    assert remakes(random, remade, region_ids(random, remade)) == {}
    assert memory_timeline(random, remade) == memory_timeline(random, {"a": True, "b": NEW_REGION})
    random_after = replace(problem, unremakeable=frozenset({"b"}))    # it replays its own RNG state
    assert remakes(random_after, remade, region_ids(random_after, remade)) == {1: 0}
    silent = replace(problem, saves={"a": True})         # b's region saves nothing: it is never recomputed
    assert remakes(silent, remade, region_ids(silent, remade)) == {}


def test_a_region_does_not_remake_from_a_region_that_remakes():
    """Region c would hand checkpoint the inputs of region b, among them ``a``'s output, which b remakes:
    it would hold what b's remaking is there to drop. Only b remakes."""
    def act(owner, saver, nbytes, position):
        return Activation(f"h{owner}", owner=owner, nbytes=nbytes, hold_start=position, savers=(saver,),
                          readers=(saver,), save_end=position, read_end=position)
    problem = Problem(chain=("a", "b", "c"), recomputable=frozenset("abc"), cost=dict.fromkeys("abc", 1),
                      flops={}, activations=(act("a", "b", 100, 4), act("b", "c", 10, 3)), fixed=(0,) * 6,
                      num_forward=3, backward_op={3: "c", 4: "b", 5: "a"}, saves=dict.fromkeys("bc", False))
    both = {"a": True, "b": REMAKE, "c": REMAKE}
    assert remakes(problem, both, region_ids(problem, both)) == {1: 0}


def chain(x):
    h = torch.sin(x)          # the region before: makes h
    return torch.exp(h) * 2   # the remaking region: exp keeps its output for backward, not h


def test_the_remaking_region_frees_its_input_after_forward_with_the_same_gradients():
    """Measured: after forward the plain cut holds ``h`` (its checkpoint saved it), the remaking region
    does not; backward gives eager's gradient bit for bit."""
    x = torch.randn(4096, requires_grad=True)
    eager = torch.autograd.grad(chain(x).sum(), x)[0]
    decisions = {"sin": "recompute", "exp": "recompute", "mul": "recompute"}
    live, grads = {}, {}
    for name, remade in (("cut", ()), ("remake", ("exp",))):
        gm = rewrite_recompute(torch.fx.symbolic_trace(chain), decisions, starts=("exp",), remakes=remade)
        with LiveStorageTracker() as tracker:
            out = gm(x)
            live[name] = tracker.current
            grads[name] = torch.autograd.grad(out.sum(), x)[0]
            del out
    assert "RemakingRegion" in type(gm.recompute_region_1).__name__
    size = x.numel() * x.element_size()
    assert live["cut"] == 2 * size and live["remake"] == size      # the output; and h, held by the cut
    assert torch.equal(grads["remake"], eager) and torch.equal(grads["cut"], eager)


class ScaledExp(torch.nn.Module):
    """The region before makes an alias of a parameter (as ``to`` to its own dtype does) besides ``h``."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(64))

    def forward(self, x):
        h = x * 3.0
        scale = torch.ops.aten.alias.default(self.scale)
        return torch.exp(h) * scale


def test_a_remaking_runs_under_flop_counting_and_counts_what_runs_again():
    """FlopCounterMode tracks modules with hooks that need a grad_fn on every output requiring grad; the
    remaking (without autograd) makes a parameter's alias that has none. It runs, and the gradients are
    eager's."""
    from torch.utils.flop_counter import FlopCounterMode

    model, x = ScaledExp(), torch.randn(64, requires_grad=True)
    eager = torch.autograd.grad(model(x).sum(), (x, model.scale))
    decisions = dict.fromkeys(("mul", "alias_default", "exp", "mul_1"), "recompute")
    gm = rewrite_recompute(torch.fx.symbolic_trace(model), decisions, starts=("exp",), remakes=("exp",))
    with FlopCounterMode(display=False):
        gm(x).sum().backward()
    assert torch.equal(x.grad, eager[0]) and torch.equal(gm.scale.grad, eager[1])


def dropout_chain(x):
    h = torch.nn.functional.dropout(torch.sin(x), 0.5)     # the region before draws a mask
    return torch.exp(h) * 2


def test_the_rewrite_refuses_to_remake_from_a_random_region():
    """Made again from the region before, a dropout there would draw a new mask (the remaking replays the
    remaking region's RNG state, not the one before's): the memory model never plans it (``unremakeable``);
    a plan that asks for it anyway is an error naming the op, not other gradients."""
    gm = torch.fx.symbolic_trace(dropout_chain)
    decisions = {node.name: "recompute" for node in gm.graph.nodes if node.op == "call_function"}
    with pytest.raises(ValueError, match="dropout"):
        rewrite_recompute(gm, decisions, starts=("exp",), remakes=("exp",))
