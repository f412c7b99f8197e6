"""Profile: one fake training step of the captured graph, annotating every node.

For each ``call_function`` node, ``node.meta`` gets a :class:`~.profile_records.NodeInfo`: its forward
position, the FLOPs it runs (``FlopCounterMode``), the tensors (storages) it creates and reads, the tensors
autograd saves for its backward — observed through saved-tensor hooks, not read from a table — and the
position at which its backward runs. ``gm.meta`` gets the :class:`~.profile_records.StepProfile`: every
activation tensor with its lifetime, and the measured memory at each forward node and each backward event,
which calibrates the memory model. Read them with :func:`~.meta.node_info` and :func:`~.meta.step_profile`.
"""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
from torch.fx._pytree import tree_flatten_spec
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from autorecompute.passes.fake import fake_step
from autorecompute.passes.meta import node_info, set_node_info, set_step_profile, step_profile
from autorecompute.passes.profile_records import NodeInfo, StepProfile, TensorInfo
from autorecompute.runtime import workspaces
from autorecompute.runtime.memory import (LiveStorageTracker, device_bytes_outside, hold_reserve,
                                          output_tensors_for_backward, step_state, tensor_bytes)

# imported from here by autorecompute/planner.py, passes/rewrite_stash.py and passes/apply_plan.py
__all__ = ["profile_step", "module_path", "node_info", "step_profile", "NodeInfo", "StepProfile", "TensorInfo"]


def module_path(node: torch.fx.Node) -> str:
    """Dotted path of the innermost module that produced ``node`` (from ``nn_module_stack``)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.replace("L['self'].", "").replace("L__self__.", "") if isinstance(path, str) else ""


@dataclass
class _TensorDraft:
    """A :class:`TensorInfo` while forward runs: its lifetime, savers and readers grow node by node."""

    name: str
    owner: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    birth: int
    last_forward_use: int
    savers: list[str] = field(default_factory=list)
    readers: list[str] = field(default_factory=list)
    is_output: bool = False

    def info(self) -> TensorInfo:
        return TensorInfo(name=self.name, owner=self.owner, nbytes=self.nbytes, shape=self.shape, dtype=self.dtype,
                          birth=self.birth, last_forward_use=self.last_forward_use, savers=self.savers,
                          readers=self.readers, is_output=self.is_output)


class _Profiler(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, tracker: LiveStorageTracker, static_keys: set[int]):
        super().__init__(gm, garbage_collect_values=True)
        # a value nothing reads (``copy_``'s result: a view of the tensor it wrote into) goes at once, as in the
        # GraphModule's own code; the Interpreter frees values at their last use only, and would keep such a
        # view, and the storage under it, to the end of the step
        for node in self.graph.nodes:
            if not node.users and node.op != "output":
                self.user_to_last_uses.setdefault(node, []).append(node)
        self.tracker = tracker
        self.static_keys = static_keys
        self.owner_of_key: dict[int, str] = {}      # live storage → tensor name
        self.tensors: dict[str, _TensorDraft] = {}
        self.values_of: dict[str, list[str]] = {}   # node name → tensor names of its value
        self.infos: dict[str, NodeInfo] = {}        # backward events not yet in: see ``backward_event_of``
        self.backward_event_of: dict[str, int] = {}
        self.current: str | None = None
        self.position = -1
        self.pending_saves: list[tuple[str, Any, torch.Tensor]] = []
        self.static_saved: dict[str, int] = {}
        self.grad_fn_owner: dict[int, str] = {}     # id of a grad_fn (while alive) → the node that made it
        self.shares_backward: dict[str, str] = {}   # node whose output is its input's → that input's maker
        self.order: list[str] = []
        self.forward_peaks: list[int] = []
        self.backward_events: list[str] = []
        self.backward_peaks: list[int] = []
        self.backward_starts: list[int] = []  # tracked bytes as each backward event starts (before its op runs)
        self.first_segment_peak = 0          # memory before the first backward event (the seed gradients)
        self.counter: FlopCounterMode | None = None
        self.flops_at_last_pack = 0
        # handles of the backward-event hooks and the storages' finalizers, removed after the step: an autograd
        # node or a storage the step leaves alive would keep the profiler (and ``gm``) through them
        self.hooks: list = []
        self.finalizers: list[weakref.finalize] = []

    # saved-tensor hook: records which storage the running node asks autograd to keep
    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.current is not None:
            self.flops_at_last_pack = self.counter.get_total_flops()
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self.static_keys:
                self.static_saved[self.current] = self.static_saved.get(self.current, 0) + storage.nbytes()
            else:
                self.pending_saves.append((self.current, storage, tensor))
        return tensor

    def _forget(self, key: int) -> None:
        self.owner_of_key.pop(key, None)

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function":
            out = super().run_node(n)
            if n.op == "placeholder" or n.op == "get_attr":
                self.values_of[n.name] = []
            return out
        self.position += 1
        self.current = n.name
        self.order.append(n.name)
        self.pending_saves = []
        self.tracker.reset_window_peak()
        flops_before = self.flops_at_last_pack = self.counter.get_total_flops()
        # the inputs' autograd nodes before the op runs (an in-place op replaces its input's)
        input_grad_fns = [t.grad_fn for t in tree_flatten([self.env.get(a) for a in n.all_input_nodes])[0]
                          if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        out = super().run_node(n)
        flops = self.counter.get_total_flops() - flops_before
        forward_peak = self.tracker.reset_window_peak()
        self.current = None

        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        created = self._record_created(n, flat_out)
        reads = self._record_reads(n)
        saves = self._record_saves(n, created)
        self._hook_backward(n, flat_out, input_grad_fns)
        self.infos[n.name] = NodeInfo(
            position=self.position, flops=int(flops), creates=created, reads=reads,
            saves=saves, saves_static_bytes=self.static_saved.get(n.name, 0), backward_event=None,
            forward_peak=forward_peak, module_path=module_path(n),
            flops_before_last_save=int(self.flops_at_last_pack - flops_before))
        self.forward_peaks.append(forward_peak)
        return out

    def _new_tensor(self, name: str, owner: str, storage, t: torch.Tensor, birth: int) -> None:
        """Names ``storage`` ``name`` while it lives."""
        key = storage._cdata
        self.owner_of_key[key] = name
        self.finalizers.append(weakref.finalize(storage, self._forget, key))
        self.tensors[name] = _TensorDraft(
            name=name, owner=owner, nbytes=storage.nbytes(), shape=tuple(t.shape),
            dtype=str(t.dtype).replace("torch.", ""), birth=birth, last_forward_use=self.position)

    def _record_created(self, n: torch.fx.Node, flat_out: list[torch.Tensor]) -> list[str]:
        """The storages ``n``'s value allocates, named; a getitem's are its tuple producer's (it allocated them),
        so they are added to the producer's ``creates`` and ``n`` creates none."""
        created, value_tensors = [], []
        for i, t in enumerate(flat_out):
            storage = t.untyped_storage()
            name = self.owner_of_key.get(storage._cdata)
            if name is None and storage._cdata not in self.static_keys:
                name = n.name if len(flat_out) == 1 else f"{n.name}[{i}]"
                owner = n.name
                if n.target is operator.getitem:   # the tuple's producer allocated it
                    name, owner = n.name, n.args[0].name
                self._new_tensor(name, owner, storage, t,
                                 self.infos[owner].position if owner in self.infos else self.position)
                created.append(name)
            if name is not None:
                value_tensors.append(name)
        self.values_of[n.name] = value_tensors
        if n.target is operator.getitem and n.args[0].name in self.infos:
            producer = self.infos[n.args[0].name]
            self.infos[n.args[0].name] = replace(producer, creates=[*producer.creates, *created])
            return []
        return created

    def _record_reads(self, n: torch.fx.Node) -> list[str]:
        """The activation tensors ``n`` reads, each then read last at this position."""
        reads = sorted({name for arg in n.all_input_nodes for name in self.values_of.get(arg.name, [])})
        for name in reads:
            draft = self.tensors[name]
            draft.last_forward_use = self.position
            if n.name not in draft.readers:
                draft.readers.append(n.name)
        return reads

    def _record_saves(self, n: torch.fx.Node, created: list[str]) -> list[str]:
        """The activation tensors autograd kept for ``n``'s backward; one the op made internally (a dropout
        mask) is named here and added to ``created``."""
        saves = []
        for node_name, storage, t in self.pending_saves:
            name = self.owner_of_key.get(storage._cdata)
            if name is None:   # a tensor the op made internally and kept for backward (a dropout mask)
                name = f"{n.name}.saved{len(created)}"
                self._new_tensor(name, n.name, storage, t, self.position)
                created.append(name)
            if name not in saves:
                saves.append(name)
                self.tensors[name].savers.append(node_name)
        self.pending_saves = []
        return saves

    def _hook_backward(self, n: torch.fx.Node, flat_out: list[torch.Tensor], input_grad_fns: list) -> None:
        """A hook that opens ``n``'s backward event when its autograd node runs."""
        grad_fn = flat_out[0].grad_fn if flat_out else None
        if grad_fn is not None and any(grad_fn is g for g in input_grad_fns):
            # the op returned its input (``.to`` its own dtype, dropout with p=0): it has no backward of its
            # own, and a second hook on the same grad_fn would open an empty event before the real one, so
            # the real one's memory would be booked at a position where the model no longer holds its inputs
            if id(grad_fn) in self.grad_fn_owner:   # (not when made outside the graph: an input's)
                self.shares_backward[n.name] = self.grad_fn_owner[id(grad_fn)]
        elif grad_fn is not None:
            self.grad_fn_owner[id(grad_fn)] = n.name
            self.hooks.append(grad_fn.register_prehook(self._on_backward(n.name)))

    def _on_backward(self, name: str):
        def hook(grad_outputs):
            self.backward_starts.append(self.tracker.current)
            peak = self.tracker.reset_window_peak()
            if self.backward_events:
                self.backward_peaks.append(peak)
            else:
                self.first_segment_peak = peak
            self.backward_event_of[name] = len(self.backward_events)
            self.backward_events.append(name)
        return hook

    def node_infos(self) -> dict[str, NodeInfo]:
        """Every node's record, its backward event in (a node that returned its input: its maker's)."""
        events = dict(self.backward_event_of)
        for name, maker in self.shares_backward.items():
            events[name] = events.get(maker)
        return {name: replace(info, backward_event=events[name]) if events.get(name) is not None else info
                for name, info in self.infos.items()}


def profile_step(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, loss_reserve: int | str = 0,
                 keep_outputs: bool = True) -> StepProfile:
    """Runs one fake forward + backward of ``gm`` and annotates it (see module docstring).

    ``args``/``kwargs`` are the real (or meta) example inputs; nothing real is allocated, except on a CUDA
    device the first time an op signature is met: its kernel's workspace is then measured there
    (:mod:`autorecompute.runtime.workspaces`) and the step profiled again with it. ``loss_reserve`` bytes
    (``"auto"``: sized from the outputs, :func:`~autorecompute.runtime.memory.loss_reserve_bytes`) are held
    beside the outputs' gradients as backward starts, as the caller's loss holds them; the outputs backward does
    not start from are held through it when ``keep_outputs`` (``run_step``).
    """
    return workspaces.with_workspaces(lambda: _profile_once(gm, args, kwargs, loss_reserve, keep_outputs))


def _profile_once(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, loss_reserve: int | str,
                  keep_outputs: bool) -> StepProfile:
    resident, parameter_grad_bytes = _resident(gm, args, kwargs)
    with fake_step(gm, args, kwargs) as (fake_args, fake_kwargs):
        flat_args = tree_flatten_spec((list(fake_args), fake_kwargs), gm._in_spec) \
            if getattr(gm, "_in_spec", None) is not None else list(fake_args)
        static = [*gm.parameters(), *gm.buffers(), *flat_args]
        static_keys = {t.untyped_storage()._cdata for t in static if isinstance(t, torch.Tensor)}
        tracker = LiveStorageTracker()
        profiler = _Profiler(gm, tracker, static_keys)
        with tracker:
            outputs, grads_of = _run_forward(profiler, flat_args)
            if not keep_outputs:
                outputs = None      # the caller drops what backward does not start from
            reserved = _run_backward(grads_of, loss_reserve)
            del grads_of, outputs
            _close_backward(profiler, tracker)
    infos = profiler.node_infos()
    for node in gm.graph.nodes:
        if node.name in infos:
            set_node_info(node, infos[node.name])
    profile = StepProfile(
        resident=resident, tensors={name: draft.info() for name, draft in profiler.tensors.items()},
        order=profiler.order, forward_peaks=profiler.forward_peaks, backward_events=profiler.backward_events,
        backward_peaks=profiler.backward_peaks, backward_starts=profiler.backward_starts,
        parameter_grad_bytes=parameter_grad_bytes,
        tracked_peak=tracker.peak, loss_reserve=reserved)
    set_step_profile(gm, profile)
    return profile


def _resident(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> tuple[dict[str, int], int]:
    """(the bytes on the device before the step, by kind; the bytes of the parameter gradients it makes)."""
    params = list(gm.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    resident = {
        "parameters": tensor_bytes(params),
        "buffers": tensor_bytes(list(gm.buffers())),
        "inputs": tensor_bytes([args, kwargs]),
        "gradients": tensor_bytes(grads),
    }
    units = gm.meta.get("sharded_units", ())
    if units:       # FSDP2: this rank's shards (the full parameters are gathered in the step, played there)
        resident["parameter shards"] = sum(unit.shard_bytes for unit in units)
        resident["gradient shards"] = sum(unit.held_gradient_bytes() for unit in units)
    other = device_bytes_outside(step_state(gm, args, kwargs))
    if other:       # CUDA only: workspaces, optimizer state, other tensors, the allocator's slack
        resident["other on device"] = other
    return resident, tensor_bytes([p for p in params if p.requires_grad and p.grad is None])


def _run_forward(profiler: _Profiler, flat_args: list) -> tuple[Any, list[torch.Tensor]]:
    """Runs the forward, marks its outputs, and returns them with those backward starts from."""
    # one FLOP counter for the whole forward: each node reads the difference it made
    with torch.autograd.graph.saved_tensors_hooks(profiler.pack, lambda t: t), \
            FlopCounterMode(display=False) as profiler.counter:
        outputs = profiler.run(*flat_args)
    profiler.env.clear()    # (it holds the output node's value: the outputs' lifetime is the caller's)
    for t in tree_flatten(outputs)[0]:
        name = profiler.owner_of_key.get(t.untyped_storage()._cdata) if isinstance(t, torch.Tensor) else None
        if name is not None:
            profiler.tensors[name].is_output = True
            profiler.tensors[name].last_forward_use = profiler.position
    return outputs, output_tensors_for_backward(outputs)


def _run_backward(grads_of: list[torch.Tensor], loss_reserve: int | str) -> int:
    """Runs backward from ``grads_of`` with unit gradients, holding the loss's reserve; returns its bytes."""
    if not grads_of:
        return 0
    seeds = [torch.ones_like(t) for t in grads_of]
    reserved = hold_reserve(grads_of, loss_reserve)
    torch.autograd.backward(grads_of, seeds)
    return reserved


def _close_backward(profiler: _Profiler, tracker: LiveStorageTracker) -> None:
    """Removes the step's hooks and finalizers and books the last backward event's peak (the first event's
    includes what came before it: the seed gradients)."""
    for handle in profiler.hooks:
        handle.remove()
    for finalizer in profiler.finalizers:
        finalizer.detach()
    last = tracker.reset_window_peak()
    if profiler.backward_events:
        profiler.backward_peaks.append(last)
        profiler.backward_peaks[0] = max(profiler.backward_peaks[0], profiler.first_segment_peak)
