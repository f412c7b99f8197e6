"""A cross-entropy that never holds its log-softmax: computed and differentiated a chunk of rows at a time.

Autograd's ``cross_entropy`` over logits of a vocabulary's width keeps their log-softmax for backward, and its
backward holds three tensors of that size at once: the log-softmax, the gradient ``nll_loss`` makes for it (zeros
but at the targets) and the logits' gradient. At a 50k vocabulary that is often the step's peak. This one keeps
the logits instead (which the step holds anyway, or which it would free as the log-softmax is made), and makes
the log-softmax again in backward, a chunk of rows at a time, straight into the logits' gradient: one
vocabulary-sized tensor less at backward, and the log-softmax's gone from the forward's end.

The values are autograd's bit for bit: each row's log-softmax and its backward are the same kernels on the same
row, and the loss is ``nll_loss`` over the same picked log-probabilities in the same order. The price is one
log-softmax more, a memory-bound pass over the logits (no FLOPs as ``FlopCounterMode`` counts them).

Played on fake tensors (the planner's profile and its verification of a plan), one chunk of each size stands for
the others: every chunk makes and frees the same tensors in turn, so the memory is the same, and at a 50k
vocabulary the fifty chunks' ops would be a good part of the step's fake run.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from autorecompute.runtime.memory import in_fake_step

_aten = torch.ops.aten
REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}   # ``aten.cross_entropy_loss``'s reduction codes


class _CrossEntropyInChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int,
                chunks: int, upcast: torch.dtype | None) -> torch.Tensor:
        rows = _rows_per_chunk(logits.shape[0], chunks)
        picked = logits.new_empty((logits.shape[0], 1), dtype=upcast or logits.dtype)
        for start in _chunk_starts(logits.shape[0], rows):
            part = slice(start, start + rows)
            classes = torch.where(target[part] == ignore_index, 0, target[part]).unsqueeze(1)
            torch.gather(_aten._log_softmax(_cast(logits[part], upcast), 1, False), 1, classes, out=picked[part])
        # nll_loss over the picked column: the same values summed in the same order as over the whole rows
        # (column 0 for each row, -1 marking the ignored ones: ignore_index may be 0)
        loss, total_weight = _aten.nll_loss_forward(picked, torch.where(target == ignore_index, -1, 0), None,
                                                    reduction, -1)
        ctx.save_for_backward(logits, target, total_weight)
        ctx.reduction, ctx.ignore_index, ctx.rows, ctx.upcast = reduction, ignore_index, rows, upcast
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, target, total_weight = ctx.saved_tensors
        if torch.is_grad_enabled():         # create_graph=True: the same ops, recorded, none written in place
            return _recorded_backward(ctx, grad, logits, target, total_weight), None, None, None, None, None
        result = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for start in _chunk_starts(logits.shape[0], ctx.rows):
            part = slice(start, start + ctx.rows)
            log_softmax = _aten._log_softmax(_cast(logits[part], ctx.upcast), 1, False)
            incoming = grad[part] if ctx.reduction == REDUCTIONS["none"] else grad
            # nll_loss's gradient made in the result's rows (or a chunk of the upcast's dtype, cast into them as
            # the upcast's backward casts), then the log-softmax's backward over it there: each element reads its
            # own gradient and output after its row's sum, as the kernel reads them
            rows = result[part] if log_softmax.dtype == result.dtype else torch.empty_like(log_softmax)
            _aten.nll_loss_backward.grad_input(incoming, log_softmax, target[part], None, ctx.reduction,
                                               ctx.ignore_index, total_weight, grad_input=rows)
            _aten._log_softmax_backward_data.out(rows, log_softmax, 1, log_softmax.dtype, out=rows)
            del log_softmax     # before the next chunk's is made
            if rows.dtype != result.dtype:
                result[part].copy_(rows)
            del rows
        return result, None, None, None, None, None


def _recorded_backward(ctx, grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                       total_weight: torch.Tensor) -> torch.Tensor:
    """The logits' gradient by the backward's ops without ``out=``, so that autograd records them (a gradient
    of the gradient); the whole of each chunk's tensors is held until the end."""
    parts = []
    for start in range(0, logits.shape[0], ctx.rows):
        part = slice(start, start + ctx.rows)
        log_softmax = _aten._log_softmax(_cast(logits[part], ctx.upcast), 1, False)
        incoming = grad[part] if ctx.reduction == REDUCTIONS["none"] else grad
        picked_grad = _aten.nll_loss_backward(incoming, log_softmax, target[part], None, ctx.reduction,
                                              ctx.ignore_index, total_weight)
        parts.append(_aten._log_softmax_backward_data(picked_grad, log_softmax, 1, log_softmax.dtype))
    return torch.cat(parts).to(logits.dtype) if parts else torch.zeros_like(logits)


def _rows_per_chunk(rows: int, chunks: int) -> int:
    return max(1, -(-rows // max(1, chunks)))


def _chunk_starts(total: int, rows: int) -> range | tuple[int, ...]:
    """The first row of each chunk to run: all of them, or, played on fake tensors, the first chunk and the last
    (the only one that can be shorter) for the rest."""
    starts = range(0, total, rows)
    return (starts[0], starts[-1]) if len(starts) > 2 and _played_on_fake_tensors() else starts


def _played_on_fake_tensors() -> bool:
    """Whether the op runs in a fake step (no values computed), not traced into a graph: a graph traced with
    fake tensors must still take every chunk."""
    if torch.compiler.is_compiling() or not in_fake_step():
        return False
    return not any(isinstance(mode, ProxyTorchDispatchMode) for mode in _get_current_dispatch_mode_stack())


def _cast(chunk: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return chunk if dtype is None else chunk.to(dtype)


def cross_entropy_in_chunks(logits: torch.Tensor, target: torch.Tensor, reduction: int = REDUCTIONS["mean"],
                            ignore_index: int = -100, chunks: int = 8,
                            upcast: torch.dtype | None = None) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy(logits, target, reduction=..., ignore_index=...)`` for 2-D ``logits``
    and class-index ``target``, whose log-softmax lives a chunk of ``chunks`` at a time (see the module
    docstring); ``reduction`` as ``aten.cross_entropy_loss`` codes it (:data:`REDUCTIONS`). With ``upcast``,
    that of ``logits.to(upcast)`` (``logits.float()`` before the loss, as Hugging Face's causal-LM loss does),
    each chunk cast in turn: the low-precision logits are kept, and their gradient is made in their dtype.

    Example:
        >>> logits = torch.randn(64, 1000, requires_grad=True)
        >>> target = torch.randint(0, 1000, (64,))
        >>> loss = cross_entropy_in_chunks(logits, target)
        >>> expected = torch.nn.functional.cross_entropy(logits, target)
        >>> torch.equal(loss, expected)
        True
        >>> torch.equal(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(expected, logits)[0])
        True
    """
    if isinstance(logits, torch.fx.Proxy):
        # traced again (a GraphModule pickled or symbolic_trace'd is rebuilt by tracing its code): one node, as
        # planned — traced into, it would record its chunks' ops and not their memory
        return logits.tracer.create_proxy("call_function", cross_entropy_in_chunks,
                                          (logits, target, reduction, ignore_index, chunks, upcast), {})
    device = logits.device.type
    if not _autocast_enabled(device):
        return _CrossEntropyInChunks.apply(logits, target, reduction, ignore_index, chunks, upcast)
    # autocast runs cross-entropy in float32 (its fp32 list), its input cast up whole: here a chunk at a time
    if upcast is None and logits.is_floating_point() and logits.element_size() < 4:
        upcast = torch.float32
    with torch.autocast(device, enabled=False):
        return _CrossEntropyInChunks.apply(logits, target, reduction, ignore_index, chunks, upcast)


def _autocast_enabled(device: str) -> bool:
    try:
        return torch.is_autocast_enabled(device)
    except (RuntimeError, TypeError):       # a device type autocast does not know (meta)
        return False


def upcast_by_cross_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as they are: what ``logits.to(float32)`` becomes where the one cross-entropy reading the result
    makes that cast itself, a chunk at a time (``cross_entropy_in_chunks(..., upcast=)``): the float copy of
    the logits is never whole.

    Example:
        >>> logits = torch.randn(16, 100, dtype=torch.bfloat16, requires_grad=True)
        >>> target = torch.randint(0, 100, (16,))
        >>> loss = cross_entropy_in_chunks(upcast_by_cross_entropy(logits), target, upcast=torch.float32)
        >>> torch.equal(loss, torch.nn.functional.cross_entropy(logits.float(), target))
        True
    """
    if isinstance(logits, torch.fx.Proxy):
        return logits.tracer.create_proxy("call_function", upcast_by_cross_entropy, (logits,), {})
    return logits
