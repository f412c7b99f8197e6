"""Capture's clean-up transforms, each on a small graph: the graph before, and the graph expected after.

Each graph is written node by node (its ``val`` metadata from real tensors, as export records fake ones), so
what a transform changes is all that changes; ``listing`` shows a graph as one line per node.
"""
import torch
import torch.fx

from autorecompute.passes.drop_guards import drop_guards_and_asserts
from autorecompute.passes.functionalize_mutations import functionalize_activation_mutations
from autorecompute.passes.inline_attention import inline_math_attention
from autorecompute.passes.meta import is_lean_op, lean_op
from autorecompute.passes.softmax_in_place import write_softmax_backward_in_place
from autorecompute.passes.widen_at_readers import widen_at_each_reader
from autorecompute.runtime.softmax import softmax_backward_in_place

aten = torch.ops.aten


def listing(gm: torch.fx.GraphModule) -> list[str]:
    """``name = target(args)`` for each node (``target`` as aten prints it, or the function's name)."""
    def show(value):
        return value.name if isinstance(value, torch.fx.Node) else repr(value)

    def target(node):
        return node.target if isinstance(node.target, str) else \
            str(node.target) if hasattr(node.target, "_schema") else node.target.__name__

    return [f"{n.name} = {n.op} {target(n)}({', '.join(map(show, n.args))})" for n in gm.graph.nodes]


_RUN = object()


class _Graph:
    """A graph written node by node; each node's ``val`` is the real tensor it computes."""

    def __init__(self, root: torch.nn.Module | None = None):
        self.graph = torch.fx.Graph()
        self.root = root or torch.nn.Module()

    def input(self, name: str, value: torch.Tensor) -> torch.fx.Node:
        node = self.graph.placeholder(name)
        node.meta["val"] = value
        return node

    def op(self, target, *args, value=_RUN, **kwargs) -> torch.fx.Node:
        """A call of ``target``; its ``val`` is ``value``, else what running it on the inputs' values gives."""
        node = self.graph.call_function(target, args, kwargs)
        if value is _RUN:
            value = target(*torch.fx.map_arg(args, lambda n: n.meta["val"]),
                           **torch.fx.map_arg(kwargs, lambda n: n.meta["val"]))
        node.meta["val"] = value
        return node

    def module(self, *outputs: torch.fx.Node) -> torch.fx.GraphModule:
        self.graph.output(outputs[0] if len(outputs) == 1 else outputs)
        return torch.fx.GraphModule(self.root, self.graph)


def test_guards_and_asserts_nothing_reads_are_dropped():
    root = torch.nn.Module()
    root._guards_fn = torch.nn.Identity()
    g = _Graph(root)
    x = g.input("x", torch.randn(2, 3))
    g.graph.call_module("_guards_fn", (x,))
    g.op(aten._assert_tensor_metadata.default, x, value=None)
    y = g.op(aten.relu.default, x)
    gm = g.module(y)
    assert listing(gm) == ["x = placeholder x()",
                           "_guards_fn = call_module _guards_fn(x)",
                           "_assert_tensor_metadata_default = call_function aten._assert_tensor_metadata.default(x)",
                           "relu_default = call_function aten.relu.default(x)",
                           "output = output output(relu_default)"]
    drop_guards_and_asserts(gm)
    assert listing(gm) == ["x = placeholder x()",
                           "relu_default = call_function aten.relu.default(x)",
                           "output = output output(relu_default)"]


def _attention(dropout_p: float) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    g = _Graph()
    q, k, v = (g.input(name, torch.randn(1, 2, 4, 8)) for name in "qkv")
    out = g.op(aten.scaled_dot_product_attention.default, q, k, v, dropout_p=dropout_p,
               value=torch.empty(1, 2, 4, 8))
    return g.module(out)


def test_attention_with_dropout_becomes_the_ops_of_its_math_composite():
    gm = _attention(0.5)
    assert listing(gm)[3:] == [
        "scaled_dot_product_attention_default = call_function aten.scaled_dot_product_attention.default(q, k, v)",
        "output = output output(scaled_dot_product_attention_default)"]
    inline_math_attention(gm)
    assert [line.split(" = ", 1)[1].split("(")[0] for line in listing(gm)] == [
        "placeholder q", "placeholder k", "placeholder v",
        "call_function aten.mul.Scalar", "call_function aten.transpose.int", "call_function aten.mul.Scalar",
        "call_function aten.expand.default", "call_function aten.view.default", "call_function aten.expand.default",
        "call_function aten.view.default", "call_function aten.bmm.default", "call_function aten._unsafe_view.default",
        "call_function aten._safe_softmax.default",
        "call_function aten.empty_like.default", "call_function aten.bernoulli_.float",     # dropout's mask
        "call_function aten.div_.Scalar", "call_function aten.mul.Tensor",
        "call_function aten.expand.default", "call_function aten.view.default", "call_function aten.expand.default",
        "call_function aten.view.default", "call_function aten.bmm.default", "call_function aten._unsafe_view.default",
        "output output"]


def test_attention_that_runs_a_fused_kernel_or_under_autocast_stays_one_node():
    gm = _attention(0.0)               # a CPU runs flash attention without dropout
    before = listing(gm)
    inline_math_attention(gm)
    assert listing(gm) == before
    gm = _attention(0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inline_math_attention(gm)
    assert listing(gm) == before


def test_an_in_place_op_on_an_activation_nothing_else_reads_is_made_out_of_place():
    g = _Graph()
    x = g.input("x", torch.randn(2, 3))
    h = g.op(aten.mul.Tensor, x, x)
    kept = g.op(aten.exp.default, x)
    read_twice = g.op(aten.add.Tensor, kept, 1.0)             # read by relu_ below and by the output
    relu = g.op(aten.relu_.default, h)
    sigmoid = g.op(aten.sigmoid_.default, kept)
    gm = g.module(relu, sigmoid, read_twice)
    functionalize_activation_mutations(gm)
    assert listing(gm) == ["x = placeholder x()",
                           "mul_tensor = call_function aten.mul.Tensor(x, x)",
                           "exp_default = call_function aten.exp.default(x)",
                           "add_tensor = call_function aten.add.Tensor(exp_default, 1.0)",
                           "relu__default = call_function aten.relu.default(mul_tensor)",
                           "sigmoid__default = call_function aten.sigmoid_.default(exp_default)",
                           "output = output output((relu__default, sigmoid__default, add_tensor))"]


def test_a_fresh_tensor_filled_with_bernoulli_becomes_one_bernoulli_op():
    g = _Graph()
    x = g.input("x", torch.randn(2, 3))
    empty = g.op(aten.empty_like.default, x)
    mask = g.op(aten.bernoulli_.float, empty, 0.25, value=torch.ones(2, 3))
    gm = g.module(g.op(aten.mul.Tensor, x, mask))
    functionalize_activation_mutations(gm)
    assert listing(gm) == ["x = placeholder x()",
                           "detach_default = call_function aten.detach.default(x)",
                           "bernoulli__float = call_function aten.bernoulli.p(detach_default, 0.25)",
                           "mul_tensor = call_function aten.mul.Tensor(x, bernoulli__float)",
                           "output = output output(mul_tensor)"]


def _softmax_read_by(*readers) -> torch.fx.GraphModule:
    g = _Graph()
    x, w = g.input("x", torch.randn(2, 4, 4)), g.input("w", torch.randn(2, 4, 4))
    p = g.op(aten.softmax.int, x, -1)
    return g.module(*[g.op(reader, p, w) for reader in readers])


def test_a_softmax_whose_gradient_is_its_own_writes_its_backward_into_it():
    gm = _softmax_read_by(aten.bmm.default)
    write_softmax_backward_in_place(gm)
    softmax = next(n for n in gm.graph.nodes if n.name == "softmax_int")
    assert softmax.target is softmax_backward_in_place
    assert listing(gm) == ["x = placeholder x()", "w = placeholder w()",
                           "softmax_int = call_function softmax_backward_in_place(x, -1, None, False)",
                           "bmm_default = call_function aten.bmm.default(softmax_int, w)",
                           "output = output output(bmm_default)"]
    assert lean_op(softmax).lean_constants == (-1, None, False)          # the ``safe`` flag last
    assert lean_op(softmax).autograd is aten.softmax.int


def test_a_softmax_whose_gradient_others_read_stays_autograds():
    gm = _softmax_read_by(aten.bmm.default, aten.add.Tensor)    # two readers: one gradient is their sum
    before = listing(gm)
    write_softmax_backward_in_place(gm)
    assert listing(gm) == before
    assert not any(is_lean_op(n) for n in gm.graph.nodes)


def test_a_widening_op_runs_again_before_each_later_reader():
    g = _Graph()
    causal = g.input("causal", torch.ones(4, 4, dtype=torch.bool).tril())
    a, b = g.input("a", torch.randn(4, 4)), g.input("b", torch.randn(4, 4))
    mask = g.op(aten.where.Scalar, causal, 0.0, float("-inf"))   # a float mask, four times the boolean's bytes
    first = g.op(aten.add.Tensor, a, mask)
    second = g.op(aten.add.Tensor, b, mask)
    gm = g.module(first, second)
    widen_at_each_reader(gm)
    assert listing(gm) == ["causal = placeholder causal()", "a = placeholder a()", "b = placeholder b()",
                           "where_scalar = call_function aten.where.Scalar(causal, 0.0, -inf)",
                           "add_tensor = call_function aten.add.Tensor(a, where_scalar)",
                           "where_scalar_1 = call_function aten.where.Scalar(causal, 0.0, -inf)",
                           "add_tensor_1 = call_function aten.add.Tensor(b, where_scalar_1)",
                           "output = output output((add_tensor, add_tensor_1))"]


def test_an_op_that_does_not_widen_keeps_its_readers():
    g = _Graph()
    x, a = g.input("x", torch.randn(4, 4)), g.input("a", torch.randn(4, 4))
    same_size = g.op(aten.mul.Tensor, x, 2.0)
    gm = g.module(g.op(aten.add.Tensor, a, same_size), g.op(aten.sub.Tensor, a, same_size))
    before = listing(gm)
    widen_at_each_reader(gm)
    assert listing(gm) == before
