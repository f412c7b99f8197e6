"""Before/Expected for the rewrite pass, on a hand-written graph."""
import torch
import torch.fx

from autorecompute.passes.rewrite_recompute import find_regions, rewrite_recompute
from autorecompute.runtime.regions import batch_norm_once


RECOMPUTE = {"gelu_default": "recompute", "linear_default_1": "recompute", "batch_norm_default": "recompute"}


def before():
    def f(x, w, bn_w, bn_b, rm, rv):
        a = torch.ops.aten.linear.default(x, w)
        b = torch.ops.aten.gelu.default(a)
        c = torch.ops.aten.linear.default(b, w)
        d = torch.ops.aten.batch_norm.default(c, bn_w, bn_b, rm, rv, True, 0.1, 1e-5, False)
        e = torch.ops.aten.relu.default(d)
        return torch.ops.aten.linear.default(e, w)
    return torch.fx.symbolic_trace(f)


def test_regions_are_maximal_runs_of_recompute():
    gm = before()
    decisions = {"linear_default": "keep", **RECOMPUTE, "relu_default": "keep"}
    regions = find_regions(gm.graph, decisions)
    assert [[n.name for n in r] for r in regions] == [["gelu_default", "linear_default_1", "batch_norm_default"]]


def test_rewrite_outlines_each_region_into_a_checkpointed_submodule():
    gm = before()
    gm = rewrite_recompute(gm, RECOMPUTE)
    top = [n.target if n.op != "call_function" else getattr(n.target, "__name__", str(n.target))
           for n in gm.graph.nodes if n.op in ("call_function", "call_module")]
    assert top == ["linear.default", "recompute_region_0", "getitem", "relu.default", "linear.default"]
    body = gm.recompute_region_0.body
    assert [n.name for n in body.graph.nodes if n.op == "placeholder"] == [
        "recomputing", "linear_default", "w", "bn_w", "bn_b", "rm", "rv"]
    targets = [n.target for n in body.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.aten.gelu.default, torch.ops.aten.linear.default, batch_norm_once]


def _assert_same_step_as_eager(gm) -> None:
    """One step of ``gm`` against ``before()``'s: values, gradients and running statistics (updated once)."""
    torch.manual_seed(0)
    args = [torch.randn(8, 4), torch.randn(4, 4, requires_grad=True), torch.ones(4, requires_grad=True),
            torch.zeros(4, requires_grad=True), torch.zeros(4), torch.ones(4)]
    out = before()(*args)
    out.sum().backward()
    grads = [a.grad.clone() for a in args if a.requires_grad]
    stats = [args[4].clone(), args[5].clone()]
    for a in args:
        a.grad = None
    args[4].zero_(), args[5].fill_(1)
    out2 = gm(*args)
    out2.sum().backward()
    assert torch.equal(out, out2)
    assert all(torch.equal(g, a.grad) for g, a in zip(grads, [a for a in args if a.requires_grad]))
    assert torch.equal(stats[0], args[4]) and torch.equal(stats[1], args[5])   # running stats updated once


def test_rewritten_graph_computes_the_same_values_and_gradients():
    _assert_same_step_as_eager(rewrite_recompute(before(), RECOMPUTE))


def test_a_region_start_cuts_a_run_into_two_checkpoints():
    """``starts`` (the plan's ``region_starts``) begin a new region inside a run of recomputed ops: two
    checkpoints back to back, the first one's output the second one's input; values, gradients and running
    statistics as eager's."""
    decisions = {"linear_default": "keep", **RECOMPUTE, "relu_default": "keep"}
    regions = find_regions(before().graph, decisions, starts={"linear_default_1"})
    assert [[n.name for n in r] for r in regions] == [["gelu_default"], ["linear_default_1", "batch_norm_default"]]
    assert len(find_regions(before().graph, decisions, starts={"gelu_default"})) == 1   # a run's first op: no cut

    gm = rewrite_recompute(before(), RECOMPUTE, starts={"linear_default_1"})
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["recompute_region_0", "recompute_region_1"]
    _assert_same_step_as_eager(gm)
