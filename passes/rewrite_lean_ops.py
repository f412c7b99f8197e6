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
    _check_together(gm, lean)
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            if is_lean_op(node):
                changed |= _switch(node, node.name in lean)
        if changed:
            module.recompile()
    return gm


def _switch(node: torch.fx.Node, lean: bool) -> bool:
    """``node`` in its lean form or autograd's; whether it changed."""
    forms = lean_op(node)
    inputs = node.args[:forms.inputs]
    target, args, kwargs = (forms.lean, inputs + forms.lean_constants, {}) if lean \
        else (forms.autograd, inputs + forms.autograd_constants, dict(forms.autograd_keywords))
    if node.target is target and node.args == args and node.kwargs == kwargs:
        return False
    node.target, node.args, node.kwargs = target, args, kwargs
    return True


def _check_together(gm: torch.fx.GraphModule, lean: Collection[str]) -> None:
    """Fails where an op named lean is lean only with another that is not (its values would change)."""
    for module in gm.modules():
        for node in module.graph.nodes if isinstance(module, torch.fx.GraphModule) else ():
            if is_lean_op(node) and node.name in lean and lean_op(node).lean_with not in ("", *lean):
                raise ValueError(f"{node.name!r} ({lean_op(node).kind}) is lean only together with "
                                 f"{lean_op(node).lean_with!r}, which is not named lean: name both or neither")
