"""A softmax whose backward writes the input's gradient over the output's gradient, as Megatron's fused
softmax does.

Autograd's softmax backward holds three tensors of the attention's size at once: the probabilities it
saved, the gradient it receives and the gradient it makes — in an attention layer's backward, often the
step's peak. Each gradient element depends only on its own row's incoming gradient and probabilities, and
the kernels read a row (its sum of gradient × probability) before writing it, so the incoming gradient's
buffer can take the result: the same kernel (``_softmax_backward_data``), the same values bit for bit, one
tensor fewer.

That is only right when nothing else reads the incoming gradient. The capture pass that puts this op in a
graph (:func:`autorecompute.passes.capture`) proves it from the graph: the softmax's result reaches the loss
through one op whose backward makes a new tensor for it (a matmul, a product with a dropout mask), possibly
through views and casts to its own dtype, which hand that tensor on unchanged. At run time the gradient must
also be contiguous (not a broadcast scalar) and of the result's dtype, and no graph of the backward may be
recorded (``create_graph=True``); otherwise the backward makes a new tensor, as autograd's does.
"""
from __future__ import annotations

import torch
import torch.fx

# autograd's softmax op for ``safe`` (the ops capture replaces, and those the rewrite puts back)
AUTOGRAD_SOFTMAX = {False: torch.ops.aten.softmax.int, True: torch.ops.aten._safe_softmax.default}
_BACKWARD = torch.ops.aten._softmax_backward_data


class _SoftmaxWritingIntoItsGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, dtype: torch.dtype | None, safe: bool) -> torch.Tensor:
        result = AUTOGRAD_SOFTMAX[safe](x, dim, dtype)
        ctx.save_for_backward(result)
        ctx.dim = dim
        return result

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        result, = ctx.saved_tensors
        if grad.is_contiguous() and grad.dtype == result.dtype and not torch.is_grad_enabled():
            return _BACKWARD.out(grad, result, ctx.dim, result.dtype, grad_input=grad), None, None, None
        return _BACKWARD.default(grad, result, ctx.dim, result.dtype), None, None, None


def softmax_backward_in_place(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None,
                              safe: bool = False) -> torch.Tensor:
    """``torch.softmax(x, dim, dtype)`` (``aten._safe_softmax`` when ``safe``: fully masked rows give 0),
    whose backward overwrites the incoming gradient with the input's. Only for an ``x`` of the result's dtype,
    whose result's gradient nothing else reads (see the module docstring).

    Example:
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> w = torch.randn(8, 3)
        >>> softmax_backward_in_place(x, -1).matmul(w).sum().backward()
        >>> expected, = torch.autograd.grad(torch.softmax(x, -1).matmul(w).sum(), x)
        >>> torch.equal(x.grad, expected)
        True
    """
    if isinstance(x, torch.fx.Proxy):
        # traced again (a GraphModule pickled or symbolic_trace'd is rebuilt by tracing its code): one node, as
        # planned — traced into, it would record autograd's softmax and lose the memory the plan counts on
        return x.tracer.create_proxy("call_function", softmax_backward_in_place, (x, dim, dtype, safe), {})
    return _SoftmaxWritingIntoItsGradient.apply(x, dim, dtype, safe)
