"""Capture clean-up: attention that PyTorch runs as its math composite, split into the ops that composite runs.

As one node, ``scaled_dot_product_attention``'s backward holds every tensor it saved at once (the attention
probabilities, the dropout mask and the masked probabilities); as ops, each can be kept, recomputed or
rematerialized on its own — what ``torch.compile``'s partitioner sees too. A call that runs a fused kernel
(flash / memory-efficient attention) stays one node: there is nothing to split.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from autorecompute.passes.autocast import callers_autocast

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_INHERITED_META = ("nn_module_stack", "stack_trace", "source_fn_stack")


def inline_math_attention(gm: torch.fx.GraphModule) -> None:
    """Each ``scaled_dot_product_attention`` node that dispatches to PyTorch's math composite on its device (on
    a CPU: with dropout) becomes the ops that composite runs, traced by ``make_fx`` below autograd: the same
    kernels, the same random numbers, the same gradients. In place.

    Under ``torch.autocast`` every call stays one node: eager runs the composite below autocast (its matmuls
    in the dtype the autocast kernel chose), while inlined ops would each be cast by autocast again when the
    graph runs, and their gradients would differ from eager's."""
    if callers_autocast():
        return
    for node in list(gm.graph.find_nodes(op="call_function", target=_SDPA)):
        tensors, constants = _sdpa_call(node)
        if tensors is None:
            continue
        names = list(tensors)

        def attention(*values):
            return _SDPA(**dict(zip(names, values)), **constants)

        try:
            sub = make_fx(attention, tracing_mode="fake")(*[_example(tensors[n].meta["val"]) for n in names])
        except Exception:  # noqa: BLE001  (a call make_fx cannot trace stays one node: still correct)
            continue
        if any(n.target is _SDPA or "attention" in str(n.target) for n in sub.graph.nodes if n.op == "call_function"):
            continue      # a fused kernel: one op, nothing to split
        _inline(gm, node, sub, [tensors[n] for n in names])


def _sdpa_call(node: torch.fx.Node) -> tuple[dict | None, dict]:
    """(tensor arguments by name, the other arguments) of an SDPA node, or (None, {}) when not plannable."""
    bound = dict(zip(_SDPA_ARGUMENTS, node.args))
    bound.update(node.kwargs)
    tensors = {k: v for k, v in bound.items() if isinstance(v, torch.fx.Node)}
    constants = {k: v for k, v in bound.items() if not isinstance(v, torch.fx.Node)}
    values = [t.meta.get("val") for t in tensors.values()]
    if not all(isinstance(v, torch.Tensor) and v.device.type != "meta" for v in values):
        return None, {}
    return tensors, constants


def _example(value: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor with ``value``'s metadata: make_fx only reads shapes, strides and devices."""
    example = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device=value.device)
    return example.requires_grad_(value.requires_grad)


def _inline(gm: torch.fx.GraphModule, node: torch.fx.Node, sub: torch.fx.GraphModule,
            inputs: list[torch.fx.Node]) -> None:
    """Replaces ``node`` by the graph of ``sub`` (its placeholders bound to ``inputs``); the copied ops keep
    ``node``'s module path and stack trace, so they are grouped and reported where the call was."""
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = iter(inputs)
    inherited = {key: node.meta[key] for key in _INHERITED_META if key in node.meta}
    result = None
    with gm.graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                result = torch.fx.map_arg(n.args[0], env.__getitem__)
            else:
                copied = gm.graph.node_copy(n, env.__getitem__)
                copied.meta.update(inherited)
                env[n] = copied
    if isinstance(result, (tuple, list)):
        result = result[0]
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)
