"""Capture clean-up: export's input guard and its assertion nodes out of the graph.

autorecompute keys each plan on the input signature itself, so the guard that re-checks it at every call
and the assertions on shapes and scalars add nothing but nodes for the planner to step over.
"""
from __future__ import annotations

import torch
import torch.fx

_DROPPED_TARGETS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


def drop_guards_and_asserts(gm: torch.fx.GraphModule) -> None:
    """Erases the ``_guards_fn`` call and the assertion nodes nothing reads, in place."""
    for node in list(gm.graph.nodes):
        is_guard = node.op == "call_module" and node.target == "_guards_fn"
        if (is_guard or (node.op == "call_function" and node.target in _DROPPED_TARGETS)) and not node.users:
            gm.graph.erase_node(node)
