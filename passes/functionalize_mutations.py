"""Capture clean-up: in-place ops on an activation that nothing else reads, made out-of-place.

Recomputing a region then never replays a mutation of its own input. In-place updates of buffers
(BatchNorm's ``num_batches_tracked``) and of tensors other ops read stay as they are: there the write is
what the model means.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from autorecompute.passes.graph_facts import is_mutating, is_view


def functionalize_activation_mutations(gm: torch.fx.GraphModule) -> None:
    """``relu_(x)`` → ``relu(x)`` when ``x`` is an activation read by nothing else; ``empty_like(x).bernoulli_(p)``
    → ``bernoulli(x, p)``. In place.

    Export tracks the tensor object, so every later use already refers to the in-place node's output; with
    ``x`` having no other user, the out-of-place op computes the same values.
    """
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not is_mutating(node) or not node.args:
            continue
        target_arg = node.args[0]
        if not isinstance(target_arg, torch.fx.Node) or target_arg.op != "call_function":
            continue
        if _fills_fresh_tensor_with_bernoulli(node):
            _draw_into_fresh_tensor(gm, node, target_arg)
            continue
        if len(target_arg.users) != 1 or target_arg.target is operator.getitem or is_view(target_arg):
            continue
        functional = _functional_variant(node.target)
        if functional is not None:
            node.target = functional


def _draw_into_fresh_tensor(gm: torch.fx.GraphModule, node: torch.fx.Node, empty: torch.fx.Node) -> None:
    """``bernoulli_(empty_like(x), p)`` (dropout's mask, as the math attention runs it) → ``bernoulli(x, p)``: the
    same numbers in a fresh tensor like ``x``, and an op that can be recomputed with its RNG replayed. It reads
    ``x`` detached: the mask is no function of ``x`` (no gradient through it)."""
    with gm.graph.inserting_before(node):
        like = gm.graph.call_function(torch.ops.aten.detach.default, (empty.args[0],))
    like.meta.update(empty.meta)
    node.target = torch.ops.aten.bernoulli.p
    node.args = (like, node.args[1] if len(node.args) > 1 else 0.5)
    gm.graph.erase_node(empty)


def _fills_fresh_tensor_with_bernoulli(node: torch.fx.Node) -> bool:
    """``bernoulli_(empty_like(x), p)`` with nothing else reading the empty tensor and ``x`` contiguous (so the
    fresh tensor ``bernoulli.p`` makes has the same layout)."""
    if node.target is not torch.ops.aten.bernoulli_.float or node.kwargs.get("generator") is not None:
        return False
    empty = node.args[0]
    if empty.target is not torch.ops.aten.empty_like.default or len(empty.users) != 1 or not empty.args:
        return False
    like = empty.args[0].meta.get("val") if isinstance(empty.args[0], torch.fx.Node) else None
    plain = all(empty.kwargs.get(k) is None for k in ("dtype", "layout", "device", "pin_memory")) and \
        empty.kwargs.get("memory_format") in (None, torch.preserve_format, torch.contiguous_format)
    return plain and isinstance(like, torch.Tensor) and like.is_contiguous()


def _functional_variant(op):
    """The out-of-place overload of an in-place aten op (``relu_.default`` → ``relu.default``), or None."""
    packet_name = op._schema.name.split("::")[-1]
    if not packet_name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, packet_name[:-1], None)
    if packet is None:
        return None
    return getattr(packet, op._overloadname, None)
