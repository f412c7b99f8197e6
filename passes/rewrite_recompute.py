"""Rewrite: (GraphModule, decisions) → GraphModule whose recomputed ops run in checkpointed regions.

Decides nothing: regions are the maximal runs of ops the plan marks ``"recompute"`` (a ``getitem`` of a
region op joins its region; buffer updates that read no activation stay outside and run just before it).
Each region becomes a submodule ``recompute_region_<k>`` (a :class:`CheckpointRegion` around a small
GraphModule), so ``gm.code`` shows the boundaries and ``print(gm.recompute_region_0.body.code)`` the body.
"""
from __future__ import annotations

import operator
from typing import Collection, Mapping

import torch
import torch.fx

from autorecompute.passes.graph_facts import device_of, draws_random_numbers
from autorecompute.passes.meta import mark_region, mark_source, source_op
from autorecompute.runtime.regions import BATCH_NORM, CheckpointRegion, RemakingRegion, batch_norm_once



def copy_replaying(graph: torch.fx.Graph, node: torch.fx.Node, arg_transform, recomputing) -> torch.fx.Node:
    """``graph.node_copy(node, arg_transform)``, with BatchNorm run as ``batch_norm_once(recomputing, ...)``:
    a region body (``recomputing`` its placeholder) and a rematerialization recipe (``True``) run it again
    without updating its running statistics a second time."""
    copied = graph.node_copy(node, arg_transform)
    if node.target is BATCH_NORM:
        copied.target = batch_norm_once
        copied.args = (recomputing, *copied.args)
    return copied


def find_regions(graph: torch.fx.Graph, decisions: Mapping[str, str],
                 starts: Collection[str] = ()) -> list[list[torch.fx.Node]]:
    """Runs of nodes marked ``"recompute"`` in graph order (the plan's regions): maximal, except that a
    node in ``starts`` begins a new one."""
    from autorecompute.passes.build_problem import is_transparent

    regions: list[list[torch.fx.Node]] = []
    current: list[torch.fx.Node] = []
    members: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "call_function" and decisions.get(node.name) == "recompute":
            if node.name in starts and current:
                regions.append(current)
                current, members = [], set()
            current.append(node)
            members.add(node)
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in members:
            current.append(node)
            members.add(node)
        elif node.op == "call_function" and current and _is_hoistable(node, members, is_transparent):
            continue
        elif current:
            regions.append(current)
            current, members = [], set()
    if current:
        regions.append(current)
    return regions


def _is_hoistable(node: torch.fx.Node, members: set, is_transparent) -> bool:
    try:
        transparent = is_transparent(node)
    except RuntimeError:     # not profiled: be safe and end the region
        return False
    return transparent and not any(arg in members for arg in node.all_input_nodes)


def rewrite_recompute(gm: torch.fx.GraphModule, decisions: Mapping[str, str],
                      starts: Collection[str] = (), remakes: Collection[str] = ()) -> torch.fx.GraphModule:
    """Rewrites ``gm`` in place (and returns it) so that ops marked ``"recompute"`` are recomputed in backward,
    each run of them in one checkpointed region (a new one from each op in ``starts``, the plan's
    ``region_starts``). A region that begins with an op in ``remakes`` (the plan's ``region_remakes``, also
    in ``starts``) makes what it reads from the region before it again when it is recomputed, from that
    region's inputs, instead of holding it (a :class:`RemakingRegion`).

    Raises:
        ValueError: a region in ``remakes`` would make its inputs again by running a random or
            state-updating op of the region before (the memory model never plans one: ``Problem.unremakeable``).

    Example:
        >>> import torch.fx
        >>> gm = torch.fx.symbolic_trace(lambda x: torch.tanh(torch.sin(x)) * 2)
        >>> gm = rewrite_recompute(gm, {"sin": "recompute", "tanh": "recompute"})
        >>> print(gm.code.strip().splitlines()[1].strip())
        recompute_region_0 = self.recompute_region_0(x);  x = None
    """
    regions = find_regions(gm.graph, decisions, starts)
    # last first: a region that remakes its inputs reads the nodes of the region before it, outlined after it
    for k in reversed(range(len(regions))):
        before = regions[k - 1] if k and regions[k][0].name in remakes else None
        _outline(gm, regions[k], f"recompute_region_{k}", before)
    gm.graph.lint()
    gm.recompile()
    return gm


def _inputs(region: list[torch.fx.Node]) -> list[torch.fx.Node]:
    members = set(region)
    inputs: list[torch.fx.Node] = []
    for node in region:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in inputs:
                inputs.append(arg)
    return inputs


def _needed(nodes: list[torch.fx.Node], outputs: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The nodes of ``nodes`` (a region, in graph order) that ``outputs`` are made from."""
    members, needed = set(nodes), set(outputs)
    for node in reversed(nodes):
        if node in needed:
            needed.update(arg for arg in node.all_input_nodes if arg in members)
    return [node for node in nodes if node in needed]


def _body(nodes: list[torch.fx.Node], inputs: list[torch.fx.Node], outputs: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """A GraphModule ``(recomputing, *inputs) -> tuple(outputs)`` running ``nodes``."""
    body = torch.fx.Graph()
    recomputing = body.placeholder("recomputing")
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for arg in inputs:
        env[arg] = body.placeholder(arg.name)
        env[arg].meta = dict(arg.meta)
    for node in nodes:
        env[node] = copy_replaying(body, node, env.__getitem__, recomputing)
    body.output(tuple(env[node] for node in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), body, class_name="RegionBody")


def _outline(gm: torch.fx.GraphModule, region: list[torch.fx.Node], name: str,
             before: list[torch.fx.Node] | None = None) -> None:
    members = set(region)
    inputs = _inputs(region)
    outputs = [node for node in region if any(user not in members for user in node.users)]
    body_module = _body(region, inputs, outputs)
    device = device_of(region)
    preserve_rng = any(draws_random_numbers(n) for n in region) and device not in (None, "meta")
    # the tensors the region before makes, made again from that region's inputs (the ops they need)
    made_before = set(before or ())
    remade = [i for i, arg in enumerate(inputs) if arg in made_before]
    if not remade:
        gm.add_submodule(name, CheckpointRegion(body_module, preserve_rng_state=preserve_rng))
        call_args = tuple(inputs)
    else:
        needed = _needed(before, [inputs[i] for i in remade])
        # made again without its own RNG state or a second state update, they would differ from forward's
        from autorecompute.passes.build_problem import unreplayable
        unrepeatable = [node.name for node in needed if draws_random_numbers(node) or unreplayable(node)]
        if unrepeatable:
            raise ValueError(f"{name} ({region[0].name} ...) makes its inputs again from the region before it, "
                             f"which runs {unrepeatable}: random or state-updating ops cannot run a third time "
                             "alike (plan and graph disagree: drop it from the plan's region_remakes)")
        before_inputs = _inputs(needed)
        remake = _body(needed, before_inputs, [inputs[i] for i in remade])
        gm.add_submodule(name, RemakingRegion(body_module, remake, len(before_inputs), tuple(remade),
                                              preserve_rng_state=preserve_rng))
        call_args = (*before_inputs, *inputs)

    with gm.graph.inserting_after(region[-1]):
        call = gm.graph.call_module(name, call_args)
    mark_region(call, [node.name for node in region])
    replacements = []
    with gm.graph.inserting_after(call):
        for i, node in enumerate(outputs):
            replacements.append((node, gm.graph.call_function(operator.getitem, (call, i))))
    for node, item in replacements:
        item.meta = dict(node.meta)
        mark_source(item, source_op(node))
        node.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
    for node in reversed(region):
        gm.graph.erase_node(node)
