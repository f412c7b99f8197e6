"""Verify under torch.compile: the peak of a plan's training step as torch.compile runs it, on meta tensors.

Under ``torch.compile`` a plan's regions reach AOTAutograd as checkpointed regions
(:class:`~autorecompute.runtime.regions.CheckpointRegion`), and its min-cut partitioner decides what the
compiled forward hands to the compiled backward: it recomputes what the regions recompute and may save other
tensors than eager autograd does around them. So a plan for torch.compile is measured on the graphs the
partitioner makes: the plan's module compiled by dynamo with ``aot_autograd`` and
``min_cut_rematerialization_partition`` (the partition inductor uses), each graph run op by op under a
:class:`~autorecompute.runtime.memory.LiveStorageTracker` (what ``aot_eager`` runs), on meta copies of the
state and inputs: no memory, no kernels, seconds of tracing.

The tracker runs inside the compiled graphs only (dynamo does not compile under a dispatch mode), and over what
the step makes outside them: the unit gradients and the caller's loss reserve at the start of backward
(``run_step(tracking=...)``).
"""
from __future__ import annotations

import torch
import torch.fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only

from autorecompute.decisions import Rewrite
from autorecompute.passes.apply_plan import apply_plan
from autorecompute.runtime.memory import LiveStorageTracker, StepMemory, resident_bytes, run_step

META = torch.device("meta")


def compiled_step_memory(gm: torch.fx.GraphModule, rewrite: Rewrite, args: tuple, kwargs: dict,
                         reserve: int | str = 0, keep_outputs: bool = True) -> StepMemory:
    """The memory of one training step of ``rewrite`` carried out on ``gm`` and compiled by ``torch.compile``
    (the partition of ``aot_autograd``; the step of :func:`~autorecompute.runtime.memory.run_step`).

    Raises:
        ValueError: the plan stashes tensors (offload, compress, rematerialize): hooks a compiled graph
            bypasses, so no plan for torch.compile has them.
        torch._dynamo.exc.Unsupported: dynamo cannot trace the module as one graph.
    """
    if rewrite.stash:
        raise ValueError(f"a plan for torch.compile stashes nothing; this one stashes {sorted(rewrite.stash)[:3]}")
    module = apply_plan(gm, rewrite, bind_calls=False)
    resident = resident_bytes(module, args, kwargs)
    _make_on_meta(module)
    memo: dict[int, torch.Tensor] = {}
    state = {name: _on_meta(t, memo) for name, t in module.named_parameters(remove_duplicate=False)}
    state.update({name: _on_meta(t, memo) for name, t in module.named_buffers(remove_duplicate=False)})
    state.update({name: _on_meta(t, memo) for name, t in _tensor_constants(module) if name not in state})
    meta_args, meta_kwargs = tree_map(lambda v: _on_meta(v, memo), (tuple(args), dict(kwargs)))
    tracker = _MetaGraphTracker(scratch_device=_device_of(module, args, kwargs))
    with _reparametrize_module(module, state, tie_weights=True), torch.enable_grad():
        compiled = torch.compile(module, backend=_tracked_backend(tracker), fullgraph=True)
        # the unit gradients and the caller's loss reserve are made outside the graphs: tracked there too
        run_step(compiled, meta_args, meta_kwargs, reserve, keep_outputs, tracking=tracker)
    return StepMemory(resident=resident, tracked_peak=tracker.peak)


def _device_of(module: torch.nn.Module, args: tuple, kwargs: dict) -> torch.device | None:
    """The device the step runs on (whose kernels' scratch the meta step counts), None on meta."""
    tensors = [*module.parameters(), *(v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor))]
    device = tensors[0].device if tensors else None
    return None if device is None or device.type == "meta" else device


def _make_on_meta(module: torch.nn.Module) -> None:
    """Points the ops of ``module``'s graphs that name a device (``ones(..., device=cpu)``: a causal mask;
    ``to(x, cpu)``) at ``meta``, where its state and inputs are measured."""
    for graph_module in module.modules():
        if not isinstance(graph_module, torch.fx.GraphModule):
            continue
        for node in graph_module.graph.nodes:
            node.args, node.kwargs = tree_map_only(torch.device, lambda _: META, (node.args, node.kwargs))
        graph_module.recompile()


def _tensor_constants(module: torch.fx.GraphModule):
    """(name, tensor) of the plain tensor attributes the graph reads (constants export lifted: a causal mask)."""
    for node in module.graph.nodes:
        if node.op == "get_attr":
            value = module.get_submodule(node.target.rpartition(".")[0]) if "." in node.target else module
            value = getattr(value, node.target.rpartition(".")[2])
            if isinstance(value, torch.Tensor):
                yield node.target, value


def _on_meta(value, memo: dict[int, torch.Tensor]):
    """A meta tensor like ``value`` (the same one for the same tensor: tied weights stay tied)."""
    if not isinstance(value, torch.Tensor):
        return value
    if id(value) not in memo:
        copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        if isinstance(value, torch.nn.Parameter):
            copy = torch.nn.Parameter(copy, requires_grad=value.requires_grad)
        elif value.requires_grad:
            copy.requires_grad_(True)
        if value.is_leaf and value.grad is not None:
            copy.grad = _on_meta(value.grad, memo)
        memo[id(value)] = copy
    return memo[id(value)]


class _MetaGraphTracker(LiveStorageTracker):
    """A :class:`LiveStorageTracker` that runs the RNG-state wrappers of a recomputed random op (which have no
    meta kernel) as the op itself, beside a generator state's bytes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

        if func is run_and_save_rng_state:
            return super().__torch_dispatch__(_saving_rng_state, types, args, kwargs)
        if func is run_with_rng_state:
            return super().__torch_dispatch__(_with_rng_state, types, args, kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _saving_rng_state(op, *args, **kwargs):
    return torch.empty_like(torch.get_rng_state(), device="meta"), op(*args, **kwargs)


def _with_rng_state(rng_state, op, *args, **kwargs):
    return op(*args, **kwargs)


def _tracked_backend(tracker: LiveStorageTracker):
    """``aot_autograd`` with torch.compile's default partition, each graph run op by op (``aot_eager``)
    with ``tracker`` active."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def graph_compiler(gm: torch.fx.GraphModule, example_inputs):
        # aot_eager's: the boxed graph takes the list and frees each input after its last use, as a compiled
        # backward frees the saved tensors
        compiled = boxed_nop(gm, example_inputs)

        def run(args: list):
            with tracker:
                return compiled(args)
        run._boxed_call = True
        return run

    return aot_autograd(fw_compiler=graph_compiler, bw_compiler=graph_compiler,
                        partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True)
