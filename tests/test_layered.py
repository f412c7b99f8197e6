"""Planning by layers (autorecompute/solvers/layered.py): the stack found in the captured graph, the dynamic
programme against brute force over the same block decisions, and deeper models planned by their layers —
within budget, with eager's gradients."""
from __future__ import annotations

import itertools
import random
import re

import numpy as np
import pytest
import torch

import autorecompute
import models
from autorecompute.decisions import Op
from autorecompute.memory_model import TimelineChanges, extra_cost, memory_timeline, predicted_peak
from autorecompute.passes.build_problem import build_problem
from autorecompute.passes.capture import capture
from autorecompute.passes.profile import profile_step
from autorecompute.search import Strategies
from autorecompute.solvers import cpsat, layered
from autorecompute.solvers.segment_plans import per_block_plan
from autorecompute.throughputs import CPU_DISK, counting_flops
from harness import assert_bitwise_equal, measured_step, sqrt_n_rewrite


def _problem(case: models.Case, **options):
    gm = capture(case.model, case.args, case.kwargs)
    profile_step(gm, case.args, case.kwargs)
    return build_problem(gm, **options)


def test_the_stack_is_the_decoder_layers_found_in_the_graph():
    problem = _problem(models.llama(layers=6, batch=2, sequence=32))
    stack = layered.find_stack(problem)
    assert stack is not None and len(stack.blocks) == 6
    assert set(stack.blocks) <= set(problem.blocks)
    assert len({len(block) for block in stack.blocks}) == 1
    # one after another: forward in order, backward in reverse, no span inside another
    assert all(a[1] < b[0] for a, b in zip(stack.forward, stack.forward[1:]))
    assert all(b[1] < a[0] for a, b in zip(stack.backward, stack.backward[1:]))


def test_three_layers_are_too_few_for_a_stack():
    assert layered.find_stack(_problem(models.llama(layers=3, batch=2, sequence=32))) is None


def _brute_force(problem, stack: layered.Stack, templates, budget: int) -> int | None:
    """The least cost of any assignment of ``templates`` to the blocks that fits ``budget`` in the model."""
    keep = {op: False for op in problem.recomputable}
    best = None
    for chosen in itertools.product(templates, repeat=len(stack.blocks)):
        plan = layered._with_blocks(problem, stack, (keep, {}), dict(enumerate(chosen)))
        if predicted_peak(problem, *plan) <= budget:
            cost = extra_cost(problem, *plan)
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("fraction", [0.6, 0.75, 0.9])
def test_the_layers_dynamic_programme_matches_brute_force(fraction):
    """Four MLP blocks, recompute only: every assignment of the menu's block decisions (those of its runs
    included: a region opened, one continued) tried in the memory model. The DP's plan fits the budget and
    costs what the cheapest fitting assignment costs."""
    torch.manual_seed(0)
    case = models.Case("mlp", models.MLP(layers=4, d=32), (torch.randn(256, 32),))
    problem = _problem(case)
    stack = layered.find_stack(problem)
    keep = {op: False for op in problem.recomputable}
    planner = layered.ByLayers(problem, stack, [(keep, {})])
    templates = list(dict.fromkeys(t for entry in planner.bases[0].entries for t in entry.segment))
    unoptimized, lowest = predicted_peak(problem, keep), predicted_peak(problem, *planner.lowest())
    budget = int(lowest + fraction * (unoptimized - lowest))
    found = planner.cheapest(budget)
    assert found is not None and predicted_peak(problem, *found) <= budget
    assert extra_cost(problem, *found) == _brute_force(problem, stack, templates, budget)


@pytest.mark.parametrize("fraction", [0.2, 0.35, 0.5, 0.65, 0.8])
def test_offloading_by_layers_costs_what_cp_sat_proves_least(fraction):
    """Four alike blocks of eight Linear + Tanh, offloading only: each block's eight saved tensors cost one copy
    apiece, so the least-cost plan offloads the fewest tensors whose absence fits the budget — a count per
    block the budget sets, not a fixed share of the block. The layers' plan costs CP-SAT's proven optimum."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())])
              for _ in range(4)]
    case = models.Case("stack", torch.nn.Sequential(*blocks), (torch.randn(256, 32),))
    problem = _problem(case, recompute=False, offload=CPU_DISK, offload_gradients=False)
    planner = layered.ByLayers(problem, layered.find_stack(problem), [({}, {})])
    unoptimized, lowest = predicted_peak(problem, {}), predicted_peak(problem, *planner.lowest())
    budget = int(lowest + fraction * (unoptimized - lowest))
    found = planner.cheapest(budget)
    optimum = cpsat.solve(problem, budget=budget, time_limit=10)
    assert optimum.status == "optimal"
    assert found is not None and predicted_peak(problem, *found) <= budget
    assert extra_cost(problem, *found) == extra_cost(problem, optimum.recompute, optimum.stash)


@pytest.mark.slow
@pytest.mark.parametrize("actions", [None, ("recompute",)], ids=["default", "recompute"])
def test_a_six_layer_decoder_is_planned_by_layers_within_budget_with_eagers_gradients(actions):
    """With the default actions (on the CPU the least-time plan here offloads) and with recomputation alone."""
    case = models.llama(layers=6)
    model = case.model
    eager = measured_step(model, model, case.args, case.kwargs, seed=1)
    knobs = {"actions": actions} if actions else {}
    compiled = autorecompute.compile(model, budget=0.6, loss_reserve=0, **knobs)
    planned = measured_step(compiled, model, case.args, case.kwargs, seed=1)
    plan = compiled.plan
    assert plan.solver_status.startswith("feasible (by layers")
    assert planned.peak <= plan.budget < eager.peak
    assert plan.count("recompute") > 0 if actions else plan.count("recompute") + plan.count("offload") > 0
    assert_bitwise_equal(planned, eager)


def test_a_time_limit_given_asks_for_the_whole_model_search():
    from autorecompute.planner import BY_LAYERS_TIME_LIMIT, PlannerOptions, search_setup

    problem = _problem(models.llama(layers=4, batch=2, sequence=32))
    assert search_setup(problem, PlannerOptions()) == (BY_LAYERS_TIME_LIMIT, Strategies.by_layers())
    assert search_setup(problem, PlannerOptions(solver_time_limit=3.0)) == (3.0, Strategies())


def test_the_minimum_planned_by_layers_is_a_budget_that_plans():
    """``minimum_peak`` with the default search (by layers, then the whole model below what the layers reach)
    is a budget ``plan`` meets, measured so."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6)])
    x = torch.randn(512, 64)
    low = autorecompute.minimum_peak(model, x, actions=("recompute",))
    plan = autorecompute.plan(model, x, budget=low, actions=("recompute",))
    assert plan.predicted_peak <= low < plan.baseline_peak
    compiled = autorecompute.compile(model, budget=low, actions=("recompute",), loss_reserve=0)
    assert measured_step(compiled, model, (x,), {}).peak <= low


def test_the_layers_minimum_splits_blocks_into_regions_below_per_layer_checkpointing():
    """Llama's layers, each one region (per-layer checkpointing, the embeddings and tables made again too),
    hold a whole layer's tensors again at its backward; the layers' menu also splits a block into regions one
    after another, measured on every base plan (what a block saves depends on whether the ops before the stack
    are made again), so its minimum is lower, and some blocks of it are recomputed as two regions or more."""
    problem = _problem(models.llama(layers=6))
    stack = layered.find_stack(problem)
    in_blocks = {op for block in stack.blocks for op in block}
    per_layer = {**per_block_plan(problem), **{op: True for op in problem.recomputable if op not in in_blocks}}
    recompute, stash = layered.planner_of(problem).lowest()
    assert predicted_peak(problem, recompute, stash) <= 0.9 * predicted_peak(problem, per_layer)

    def regions(block) -> int:
        return sum(1 for k, op in enumerate(block) if recompute.get(op) and
                   (k == 0 or not recompute.get(block[k - 1]) or Op.of(recompute[op]).starts_region))
    assert max(regions(block) for block in stack.blocks) >= 2


@pytest.mark.parametrize("case", [lambda: models.llama(layers=4, batch=2, sequence=32),
                                  lambda: models.Case("mlp", models.MLP(layers=5, d=32), (torch.randn(64, 32),))],
                         ids=["llama", "mlp"])
def test_a_menu_entry_changes_the_timeline_as_the_whole_memory_model_says(case):
    """The menu is priced by :class:`TimelineChanges` from the activations a change touches; on every base
    plan (outside ops kept or made again, tensors stashed), every entry's change and extra cost equal the
    whole memory model's difference."""
    torch.manual_seed(0)
    problem = _problem(case())
    planner = layered.planner_of(problem)
    stack = planner.stack
    segments = layered.menu(problem, stack, planner.plans)
    assert any(problem.stash_options.values())
    for base in planner.bases:
        changes = TimelineChanges(problem, base.plan)
        for segment in segments + [entry.segment for entry in base.entries]:
            first = layered._measured_at(stack, len(segment))
            plan = layered._with_blocks(problem, stack, base.plan, dict(enumerate(segment, start=first)))
            delta, cost = changes.change(plan)
            whole = np.asarray(memory_timeline(problem, *plan)) - np.asarray(memory_timeline(problem, *base.plan))
            assert delta.tolist() == whole.tolist()
            assert cost == extra_cost(problem, *plan) - extra_cost(problem, *base.plan)


def test_any_change_of_a_base_is_priced_as_the_whole_memory_model_says():
    """:class:`TimelineChanges` judges again only the stash choices a change can alter: on every base, random
    changes — ops flipped (recomputable or not, in the blocks or outside), stash choices dropped, added or
    swapped for another action — are priced as the whole memory model's difference."""
    torch.manual_seed(0)
    problem = _problem(models.llama(layers=4, batch=2, sequence=32))
    planner = layered.planner_of(problem)
    draw = random.Random(0)
    options = [(name, option.action) for name, choices in sorted(problem.stash_options.items())
               for option in choices]
    for base in planner.bases:
        changes = TimelineChanges(problem, base.plan)
        for _ in range(25):
            recompute, stash = dict(base.plan[0]), dict(base.plan[1] or {})
            for op in draw.sample(problem.chain, 3):
                recompute[op] = not recompute.get(op)
            for name in draw.sample(sorted(stash), min(2, len(stash))):
                del stash[name]
            stash.update(draw.sample(options, 3))
            delta, cost = changes.change((recompute, stash))
            whole = np.asarray(memory_timeline(problem, recompute, stash)) \
                - np.asarray(memory_timeline(problem, *base.plan))
            assert delta.tolist() == whole.tolist()
            assert cost == extra_cost(problem, recompute, stash) - extra_cost(problem, *base.plan)


@pytest.mark.slow
def test_at_sqrt_ns_peak_llamas_layers_are_made_again_around_a_kept_stretch():
    """At the peak √N over the graph's articulation points measures on a 12-layer Llama, the room above the
    least peak is a tenth of it: the DP finds a plan under that budget only with blocks recomputed but for one
    stretch kept (an MLP's matmuls), a region on each side of it — no single region or split of a block
    fits there."""
    torch.manual_seed(0)
    case = models.llama(layers=12)
    gm = capture(case.model, case.args, case.kwargs)
    profile_step(gm, case.args, case.kwargs)
    problem = build_problem(gm, device=counting_flops(CPU_DISK))   # least FLOPs, as docs/benchmarks-depth.md
    sqrt_n = sqrt_n_rewrite(gm, problem)
    budget = measured_step(sqrt_n, case.model, case.args, case.kwargs, seed=1).peak
    planner = layered.planner_of(problem)
    found = planner.cheapest(budget)
    assert found is not None and predicted_peak(problem, *found) <= budget

    def kept_between_regions(block) -> bool:
        pattern = "".join("r" if found[0].get(op) else "k" for op in block if op in problem.recomputable)
        return re.search("r+k+r", pattern) is not None
    assert any(kept_between_regions(block) for block in planner.stack.blocks)
