"""Repeated blocks (``Problem.repeats``): one op of every layer decided alike by the minimum-peak search."""
import dataclasses

import pytest
import torch
from torch import nn

import models
from autorecompute.memory_model import NEW_REGION, predicted_peak
from autorecompute.passes.build_problem import build_problem, repeated_blocks, repeated_ops
from autorecompute.passes.capture import capture
from autorecompute.passes.meta import node_info
from autorecompute.passes.profile import module_path, profile_step
from autorecompute.decisions import MoveKind
from autorecompute.solvers import greedy
from autorecompute.solvers.segment_plans import per_block_plan


@pytest.fixture(scope="module")
def gpt_problem():
    """The GPT-style decoder at 16 samples (six equal layers; activations dominate) and its graph."""
    case = models.ACTIVATION_HEAVY["gpt"]()
    gm = capture(case.model, case.args, case.kwargs)
    profile_step(gm, case.args, case.kwargs)
    return build_problem(gm), gm, len(case.model.blocks)


def test_each_group_is_one_op_of_every_layer(gpt_problem):
    problem, gm, layers = gpt_problem
    nodes = {node.name: node for node in gm.graph.nodes}
    assert problem.repeats, "a model of equal layers has repeated ops"
    seen: set[str] = set()
    for group in problem.repeats:
        assert len(group) == layers
        assert len({nodes[op].target for op in group}) == 1           # one op ...
        paths = [node_info(nodes[op]).module_path for op in group]
        assert [path.split(".")[1] for path in paths] == [str(i) for i in range(layers)]   # ... of each layer
        assert set(group) <= problem.recomputable and seen.isdisjoint(group)
        seen |= set(group)


def test_per_block_checkpointing_makes_each_layer_one_region_that_keeps_its_input(gpt_problem):
    """Each layer's ops are recomputed but its last (the next layer's input, the checkpoint); the ops outside
    the layers are kept; so the recomputed runs are the layers, one region each."""
    problem, gm, layers = gpt_problem
    assert len(problem.blocks) == layers
    plan = per_block_plan(problem)
    recomputed = [op for op in problem.chain if plan.get(op)]
    assert recomputed == [op for block in problem.blocks for op in block[:-1] if op in problem.recomputable]
    runs, previous = [], None
    for op in problem.chain:
        if plan.get(op) and previous is not None and plan.get(previous):
            runs[-1].append(op)
        elif plan.get(op):
            runs.append([op])
        previous = op
    assert len(runs) == layers
    assert per_block_plan(dataclasses.replace(problem, blocks=())) is None


class _Heads(nn.Module):
    """A layer of two equal heads (a ModuleList inside each layer)."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.out(torch.cat([head(x) for head in self.heads], -1))


class _EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleList([_Heads() for _ in range(3)])
        self.decoder = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])

    def forward(self, x):
        for layer in self.encoder:
            x = layer(x)
        for layer in self.decoder:
            x = layer(x)
        return x


def test_blocks_are_the_outermost_layers_of_each_stack():
    """An encoder's and a decoder's layers are two stacks of three blocks each, not three blocks of two
    layers; the heads inside each encoder layer repeat each other but are not blocks (their layer is)."""
    gm = capture(_EncoderDecoder(), (torch.randn(4, 8),), {})
    blocks = repeated_blocks([node for node in gm.graph.nodes if node.op == "call_function"])
    layers = [{".".join(module_path(node).split(".")[:2]) for node in gm.graph.nodes if node.name in block}
              for block in blocks]
    assert layers == [{f"{stack}.{i}"} for stack in ("encoder", "decoder") for i in range(3)]


class Layer(nn.Module):
    """A residual MLP layer; ``twice``: it calls its first linear layer once more."""

    def __init__(self, twice: bool = False):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        self.twice = twice

    def forward(self, x):
        if self.twice:
            x = self.mlp[2](self.mlp[0](x))
        return x + self.mlp(x)


def groups_of(model: nn.Module) -> list[list[str]]:
    """``repeated_ops`` of the captured model, each op named by its module path."""
    gm = capture(model, (torch.randn(2, 8),), {})
    nodes = [node for node in gm.graph.nodes if node.op == "call_function"]
    paths = {node.name: module_path(node) for node in nodes}
    return [[paths[op] for op in group] for group in repeated_ops(nodes)]


def test_only_blocks_that_call_the_same_ops_repeat_each_other():
    """Before: every index in a module path was a wildcard, so an MLP's two linear layers (``mlp.0``,
    ``mlp.2``: other shapes) made one group with the other layer's, and a layer that calls an op once
    more than the others was aligned with them call by call. Expected: the layers' ops pair up one to
    one; the layer that differs is in no group."""
    assert groups_of(nn.Sequential(Layer(), Layer())) == [
        ["0.mlp.0", "1.mlp.0"], ["0.mlp.1", "1.mlp.1"], ["0.mlp.2", "1.mlp.2"], ["0", "1"]]
    uneven = groups_of(nn.Sequential(Layer(twice=True), Layer(), Layer()))
    assert uneven and all([path.split(".")[0] for path in group] == ["1", "2"] for group in uneven)


def test_a_group_move_decides_every_op_and_undoes_exactly():
    recompute = {"a": True, "b": False}
    undo = greedy._apply(recompute, {}, MoveKind.GROUP, ("a", "b", "c"), NEW_REGION)
    assert recompute == {"a": NEW_REGION, "b": NEW_REGION, "c": NEW_REGION}
    undo()
    assert recompute == {"a": True, "b": False}
    assert greedy._apply({"a": False}, {}, MoveKind.GROUP, ("a", "b"), False) is None    # nothing to change


def test_group_moves_lower_a_peak_every_layer_reaches(gpt_problem):
    """From the same start and with the same work, the minimum-peak local search goes lower with the group
    moves: each layer held its attention and MLP in one region, and splitting one layer's alone raised the
    peak (its MLP region's input held through the other layers' backward)."""
    problem, _, _ = gpt_problem
    alone = dataclasses.replace(problem, repeats=())
    start = greedy.lowest_start(dataclasses.replace(alone, blocks=()))    # √N's or a segment plan's
    with_groups = predicted_peak(problem, *greedy.lower_peak(problem, start, work=2_000_000))
    without = predicted_peak(alone, *greedy.lower_peak(alone, start, work=2_000_000))
    assert with_groups < without
