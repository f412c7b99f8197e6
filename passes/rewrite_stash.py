"""Rewrite: (GraphModule, a plan's stash records) → GraphModule whose saved activations are offloaded, compressed or
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
* ``stash_prefetch`` (plain ``offload`` only) after the value whose backward is the first at or after the plan's
  prefetch point — the copy back starts when backward gets there.

Tensors an op saves for its backward without returning them (a dropout mask, a reshaped matmul operand;
named ``<op>.saved<k>`` by the profile) are stashed by ``stash_scope_begin`` / ``stash_scope_end`` around
that op instead of the first two nodes.

The nodes call into a :class:`~autorecompute.runtime.stash.StashRuntime` submodule ``stash_runtime``, so
``print(gm.code)`` shows every offload, prefetch and cast.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.fx

from autorecompute.decisions import Action, ActionKind, Stashed
from autorecompute.passes.build_problem import is_random
from autorecompute.passes.profile import StepProfile, step_profile
from autorecompute.passes.meta import STASH_RUNTIME, is_region_output, node_info_if_profiled, ops_run_by, source_op
from autorecompute.passes.rewrite_recompute import copy_replaying
from autorecompute.problem import GRADIENT
from autorecompute.runtime.regions import BATCH_NORM, RUNNING_STATISTICS
from autorecompute.runtime.stash import (StashRuntime, stash_compress, stash_delivered, stash_gradient,
                                         stash_hooks_off, stash_hooks_on, stash_offload, stash_prefetch,
                                         stash_release, stash_rematerialize, stash_rng_state, stash_scope_begin,
                                         stash_scope_end, stash_watch)

log = logging.getLogger("autorecompute")
_OFFLOAD = Action(ActionKind.OFFLOAD)      # prefetched from its event (``offload:late`` comes back at first use)


@dataclass
class _Outer:
    """The outer graph as the rewrite reads it, taken before any stash node goes in (``position`` is the
    order of the original nodes: a stash node has none)."""

    gm: torch.fx.GraphModule
    profile: StepProfile
    values: list[torch.fx.Node]                 # the outer call nodes
    value_of: dict[str, torch.fx.Node]          # original node name → outer node carrying its value
    runs_at: dict[int, torch.fx.Node]           # forward position → outer node that runs it
    triggers: list[tuple[int, torch.fx.Node]]   # (backward event, a tensor value whose backward it is), sorted
    position: dict[torch.fx.Node, int]
    runtime: torch.fx.Node | None = None        # the ``get_attr`` of ``stash_runtime``

    @property
    def graph(self) -> torch.fx.Graph:
        return self.gm.graph

    def later(self, node: torch.fx.Node, than: torch.fx.Node) -> bool:
        return self.position.get(node, -1) > self.position.get(than, -1)


def _read_outer(gm: torch.fx.GraphModule, runtime: StashRuntime) -> _Outer:
    """The outer graph's values, then ``runtime`` added as ``stash_runtime`` and read before the first op."""
    profile = step_profile(gm)
    order = {name: i for i, name in enumerate(profile.order)}
    graph = gm.graph
    values = [n for n in graph.nodes if n.op in ("call_function", "call_module")]
    value_of: dict[str, torch.fx.Node] = {}
    runs_at: dict[int, torch.fx.Node] = {}
    for node in values:
        value_of[source_op(node)] = node
        for member in ops_run_by(node):
            if member in order:
                runs_at.setdefault(order[member], node)
    triggers = sorted(((info.backward_event, node) for node in values
                       if (info := node_info_if_profiled(node)) is not None and info.backward_event is not None
                       and isinstance(node.meta.get("val"), torch.Tensor)), key=lambda e: e[0])
    outer = _Outer(gm, profile, values, value_of, runs_at, triggers,
                   {node: i for i, node in enumerate(graph.nodes)})
    gm.add_submodule(STASH_RUNTIME, runtime)
    first = next(iter(n for n in graph.nodes if n.op not in ("placeholder",)))
    with graph.inserting_before(first):
        outer.runtime = graph.get_attr(STASH_RUNTIME)
    return outer


def _visible_view(outer: list[torch.fx.Node], name: str) -> torch.fx.Node | None:
    """An outer value that is a view of tensor ``name`` (same storage), when ``name`` itself is not one."""
    for node in outer:
        info = node_info_if_profiled(node)
        # a region output that allocates nothing is an alias: mutating ops are never recomputed
        alias = getattr(node.target, "is_view", False) or is_region_output(node)
        if info is not None and not info.creates and name in info.reads and alias:
            return node
    return None


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


def rewrite_stash(gm: torch.fx.GraphModule, stash: Mapping[str, Stashed], runtime: StashRuntime
                  ) -> torch.fx.GraphModule:
    """Rewrites ``gm`` in place (and returns it) so the activations in ``stash`` are stashed as the plan says.

    Args:
        gm: a profiled GraphModule (``profile_step``), its recomputed regions already outlined.
        stash: tensor name → how it is stashed (a plan's :attr:`~autorecompute.decisions.Rewrite.stash`):
            its action; for a plain ``offload`` the backward event from which it is prefetched; for a
            rematerialization the ops its recipe runs again (none: its own op alone; a longer recipe, or
            BatchNorm alone, becomes the submodule ``remat_<tensor>``) and, for ``rematerialize:chain``, the
            saved tensors the recipe makes again on its way (each gets a ``stash_delivered`` node, whose handle
            the recipe's ``stash_rematerialize`` node takes; they are not keys of ``stash``).
        runtime: the tiers; added as the submodule ``stash_runtime``.
    """
    if not stash:
        return gm
    outer = _read_outer(gm, runtime)
    _stash_internal(outer, {name: stashed for name, stashed in stash.items() if ".saved" in name})
    _stash_gradients(outer, [name for name in stash if name.startswith(GRADIENT)])
    savers = _stash_values(outer, {name: s for name, s in stash.items() if not name.startswith(GRADIENT)})
    # autograd saves stashed tensors through the hooks only around these ops
    for saver in sorted(savers, key=outer.position.__getitem__):
        with gm.graph.inserting_before(saver):
            gm.graph.call_function(stash_hooks_on, (outer.runtime,))
        with gm.graph.inserting_after(saver):
            gm.graph.call_function(stash_hooks_off, (outer.runtime, saver))
    gm.graph.lint()
    gm.recompile()
    return gm


def _prefetch(outer: _Outer, stashed: Stashed, handle: torch.fx.Node, value: torch.fx.Node, *extra) -> None:
    """``stash_prefetch`` of a plainly offloaded tensor after the first value whose backward comes at or
    after its prefetch event (after its handle when that value is made before it)."""
    if stashed.action != _OFFLOAD:
        return
    trigger = next((node for event, node in outer.triggers if event >= stashed.prefetch_event), None)
    if trigger is not None:
        with outer.graph.inserting_after(trigger if outer.later(trigger, value) else handle):
            outer.graph.call_function(stash_prefetch, (handle, trigger, *extra))


def _stash_internal(outer: _Outer, stash: Mapping[str, Stashed]) -> None:
    """A stash scope around each op whose internal saved tensors (``<op>.saved<k>``) are stashed."""
    by_op: dict[str, list[str]] = {}
    for name in stash:
        by_op.setdefault(outer.profile.tensors[name].owner, []).append(name)
    graph = outer.graph
    for op, names in by_op.items():
        node = outer.value_of.get(op)
        info = node_info_if_profiled(node) if node is not None else None
        if info is None:
            raise ValueError(f"op {op!r} of stashed tensors {names} is not in the graph (plan and graph disagree)")
        internal = tuple(c for c in info.creates if ".saved" in c)
        with graph.inserting_before(node):
            begin = graph.call_function(stash_scope_begin, (outer.runtime, *node.all_input_nodes))
        begin.name = f"stash_scope_{node.name}"
        with graph.inserting_after(node):
            # action names: what the generated code can print
            end = graph.call_function(stash_scope_end, (outer.runtime, begin, node, internal,
                                                        {n: str(stash[n].action) for n in names}))
        end.name = f"stashed_{node.name}"
        for name in names:
            _prefetch(outer, stash[name], end, node, name)


def _stash_gradients(outer: _Outer, names: list[str]) -> None:
    """``stash_gradient`` after the read of each parameter whose gradient is offloaded."""
    read = {node.target: node for node in outer.graph.find_nodes(op="get_attr")}
    for name in names:
        param = read.get(name[len(GRADIENT):])
        if param is None:
            raise ValueError(f"the gradient {name!r} is offloaded but no parameter {name[len(GRADIENT):]!r} is read "
                             "(plan and graph disagree)")
        with outer.graph.inserting_after(param):
            outer.graph.call_function(stash_gradient, (outer.runtime, param, name))


def _stash_values(outer: _Outer, stash: Mapping[str, Stashed]) -> set[torch.fx.Node]:
    """The stash nodes of every stashed tensor an outer value holds, and of those chain rematerializations
    make again, in the order they are made; returns the kept ops that save them."""
    made_by = {made: name for name, stashed in stash.items() for made in stashed.delivers}
    entries: dict[str, Stashed | None] = {**stash, **dict.fromkeys(made_by)}    # None: made again by a chain
    handles: dict[str, torch.fx.Node] = {}
    savers: set[torch.fx.Node] = set()
    tensors = outer.profile.tensors
    for name in sorted((n for n in entries if ".saved" not in n), key=lambda n: tensors[n].birth):
        stashed = entries[name]
        value = outer.value_of.get(name) or _visible_view(outer.values, name)
        if value is None and name in made_by:
            raise ValueError(f"{name!r} is made again by the recipe of {made_by[name]!r} but is not a value of "
                             "the outer graph (plan and graph disagree)")
        if value is None:
            # made and viewed inside a recomputed region: no outer value shares its storage, so it stays
            # on the device (the verification measures that; the planner tightens if it matters)
            log.debug("stash of %s skipped: no value of the outer graph holds its storage", name)
            continue
        handles[name] = _stash_value(outer, name, stashed, value, handles)
        savers.update(outer.value_of[s] for s in tensors[name].savers
                      if s in outer.value_of and outer.value_of[s].name == s)
    return savers


def _stash_value(outer: _Outer, name: str, stashed: Stashed | None, value: torch.fx.Node,
                 handles: Mapping[str, torch.fx.Node]) -> torch.fx.Node:
    """Watch, handle, release and prefetch nodes of tensor ``name`` (held by ``value``); returns the handle.
    ``stashed`` None: a chain rematerialization makes it again."""
    remade = stashed is None or stashed.action.kind is ActionKind.REMATERIALIZE
    if remade and (value.op != "call_function" or value.name != name):
        raise ValueError(f"{name!r} is rematerialized but its op is not a node of the outer graph "
                         "(plan and graph disagree: the op must be kept)")
    tensor, graph = outer.profile.tensors[name], outer.graph
    producer = outer.runs_at.get(tensor.birth, value)
    with graph.inserting_before(value if outer.later(producer, value) else producer):
        graph.call_function(stash_watch, (outer.runtime,))
    if stashed is None:
        with graph.inserting_after(value):
            handle = graph.call_function(stash_delivered, (outer.runtime, value, name))
    elif remade:
        handle = _rematerialize(outer, name, stashed, value, handles)
    else:
        with graph.inserting_after(value):
            handle = graph.call_function(stash_offload, (outer.runtime, value, name)) \
                if stashed.action.kind is ActionKind.OFFLOAD else \
                graph.call_function(stash_compress, (outer.runtime, value, name, stashed.action.variant))
    # offload_x, compress_x, rematerialize_x, delivered_x
    handle.name = f"{'delivered' if stashed is None else stashed.action.kind.value}_{value.name}"
    last_use = outer.runs_at.get(tensor.last_forward_use, value)
    with graph.inserting_after(last_use if outer.later(last_use, value) else handle):
        graph.call_function(stash_release, (outer.runtime, handle))
    if stashed is not None:
        _prefetch(outer, stashed, handle, value)
    return handle


def _rematerialize(outer: _Outer, name: str, stashed: Stashed, value: torch.fx.Node,
                   handles: Mapping[str, torch.fx.Node]) -> torch.fx.Node:
    """The ``stash_rematerialize`` node of ``value`` (and the RNG state before it when its op is random)."""
    graph, rng = outer.graph, None
    if is_random(value):
        with graph.inserting_before(value):
            rng = graph.call_function(stash_rng_state, (str(value.meta["val"].device),))
        rng.name = f"rng_state_{value.name}"
    recipe = stashed.recipe or (name,)
    # a longer recipe, or BatchNorm (run as batch_norm_once: not an op the graph can pass as a value),
    # becomes a GraphModule of its own
    if len(recipe) > 1 or value.target is BATCH_NORM:
        chain = [outer.value_of.get(op) for op in recipe]
        if any(node is None or node.name != op for node, op in zip(chain, recipe)):
            raise ValueError(f"the recipe {recipe} of {name!r} has ops outside the outer graph (plan and "
                             "graph disagree: its ops must be kept)")
        module, bases, unchecked = _recipe_module(chain, [outer.value_of[made] for made in stashed.delivers])
        outer.gm.add_submodule(f"remat_{value.name}", module)
        with graph.inserting_before(value):
            op, args, kwargs = graph.get_attr(f"remat_{value.name}"), tuple(bases), {}
    else:
        op, args, kwargs, unchecked = value.target, value.args, value.kwargs, ()
    made = tuple(handles[m] for m in stashed.delivers)
    with graph.inserting_after(value):
        return graph.call_function(stash_rematerialize, (outer.runtime, value, name, op, args, kwargs,
                                                         rng, made, unchecked))
