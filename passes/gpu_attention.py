"""Capture clean-up: attention on the ``meta`` device runs the fused kernel a GPU would run.

A model on ``meta`` is planned for a CUDA GPU (the device such models are built on ``meta`` for). There
``scaled_dot_product_attention`` runs a fused kernel — flash attention or memory-efficient attention — whose
backward holds the output and a float32 logsumexp (batch × heads × tokens), where the math composite the
``meta`` device falls back to holds the attention matrix and its softmax (tokens² per head). Each such node
calls :func:`attention_as_a_gpu_runs_it` instead, which runs on ``meta`` the fused ATen op the GPU's
dispatcher picks: its saved tensors, outputs and FLOPs are the GPU's. The node keeps its name, so a plan
made on ``meta`` applies to a capture of the real model, where the node is PyTorch's own call.
"""
from __future__ import annotations

import torch
import torch.fx

_aten = torch.ops.aten
_SDPA = _aten.scaled_dot_product_attention.default
_HALF = (torch.float16, torch.bfloat16)
FLASH_HEAD_DIM = 256       # the largest head the flash kernel takes (sm80 and later)


def gpu_kernel(query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None) -> str:
    """The kernel a CUDA GPU (sm80 or later) runs for these arguments, in its dispatcher's order: "flash"
    (half precision, no mask, heads ≤ 256 wide in multiples of 8), "efficient" (no grouped heads), "math".

    Example:
        >>> q = torch.empty(1, 8, 1024, 64, dtype=torch.bfloat16, device="meta")
        >>> gpu_kernel(q, q, None), gpu_kernel(q.float(), q.float(), None)
        ('flash', 'efficient')
    """
    head = query.shape[-1]
    grouped = query.dim() == 4 and key.shape[-3] != query.shape[-3]
    if query.dtype in _HALF and attn_mask is None and head <= FLASH_HEAD_DIM and head % 8 == 0:
        return "flash"
    if query.dtype in (*_HALF, torch.float32) and not grouped and query.dim() == 4:
        return "efficient"
    return "math"


def attention_as_a_gpu_runs_it(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                               scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` as the fused kernel a GPU picks (:func:`gpu_kernel`), on any device
    whose tensors hold no data (``meta``, fake tensors): what the kernel allocates, saves and computes."""
    kernel = gpu_kernel(query, key, attn_mask)
    if kernel == "flash":
        return _aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                         scale=scale)[0]
    if kernel == "efficient":
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # as SDPA does before the kernel: a boolean mask becomes an additive bias in the query's dtype
            attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
        compute_logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return _aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, compute_logsumexp,
                                                             dropout_p, is_causal, scale=scale)[0]
    return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def size_attention_as_a_gpu_runs_it(gm: torch.fx.GraphModule) -> int:
    """Each ``scaled_dot_product_attention`` node on ``meta`` tensors calls :func:`attention_as_a_gpu_runs_it`;
    returns how many. In place.

    Example:
        >>> class Attend(torch.nn.Module):
        ...     def forward(self, q):
        ...         return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        >>> q = torch.empty(1, 2, 16, 8, device="meta")
        >>> gm = torch.export.export(Attend(), (q,)).module()
        >>> size_attention_as_a_gpu_runs_it(gm)
        1
    """
    nodes = [n for n in gm.graph.find_nodes(op="call_function", target=_SDPA) if _on_meta(n)]
    for node in nodes:
        node.target = attention_as_a_gpu_runs_it
    if nodes:
        gm.recompile()
    return len(nodes)


def _on_meta(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.device.type == "meta"
