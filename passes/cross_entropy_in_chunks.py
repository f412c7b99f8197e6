"""Capture clean-up: each cross-entropy over class indices becomes one whose log-softmax lives a chunk at a time.

:func:`~autorecompute.runtime.cross_entropy.cross_entropy_in_chunks` holds the logits where autograd's holds their
log-softmax, and one vocabulary-sized tensor less in its backward; the values are the same. The profile counts
that memory; a plan that fits without it puts autograd's cross-entropy back
(:mod:`~autorecompute.passes.rewrite_lean_ops`).
"""
from __future__ import annotations

import math

import torch
import torch.fx

from autorecompute.passes.meta import LeanOp, mark_lean_op
from autorecompute.runtime.cross_entropy import cross_entropy_in_chunks

_CROSS_ENTROPY = torch.ops.aten.cross_entropy_loss.default
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
        mark_lean_op(node, LeanOp("cross-entropy in chunks", 2, cross_entropy_in_chunks,
                                  (reduction, ignore_index, chunks), _CROSS_ENTROPY, options))
        node.target, node.args, node.kwargs = cross_entropy_in_chunks, (logits, target, reduction, ignore_index,
                                                                         chunks), {}


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
