"""Capture: ``torch.export`` (non-strict, training IR) → a differentiable GraphModule.

The GraphModule shares the model's Parameters and buffers (same objects). Two clean-ups make it plannable:
assertion nodes and the input guard are dropped (autorecompute keys plans on the input signature itself),
and in-place ops on an activation that nothing else reads are made out-of-place, so that recomputing a
region never replays a mutation of its own input. In-place updates of buffers (BatchNorm's
``num_batches_tracked``) stay as they are.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from autorecompute.errors import CaptureError

_DROPPED_TARGETS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


def capture(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    """Exports ``model`` for ``(args, kwargs)`` and returns a plannable GraphModule.

    Example:
        >>> gm = capture(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),), {})
        >>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
        ['linear.default', 'relu.default']

    Raises:
        CaptureError: when ``torch.export`` cannot trace the model; the message names the construct.
    """
    try:
        exported = torch.export.export(model, tuple(args), dict(kwargs), strict=False)
    except Exception as exc:  # export raises many types; all mean "cannot capture"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {type(exc).__name__}: {first_line}\n"
            "  Fix: make the failing construct traceable (data-dependent Python control flow on tensor values,"
            " .item(), .tolist(), or iterating a tensor are the usual causes), wrap it in a submodule you run"
            " outside autorecompute, or apply autorecompute.compile to a traceable submodule instead.") from exc
    gm = exported.module()
    _share_state_with(gm, model)
    _drop_guards_and_asserts(gm)
    _functionalize_activation_mutations(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def _share_state_with(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Points every get_attr at the model's own Parameter / buffer object (export normally already does)."""
    originals = dict(model.named_parameters(remove_duplicate=False))
    originals.update(model.named_buffers(remove_duplicate=False))
    for node in gm.graph.find_nodes(op="get_attr"):
        original = originals.get(node.target)
        if original is None:
            continue
        owner_path, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if getattr(owner, attr) is not original:
            if isinstance(original, torch.nn.Parameter):
                owner.register_parameter(attr, original)
            else:
                owner.register_buffer(attr, original)


def _drop_guards_and_asserts(gm: torch.fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        is_guard = node.op == "call_module" and node.target == "_guards_fn"
        if (is_guard or (node.op == "call_function" and node.target in _DROPPED_TARGETS)) and not node.users:
            gm.graph.erase_node(node)


def is_mutating(node: torch.fx.Node) -> bool:
    """Whether ``node`` writes into one of its arguments (``add_``, ``relu_``, ``copy_``...)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _functionalize_activation_mutations(gm: torch.fx.GraphModule) -> None:
    """``relu_(x)`` → ``relu(x)`` when ``x`` is an activation read by nothing else.

    Export tracks the tensor object, so every later use already refers to the in-place node's output; with
    ``x`` having no other user, the out-of-place op computes the same values.
    """
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not is_mutating(node) or not node.args:
            continue
        target_arg = node.args[0]
        if not isinstance(target_arg, torch.fx.Node) or target_arg.op != "call_function":
            continue
        if len(target_arg.users) != 1 or target_arg.target is operator.getitem or _is_view(target_arg):
            continue
        functional = _functional_variant(node.target)
        if functional is not None:
            node.target = functional


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _functional_variant(op):
    packet_name = op._schema.name.split("::")[-1]
    if not packet_name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, packet_name[:-1], None)
    if packet is None:
        return None
    return getattr(packet, op._overloadname, None)
