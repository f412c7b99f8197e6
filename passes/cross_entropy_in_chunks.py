"""Capture clean-up: each cross-entropy over class indices becomes one whose log-softmax lives a chunk at a time.

:func:`~autorecompute.runtime.cross_entropy.cross_entropy_in_chunks` holds the logits where autograd's holds their
log-softmax, and one vocabulary-sized tensor less in its backward; the values are the same. The profile counts
that memory; a plan that fits without it puts autograd's cross-entropy back
(:mod:`~autorecompute.passes.rewrite_lean_ops`). Where low-precision logits are cast up for the loss alone
(``logits.float()`` in Hugging Face's causal-LM loss), the cast is made a chunk at a time too: the cast node
hands the logits on as they are (:func:`~autorecompute.runtime.cross_entropy.upcast_by_cross_entropy`), lean
only together with its cross-entropy.
"""
from __future__ import annotations

import math

import torch
import torch.fx

from autorecompute.passes.meta import LeanOp, mark_lean_op
from autorecompute.runtime.cross_entropy import cross_entropy_in_chunks, upcast_by_cross_entropy

_aten = torch.ops.aten
_CROSS_ENTROPY = _aten.cross_entropy_loss.default
_UPCASTS = {_aten.to.dtype, _aten._to_copy.default, _aten.to.dtype_layout}
_RESHAPES = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.flatten.using_ints}
_PARAMETERS = ("weight", "reduction", "ignore_index", "label_smoothing")
_DEFAULTS = (None, 1, -100, 0.0)
# the chunks' log-softmax and its gradient are at most an eighth of the logits each, and at most this many bytes
# (tens of chunks at a 50k vocabulary and thousands of tokens: little Python for the memory)
MIN_CHUNKS = 8
CHUNK_BYTES = 32 * 2**20


def chunk_cross_entropies(gm: torch.fx.GraphModule) -> None:
    """Each ``aten.cross_entropy_loss`` over 2-D logits and class indices, unweighted and unsmoothed, becomes
    ``cross_entropy_in_chunks``, marked with both forms (:class:`~.meta.LeanOp`). In place."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _CROSS_ENTROPY:
            continue
        options = _options(node)
        logits, target = node.args[:2]
        if options is None or not _chunkable(logits, target):
            continue
        weight, reduction, ignore_index, smoothing = options
        chunks = chunks_for(logits.meta["val"])
        upcast = _upcast_for_the_loss_alone(logits, node)
        if upcast is not None:
            _defer_upcast(upcast, node.name)
        lean = (reduction, ignore_index, chunks, None if upcast is None else logits.meta["val"].dtype)
        mark_lean_op(node, LeanOp("cross-entropy in chunks", 2, cross_entropy_in_chunks, lean, _CROSS_ENTROPY,
                                  options))
        node.target, node.args, node.kwargs = cross_entropy_in_chunks, (logits, target, *lean), {}


def _upcast_for_the_loss_alone(logits: torch.fx.Node, loss: torch.fx.Node) -> torch.fx.Node | None:
    """The node casting low-precision floats up whose one reader is ``logits``, a reshape whose one reader is
    the cross-entropy ``loss``: ``logits.float().view(-1, vocabulary)``. None where there is none."""
    if logits.target not in _RESHAPES or list(logits.users) != [loss]:
        return None
    cast = logits.args[0]
    if not isinstance(cast, torch.fx.Node) or cast.op != "call_function" or cast.target not in _UPCASTS \
            or list(cast.users) != [logits] or not isinstance(cast.args[0], torch.fx.Node):
        return None
    before, after = cast.args[0].meta.get("val"), cast.meta.get("val")
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return None
    widens = before.is_floating_point() and after.is_floating_point() and before.element_size() < after.element_size()
    same = before.shape == after.shape and before.stride() == after.stride() and before.device == after.device \
        and before.layout == after.layout
    return cast if widens and same else None


def _defer_upcast(cast: torch.fx.Node, loss: str) -> None:
    """``cast`` hands its input on as it is, lean only together with the cross-entropy ``loss`` that casts."""
    mark_lean_op(cast, LeanOp("upcast made by its cross-entropy", 1, upcast_by_cross_entropy, (), cast.target,
                              tuple(cast.args[1:]), tuple(cast.kwargs.items()), lean_with=loss))
    cast.target, cast.args, cast.kwargs = upcast_by_cross_entropy, (cast.args[0],), {}


def chunks_for(logits: torch.Tensor) -> int:
    """How many chunks of rows ``logits`` are taken in: at least :data:`MIN_CHUNKS`, each at most
    :data:`CHUNK_BYTES`, at most one a row."""
    size = logits.numel() * logits.element_size()
    return max(1, min(logits.shape[0], max(MIN_CHUNKS, math.ceil(size / CHUNK_BYTES))))


def _options(node: torch.fx.Node) -> tuple | None:
    """(weight, reduction, ignore_index, label_smoothing) of a cross-entropy node, when it is one this pass
    chunks: no class weights, no label smoothing."""
    given = dict(zip(_PARAMETERS, node.args[2:]), **node.kwargs)
    options = tuple(given.get(name, default) for name, default in zip(_PARAMETERS, _DEFAULTS))
    weight, reduction, ignore_index, smoothing = options
    if weight is not None or smoothing != 0.0 or reduction not in (0, 1, 2) or not isinstance(ignore_index, int):
        return None
    return options


def _chunkable(logits, target) -> bool:
    """2-D floating logits and 1-D ``int64`` class indices, as values capture recorded."""
    if not (isinstance(logits, torch.fx.Node) and isinstance(target, torch.fx.Node)):
        return False
    x, y = logits.meta.get("val"), target.meta.get("val")
    return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == 2 and x.is_floating_point() \
        and y.dim() == 1 and y.dtype == torch.int64
