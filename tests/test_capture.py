"""Capture: what the planner sees of attention, and of ops whose results are written in place later."""
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import autorecompute
import models
from autorecompute.passes.build_problem import build_problem
from autorecompute.passes.capture import capture
from autorecompute.passes.profile import profile_step
from harness import assert_bitwise_equal, measured_step

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Attention(torch.nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.dropout = dropout

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        mask = torch.ones(16, 16, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout).sum(1)


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_attention_with_dropout_becomes_the_math_ops_pytorch_runs():
    """On a CPU, SDPA with dropout runs its math composite: the captured graph holds those ops (two bmm, the
    softmax, the mask drawn by bernoulli.p, the masked probabilities as their own tensor), and computes the
    same outputs and gradients as eager, bit for bit (the same random numbers), at no higher a peak (the graph
    drops each temporary at its last use, where the C++ composite holds some to its end)."""
    x = torch.randn(2, 16, 32)
    model = Attention(0.1)
    gm = capture(model, (x,), {})
    ops = targets(gm)
    aten = torch.ops.aten
    assert SDPA not in ops
    assert ops.count(aten.bmm.default) == 2
    assert aten._safe_softmax.default in ops and aten.bernoulli.p in ops and aten.div.Scalar in ops
    assert not any(getattr(t, "_schema", None) and t._schema.name.endswith("_") for t in ops), "in-place op left"
    eager = measured_step(model, model, (x,), {}, seed=5)
    captured = measured_step(gm, model, (x,), {}, seed=5)
    assert_bitwise_equal(eager, captured)
    assert captured.peak <= eager.peak


def test_attention_without_dropout_stays_one_fused_op():
    """Without dropout a CPU runs flash attention: one kernel, kept as one node."""
    x = torch.randn(2, 16, 32)
    assert targets(capture(Attention(0.0), (x,), {})).count(SDPA) == 1


def test_masked_probabilities_can_be_rematerialized_without_flops():
    """The probabilities after dropout (softmax output × mask) are an elementwise product of two tensors
    autograd keeps anyway: a rematerialization that runs no FLOPs — what SDPA as one op could not offer."""
    x = torch.randn(2, 16, 32)
    gm = capture(Attention(0.1), (x,), {})
    profile_step(gm, (x,), {})
    problem = build_problem(gm)
    masked = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    options = [o for name in masked for o in problem.stash_options.get(name, ()) if o.action == "rematerialize"]
    assert options and all(problem.flops[op] == 0 for o in options for op in o.recipe)


class WrittenLater(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x).exp()
        y = h * 3             # reads h before the write below, so the write cannot be made out-of-place
        h.add_(1.0)
        return (y * h).sum()


def test_an_op_whose_result_is_written_in_place_later_is_not_recomputable():
    """Running ``exp`` again would give its value before ``add_``: neither a region nor a rematerialization
    may remake it."""
    x = torch.randn(4, 8)
    gm = capture(WrittenLater(), (x,), {})
    exp = next(n.name for n in gm.graph.nodes if n.target is torch.ops.aten.exp.default)
    assert any(n.target is torch.ops.aten.add_.Tensor for n in gm.graph.nodes)
    profile_step(gm, (x,), {})
    problem = build_problem(gm)
    assert exp not in problem.recomputable
    assert exp not in problem.stash_options


def test_least_flops_plan_at_torch_compiles_point_runs_no_flops_again():
    """GPT-2 with dropout at 69.6% of eager's peak: torch.compile's ``activation_memory_budget=0.7`` point,
    where its partitioner recomputes only elementwise ops. With attention split into its math ops, a plan
    that runs no FLOPs again fits there; the least-FLOPs search starts from it (it had run a 4.2-MFLOP
    matmul again: goal 3 of the benchmarks)."""
    case = models.make("gpt2")
    model = case.model
    eager = measured_step(model, model, case.args, case.kwargs, seed=2)
    with FlopCounterMode(display=False) as counter:
        measured_step(model, model, case.args, case.kwargs, seed=2)
    eager_flops = counter.get_total_flops()
    model.zero_grad(set_to_none=True)
    budget = int(0.696 * eager.peak)
    compiled = autorecompute.compile(model, budget=budget, solver_time_limit=6.0, actions=("recompute",),
                                     objective="flops")
    result = measured_step(compiled, model, case.args, case.kwargs, seed=2)
    with FlopCounterMode(display=False) as counter:
        measured_step(compiled, model, case.args, case.kwargs, seed=2)
    assert result.peak <= budget
    assert compiled.plan.extra_flops == 0
    assert counter.get_total_flops() == eager_flops
    assert_bitwise_equal(eager, result)
