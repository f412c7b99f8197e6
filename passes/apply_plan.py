"""Apply: (profiled GraphModule, a plan's :class:`~autorecompute.decisions.Rewrite`) → the module that runs it.

The rewrite passes in the planner's order, on a copy: :func:`rewrite_recompute` (the recomputed ops in
checkpointed regions, cut and remade where the plan says), :func:`rewrite_stash` (offload, compress,
rematerialize), the result wrapped in a :class:`StashedModule` when anything is stashed, then
:func:`rewrite_lean_ops` (the lean ops the plan keeps) and, unless ``bind_calls=False``,
:func:`rewrite_calls`. Decides nothing: a plan saved as JSON (``Plan.from_json(text).rewrite``) applies to a
freshly captured and profiled model without solving, and gives the module planning gave.

Example:
    >>> import torch
    >>> from autorecompute.decisions import Op, Rewrite
    >>> from autorecompute.passes.capture import capture
    >>> from autorecompute.passes.profile import profile_step
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    >>> x = torch.randn(4, 8)
    >>> gm = capture(model, (x,), {})
    >>> _ = profile_step(gm, (x,), {})
    >>> module = apply_plan(gm, Rewrite({"tanh": Op.RECOMPUTE}))
    >>> "recompute_region_0" in module.code and "recompute_region_0" not in gm.code
    True
"""
from __future__ import annotations

import torch
import torch.fx

from autorecompute.decisions import Rewrite
from autorecompute.passes.profile import step_profile
from autorecompute.passes.rewrite_calls import rewrite_calls
from autorecompute.passes.rewrite_recompute import rewrite_recompute
from autorecompute.passes.rewrite_lean_ops import rewrite_lean_ops
from autorecompute.passes.rewrite_stash import rewrite_stash
from autorecompute.problem import GRADIENT
from autorecompute.runtime.stash import StashedModule, StashRuntime


def clone_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph, sharing its parameters and buffers."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    if isinstance(output, tuple):
        output_value, _ = output
        graph.output(output_value)
    graph._codegen = gm.graph._codegen      # pytree in/out specs: immutable, shared
    clone = torch.fx.GraphModule(gm, graph)
    clone.meta = dict(gm.meta)
    return clone


def graph_module_of(module: torch.nn.Module) -> torch.fx.GraphModule:
    """The rewritten GraphModule of what :func:`apply_plan` returns (itself, or inside a StashedModule)."""
    return module.graph_module if isinstance(module, StashedModule) else module


def apply_plan(gm: torch.fx.GraphModule, rewrite: Rewrite, runtime: StashRuntime | None = None, *,
               bind_calls: bool = True) -> torch.nn.Module:
    """A new module carrying ``rewrite`` out on a copy of ``gm`` (``gm`` is left as it is; the copy shares its
    parameters and buffers): a GraphModule, or a :class:`StashedModule` around one when anything is stashed.

    Args:
        gm: the captured model, profiled (``profile_step``) for the inputs the plan is for: the regions and
            the stash nodes are placed by the profile's positions.
        rewrite: what to carry out (``plan.rewrite``, or the planner's rewrite of its decisions).
        runtime: the stash tiers, added as the submodule ``stash_runtime`` (shared by every module it is
            given to); None: a new ``StashRuntime()``, its disk tier in the system temporary directory.
            Unused when nothing is stashed.
        bind_calls: call each op through eager's binding where that dispatches the same ops
            (:func:`rewrite_calls`: the same kernels and allocations, a microsecond less per call), as the
            module a plan runs with does. False gives the planner's candidates, measured before it: each
            call keeps its ``OpOverload``.

    Raises:
        RuntimeError: ``gm`` is not profiled.
        ValueError: the plan names ops or tensors ``gm`` does not have (a plan of another model or input
            signature).
    """
    _check_applies(gm, rewrite)
    module = rewrite_recompute(clone_graph_module(gm), rewrite.words, rewrite.region_starts, rewrite.region_remakes)
    if rewrite.stash:
        module = StashedModule(rewrite_stash(module, rewrite.stash, runtime if runtime is not None else StashRuntime()))
    # after the stash rewrite, as in the planner: a single-op rematerialization of a lean op keeps the op the
    # stash rewrite finds (capture's, the one the profile measured) as an argument of its node
    rewrite_lean_ops(graph_module_of(module), lean=rewrite.lean_ops)
    if bind_calls:
        rewrite_calls(graph_module_of(module))
    return module


def _check_applies(gm: torch.fx.GraphModule, rewrite: Rewrite) -> None:
    """Fails unless ``gm`` is profiled and has every op and tensor ``rewrite`` names: the rewrite passes would
    leave an unknown op out of its region silently."""
    profile = step_profile(gm)
    ops = {node.name for node in gm.graph.nodes if node.op == "call_function"}
    missing = [op for op in rewrite.ops if op not in ops]
    tensors = [tensor for name, stashed in rewrite.stash.items() for tensor in (name, *stashed.delivers)
               if not tensor.startswith(GRADIENT)]
    missing += [name for name in tensors if name not in profile.tensors]
    missing += [name for name in rewrite.lean_ops if name not in ops]
    if missing:
        shown = ", ".join(map(repr, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"the plan names {shown}, which the captured graph does not have: it is the plan of "
                         "another model or input signature (plan it for this one, or capture the model on the "
                         "inputs the plan is for)")
