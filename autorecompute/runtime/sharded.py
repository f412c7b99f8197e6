"""FSDP2 inside a captured graph: each ``fully_shard``-ed module's run of ops bracketed by FSDP2's own calls.

A captured graph is one flat run of ops, so FSDP2's module hooks never fire in it. Capture
(:mod:`autorecompute.passes.sharded_units`) brackets the ops of each sharded module by
:meth:`ShardedUnit.enter` and :meth:`ShardedUnit.exit` and reads its parameters through
:meth:`ShardedUnit.parameter`. On real tensors these call FSDP2's own forward hooks — all-gather, the
post-backward autograd function on the inputs, reshard, the pre-backward hooks on the outputs — so the graph
runs under FSDP2 as the module does, collectives and gradients included.
On fake tensors (profiling, verifying a plan) they play FSDP2's memory instead: the all-gathered parameters
while the module runs forward and backward, the reduce-scatter's buffers and the gradient shards, held in
every :class:`~autorecompute.runtime.memory.LiveStorageTracker` that measures the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from autorecompute.runtime.memory import active_trackers, in_fake_step, tensor_bytes


@dataclass
class SharedComm:
    """FSDP2's communication state shared by a model's units, as a fake step plays it."""

    units: list = field(default_factory=list)     # every unit of the model
    pending: int = 0        # bytes of the last forward all-gather's flat output, freed by the next one
    order: list = field(default_factory=list)     # the units' forwards in the order they ended
    retained: int = 0       # bytes of the last reduce-scatter's flat input, freed by the next one
    final_queued: bool = False
    first: object = None    # the unit whose forward starts the step (the outermost)

    def reset(self) -> None:
        """A new fake step: nothing gathered, held or queued (a step before may have ended without backward)."""
        self.pending = self.retained = 0
        self.final_queued = False
        self.order.clear()
        for unit in self.units:
            unit._simulated = None


@dataclass(eq=False)
class ShardedUnit:
    """One ``fully_shard``-ed module of the captured model: its FSDP2 state and its memory per rank.

    Attributes:
        module: the module ``fully_shard`` was applied to.
        path: its dotted path in the captured model (``""``: the root).
        gathered_bytes: its parameters all-gathered (padded as FSDP2 pads them), in the dtype they run in.
        shard_bytes: this rank's shard of them.
        reshards_after_forward: whether FSDP2 frees the gathered parameters between forward and backward.
        scatter_scratch_bytes: what the process group's all-gather and reduce-scatter allocate besides their
            input and output (gloo: a copy of the gathered bytes).
        accumulates: whether this rank holds gradient shards before the step (gradient accumulation): the
            reduce-scatter adds into them.
        comm: what the model's units share: the flat output of the last all-gather in forward, still held.
    """

    module: torch.nn.Module
    path: str
    gathered_bytes: int
    shard_bytes: int
    reshards_after_forward: bool
    scatter_scratch_bytes: int = 0
    accumulates: bool = False
    comm: "SharedComm" = field(default_factory=lambda: SharedComm())
    _simulated: "_SimulatedUnit" = field(default=None, repr=False)

    def __repr__(self) -> str:      # printed graphs show it
        return f"ShardedUnit({self.path or '<root>'})"

    @property
    def state(self):
        return self.module._get_fsdp_state()

    @property
    def fsdp_params(self) -> list:
        group = self.state._fsdp_param_group
        return list(group.fsdp_params) if group is not None else []

    def key(self) -> tuple:
        """What the plan depends on besides the graph (part of the plan's key)."""
        return (self.path, self.gathered_bytes, self.shard_bytes, self.reshards_after_forward,
                self.scatter_scratch_bytes, self.accumulates)

    def __deepcopy__(self, memo: dict) -> "ShardedUnit":
        return self         # a copied graph runs on the same sharded module

    def enter(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Before the unit's first op: FSDP2's pre-forward (all-gather, post-backward function on the inputs
        that need gradients). Returns the inputs the unit's ops read."""
        if in_fake_step():     # (FSDP2's memory is played, no collective runs)
            if self is self.comm.first:
                self.comm.reset()
            return self.simulated().enter(inputs)
        args, _ = self.state._pre_forward(self.module, inputs, {})
        return tuple(args)

    def exit(self, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """After the unit's last op: FSDP2's post-forward (reshard, pre-backward hooks on the outputs)."""
        if in_fake_step():
            return self.simulated().exit(outputs)
        return tuple(self.state._post_forward(self.module, (), outputs))

    def parameter(self, index: int, placeholder: torch.Tensor) -> torch.Tensor:
        """The unit's ``index``-th parameter as its ops read it: FSDP2's all-gathered Parameter (the
        placeholder, storage-less or fake, stands for it where the step is played)."""
        if in_fake_step():
            self.simulated().parameters[index] = placeholder
            return placeholder
        return self.fsdp_params[index].unsharded_param

    def held_shards(self) -> list[torch.Tensor]:
        """This rank's parameter shards and gradient shards: resident before a step, though not among the
        captured graph's parameters (placeholders stand there)."""
        shards = [p.sharded_param for p in self.fsdp_params]
        return [*(p.to_local() for p in shards), *(p.grad.to_local() for p in shards if p.grad is not None)]

    def held_gradient_bytes(self) -> int:
        """Bytes of the gradient shards this rank holds now (from earlier backwards: accumulation)."""
        grads = [p.sharded_param.grad for p in self.fsdp_params if p.sharded_param.grad is not None]
        return tensor_bytes([g.to_local() for g in grads])     # (views of one flat buffer a unit)

    def simulated(self) -> "_SimulatedUnit":
        if self._simulated is None:
            self._simulated = _SimulatedUnit(self)
        return self._simulated


def is_sharded_call(node) -> bool:
    """Whether an FX node calls a unit's FSDP2 bracket (``enter`` / ``exit`` / ``parameter``)."""
    return getattr(node.target, "__func__", None) in _CALLS


def _hold(nbytes: int) -> None:
    for tracker in active_trackers():
        tracker.hold(nbytes)


class _SimulatedUnit:
    """FSDP2's memory for one unit in a fake step, as its hooks allocate and free on a rank (gloo and NCCL alike
    run them in this order; NCCL's streams only overlap them with compute)."""

    def __init__(self, unit: ShardedUnit):
        self.unit = unit
        self.parameters: dict[int, torch.Tensor] = {}
        self.gathered = False
        self.prefetched = False           # all-gathered into its flat output, not yet copied out

    def _all_gather(self) -> None:
        """The all-gather itself: its flat output, and the process group's scratch for a moment."""
        unit = self.unit
        _hold(unit.gathered_bytes + unit.scatter_scratch_bytes)
        _hold(-unit.scatter_scratch_bytes)

    def _gather(self, forward: bool) -> None:
        """All-gather, then its flat output copied out into the parameters. In forward FSDP2 keeps the flat
        output until the next unit's all-gather has run (to overlap the two); in backward it frees it at once."""
        if self.gathered:
            return
        comm, nbytes = self.unit.comm, self.unit.gathered_bytes
        if not self.prefetched:
            self._all_gather()
        _hold(-comm.pending)
        comm.pending = 0
        _hold(nbytes)
        if forward:
            comm.pending = nbytes
        else:
            _hold(-nbytes)
        self.gathered, self.prefetched = True, False

    def _prefetch(self) -> None:
        """FSDP2's default backward prefetch: all-gathered now, copied out at the unit's own backward."""
        if not self.gathered and not self.prefetched:
            self._all_gather()
            self.prefetched = True

    def _reshard(self) -> None:
        if self.gathered:
            _hold(-self.unit.gathered_bytes)
            self.gathered = False

    def enter(self, inputs: tuple) -> tuple:
        self._gather(forward=True)
        needing = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not needing:     # (the root's token ids): reduce-scatters when backward ends
            return tuple(inputs)
        passed = _AfterUnitBackward.apply(self, *[inputs[i] for i in needing])
        out = list(inputs)
        for i, t in zip(needing, passed):
            out[i] = t
        return tuple(out)

    def exit(self, outputs: tuple) -> tuple:
        comm = self.unit.comm
        if self.unit.reshards_after_forward:
            self._reshard()
        comm.order.append(self)
        if self.unit is comm.first:      # the outermost post-forward frees the last all-gather's flat output
            _hold(-comm.pending)
            comm.pending = 0
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._before_backward)
        return tuple(outputs)

    def _before_backward(self, grad: torch.Tensor) -> torch.Tensor:
        comm = self.unit.comm
        if not comm.final_queued:
            comm.final_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(partial(_at_backward_end, comm))
        self._gather(forward=False)
        position = comm.order.index(self) if self in comm.order else 0
        if position > 0:
            comm.order[position - 1]._prefetch()
        return grad

    def after_backward(self) -> None:
        """FSDP2's post-backward: the gathered parameters freed, the last reduce-scatter's input (kept while
        this one runs) freed, the gradients copied into this one's flat input and freed, scattered into this
        rank's gradient shard (kept after the step); this input is kept until the next reduce-scatter."""
        if not self.parameters:
            return
        unit, comm = self.unit, self.unit.comm
        self._reshard()
        _hold(-comm.retained)
        _hold(unit.gathered_bytes + unit.shard_bytes + unit.scatter_scratch_bytes)
        for p in self.parameters.values():
            p.grad = None
        _hold(-unit.scatter_scratch_bytes - (unit.shard_bytes if unit.accumulates else 0))   # (added into them)
        comm.retained = unit.gathered_bytes
        self.parameters.clear()


def _at_backward_end(comm: SharedComm) -> None:
    """FSDP2's final callback: the post-backward of units whose inputs need no gradient (the root's), then the
    last reduce-scatter's input freed."""
    for simulated in reversed(comm.order):
        simulated.after_backward()
        if simulated.prefetched:        # (prefetched for a backward that did not reach it: a frozen unit)
            _hold(-simulated.unit.gathered_bytes)
            simulated.prefetched = False
    _hold(-comm.retained)
    comm.retained = 0
    comm.final_queued = False


class _AfterUnitBackward(torch.autograd.Function):
    """Identity on the unit's inputs; its backward runs once the unit's backward is done (FSDP2's
    RegisterPostBackwardFunction)."""

    @staticmethod
    def forward(ctx, simulated: _SimulatedUnit, *inputs: torch.Tensor):
        ctx.simulated = simulated
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.simulated.after_backward()
        return (None, *grads)


_CALLS = (ShardedUnit.enter, ShardedUnit.exit, ShardedUnit.parameter)
