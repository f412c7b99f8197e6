"""A saved plan is the contract between solving and rewriting: read back from JSON, ``apply_plan`` carries it
out on a freshly captured model, without solving, and gives the module planning gave — eager's gradients bit
for bit, the peak the plan predicts, the same graph code."""
import dataclasses

import pytest
import torch
import torch.nn as nn

import autorecompute
import models
from autorecompute.decisions import Op, Rewrite
from autorecompute.memory_model import predicted_peak, rewrite_of
from autorecompute.passes.build_problem import build_problem
from autorecompute.passes.apply_plan import apply_plan, graph_module_of
from autorecompute.passes.capture import capture
from autorecompute.passes.profile import profile_step
from autorecompute.passes.verify import fake_step_memory, verify_plan
from autorecompute.plan import Plan
from autorecompute.runtime.stash import StashRuntime
from autorecompute.solvers.segment_plans import per_block_plan
from conftest import SOLVER_TIME
from harness import assert_bitwise_equal, measured_step


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc1, self.fc2, self.drop = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d), \
            nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))))


class Residual(nn.Module):
    """Pre-norm residual MLP blocks with dropout, a softmax at the end: small enough to plan in seconds, with
    plans that recompute regions and rematerialize, or cut regions that make their inputs again."""

    def __init__(self, d: int = 64, blocks: int = 4):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d) for _ in range(blocks)])

    def forward(self, x):
        return self.blocks(x).softmax(-1)


def residual() -> models.Case:
    torch.manual_seed(0)
    return models.Case("residual", Residual(), (torch.randn(512, 64),))


def graph_codes(module: torch.nn.Module) -> dict[str, tuple[str, str]]:
    """Every submodule of the rewritten GraphModule: its type, and its code where it is a GraphModule (the
    outer graph, region bodies, remaking bodies, recipes)."""
    return {name: (type(m).__name__, m.code if isinstance(m, torch.fx.GraphModule) else "")
            for name, m in graph_module_of(module).named_modules()}


def solved_then_applied(case: models.Case, budget, actions: tuple[str, ...], tmp_path):
    """(the plan solving gave, read back from its JSON file; the module solving gave; the module
    ``apply_plan`` gives for the plan on a fresh capture)."""
    compiled = autorecompute.compile(case.model, budget=budget, actions=actions, loss_reserve=0,
                                     solver_time_limit=SOLVER_TIME)
    path = tmp_path / "plan.json"
    path.write_text(compiled.prepare(*case.args, **case.kwargs).to_json())
    plan = Plan.from_json(path.read_text())
    gm = capture(case.model, case.args, case.kwargs)
    profile_step(gm, case.args, case.kwargs, plan.loss_reserve)
    captured = gm.code
    applied = apply_plan(gm, plan.rewrite, StashRuntime())
    assert gm.code == captured, "the captured graph is left as it is"
    return plan, compiled._last.module, applied


def check_applied(case: models.Case, plan: Plan, solved: torch.nn.Module, applied: torch.nn.Module) -> None:
    # (c) the module solving gave: the same graph code, region bodies and recipes included
    assert type(applied).__name__ == type(solved).__name__     # (a StashedModule, or the GraphModule itself)
    assert graph_codes(applied) == graph_codes(solved)
    # (b) the peak the plan predicts, on fake tensors and measured; (a) eager's gradients bit for bit
    assert fake_step_memory(applied, case.args, case.kwargs).peak == plan.predicted_peak <= plan.budget
    eager = measured_step(case.model, case.model, case.args, case.kwargs, seed=1)
    result = measured_step(applied, case.model, case.args, case.kwargs, seed=1)
    assert result.peak <= plan.budget, (result.peak, plan.budget)
    assert_bitwise_equal(eager, result)


def test_the_memory_model_counts_the_generator_state_a_random_region_keeps():
    """Each checkpointed CPU region that runs dropout keeps torch's generator state (5 KB) from its forward
    until its recomputation: the memory model counts it, once per region, so every block checkpointed is
    predicted within less than one state of the measured peak and not below it (a bias gradient, 256 B,
    lands at the peak in the model and after it when measured); without it, under it."""
    case = residual()
    gm = capture(case.model, case.args, case.kwargs)
    profile_step(gm, case.args, case.kwargs)
    problem = build_problem(gm)
    assert problem.rng_state_bytes == torch.get_rng_state().numel() and problem.random_ops
    plan = per_block_plan(problem)
    _, measured = verify_plan(gm, rewrite_of(problem, plan), StashRuntime(), case.args, case.kwargs)
    blind = dataclasses.replace(problem, rng_state_bytes=0)
    predicted = predicted_peak(problem, plan)
    assert predicted - predicted_peak(blind, plan) == len(case.model.blocks) * problem.rng_state_bytes
    assert measured <= predicted < measured + problem.rng_state_bytes
    assert predicted_peak(blind, plan) < measured


@pytest.mark.parametrize("budget, shape", [(0.5, "regions and a rematerialization"),
                                           (0.47, "back-to-back regions, one remaking its inputs")])
def test_a_saved_plan_applies_to_a_fresh_capture_as_solving_did(tmp_path, budget, shape):
    case = residual()
    plan, solved, applied = solved_then_applied(case, budget, ("recompute",), tmp_path)
    if shape.startswith("regions"):
        assert plan.count("recompute") and plan.count("rematerialize"), f"the plan is not of {shape}: {plan}"
        assert "stash_rematerialize(" in graph_module_of(applied).code
    else:
        assert plan.region_starts and plan.region_remakes, f"the plan is not of {shape}: {plan}"
        assert any(type(m).__name__ == "RemakingRegion" for m in graph_module_of(applied).modules())
    check_applied(case, plan, solved, applied)


@pytest.mark.slow
def test_a_saved_plan_that_recomputes_and_offloads_applies_as_solved(tmp_path):
    case = models.make("gpt")
    plan, solved, applied = solved_then_applied(case, 0.5, ("recompute", "offload"), tmp_path)
    assert plan.count("recompute") and any(r.action.startswith("offload") for r in plan.stash.values()), \
        f"the plan neither recomputes nor offloads: {plan}"
    check_applied(case, plan, solved, applied)


class Attention(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.q, self.out = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.out(torch.softmax(torch.tanh(self.q(x)) @ x.transpose(1, 2), -1) @ x)


def test_candidates_keep_their_overloads_and_the_captured_softmaxes():
    """``verify_plan`` measures a plan as the planner's candidates are: calls not bound, and the softmaxes
    as capture left them (every one in place) when the rewrite names them all; ``apply_plan`` binds the
    calls, and puts a softmax the rewrite does not name back on autograd's backward."""
    from autorecompute.passes.rewrite_lean_ops import lean_op_nodes

    torch.manual_seed(0)
    model, x = Attention(), torch.randn(4, 16, 32)
    gm = capture(model, (x,), {})
    profile_step(gm, (x,), {})
    in_place = tuple(lean_op_nodes(gm))
    assert in_place == ("softmax",)
    rewrite = Rewrite({"tanh": Op.RECOMPUTE}, lean_ops=in_place)
    module, peak = verify_plan(gm, rewrite, None, (x,), {})
    assert "torch.ops.aten.linear" in module.code and "recompute_region_0" in module.code
    targets = {n.name: n.target for n in gm.graph.nodes}
    assert all(n.target is targets[n.name] for n in module.graph.nodes if n.name in in_place)
    assert peak == fake_step_memory(module, (x,), {}).peak
    bound = apply_plan(gm, Rewrite(rewrite.ops))
    assert "torch.ops.aten.linear" not in bound.code and "recompute_region_0" in bound.code
    assert all(n.target is not targets[n.name] for n in bound.graph.nodes if n.name in in_place)


def test_a_plan_of_another_model_or_an_unprofiled_graph_is_refused():
    case = residual()
    gm = capture(case.model, case.args, case.kwargs)
    with pytest.raises(RuntimeError, match="profile_step"):
        apply_plan(gm, Rewrite({"gelu": Op.RECOMPUTE}))
    profile_step(gm, case.args, case.kwargs)
    with pytest.raises(ValueError, match="another model"):
        apply_plan(gm, Rewrite({"gelu": Op.RECOMPUTE, "conv2d": Op.RECOMPUTE}))
