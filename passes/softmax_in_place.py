"""Capture clean-up: each softmax whose gradient is its own gets a backward written into that gradient.

:func:`~autorecompute.runtime.softmax.softmax_backward_in_place` holds two attention-sized tensors in its
backward where autograd's holds three; the values are the same (same kernel). The profile counts that memory;
a plan that fits without it puts autograd's backward back (:mod:`~autorecompute.passes.rewrite_lean_ops`).
"""
from __future__ import annotations

import torch
import torch.fx

from autorecompute.passes.meta import LeanOp, mark_lean_op
from autorecompute.runtime.softmax import AUTOGRAD_SOFTMAX, softmax_backward_in_place

_SOFTMAXES = {op: safe for safe, op in AUTOGRAD_SOFTMAX.items()}    # → the ``safe`` flag
_aten = torch.ops.aten
# ops whose backward makes a new tensor for the argument (a matmul's ``grad @ other.T``, a mask's product)
_NEW_GRADIENT = {_aten.matmul.default, _aten.bmm.default, _aten.mm.default, _aten.mul.Tensor,
                 _aten.native_dropout.default}
# ops whose backward hands the gradient on as it is, or as a view of it (``to`` its own dtype, dropout at p=0
# on a CPU, which return their input): the gradient is then as much the softmax's own as theirs
_HANDS_GRADIENT_ON = {_aten.to.dtype, _aten._to_copy.default, _aten.dropout.default, _aten.view.default,
                      _aten.reshape.default, _aten._unsafe_view.default, _aten.expand.default, _aten.clone.default,
                      _aten.contiguous.default, _aten.transpose.int, _aten.permute.default,
                      _aten.unsqueeze.default, _aten.alias.default}


def write_softmax_backward_in_place(gm: torch.fx.GraphModule) -> None:
    """Each softmax over the last dimension, in its input's dtype, whose result's gradient is its own becomes
    ``softmax_backward_in_place``, marked with both forms (:class:`~.meta.LeanOp`), which ``rewrite_lean_ops``
    reads to put autograd's softmax back. In place."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SOFTMAXES or node.kwargs:
            continue
        x, result = node.args[0], node.meta.get("val")
        source = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not (isinstance(result, torch.Tensor) and isinstance(source, torch.Tensor)):
            continue
        dim = node.args[1] if len(node.args) > 1 else None
        if source.dtype != result.dtype or not isinstance(dim, int) or dim % max(result.dim(), 1) != result.dim() - 1:
            continue
        if _owns_its_gradient(node):
            dtype = node.args[2] if len(node.args) > 2 else None
            safe = _SOFTMAXES[node.target]
            mark_lean_op(node, LeanOp("softmax in place", 1, softmax_backward_in_place, (dim, dtype, safe),
                                      node.target, (dim, dtype)))
            node.args = (x, dim, dtype, safe)
            node.target = softmax_backward_in_place


def _owns_its_gradient(node: torch.fx.Node) -> bool:
    """Whether the gradient autograd hands ``node``'s backward is read by nothing else: one op reads ``node``
    where a gradient flows, once, and its backward makes a new tensor for it — or hands on its own gradient,
    which it owns in turn. (Readers that take no gradient, ``detach``, do not count; a graph output's gradient
    is the caller's.)"""
    readers = [user for user in node.users if user.op != "call_function" or _takes_gradient(user)]
    if len(readers) != 1 or readers[0].op != "call_function":
        return False
    reader = readers[0]
    read: list[torch.fx.Node] = []
    torch.fx.node.map_arg((reader.args, reader.kwargs), read.append)
    if read.count(node) != 1:
        return False
    return reader.target in _NEW_GRADIENT or (reader.target in _HANDS_GRADIENT_ON and _owns_its_gradient(reader))


def _takes_gradient(node: torch.fx.Node) -> bool:
    """Whether a gradient may flow back through ``node`` (export's values do not say whether they require one)."""
    value = node.meta.get("val")
    floating = not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex()
    return node.target is not torch.ops.aten.detach.default and floating
