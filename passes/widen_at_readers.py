"""Capture clean-up: a cheap op that widens a tensor no gradient flows through runs again before each reader.

Hugging Face decoders build the float attention mask once (``where(bool_mask, 0, -inf)``, four times the
boolean's bytes) and add it in every layer: the float mask is then on the device from the first layer's
forward to its backward, and every recomputed layer holds it as a region input. Made again at each layer (one
elementwise op), the boolean mask is what stays. The rule is XLA's rematerialization of broadcasts and
converts.
"""
from __future__ import annotations

import torch
import torch.fx

from autorecompute.passes.graph_facts import is_mutating, is_view

# elementwise ops without the pointwise tag that widen a tensor: casts, and where with a scalar branch
_WIDENING = {torch.ops.aten.where.ScalarOther, torch.ops.aten.where.ScalarSelf, torch.ops.aten.where.Scalar,
             torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout}


def widen_at_each_reader(gm: torch.fx.GraphModule) -> None:
    """Runs a widening op (:func:`_widens`) with several readers again before each reader after the first,
    each reading its own copy. In place. The values are the same op's on the same inputs."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or len(node.users) < 2 or not _widens(node):
            continue
        for reader in sorted(node.users, key=_position(gm))[1:]:
            with gm.graph.inserting_before(reader):
                again = gm.graph.node_copy(node)
            reader.replace_input_with(node, again)


def _position(gm: torch.fx.GraphModule):
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return order.__getitem__


def _widens(node: torch.fx.Node) -> bool:
    """An elementwise op, no gradient through it, no random numbers, writing at least twice the bytes of its
    inputs' storages."""
    value = node.meta.get("val")
    target = node.target
    if not isinstance(value, torch.Tensor) or value.requires_grad or is_mutating(node) or is_view(node):
        return False
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if target not in _WIDENING and torch.Tag.pointwise not in target.tags:
        return False
    inputs = [n.meta.get("val") for n in node.all_input_nodes]
    if not all(isinstance(v, torch.Tensor) and not v.requires_grad for v in inputs):
        return False
    storages = {v.untyped_storage()._cdata: v.untyped_storage().nbytes() for v in inputs}
    out = value.numel() * value.element_size()
    return out >= 2 * sum(storages.values())
