"""Before/Expected for rewrite_calls: each aten op called through eager's binding where that dispatches the same."""
import operator
import pickle

import pytest
import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import autorecompute
import models
from conftest import SOLVER_TIME
from autorecompute.passes import rewrite_calls as rewrite_calls_pass
from autorecompute.passes.rewrite_calls import binding_for, rewrite_calls
from autorecompute.runtime import tensor_methods
from harness import assert_bitwise_equal, measured_step

aten = torch.ops.aten


def before() -> torch.fx.GraphModule:
    def f(x, w):
        t = aten.transpose.int(x, 0, 1)
        y = aten.linear.default(t, w)
        z = aten.add.Scalar(y, 2)            # torch.add(y, 2) would dispatch add.Tensor: must stay
        parts = aten.split.Tensor(z, 2, 0)   # torch.split is a Python wrapper (and returns a tuple): stays
        v = aten.view.default(parts[0], [-1])
        return aten.add.Tensor(v, aten.sum.default(parts[1]))
    return recorded(torch.fx.symbolic_trace(f), torch.randn(3, 4), torch.randn(4, 3))


def recorded(gm: torch.fx.GraphModule, *args) -> torch.fx.GraphModule:
    """``gm`` with each node's value recorded in ``meta["val"]``, as capture leaves it."""
    FakeTensorProp(gm).propagate(*args)
    return gm


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_bindings_replace_overloads_that_dispatch_the_same():
    expected = [torch.transpose, torch._C._nn.linear, aten.add.Scalar, aten.split.Tensor, operator.getitem,
                tensor_methods.view, operator.getitem, torch.sum, torch.add]
    assert targets(before()) == [aten.transpose.int, aten.linear.default, aten.add.Scalar, aten.split.Tensor,
                                 operator.getitem, aten.view.default, operator.getitem, aten.sum.default,
                                 aten.add.Tensor]
    assert targets(rewrite_calls(before())) == expected
    assert "torch.transpose(" in rewrite_calls(before()).code


def test_rewritten_graph_computes_the_same_values_and_gradients():
    x, w = torch.randn(3, 4), torch.randn(4, 3, requires_grad=True)
    reference, rewritten = before(), rewrite_calls(before())
    out = reference(x, w)
    (grad,) = torch.autograd.grad(out.sum(), w)
    out2 = rewritten(x, w)
    (grad2,) = torch.autograd.grad(out2.sum(), w)
    assert targets(rewritten) != targets(reference)
    assert torch.equal(out, out2) and torch.equal(grad, grad2)


def test_the_rewritten_module_pickles():
    x, w = torch.randn(3, 4), torch.randn(4, 3)
    rewritten = rewrite_calls(before())
    assert torch.equal(pickle.loads(pickle.dumps(rewritten))(x, w), rewritten(x, w))


def test_the_check_draws_no_random_numbers_and_allocates_on_no_device():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    noise = graph.call_function(aten.randn.default, ([3],), {"device": torch.device("cpu")})
    graph.output(graph.call_function(aten.add.Tensor, (x, noise)))
    gm = recorded(torch.fx.GraphModule(torch.nn.Module(), graph), torch.randn(3))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    rewrite_calls(gm)
    assert torch.equal(torch.get_rng_state(), state)          # checked on the meta device
    assert torch.randn in targets(gm)


def test_an_op_without_recorded_inputs_keeps_its_overload(monkeypatch):
    monkeypatch.setattr(rewrite_calls_pass, "_checked", {})      # nothing known from earlier graphs
    gm = torch.fx.symbolic_trace(lambda x: aten.transpose.int(x, 0, 1))    # no meta["val"] on x
    assert targets(rewrite_calls(gm)) == [aten.transpose.int]


def test_the_binding_must_reach_the_same_overload():
    gm = recorded(torch.fx.symbolic_trace(lambda x: (aten.add.Scalar(x, 2), aten.add.Tensor(x, 2),
                                                     aten.div.Tensor(x, x))), torch.randn(2))
    by_scalar, by_tensor, div = [n for n in gm.graph.nodes if n.op == "call_function"][:3]
    # same argument kinds, different overloads: torch.add(x, 2) reaches add.Tensor, so add.Scalar keeps its own
    assert binding_for(by_scalar.target, by_scalar.args, by_scalar.kwargs) is None
    assert binding_for(by_tensor.target, by_tensor.args, by_tensor.kwargs) is torch.add
    assert binding_for(div.target, div.args, div.kwargs) is torch.div
    assert binding_for(operator.getitem, (div, 0), {}) is None       # not an aten overload


@pytest.mark.slow
def test_compiled_modules_call_bindings_in_regions_and_recipes_with_eager_gradients():
    case = models.gpt()
    eager = measured_step(case.model, case.model, case.args, case.kwargs, seed=1)
    # the step measured: a unit gradient on the outputs, no loss beside it
    compiled = autorecompute.compile(case.model, budget=0.6, loss_reserve=0, solver_time_limit=SOLVER_TIME)
    compiled.prepare(*case.args, **case.kwargs)
    gm = compiled.graph_module
    bodies = [m for name, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule) and name]
    assert bodies, "a budget of 60% recomputes: the plan has regions or recipes"
    for module in [gm, *bodies]:
        overloads = [t for t in targets(module) if isinstance(t, torch._ops.OpOverload)]
        assert all(t is aten.split.Tensor for t in overloads), overloads
    assert_bitwise_equal(eager, measured_step(compiled, case.model, case.args, case.kwargs, seed=1))
