"""Rewrite: (GraphModule, stash decisions) → GraphModule whose saved activations are offloaded, compressed or
rematerialized.

Runs after :func:`~autorecompute.passes.rewrite_recompute.rewrite_recompute` and decides nothing: for each
activation the plan stashes it inserts, in the outer graph (see ``runtime/stash.py`` for what they do),

* ``stash_offload`` / ``stash_compress`` (the cast) / ``stash_rematerialize`` (the recipe: the op and its
  inputs) right after the value is made, and ``stash_rng_state`` right before it when the op is random,
* ``stash_gradient`` after a parameter whose gradient is offloaded from its accumulation to the end of
  backward,
* ``stash_delivered`` right after a value a chain rematerialization makes again on its way (its handle goes
  to that rematerialization's ``stash_rematerialize`` node, whose recipe returns both),
* ``stash_watch`` before the node that makes it (saves until its stash node are taken over),
* ``stash_hooks_on`` / ``stash_hooks_off`` around every kept op that saves it: saved-tensor hooks run
  only there (and between ``stash_watch`` and the stash node, and in a stash scope),
* ``stash_release`` right after the node that holds its last forward use,
* ``stash_prefetch`` (offload only) after the value whose backward is the first at or after the plan's
  prefetch point — the copy back starts when backward gets there.

Tensors an op saves for its backward without returning them (a dropout mask, a reshaped matmul operand;
named ``<op>.saved<k>`` by the profile) are stashed by ``stash_scope_begin`` / ``stash_scope_end`` around
that op instead of the first two nodes.

The nodes call into a :class:`~autorecompute.runtime.stash.StashRuntime` submodule ``stash_runtime``, so
``print(gm.code)`` shows every offload, prefetch and cast.
"""
from __future__ import annotations

import logging
from typing import Mapping

import torch
import torch.fx

from autorecompute.passes.build_problem import is_random
from autorecompute.passes.profile import NodeInfo, step_profile
from autorecompute.passes.rewrite_recompute import REGION_MEMBERS, SOURCE, copy_replaying
from autorecompute.problem import GRADIENT
from autorecompute.runtime.regions import BATCH_NORM, RUNNING_STATISTICS
from autorecompute.runtime.stash import (StashRuntime, stash_compress, stash_offload, stash_prefetch,
                                         stash_delivered, stash_gradient, stash_release, stash_rematerialize, stash_rng_state,
                                         stash_scope_begin,
                                         stash_scope_end, stash_hooks_off, stash_hooks_on, stash_watch)

RUNTIME = "stash_runtime"
log = logging.getLogger("autorecompute")


def _visible_view(outer: list[torch.fx.Node], name: str) -> torch.fx.Node | None:
    """An outer value that is a view of tensor ``name`` (same storage), when ``name`` itself is not one."""
    for node in outer:
        info = _info(node)
        # a region output that allocates nothing is an alias: mutating ops are never recomputed
        alias = getattr(node.target, "is_view", False) or SOURCE in node.meta
        if info is not None and not info.creates and name in info.reads and alias:
            return node
    return None


def _info(node: torch.fx.Node) -> NodeInfo | None:
    info = node.meta.get("autorecompute")
    return info if isinstance(info, NodeInfo) else None


def _recipe_module(chain: list[torch.fx.Node], delivers: list[torch.fx.Node] = ()
                   ) -> tuple[torch.fx.GraphModule, list[torch.fx.Node], tuple[int, ...]]:
    """The ops of a rematerialization recipe as a GraphModule over its bases (the inputs it reads that it
    does not make), those bases, and the positions among them of BatchNorm's running statistics (whose
    later in-place updates do not matter to the recipe). It returns its last op's value, or that and the
    values of ``delivers`` (a chain rematerialization). BatchNorm runs as in a recomputed region: without
    updating its running statistics a second time."""
    graph, env, bases = torch.fx.Graph(), {}, []
    members = set(chain)
    statistics = set()
    for node in chain:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in env:
                env[arg] = graph.placeholder(f"base_{len(bases)}")
                bases.append(arg)
        env[node] = copy_replaying(graph, node, env.__getitem__, True)
        if node.target is BATCH_NORM:
            statistics.update(node.args[i] for i in RUNNING_STATISTICS if i < len(node.args))
    graph.output((env[chain[-1]], *[env[node] for node in delivers]) if delivers else env[chain[-1]])
    unchecked = tuple(i for i, base in enumerate(bases) if base in statistics)
    return torch.fx.GraphModule(torch.nn.Module(), graph), bases, unchecked


def rewrite_stash(gm: torch.fx.GraphModule, stash: Mapping[str, str], prefetch_at: Mapping[str, int],
                  runtime: StashRuntime, recipes: Mapping[str, tuple[str, ...]] | None = None,
                  delivers: Mapping[str, tuple[str, ...]] | None = None) -> torch.fx.GraphModule:
    """Rewrites ``gm`` in place (and returns it) so the activations in ``stash`` are stashed as the plan says.

    Args:
        stash: tensor name → ``"offload"``, ``"offload:late"``, ``"compress:<dtype>"``, ``"rematerialize"``,
            ``"rematerialize:chain"`` or ``"rematerialize:through"`` (the plan's choices).
        prefetch_at: tensor name → backward event from which an offloaded tensor may be back on the device.
        runtime: the tiers; added as the submodule ``stash_runtime``.
        recipes: rematerialized tensor → the ops its recipe runs again (default: its own op alone); a
            longer recipe, or BatchNorm alone, becomes the submodule ``remat_<tensor>``.
        delivers: chain-rematerialized tensor → the saved tensors its recipe makes again on its way; each
            gets a ``stash_delivered`` node, whose handle the recipe's ``stash_rematerialize`` node takes.
    """
    if not stash:
        return gm
    profile = step_profile(gm)
    order = {name: i for i, name in enumerate(profile.order)}
    graph = gm.graph
    outer = [n for n in graph.nodes if n.op in ("call_function", "call_module")]
    value_of: dict[str, torch.fx.Node] = {}       # original node name → outer node carrying its value
    runs_at: dict[int, torch.fx.Node] = {}        # forward position → outer node that runs it
    for node in outer:
        value_of[node.meta.get(SOURCE, node.name)] = node
        for member in node.meta.get(REGION_MEMBERS, [node.meta.get(SOURCE, node.name)]):
            if member in order:
                runs_at.setdefault(order[member], node)
    triggers = sorted(((info.backward_event, node) for node in outer
                       if (info := _info(node)) is not None and info.backward_event is not None
                       and isinstance(node.meta.get("val"), torch.Tensor)), key=lambda e: e[0])
    position = {node: i for i, node in enumerate(graph.nodes)}

    gm.add_submodule(RUNTIME, runtime)
    first = next(iter(n for n in graph.nodes if n.op not in ("placeholder",)))
    with graph.inserting_before(first):
        runtime_node = graph.get_attr(RUNTIME)
    def prefetch(name: str, handle: torch.fx.Node, value: torch.fx.Node, *extra) -> None:
        if stash.get(name) != "offload" or name not in prefetch_at:
            return
        trigger = next((node for event, node in triggers if event >= prefetch_at[name]), None)
        if trigger is not None:
            after = trigger if position.get(trigger, -1) > position.get(value, -1) else handle
            with graph.inserting_after(after):
                graph.call_function(stash_prefetch, (handle, trigger, *extra))

    internal_by_op: dict[str, list[str]] = {}
    for name in stash:
        if ".saved" in name:
            internal_by_op.setdefault(profile.tensors[name].owner, []).append(name)
    for op, names in internal_by_op.items():
        node = value_of.get(op)
        info = _info(node) if node is not None else None
        if info is None:
            raise ValueError(f"op {op!r} of stashed tensors {names} is not in the graph (plan and graph disagree)")
        internal = tuple(c for c in info.creates if ".saved" in c)
        inputs = tuple(arg for arg in node.all_input_nodes)
        with graph.inserting_before(node):
            begin = graph.call_function(stash_scope_begin, (runtime_node, *inputs))
        begin.name = f"stash_scope_{node.name}"
        with graph.inserting_after(node):
            end = graph.call_function(stash_scope_end, (runtime_node, begin, node, internal,
                                                        {n: stash[n] for n in names}))
        end.name = f"stashed_{node.name}"
        for name in names:
            prefetch(name, end, node, name)

    read = {node.target: node for node in graph.find_nodes(op="get_attr")}
    for name in [n for n in stash if n.startswith(GRADIENT)]:
        param = read.get(name[len(GRADIENT):])
        if param is None:
            raise ValueError(f"the gradient {name!r} is offloaded but no parameter {name[len(GRADIENT):]!r} is read "
                             "(plan and graph disagree)")
        with graph.inserting_after(param):
            graph.call_function(stash_gradient, (runtime_node, param, name))
    stash = {name: action for name, action in stash.items() if not name.startswith(GRADIENT)}
    delivers = {name: tuple(made) for name, made in (delivers or {}).items() if name in stash}
    made_by = {made: name for name, tensors in delivers.items() for made in tensors}
    actions = {**stash, **{made: "delivered" for made in made_by}}
    handles: dict[str, torch.fx.Node] = {}
    savers: set[torch.fx.Node] = set()
    for name in sorted((n for n in actions if ".saved" not in n), key=lambda n: profile.tensors[n].birth):
        action = actions[name]
        remade = action.startswith("rematerialize") or action == "delivered"
        value = value_of.get(name) or _visible_view(outer, name)
        tensor = profile.tensors[name]
        if value is None and name in made_by:
            raise ValueError(f"{name!r} is made again by the recipe of {made_by[name]!r} but is not a value of "
                             "the outer graph (plan and graph disagree)")
        if value is None:
            # made and viewed inside a recomputed region: no outer value shares its storage, so it stays
            # on the device (the verification measures that; the planner tightens if it matters)
            log.debug("stash of %s skipped: no value of the outer graph holds its storage", name)
            continue
        if remade and (value.op != "call_function" or value.name != name):
            raise ValueError(f"{name!r} is rematerialized but its op is not a node of the outer graph "
                             "(plan and graph disagree: the op must be kept)")
        producer = runs_at.get(tensor.birth, value)
        if position.get(producer, -1) > position.get(value, -1):
            producer = value
        with graph.inserting_before(producer):
            graph.call_function(stash_watch, (runtime_node,))
        rng = None
        if remade and action != "delivered" and is_random(value):
            with graph.inserting_before(value):
                rng = graph.call_function(stash_rng_state, (str(value.meta["val"].device),))
            rng.name = f"rng_state_{value.name}"
        recipe = (recipes or {}).get(name, (name,))
        # a longer recipe, or BatchNorm (run as batch_norm_once: not an op the graph can pass as a value),
        # becomes a GraphModule of its own
        if remade and action != "delivered" and (len(recipe) > 1 or value.target is BATCH_NORM):
            chain = [value_of.get(op) for op in recipe]
            if any(node is None or node.name != op for node, op in zip(chain, recipe)):
                raise ValueError(f"the recipe {recipe} of {name!r} has ops outside the outer graph (plan and "
                                 "graph disagree: its ops must be kept)")
            module, bases, unchecked = _recipe_module(chain, [value_of[made] for made in delivers.get(name, ())])
            gm.add_submodule(f"remat_{value.name}", module)
            with graph.inserting_before(value):
                op, args, kwargs = graph.get_attr(f"remat_{value.name}"), tuple(bases), {}
        else:
            op, args, kwargs, unchecked = value.target, value.args, value.kwargs, ()
        with graph.inserting_after(value):
            if action == "delivered":
                handle = graph.call_function(stash_delivered, (runtime_node, value, name))
            elif remade:
                made = tuple(handles[m] for m in delivers.get(name, ()))
                handle = graph.call_function(stash_rematerialize, (runtime_node, value, name, op, args, kwargs,
                                                                   rng, made, unchecked))
            elif action.startswith("offload"):
                handle = graph.call_function(stash_offload, (runtime_node, value, name))
            else:
                handle = graph.call_function(stash_compress, (runtime_node, value, name, action.split(":", 1)[1]))
        handle.name = f"{action.split(':')[0]}_{value.name}"   # offload_x, compress_x, rematerialize_x, delivered_x
        handles[name] = handle
        last_use = runs_at.get(tensor.last_forward_use, value)
        after = last_use if position.get(last_use, -1) > position.get(value, -1) else handle
        with graph.inserting_after(after):
            graph.call_function(stash_release, (runtime_node, handle))
        prefetch(name, handle, value)
        savers.update(value_of[s] for s in tensor.savers if s in value_of and value_of[s].name == s)
    for saver in sorted(savers, key=position.__getitem__):   # autograd saves stashed tensors through hooks only here
        with graph.inserting_before(saver):
            graph.call_function(stash_hooks_on, (runtime_node,))
        with graph.inserting_after(saver):
            graph.call_function(stash_hooks_off, (runtime_node, saver))
    graph.lint()
    gm.recompile()
    return gm
