"""Rewrite: (GraphModule, the softmaxes a plan writes in place) → each other softmax back on autograd's backward.

Capture gives every softmax whose gradient is its own a backward written into that gradient
(:func:`~autorecompute.runtime.softmax.softmax_backward_in_place`; the profile, hence the plan, counts that
memory). Where a plan fits its budget without it, autograd's own backward is the faster one: it is called
from C++, where the in-place one costs a Python ``autograd.Function`` (~35 µs a softmax on a CPU). Decides
nothing: the planner measures both and names the softmaxes to keep in place (``Plan.softmax_in_place``).
Works on the GraphModule and on the region bodies inside it; applying it again with other names switches
them back.
"""
from __future__ import annotations

from typing import Collection

import torch
import torch.fx

from autorecompute.passes.meta import has_softmax_in_place_mark, softmax_in_place_safe
from autorecompute.runtime.softmax import AUTOGRAD_SOFTMAX, softmax_backward_in_place



def softmax_in_place_nodes(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the softmaxes capture made ``softmax_backward_in_place`` (in ``gm`` and its region bodies),
    whichever backward they run now."""
    return sorted({node.name for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
                   for node in module.graph.nodes if _is_softmax(node)})


def rewrite_softmax(gm: torch.fx.GraphModule, in_place: Collection[str]) -> torch.fx.GraphModule:
    """``gm`` with the softmaxes named in ``in_place`` written in place and the others autograd's; in place.

    Example:
        >>> from autorecompute.passes.capture import capture
        >>> class Attention(torch.nn.Module):
        ...     def forward(self, x):
        ...         return torch.softmax(x @ x.transpose(1, 2), -1) @ x
        >>> gm = capture(Attention(), (torch.randn(2, 4, 8),), {})
        >>> softmax_in_place_nodes(gm)
        ['softmax']
        >>> [str(n.target) for n in rewrite_softmax(gm, ()).graph.nodes if n.name == "softmax"]
        ['aten.softmax.int']
    """
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            if not _is_softmax(node):
                continue
            safe = softmax_in_place_safe(node)
            x, dim, dtype = node.args[:3]
            target, args = (softmax_backward_in_place, (x, dim, dtype, safe)) if node.name in in_place \
                else (AUTOGRAD_SOFTMAX[safe], (x, dim, dtype))
            if node.target is not target:
                node.target, node.args, changed = target, args, True
        if changed:
            module.recompile()
    return gm


def _is_softmax(node: torch.fx.Node) -> bool:
    """A softmax capture wrote in place (the mark alone is not enough: a region's output copies its op's meta)."""
    return has_softmax_in_place_mark(node) and node.op == "call_function" and \
        (node.target is softmax_backward_in_place or node.target in AUTOGRAD_SOFTMAX.values())
