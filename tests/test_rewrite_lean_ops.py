"""The lean-ops rewrite: capture's in-place softmax backward switched back to autograd's, and again, in a graph
whose softmax runs inside a recomputed region (its region's outputs carry the op's marks too)."""
import torch

from autorecompute.memory_model import NEW_REGION
from autorecompute.passes.build_problem import build_problem
from autorecompute.passes.capture import capture
from autorecompute.passes.profile import profile_step
from autorecompute.passes.rewrite_recompute import rewrite_recompute
from autorecompute.passes.rewrite_lean_ops import lean_op_nodes, rewrite_lean_ops
from autorecompute.memory_model import rewrite_of
from autorecompute.passes.apply_plan import clone_graph_module
from autorecompute.runtime.softmax import softmax_backward_in_place
from harness import assert_bitwise_equal, measured_step


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.query = torch.nn.Linear(8, 8)

    def forward(self, x, v):
        return torch.tanh(torch.softmax(self.query(x) @ x.transpose(1, 2), -1) @ v)


def softmax_targets(gm) -> list:
    return [n.target for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
            if n.op == "call_function" and n.name.startswith("softmax")]


def test_softmaxes_in_a_recomputed_region_switch_between_backwards_with_eager_gradients():
    torch.manual_seed(0)
    model, args = Attention(), (torch.randn(4, 64, 8), torch.randn(4, 64, 8))
    gm = capture(model, args, {})
    profile_step(gm, args, {})
    problem = build_problem(gm)
    # every op recomputed, the softmax's reader in a region of its own: the softmax's value is a region's output
    # and the next region's input, copies of the softmax node that carry its marks
    recompute = {op: True for op in problem.recomputable}
    after = problem.chain[problem.chain.index("softmax") + 1]
    recompute[after] = NEW_REGION
    module = rewrite_recompute(clone_graph_module(gm), rewrite_of(problem, recompute).words,
                               rewrite_of(problem, recompute).region_starts)
    assert lean_op_nodes(module) == ["softmax"]
    assert softmax_targets(module) == [softmax_backward_in_place]       # in the region's body
    eager = measured_step(model, model, args, {})
    in_place = measured_step(module, model, args, {})

    rewrite_lean_ops(module, lean=())
    assert softmax_targets(module) == [torch.ops.aten.softmax.int]
    assert lean_op_nodes(module) == ["softmax"]                   # still known, to switch back
    autograds = measured_step(module, model, args, {})

    rewrite_lean_ops(module, lean=["softmax"])
    assert softmax_targets(module) == [softmax_backward_in_place]
    again = measured_step(module, model, args, {})
    for result in (in_place, autograds, again):
        assert_bitwise_equal(eager, result)
    assert in_place.peak == again.peak <= autograds.peak


def test_a_planned_graph_pickled_or_traced_again_keeps_its_softmax_in_place():
    """A GraphModule is rebuilt from its code by tracing (pickle, symbolic_trace): the in-place softmax stays
    one node there, so the rebuilt graph keeps the memory its plan counts on (traced into, it became
    autograd's softmax: 331 008 B over a 0.8 budget)."""
    import pickle

    import autorecompute

    class Scores(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            h = x @ self.w
            return torch.softmax(h @ h.transpose(-1, -2), -1) @ h

    torch.manual_seed(0)
    model, args = Scores(), (torch.randn(2, 256, 8),)
    compiled = autorecompute.compile(model, budget=0.8, solver_time_limit=2)
    planned = measured_step(compiled, model, args, {})
    assert compiled.plan.lean_ops == ("softmax",)
    for rebuilt in (pickle.loads(pickle.dumps(compiled.graph_module)), torch.fx.symbolic_trace(compiled.graph_module)):
        assert softmax_targets(rebuilt) == [softmax_backward_in_place]
        again = measured_step(rebuilt, model, args, {})      # (a pickled copy has parameters of its own)
        assert again.peak == planned.peak <= compiled.plan.budget
        assert all(torch.equal(a, b) for a, b in zip(planned.outputs, again.outputs))
