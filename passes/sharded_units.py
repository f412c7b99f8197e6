"""Capture of a ``fully_shard``-ed model (FSDP2): its math captured around the DTensor shards, each sharded
module's run of ops bracketed by FSDP2's own calls (:mod:`autorecompute.runtime.sharded`).

Before export each sharded parameter is replaced on its module by a storage-less placeholder of the full
shape (what FSDP2's all-gathered parameter is between steps: a tensor whose storage is freed), so the graph
is the model's math on full parameters and nothing is gathered to capture it. After export,
:func:`bracket_sharded_units` reads each of those parameters through ``ShardedUnit.parameter`` and brackets each
sharded module's run of ops by ``ShardedUnit.enter`` / ``ShardedUnit.exit``: run on real tensors they are FSDP2's
pre-forward and post-forward, on fake ones its memory on this rank.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Iterator

import torch
import torch.fx

from autorecompute.errors import CaptureError
# (is_sharded_call: read from here by the passes too)
from autorecompute.runtime.sharded import SharedComm, ShardedUnit, is_sharded_call  # noqa: F401


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) has sharded ``model`` or one of its submodules."""
    module_type = _fsdp_module_type()
    return module_type is not None and any(isinstance(m, module_type) for m in model.modules())


def _fsdp_module_type():
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule
    return FSDPModule


def sharded_units(model: torch.nn.Module) -> list[ShardedUnit]:
    """The model's ``fully_shard``-ed modules, outermost first (FSDP2's root state initialized, as its first
    forward would). Empty for a model FSDP2 has not sharded.

    Raises:
        CaptureError: a sharding autorecompute does not plan yet (mixed precision, CPU offload, hybrid or
            tensor-parallel meshes, grouped modules), with the fix.
    """
    module_type = _fsdp_module_type()
    if module_type is None:
        return []
    found = [(path, m) for path, m in model.named_modules() if isinstance(m, module_type)]
    if not found:
        return []
    outside = [path for path, _ in found[1:] if not _contains(found[0][0], path)]
    if outside:
        raise CaptureError(
            f"the fully_shard-ed {outside[0]} is not inside a sharded root module: FSDP2 then makes each such "
            "module a root of its own, which autorecompute does not plan. Fix: fully_shard the model itself too, "
            "after its blocks (as FSDP2's documentation does), then compile it")
    found[0][1]._get_fsdp_state()._lazy_init()
    units = [_unit(path, module) for path, module in found]
    comm = SharedComm(first=units[0], units=units)
    for unit in units:
        unit.comm = comm
    return units


def _contains(outer: str, inner: str) -> bool:
    return not outer or inner == outer or inner.startswith(outer + ".")


def _unit(path: str, module: torch.nn.Module) -> ShardedUnit:
    state = module._get_fsdp_state()
    group = state._fsdp_param_group
    _refuse_unsupported(path, state, group)
    params = list(group.fsdp_params) if group is not None else []
    world = group.mesh_info.shard_mesh_size if group is not None else 1
    gathered = sum(p.padded_sharded_param_size.numel() * world * _run_dtype(p).itemsize for p in params)
    shard = sum(p._sharded_param_data.untyped_storage().nbytes() for p in params)
    reshards = group is not None and group.post_forward_mesh_info is not None
    gloo = group is not None and torch.distributed.get_backend(group.mesh_info.shard_process_group) == "gloo"
    unit = ShardedUnit(module=module, path=path, gathered_bytes=gathered, shard_bytes=shard,
                       reshards_after_forward=reshards, scatter_scratch_bytes=gathered if gloo else 0)
    unit.accumulates = unit.held_gradient_bytes() > 0
    return unit


def _run_dtype(fsdp_param) -> torch.dtype:
    return fsdp_param.param_dtype or fsdp_param.orig_dtype


def _refuse_unsupported(path: str, state, group) -> None:
    name = path or "the root module"
    fix = ("Fix: shard with fully_shard(module) over a 1-D mesh, FSDP2's defaults otherwise, or plan the model "
           "before sharding and shard the compiled module (fully_shard(autorecompute.compile(...))).")
    if len(state._modules) > 1 or len(state._fsdp_param_groups) > 1:
        raise CaptureError(f"{name} is sharded as a group of modules or of parameter groups, which autorecompute "
                           f"does not plan yet. {fix}")
    if state._states_to_forward_prefetch or state._states_to_backward_prefetch:
        raise CaptureError(f"{name} has explicit prefetches (set_modules_to_forward/backward_prefetch), which "
                           f"autorecompute does not plan yet. {fix}")
    if group is None:
        return
    settings = {"set_requires_gradient_sync(False)": not group.reduce_grads,
                "set_reshard_after_backward(False)": not group.reshard_after_backward,
                "reshard_after_forward=<int>": group._use_post_forward_mesh,
                "set_reduce_scatter_max_input_buffers(>1)":
                    getattr(group, "reduce_scatter_max_input_buffers", 1) != 1}
    unplanned = [setting for setting, on in settings.items() if on]
    if unplanned:
        raise CaptureError(f"{name} is sharded with {unplanned[0]}, whose memory autorecompute does not plan "
                           f"yet. {fix}")
    policy = group.mp_policy
    if policy.param_dtype is not None or policy.reduce_dtype is not None or policy.output_dtype is not None:
        raise CaptureError(f"{name} is sharded with a MixedPrecisionPolicy, which autorecompute does not plan "
                           f"yet. {fix}")
    if type(group.offload_policy).__name__ != "OffloadPolicy":
        raise CaptureError(f"{name} is sharded with CPU offload, which autorecompute does not plan yet. {fix}")
    if group.mesh_info.mesh.ndim != 1 or any(p._unsharded_dtensor_spec is not None for p in group.fsdp_params):
        raise CaptureError(f"{name} is sharded over a hybrid or tensor-parallel mesh, which autorecompute does "
                           f"not plan yet. {fix}")


@contextlib.contextmanager
def full_shape_placeholders(units: list[ShardedUnit]) -> Iterator[dict[int, tuple[ShardedUnit, int]]]:
    """Inside the block each sharded parameter's module holds a storage-less Parameter of its full shape;
    yields ``id(placeholder) → (unit, index)``. The modules get their own parameters back afterwards."""
    placeholders: dict[int, tuple[ShardedUnit, int]] = {}
    swapped = []
    for unit in units:
        for index, fsdp_param in enumerate(unit.fsdp_params):
            placeholder = _storage_less(fsdp_param)
            placeholders[id(placeholder)] = (unit, index)
            info = fsdp_param._module_info
            for module, name in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]:
                swapped.append((module, name, module._parameters[name]))
                module._parameters[name] = placeholder
    try:
        yield placeholders
    finally:
        for module, name, original in reversed(swapped):
            module._parameters[name] = original


def _storage_less(fsdp_param) -> torch.nn.Parameter:
    sharded = fsdp_param.sharded_param
    tensor = torch.empty(fsdp_param._orig_size, dtype=_run_dtype(fsdp_param), device=sharded.device)
    tensor.untyped_storage().resize_(0)
    return torch.nn.Parameter(tensor, requires_grad=sharded.requires_grad)


def bracket_sharded_units(gm: torch.fx.GraphModule, units: list[ShardedUnit],
                          placeholders: dict[int, tuple[ShardedUnit, int]]) -> None:
    """Brackets each sharded module's run of ops by ``ShardedUnit.enter`` / ``ShardedUnit.exit`` and reads its
    parameters through ``ShardedUnit.parameter`` (see the module docstring). In place; records the units in
    ``gm.meta["sharded_units"]``.

    Raises:
        CaptureError: a sharded module's ops are not one run (a module called twice, or interleaved with
            another's), which FSDP2's one gather per forward cannot serve.
    """
    if not units:
        return
    gm.meta["sharded_units"] = units
    spans = _spans(gm, units)
    for unit in sorted(spans, key=_depth):
        _bracket_entry(gm, unit, spans, placeholders)
    for unit in sorted(spans, key=_depth, reverse=True):
        _bracket_exit(gm, unit, spans)


def _depth(unit: ShardedUnit) -> int:
    return unit.path.count(".") + 1 if unit.path else 0


def _within(inner: ShardedUnit, outer: ShardedUnit) -> bool:
    return _contains(outer.path, inner.path)


def _spans(gm: torch.fx.GraphModule, units: list[ShardedUnit]) -> dict[ShardedUnit, set[torch.fx.Node]]:
    """Each unit's run of nodes: from its first op (or a nested unit's) to its last."""
    from autorecompute.passes.profile import module_path

    nodes = list(gm.graph.nodes)
    owner = {}
    for node in nodes:
        if node.op == "call_function" and node.meta.get("nn_module_stack"):
            path = module_path(node)
            inside = [u for u in units if _contains(u.path, path)]
            if inside:
                owner[node] = max(inside, key=_depth)
    spans = {}
    for unit in units:
        positions = [i for i, node in enumerate(nodes) if node in owner and _within(owner[node], unit)]
        if not positions:
            continue
        span = nodes[positions[0]:positions[-1] + 1]
        # (an op of an enclosing unit among them is served: that unit is gathered while this one runs)
        strays = [n for n in span if n in owner and not _within(owner[n], unit) and not _within(unit, owner[n])]
        if strays:
            raise CaptureError(
                f"the ops of the fully_shard-ed {unit.path or 'root module'} are not one run: "
                f"{strays[0].name} of {owner[strays[0]].path or 'the root'} runs among them (the module is called "
                "more than once in forward, or its ops interleave with another's). Fix: shard modules that "
                "run once per forward, or plan the model before sharding it")
        spans[unit] = set(span)
    return spans


def _ancestors(unit: ShardedUnit, spans: dict) -> list[ShardedUnit]:
    return [u for u in spans if u is not unit and _within(unit, u)]


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _bracket_entry(gm: torch.fx.GraphModule, unit: ShardedUnit, spans: dict, placeholders: dict) -> None:
    graph, span = gm.graph, spans[unit]
    ordered = [n for n in graph.nodes if n in span]
    # (an enclosing unit's parameters are not the module's inputs: FSDP2 passes only its arguments)
    inputs = list(dict.fromkeys(a for n in ordered for a in n.all_input_nodes
                                if a not in span and a.op != "get_attr" and not is_sharded_call(a) and _is_tensor(a)))
    attributes = [n for n in graph.find_nodes(op="get_attr")
                  if placeholders.get(id(_attribute(gm, n.target)), (None,))[0] is unit]
    for attribute in attributes:
        stray = next((user for user in attribute.users if user not in span), None)
        if stray is not None:
            raise CaptureError(
                f"{stray.name} reads {attribute.target}, a parameter of the fully_shard-ed "
                f"{unit.path or 'root module'}, outside that module's forward, where FSDP2 has not gathered it. "
                "Fix: share parameters only within one sharded module (or with the root), or plan the model "
                "before sharding it")
    with graph.inserting_before(ordered[0]):
        enter = graph.call_function(unit.enter, tuple(inputs))
        enter.meta["val"] = tuple(a.meta["val"] for a in inputs)
        items = []
        for i, a in enumerate(inputs):
            items.append(graph.call_function(operator.getitem, (enter, i)))
            items[-1].meta["val"] = a.meta["val"]
        reads = []
        for attribute in attributes:
            index = placeholders[id(_attribute(gm, attribute.target))][1]
            reads.append(graph.call_function(unit.parameter, (index, attribute)))
            reads[-1].meta["val"] = attribute.meta.get("val", _attribute(gm, attribute.target))
    for node in ordered:
        for a, item in zip(inputs, items):
            node.replace_input_with(a, item)
    for attribute, read in zip(attributes, reads):
        attribute.replace_all_uses_with(read, delete_user_cb=lambda user, read=read: user is not read)
    added = {enter, *items, *reads}
    for holder in [unit, *_ancestors(unit, spans)]:
        spans[holder] |= added


def _bracket_exit(gm: torch.fx.GraphModule, unit: ShardedUnit, spans: dict) -> None:
    graph, span = gm.graph, spans[unit]
    ordered = [n for n in graph.nodes if n in span]
    outputs = [n for n in ordered if _is_tensor(n) and any(user not in span for user in n.users)]
    with graph.inserting_after(ordered[-1]):
        leave = graph.call_function(unit.exit, tuple(outputs))
    leave.meta["val"] = tuple(o.meta["val"] for o in outputs)
    items, previous = [], leave
    for i, o in enumerate(outputs):
        with graph.inserting_after(previous):
            previous = graph.call_function(operator.getitem, (leave, i))
        previous.meta["val"] = o.meta["val"]
        items.append(previous)
    for o, item in zip(outputs, items):
        o.replace_all_uses_with(item, delete_user_cb=lambda user: user not in span and user is not leave)
    added = {leave, *items}
    for holder in [unit, *_ancestors(unit, spans)]:
        spans[holder] |= added


def _attribute(gm: torch.fx.GraphModule, target: str):
    owner_path, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    return getattr(owner, name, None)


@contextlib.contextmanager
def without_forward_hooks(units: list[ShardedUnit]) -> Iterator[None]:
    """FSDP2's forward hooks off while export traces the model (they would all-gather fake tensors); the
    hook tables come back as they were, in their order."""
    tables = [table for unit in units for table in (unit.module._forward_pre_hooks, unit.module._forward_hooks)]
    saved = [dict(table) for table in tables]
    for unit in units:
        state = unit.state
        for name, table in (("_pre_forward_hook_handle", unit.module._forward_pre_hooks),
                            ("_post_forward_hook_handle", unit.module._forward_hooks)):
            handle = getattr(state, name, None)
            if handle is not None:
                table.pop(handle.id, None)
    try:
        yield
    finally:
        for table, entries in zip(tables, saved):
            table.clear()
            table.update(entries)
