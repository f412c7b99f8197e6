"""Rematerialize: a saved activation dropped after forward and made again by its own op — on inputs that
autograd holds anyway — when backward first needs it. Unlike a checkpointed region, the op that saved it
is not run again."""
import pytest
import torch
import torch.nn as nn

import autorecompute
from autorecompute.decisions import Action, Stashed
from autorecompute.passes.build_problem import build_problem
from autorecompute.passes.capture import capture
from autorecompute.passes.profile import profile_step
from autorecompute.passes.rewrite_recompute import rewrite_recompute
from autorecompute.passes.rewrite_stash import rewrite_stash
from autorecompute.memory_model import rewrite_of
from autorecompute.passes.apply_plan import clone_graph_module
from autorecompute.runtime.stash import StashedModule, StashRuntime
from harness import assert_bitwise_equal, measured_step


class AttentionLike(nn.Module):
    """Linear → softmax → dropout → linear, three times: the dropout output is saved by the next linear,
    its input by the softmax (which saves its output)."""

    def __init__(self, d: int = 64, blocks: int = 3):
        super().__init__()
        self.inp = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        for a, b in zip(self.inp, self.out):
            x = b(self.drop(a(x).softmax(-1)))
        return x


def planned(model, x):
    gm = capture(model, (x,), {})
    profile_step(gm, (x,), {})
    return gm, build_problem(gm)


def with_stash(gm, problem, stash, recipes=None, delivers=None):
    """``stash``: tensor → action name; a rematerialization is prefetched from nowhere (event 0 is unused)."""
    rewritten = rewrite_recompute(clone_graph_module(gm), rewrite_of(problem, {}).words)
    stashed = {name: Stashed(Action.parse(action), 0, (recipes or {}).get(name, ()), (delivers or {}).get(name, ()))
               for name, action in stash.items()}
    return StashedModule(rewrite_stash(rewritten, stashed, StashRuntime()))


def eager_then(module, model, x):
    """One measured step of eager and one of ``module`` (same seed, gradients cleared between): outputs and
    gradients bitwise equal."""
    eager = measured_step(model, model, (x,), {}, seed=1)
    for p in model.parameters():
        p.grad = None
    result = measured_step(module, model, (x,), {}, seed=1)
    assert_bitwise_equal(eager, result)
    return eager, result


def test_offered_only_when_the_inputs_stay_on_the_device():
    torch.manual_seed(0)
    gm, problem = planned(AttentionLike(), torch.randn(256, 64))
    remat = {name: o for name, opts in problem.stash_options.items() for o in opts if o.action == "rematerialize"}
    dropouts = [n.name for n in gm.graph.nodes if "dropout" in n.name and n.op == "call_function"]
    softmaxes = [n.name for n in gm.graph.nodes if "softmax" in n.name and n.op == "call_function"]
    for dropout, softmax in zip(dropouts, softmaxes):
        # the softmax keeps its output (the dropout's input) for its own backward, which comes later
        assert remat[dropout].needs_kept == (dropout, softmax)
        assert remat[dropout].needs_unstashed == (softmax,)
        assert remat[dropout].stored_bytes == 0
        # the softmax's own input (a linear output) is saved by nobody: its recipe runs that linear too,
        # from the linear's input, which the linear's backward holds
        assert len(remat[softmax].recipe) == 2 and remat[softmax].recipe[-1] == softmax


def test_dropout_output_made_again_with_the_same_mask():
    torch.manual_seed(0)
    model = AttentionLike()
    x = torch.randn(256, 64)
    gm, problem = planned(model, x)
    dropouts = [n.name for n in gm.graph.nodes if "dropout" in n.name and n.op == "call_function"]
    module = with_stash(gm, problem, {name: "rematerialize" for name in dropouts})
    code = module.graph_module.code
    assert code.count("stash_rematerialize(") == 3 and code.count("stash_rng_state(") == 3
    eager, result = eager_then(module, model, x)                 # same masks: bitwise equal gradients
    # two of the three dropout outputs are off the device at the start of backward (the last is needed now)
    assert result.peak <= eager.peak - 2 * 256 * 64 * 4


def test_solver_chooses_it_and_the_budget_holds():
    """A GELU MLP: the GELU output, saved by the next linear, is made again from the linear output the
    GELU saves anyway — cheaper than recomputing a region, which would run the linear again too."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)])
    x = torch.randn(4096, 256)      # 4 MiB per GELU output: ~1 ms to redo, the linear before it ~5 ms
    eager = measured_step(model, model, (x,), {}, seed=1)
    for p in model.parameters():
        p.grad = None
    compiled = autorecompute.compile(model, budget=0.8, actions=("recompute",), solver_time_limit=2)
    plan = compiled.prepare(x)
    assert plan.count("rematerialize") > 0
    assert "stash_rematerialize(" in compiled.graph_module.code
    assert plan.bytes_by_action()["rematerialize"] > 0 and "rematerialize" in plan.summary()
    result = measured_step(compiled, model, (x,), {}, seed=1)
    assert result.peak <= plan.budget
    for name, grad in eager.grads.items():
        assert torch.equal(grad, result.grads[name]), name


class TanhGELUMLP(nn.Module):
    """Linear + the tanh approximation of GELU written out (as HF GPT-2's NewGELU): an elementwise chain
    whose intermediates (the tanh output, the halves) are saved by the ops after them."""

    def __init__(self, d: int = 64, blocks: int = 3):
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))

    def forward(self, x):
        for fc in self.fc:
            h = fc(x)
            x = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))
        return x


def test_a_chain_is_made_again_back_to_held_inputs():
    """The tanh output is saved by tanh's backward and by the product after it; nothing holds the tanh
    input for that long, so the recipe runs pow, mul, add, mul and tanh again from the linear output
    (held by pow's backward). Every chain together: gradients bitwise equal, peak lower."""
    from autorecompute.memory_model import effective_stash

    torch.manual_seed(0)
    model = TanhGELUMLP()
    x = torch.randn(512, 64)
    gm, problem = planned(model, x)
    remat = {name: o for name, opts in problem.stash_options.items() for o in opts if o.action == "rematerialize"}
    chains = [o for o in remat.values() if len(o.recipe) > 1]
    assert chains and max(len(o.recipe) for o in chains) >= 5
    for option in chains:
        assert option.recipe[-1] in option.needs_kept and set(option.recipe) <= set(option.needs_kept)
    stash = effective_stash(problem, {}, {name: "rematerialize" for name, o in remat.items() if len(o.recipe) > 1})
    assert stash and all(len(remat[name].recipe) > 1 for name in stash)
    module = with_stash(gm, problem, stash, {name: remat[name].recipe for name in stash})
    assert "remat_" in module.graph_module.code
    eager, result = eager_then(module, model, x)
    assert result.peak < eager.peak


def _step_from(state, module, model, x):
    """A measured step of ``module`` from the buffers ``state`` (BatchNorm's statistics before the step)."""
    model.load_state_dict(state)
    return measured_step(module, model, (x,), {}, seed=1)


def test_recipes_run_batch_norm_again_without_updating_it():
    """BatchNorm in training mode updates its running statistics: a recipe runs it again as a recomputed
    region does (``batch_norm_once``), on copies of the statistics — the outputs depend on the batch
    statistics alone, so gradients are bitwise eager's and the statistics are updated exactly once."""
    import copy

    from autorecompute.memory_model import effective_stash

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    x = torch.randn(4, 3, 16, 16)
    gm, problem = planned(model, x)
    through_batch_norm = {name: o for name, opts in problem.stash_options.items() for o in opts
                          if o.action == "rematerialize" and "batch_norm" in o.recipe}
    assert through_batch_norm
    stash = effective_stash(problem, {}, {name: "rematerialize" for name in through_batch_norm})
    assert stash
    module = with_stash(gm, problem, stash, {name: through_batch_norm[name].recipe for name in stash})
    state = copy.deepcopy(model.state_dict())
    eager = _step_from(state, model, model, x)
    result = _step_from(state, module, model, x)
    assert_bitwise_equal(eager, result)
    for name, value in eager.buffers.items():    # running mean, variance, num_batches_tracked: once
        assert torch.equal(value, result.buffers[name]), name
    assert int(result.buffers["1.num_batches_tracked"]) == int(state["1.num_batches_tracked"]) + 1


def test_two_forwards_before_one_backward_with_batch_norm_made_again():
    """The second forward updates BatchNorm's running statistics in place before the first forward's
    backward runs the recipe again: the recipe does not depend on them (training mode) and does not check
    them for in-place changes, and gradients and statistics are eager's. BatchNorm's output alone is
    rematerialized (a single-op recipe, Conv → BN → Conv: it runs as a recipe module of its own)."""
    import copy

    from autorecompute.memory_model import effective_stash

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1))
    x1, x2 = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)
    gm, problem = planned(model, x1)
    option = problem.stash_option("batch_norm", "rematerialize")
    assert option is not None and option.recipe == ("batch_norm",)
    stash = effective_stash(problem, {}, {"batch_norm": "rematerialize"})
    assert stash == {"batch_norm": "rematerialize"}
    module = with_stash(gm, problem, stash)
    state = copy.deepcopy(model.state_dict())

    def two_forwards_one_backward(m):
        model.load_state_dict(state)
        for p in model.parameters():
            p.grad = None
        (m(x1).sum() + m(x2).sum()).backward()
        return ({n: p.grad.clone() for n, p in model.named_parameters()},
                {n: b.clone() for n, b in model.named_buffers()})

    eager_grads, eager_buffers = two_forwards_one_backward(model)
    grads, buffers = two_forwards_one_backward(module)
    for name, value in eager_grads.items():
        assert torch.equal(value, grads[name]), name
    for name, value in eager_buffers.items():
        assert torch.equal(value, buffers[name]), name


@pytest.mark.slow
def test_a_tensor_is_made_again_from_the_input_twice(monkeypatch):
    """VGG's first block: each of its 0.5-MiB tensors is needed at its own backward, but made from the one
    before it. A region (recomputed once, held to its last use) or a chain (handing over what it makes on
    its way) holds two at once; ``rematerialize:through`` makes each from the image just before its backward,
    the earlier ones again as temporaries. The lowest peak falls, the measured step stays within it, and
    gradients and BatchNorm statistics are eager's. (In tensor storages: the CPU convolutions' scratch puts a
    floor of 6.32 MiB under both lowest peaks.)"""
    import copy

    from autorecompute.runtime import memory

    monkeypatch.setattr(memory, "has_scratch", lambda func, inputs: False)
    from dataclasses import replace

    import models
    from autorecompute.solvers import cpsat

    case = models.make("vgg")
    x = case.args[0]
    model = case.model
    state = copy.deepcopy(model.state_dict())
    gm, problem = planned(model, x)
    without = replace(problem, stash_options={name: tuple(o for o in options if o.action != "rematerialize:through")
                                              for name, options in problem.stash_options.items()})
    lowest = cpsat.solve(problem, minimize="peak", time_limit=10)
    lowest_without = cpsat.solve(without, minimize="peak", time_limit=10)
    assert lowest.objective < lowest_without.objective - 2**18           # a quarter of a MiB lower at least
    assert "rematerialize:through" in lowest.stash.values()

    optimized = autorecompute.compile(model, budget=lowest.objective, actions=("recompute",), solver_time_limit=4)
    model.load_state_dict(state)
    optimized.prepare(x)
    assert optimized.plan.predicted_peak <= lowest.objective
    assert "rematerialize:through" in {record.action for record in optimized.plan.stash.values()}
    eager = _step_from(state, model, model, x)
    result = _step_from(state, optimized, model, x)
    assert result.peak <= optimized.plan.budget < eager.peak
    assert_bitwise_equal(eager, result)
    for name, value in eager.buffers.items():
        assert torch.equal(value, result.buffers[name]), name


def test_recipes_replay_the_autocast_state():
    """Under CPU autocast the linear makes bfloat16: the recipe runs under the same autocast, so the
    rematerialized tensors have forward's dtype and values (gradients bitwise equal to eager's)."""
    from autorecompute.memory_model import effective_stash

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(256, 64)
    gm, problem = planned(model, x)
    remat = {name: o for name, opts in problem.stash_options.items() for o in opts if o.action == "rematerialize"}
    stash = effective_stash(problem, {}, {name: "rematerialize" for name, o in remat.items() if len(o.recipe) == 1})
    assert stash
    module = with_stash(gm, problem, stash)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager_then(module, model, x)


def test_a_chain_frees_the_linear_output_single_op_recipes_cannot():
    """A GELU MLP: each GELU output can be made again from the linear output before it, but then that linear
    output stays held. A chain rematerialization of ``gelu_1`` runs GELU, linear, GELU again from the
    linear output two layers back, and hands over ``linear_1`` and ``gelu`` on its way: one matmul frees
    a linear output. Measured peak as the memory model says, below the best single-op plan's; gradients
    bitwise equal."""
    from autorecompute.memory_model import effective_stash, predicted_peak
    from models import MLP

    torch.manual_seed(0)
    model = MLP(layers=6, d=64)
    x = torch.randn(256, 64)
    gm, problem = planned(model, x)
    option = problem.stash_option("gelu_1", "rematerialize:chain")
    assert option.recipe == ("gelu", "linear_1", "gelu_1") and set(option.delivers) == {"gelu", "linear_1"}
    assert option.needs_unstashed == ("linear",)          # the base: held by the first GELU's backward
    single = effective_stash(problem, {}, {a.name: "rematerialize" for a in problem.activations
                                           if a.name.startswith("gelu")})
    chain = effective_stash(problem, {}, {f"gelu_{i}": "rematerialize:chain" for i in (1, 3)})
    assert set(chain) == {"gelu_1", "gelu_3"}
    options = {name: problem.stash_option(name, action) for name, action in chain.items()}
    module = with_stash(gm, problem, chain, {n: o.recipe for n, o in options.items()},
                        {n: o.delivers for n, o in options.items()})
    assert module.graph_module.code.count("stash_delivered(") == 4
    _, result = eager_then(module, model, x)
    for p in model.parameters():
        p.grad = None
    _, single_result = eager_then(with_stash(gm, problem, single), model, x)
    assert result.peak == predicted_peak(problem, {}, chain) < single_result.peak


def test_the_planner_chains_rematerializations_under_a_tight_budget():
    """Through ``compile``: the plan names the chain and what it delivers, the budget holds with fewer
    extra FLOPs than regions need, gradients are eager's."""
    from models import MLP

    torch.manual_seed(0)
    model = MLP(layers=8, d=64)
    x = torch.randn(512, 64)
    eager = measured_step(model, model, (x,), {}, seed=1)
    for p in model.parameters():
        p.grad = None
    # least FLOPs: at this size a CPU's per-tensor hook overhead would make regions the faster plan
    compiled = autorecompute.compile(model, budget=0.62, actions=("recompute",), solver_time_limit=2,
                                     objective="flops")
    plan = compiled.prepare(x)
    assert plan.extra_flops_ratio <= 0.25       # a region plan at this budget runs 62.5% more
    chained = [name for name, r in plan.stash.items() if r.action == "rematerialize:chain" and r.delivers]
    assert chained, plan.summary()
    for name in chained:
        for made in plan.stash[name].delivers:
            assert plan.stash[made].delivered_by == name
    assert "made again by the recipe of" in str(plan)
    result = measured_step(compiled, model, (x,), {}, seed=1)
    assert result.peak <= plan.budget
    for name, grad in eager.grads.items():
        assert torch.equal(grad, result.grads[name]), name


def test_a_random_op_is_priced_by_the_numbers_it_draws():
    """Dropout writes its mask and its output (2× its result) but draws one number per element of its
    result: the random-number speed applies to the result's bytes, the memory-bound speed to all it writes
    (pricing the mask as random too had doubled dropout's cost)."""
    from autorecompute.passes.meta import node_info, step_profile
    from autorecompute.transfer import TransferModel

    x = torch.randn(32, 64)
    gm = capture(AttentionLike(blocks=1), (x,), {})
    profile_step(gm, (x,), {})
    speeds = TransferModel(flops_per_second=1e9, write_bytes_per_second=1e9, read_bytes_per_second=1e9,
                           per_transfer_seconds=0.0, memory_bytes_per_second=1e9, random_bytes_per_second=1e8,
                           op_seconds=0.0, region_seconds=0.0, stash_seconds=0.0)
    problem = build_problem(gm, device=speeds)
    dropout = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.dropout.default)
    profile = step_profile(gm)
    written = sum(profile.tensors[name].nbytes for name in node_info(dropout).creates)
    result = 32 * 64 * 4
    assert written == 2 * result                     # the mask and the output
    # one FLOP-equivalent per ns: written bytes at 1 GB/s, the result's numbers at 0.1 GB/s, plus the "1 +"
    assert problem.cost[dropout.name] == 1 + written + 10 * result


def test_a_dropout_that_returns_its_input_draws_nothing():
    """Dropout with p=0 (HF Llama's attention_dropout default) returns its input: running it again costs a
    call, not a draw of random numbers for its result's bytes (priced so, it cost 0.76 ms in Llama's time
    model against 1.3 µs measured, and the least-time plan at √N's peak avoided recomputing attention)."""
    from autorecompute.transfer import TransferModel

    class ZeroDropout(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            return self.b(nn.functional.dropout(self.a(x), p=0.0, training=True))

    x = torch.randn(32, 64)
    gm = capture(ZeroDropout(), (x,), {})
    profile_step(gm, (x,), {})
    speeds = TransferModel(flops_per_second=1e9, write_bytes_per_second=1e9, read_bytes_per_second=1e9,
                           per_transfer_seconds=0.0, memory_bytes_per_second=1e9, random_bytes_per_second=1e8,
                           op_seconds=1e-6, region_seconds=0.0, stash_seconds=0.0)
    problem = build_problem(gm, device=speeds)
    dropout = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.dropout.default)
    assert problem.cost[dropout.name] == 1 + 1000       # "1 +" and one call at 1 µs: nothing written or drawn


def test_a_channels_last_activation_is_rematerialized_in_its_layout():
    """A channels-last conv net: GroupNorm's output is not contiguous, yet dense; rematerialized, the same op
    makes it again in the same layout, and the saved views are rebuilt over it (it had been kept instead,
    so the step measured one activation over its budget while the plan said rematerialized). A
    channels-last input is another signature than a contiguous one of the same shape."""
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                             nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                             nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.GroupNorm(4, 32), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).to(memory_format=torch.channels_last)

    x = torch.randn(8, 3, 32, 32).to(memory_format=torch.channels_last)
    eager_model, model = net(), net()
    eager = measured_step(eager_model, eager_model, (x,), {})
    compiled = autorecompute.compile(model, budget=0.6, actions=("recompute", "offload"), solver_time_limit=2.0,
                                     loss_reserve=0)      # the step measured: a unit gradient on the output
    result = measured_step(compiled, model, (x,), {}, seed=0)
    plan = compiled.plan
    assert "channels_last" in plan.signature
    assert result.peak <= plan.budget
    assert_bitwise_equal(eager, result)
    if not any(record.action == "rematerialize" for record in plan.stash.values()):
        # torch 2.13's CPU build: the problem offers no rematerialization of these GroupNorm outputs (the
        # plan offloads them), so the layout path this test is for is not reached
        pytest.xfail("no rematerialize option for the channels-last GroupNorm outputs on this torch build")
