"""Rewrite: (GraphModule, the lean ops a plan keeps) → each other op capture made lean back on autograd's form.

Capture makes some ops lean — the same values for less memory, at a small price in time: each softmax whose
gradient is its own gets a backward written into that gradient
(:func:`~autorecompute.runtime.softmax.softmax_backward_in_place`), each cross-entropy over class indices
a log-softmax made a chunk at a time (:func:`~autorecompute.runtime.cross_entropy.cross_entropy_in_chunks`).
The profile, hence the plan, counts their memory. Where a plan fits its budget without them, autograd's forms are
the faster ones: called from C++ where the lean ones cost a Python ``autograd.Function`` (~35 µs a softmax on a
CPU), and without the cross-entropy's second log-softmax. Decides nothing: the planner measures both and names the
ops to keep lean (``Plan.lean_ops``). Works on the GraphModule and on the region bodies inside it; applying it
again with other names switches them back.
"""
from __future__ import annotations

from typing import Collection

import torch
import torch.fx

from autorecompute.passes.meta import is_lean_op, lean_op


def lean_op_nodes(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the ops capture made lean (in ``gm`` and its region bodies), whichever form they have now."""
    return sorted({node.name for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
                   for node in module.graph.nodes if is_lean_op(node)})


def rewrite_lean_ops(gm: torch.fx.GraphModule, lean: Collection[str]) -> torch.fx.GraphModule:
    """``gm`` with the ops named in ``lean`` in their lean form and the others in autograd's; in place.

    Example:
        >>> from autorecompute.passes.capture import capture
        >>> class Attention(torch.nn.Module):
        ...     def forward(self, x):
        ...         return torch.softmax(x @ x.transpose(1, 2), -1) @ x
        >>> gm = capture(Attention(), (torch.randn(2, 4, 8),), {})
        >>> lean_op_nodes(gm)
        ['softmax']
        >>> [str(n.target) for n in rewrite_lean_ops(gm, ()).graph.nodes if n.name == "softmax"]
        ['aten.softmax.int']
    """
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            if not is_lean_op(node):
                continue
            forms = lean_op(node)
            inputs = node.args[:forms.inputs]
            target, args = (forms.lean, inputs + forms.lean_constants) if node.name in lean \
                else (forms.autograd, inputs + forms.autograd_constants)
            if node.target is not target or node.args != args:
                node.target, node.args, changed = target, args, True
        if changed:
            module.recompile()
    return gm
