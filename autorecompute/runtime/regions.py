"""Runtime of recomputed regions: non-reentrant ``torch.utils.checkpoint`` around a region GraphModule.

The region's forward runs once in forward without saving anything for backward; when backward first needs
one of its saved tensors the region runs again (RNG state replayed, so dropout masks match) and the
recomputed tensors are handed to autograd one by one.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from autorecompute.runtime.memory import hold_while_alive

# the state-updating op a recomputation runs again through ``batch_norm_once``, and the positions of the state
# it updates among its arguments (running_mean, running_var: read off the schema)
BATCH_NORM = torch.ops.aten.batch_norm.default
RUNNING_STATISTICS = tuple(i for i, argument in enumerate(BATCH_NORM._schema.arguments)
                           if argument.name.startswith("running_"))


class CheckpointRegion(torch.nn.Module):
    """Runs ``body(recomputing, *inputs)`` under non-reentrant activation checkpointing.

    ``recomputing`` is False in forward and True when the region is recomputed in backward: ops that
    update state (training-mode BatchNorm's running statistics) use it to update exactly once.

    Example:
        >>> import torch.fx
        >>> region = CheckpointRegion(torch.fx.symbolic_trace(lambda recomputing, x: (x.sin().cos(),)),
        ...                           preserve_rng_state=False)
        >>> x = torch.randn(4, requires_grad=True)
        >>> region(x)[0].sum().backward()
        >>> torch.allclose(x.grad, -x.sin().sin() * x.cos())
        True
    """

    def __init__(self, body: torch.nn.Module, preserve_rng_state: bool):
        super().__init__()
        self.body = body
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *inputs):
        if torch.compiler.is_compiling():
            # dynamo turns a checkpoint without side effects into the region its partitioner recomputes in
            # backward, running state updates once (functionalized); the call counter below would break the graph
            return checkpoint(self.body, False, *inputs, use_reentrant=False,
                              preserve_rng_state=self.preserve_rng_state)
        calls, count = 0, len(inputs)

        def run(*args):
            nonlocal calls
            recomputing = calls > 0
            calls += 1
            return self.body(recomputing, *args[:count])

        return checkpoint(run, *inputs, *rng_state_stand_in(self.preserve_rng_state, inputs), use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state)


class RemakingRegion(torch.nn.Module):
    """A :class:`CheckpointRegion` that does not hold the inputs the region before it made: called with
    that region's inputs first, then its own, it hands checkpoint only the others, and when it is
    recomputed it makes those inputs again with ``remake(True, *inputs_before)`` (without autograd; they
    are detached and require grad as in forward, so its ops save the same tensors) and drops them once it
    has run.

    The region before must not be random: the recomputation replays this region's RNG state, not its.

    Example:
        >>> import torch.fx
        >>> body = torch.fx.symbolic_trace(lambda recomputing, h: (h.exp(),))
        >>> remake = torch.fx.symbolic_trace(lambda recomputing, x: (x.sin(),))
        >>> region = RemakingRegion(body, remake, num_before=1, remade=(0,), preserve_rng_state=False)
        >>> x = torch.randn(4, requires_grad=True)
        >>> region(x, x.sin())[0].sum().backward()
        >>> torch.allclose(x.grad, x.sin().exp() * x.cos())
        True
    """

    def __init__(self, body: torch.nn.Module, remake: torch.nn.Module, num_before: int, remade: tuple[int, ...],
                 preserve_rng_state: bool):
        super().__init__()
        self.body = body
        self.remake = remake
        self.num_before = num_before
        self.remade = remade
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *inputs):
        before, own = inputs[:self.num_before], inputs[self.num_before:]
        made_in_forward = [own[i] for i in self.remade]
        requires_grad = [isinstance(t, torch.Tensor) and t.requires_grad for t in made_in_forward]
        kept = [t for i, t in enumerate(own) if i not in self.remade]
        count, calls = len(own), 0
        del inputs, own       # the closure below must not hold the remade inputs after forward

        stand_in = rng_state_stand_in(self.preserve_rng_state, (*before, *kept))

        def run(*args):
            nonlocal calls, made_in_forward
            recomputing = calls > 0
            calls += 1
            before_args, rest = args[:self.num_before], args[self.num_before:len(args) - len(stand_in)]
            if recomputing:
                with torch.no_grad():
                    # forward, not __call__: module hooks (FlopCounterMode's ModuleTracker) would register grad
                    # hooks on its outputs, and a parameter's alias made without autograd has no grad_fn
                    made = self.remake.forward(True, *before_args)
                values = [t.detach().requires_grad_(g) if isinstance(t, torch.Tensor) else t
                          for t, g in zip(made, requires_grad)]
            else:
                values, made_in_forward = made_in_forward, None     # not held by this closure after forward
            made_values, other_values = iter(values), iter(rest)     # (``remade`` is in input order)
            return self.body(recomputing, *(next(made_values) if i in self.remade else next(other_values)
                                            for i in range(count)))

        return checkpoint(run, *before, *kept, *stand_in, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state)


def rng_state_stand_in(preserving: bool, inputs: tuple) -> tuple:
    """For a region with random ops on the CPU, a stand-in for the CPU RNG state its checkpoint keeps from
    forward to recomputation (``torch.get_rng_state()``, 5 KB, made where no tracker sees it), handed to
    checkpoint beside the inputs so that it lives as long: counted in every live-storage tracker measuring the
    step while it lives. Nothing for a CUDA step (that state is host memory, outside the budget)."""
    if not preserving or not any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in inputs):
        return ()
    return (_HeldRngState(),)


class _HeldRngState:
    def __init__(self):
        hold_while_alive(self, cpu_rng_state_bytes())


@functools.cache
def cpu_rng_state_bytes() -> int:
    """Bytes of the CPU generator's state (``torch.get_rng_state()``), which a checkpoint replaying it keeps."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        return torch.get_rng_state().numel()


def batch_norm_once(recomputing: bool, input, weight, bias, running_mean, running_var, training: bool,
                    momentum: float, eps: float, cudnn_enabled: bool):
    """``aten.batch_norm`` that updates running statistics in forward only, not when recomputed.

    In training mode the output depends on batch statistics alone, so updating throw-away copies of the
    running buffers on the recomputation gives bit-identical values and leaves the real buffers updated
    once, as eager does. (Copies rather than ``None``: autograd must save the same tensors both times.)
    """
    if recomputing and training and running_mean is not None:
        running_mean, running_var = running_mean.clone(), running_var.clone()
    return BATCH_NORM(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
