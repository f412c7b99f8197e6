"""Profile: one fake training step of the captured graph, annotating every node.

For each ``call_function`` node, ``node.meta["autorecompute"]`` gets a :class:`NodeInfo`:
its forward position, the FLOPs it runs (``FlopCounterMode``), the tensors (storages) it creates and
reads, the tensors autograd saves for its backward — observed through saved-tensor hooks, not read from a
table — and the position at which its backward runs. ``gm.meta["autorecompute"]`` gets the
:class:`StepProfile`: every activation tensor with its lifetime, and the measured memory at each forward
node and each backward event, which calibrates the memory model.
"""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from autorecompute.passes.fake import fake_step
from autorecompute.runtime import workspaces
from autorecompute.runtime.memory import (LiveStorageTracker, device_bytes_outside, hold_reserve,
                                          output_tensors_for_backward, step_state, tensor_bytes)

META_KEY = "autorecompute"


@dataclass
class TensorInfo:
    """One activation storage created during forward."""

    name: str                 # the first graph value that is this tensor (producer or its getitem)
    owner: str                # the op node that allocates it (the node whose recomputation drops it)
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    birth: int                # forward position of ``owner``
    last_forward_use: int     # last forward position that reads it (graph outputs: the last position)
    savers: list[str] = field(default_factory=list)     # op nodes whose backward saved it
    readers: list[str] = field(default_factory=list)    # op nodes that read it in forward
    is_output: bool = False


@dataclass
class NodeInfo:
    """What the profile pass learned about one ``call_function`` node."""

    position: int
    flops: int
    creates: list[str]        # tensors (by name) whose storage this node allocates
    reads: list[str]          # activation tensors it reads
    saves: list[str]          # activation tensors autograd keeps for its backward
    saves_static_bytes: int   # bytes it saves that are parameters / inputs (always resident)
    backward_event: int | None  # index into StepProfile.backward_events, None if it has no backward
    forward_peak: int         # tracked bytes at the peak of its execution
    module_path: str
    # FLOPs it had run when autograd packed its last saved tensor: what checkpoint's early stop runs of it
    # again when it is a region's last saver (a 4-D matmul saves its internal copy before its bmm: 0)
    flops_before_last_save: int = 0


@dataclass
class StepProfile:
    """Graph-level result of the profile pass (``gm.meta["autorecompute"]``)."""

    resident: dict[str, int]                      # parameters, buffers, inputs, gradients (existing)
    tensors: dict[str, TensorInfo]
    order: list[str]                              # call_function nodes in forward order
    forward_peaks: list[int]                      # tracked bytes per forward position
    backward_events: list[str]                    # node names, in the order their backward ran
    backward_peaks: list[int]                     # tracked bytes per backward event
    parameter_grad_bytes: int
    tracked_peak: int
    # tracked bytes as each backward event starts: a saved tensor is unpacked then, before the event's own
    # allocations (its gradients), so what a recipe makes at that moment shares the event's headroom
    backward_starts: list[int] = field(default_factory=list)
    # bytes held beside the outputs' gradients as backward starts: the caller's loss (``run_step``)
    loss_reserve: int = 0

    def headroom(self, event: int) -> int:
        """Bytes backward event ``event`` allocates above what was live as it started (0 when unknown)."""
        if not 0 <= event < min(len(self.backward_peaks), len(self.backward_starts)):
            return 0
        return max(0, self.backward_peaks[event] - self.backward_starts[event])

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    @property
    def peak(self) -> int:
        return self.resident_bytes + self.tracked_peak


def node_info(node: torch.fx.Node) -> NodeInfo:
    """The profile of ``node``; fails with the pass to run when it is missing."""
    info = node.meta.get(META_KEY)
    if not isinstance(info, NodeInfo):
        raise RuntimeError(f"node {node.name!r} has no autorecompute profile: run "
                           "autorecompute.passes.profile.profile_step(gm, args, kwargs) first")
    return info


def step_profile(gm: torch.fx.GraphModule) -> StepProfile:
    """The graph-level profile; fails with the pass to run when it is missing."""
    info = gm.meta.get(META_KEY)
    if not isinstance(info, StepProfile):
        raise RuntimeError("graph has no autorecompute step profile: run "
                           "autorecompute.passes.profile.profile_step(gm, args, kwargs) first")
    return info


def module_path(node: torch.fx.Node) -> str:
    """Dotted path of the innermost module that produced ``node`` (from ``nn_module_stack``)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.replace("L['self'].", "").replace("L__self__.", "") if isinstance(path, str) else ""


class _Profiler(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, tracker: LiveStorageTracker, static_keys: set[int]):
        super().__init__(gm, garbage_collect_values=True)
        # a value nothing reads (``copy_``'s result: a view of the tensor it wrote into) goes at once, as in the
        # GraphModule's own code; the Interpreter frees values at their last use only, so it kept such a view,
        # and the storage under it, to the end of the step (an in-place add on a slice: +1 activation a layer)
        for node in self.graph.nodes:
            if not node.users and node.op != "output":
                self.user_to_last_uses.setdefault(node, []).append(node)
        self.tracker = tracker
        self.static_keys = static_keys
        self.owner_of_key: dict[int, str] = {}      # live storage → tensor name
        self.tensors: dict[str, TensorInfo] = {}
        self.values_of: dict[str, list[str]] = {}   # node name → tensor names of its value
        self.infos: dict[str, NodeInfo] = {}
        self.current: str | None = None
        self.position = -1
        self.pending_saves: list[tuple[str, int]] = []
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
        created, value_tensors = [], []
        for i, t in enumerate(flat_out):
            storage = t.untyped_storage()
            key = storage._cdata
            name = self.owner_of_key.get(key)
            if name is None and key not in self.static_keys:
                name = n.name if len(flat_out) == 1 else f"{n.name}[{i}]"
                owner = n.name
                if n.target is operator.getitem:   # the tuple's producer allocated it
                    name, owner = n.name, n.args[0].name
                self.owner_of_key[key] = name
                self.finalizers.append(weakref.finalize(storage, self._forget, key))
                self.tensors[name] = TensorInfo(
                    name=name, owner=owner, nbytes=storage.nbytes(), shape=tuple(t.shape),
                    dtype=str(t.dtype).replace("torch.", ""), birth=self.infos[owner].position
                    if owner in self.infos else self.position, last_forward_use=self.position)
                created.append(name)
            if name is not None:
                value_tensors.append(name)
        if n.target is operator.getitem and n.args[0].name in self.infos:
            self.infos[n.args[0].name].creates.extend(created)
            created = []
        self.values_of[n.name] = value_tensors

        reads = sorted({name for arg in n.all_input_nodes for name in self.values_of.get(arg.name, [])})
        for name in reads:
            info = self.tensors[name]
            info.last_forward_use = self.position
            if n.name not in info.readers:
                info.readers.append(n.name)
        saves = []
        for node_name, storage, t in self.pending_saves:
            key = storage._cdata
            name = self.owner_of_key.get(key)
            if name is None:   # a tensor the op made internally and kept for backward (a dropout mask)
                name = f"{n.name}.saved{len(created)}"
                self.owner_of_key[key] = name
                self.finalizers.append(weakref.finalize(storage, self._forget, key))
                self.tensors[name] = TensorInfo(
                    name=name, owner=n.name, nbytes=storage.nbytes(), shape=tuple(t.shape),
                    dtype=str(t.dtype).replace("torch.", ""), birth=self.position,
                    last_forward_use=self.position)
                created.append(name)
            if name not in saves:
                saves.append(name)
                self.tensors[name].savers.append(node_name)
        self.pending_saves = []
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
        self.infos[n.name] = NodeInfo(
            position=self.position, flops=int(flops), creates=created, reads=reads,
            saves=saves, saves_static_bytes=self.static_saved.get(n.name, 0), backward_event=None,
            forward_peak=forward_peak, module_path=module_path(n),
            flops_before_last_save=int(self.flops_at_last_pack - flops_before))
        self.forward_peaks.append(forward_peak)
        return out

    def _on_backward(self, name: str):
        def hook(grad_outputs):
            self.backward_starts.append(self.tracker.current)
            peak = self.tracker.reset_window_peak()
            if self.backward_events:
                self.backward_peaks.append(peak)
            else:
                self.first_segment_peak = peak
            self.infos[name].backward_event = len(self.backward_events)
            self.backward_events.append(name)
        return hook


def profile_step(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, loss_reserve: int | str = 0) -> StepProfile:
    """Runs one fake forward + backward of ``gm`` and annotates it (see module docstring).

    ``args``/``kwargs`` are the real (or meta) example inputs; nothing real is allocated, except on a CUDA
    device the first time an op signature is met: its kernel's workspace is then measured there
    (:mod:`autorecompute.runtime.workspaces`) and the step profiled again with it. ``loss_reserve`` bytes
    (``"auto"``: sized from the outputs, :func:`~autorecompute.runtime.memory.loss_reserve_bytes`) are held
    beside the outputs' gradients as backward starts, as the caller's loss holds them.
    """
    return workspaces.with_workspaces(lambda: _profile_once(gm, args, kwargs, loss_reserve))


def _profile_once(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, loss_reserve: int | str) -> StepProfile:
    from torch.fx._pytree import tree_flatten_spec

    params = list(gm.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    resident = {
        "parameters": tensor_bytes(params),
        "buffers": tensor_bytes(list(gm.buffers())),
        "inputs": tensor_bytes([args, kwargs]),
        "gradients": tensor_bytes(grads),
    }
    other = device_bytes_outside(step_state(gm, args, kwargs))
    if other:       # CUDA only: workspaces, optimizer state, other tensors, the allocator's slack
        resident["other on device"] = other
    parameter_grad_bytes = tensor_bytes([p for p in params if p.requires_grad and p.grad is None])
    with fake_step(gm, args, kwargs) as (fake_args, fake_kwargs):
        flat_args = tree_flatten_spec((list(fake_args), fake_kwargs), gm._in_spec) \
            if getattr(gm, "_in_spec", None) is not None else list(fake_args)
        static = [*gm.parameters(), *gm.buffers(), *flat_args]
        static_keys = {t.untyped_storage()._cdata for t in static if isinstance(t, torch.Tensor)}
        tracker = LiveStorageTracker()
        profiler = _Profiler(gm, tracker, static_keys)
        with tracker:
            # one FLOP counter for the whole forward: each node reads the difference it made
            with torch.autograd.graph.saved_tensors_hooks(profiler.pack, lambda t: t), \
                    FlopCounterMode(display=False) as profiler.counter:
                outputs = profiler.run(*flat_args)
            out_tensors = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor)]
            for t in out_tensors:
                name = profiler.owner_of_key.get(t.untyped_storage()._cdata)
                if name is not None:
                    profiler.tensors[name].is_output = True
                    profiler.tensors[name].last_forward_use = profiler.position
            grads_of = output_tensors_for_backward(outputs)
            del outputs, out_tensors
            reserved = 0
            if grads_of:
                seeds = [torch.ones_like(t) for t in grads_of]
                reserved = hold_reserve(grads_of, loss_reserve)
                torch.autograd.backward(grads_of, seeds)
                del seeds
            del grads_of
            for handle in profiler.hooks:
                handle.remove()
            for finalizer in profiler.finalizers:
                finalizer.detach()
            last = tracker.reset_window_peak()
            for name, maker in profiler.shares_backward.items():
                profiler.infos[name].backward_event = profiler.infos[maker].backward_event
            if profiler.backward_events:
                profiler.backward_peaks.append(last)
                profiler.backward_peaks[0] = max(profiler.backward_peaks[0], profiler.first_segment_peak)
    for node in gm.graph.nodes:
        if node.name in profiler.infos:
            node.meta[META_KEY] = profiler.infos[node.name]
    profile = StepProfile(
        resident=resident, tensors=profiler.tensors, order=profiler.order,
        forward_peaks=profiler.forward_peaks, backward_events=profiler.backward_events,
        backward_peaks=profiler.backward_peaks, backward_starts=profiler.backward_starts,
        parameter_grad_bytes=parameter_grad_bytes,
        tracked_peak=tracker.peak, loss_reserve=reserved)
    gm.meta[META_KEY] = profile
    return profile
