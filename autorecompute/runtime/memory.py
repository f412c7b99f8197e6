"""Live tensor-storage accounting: the one way this project measures memory.

A :class:`LiveStorageTracker` is a ``TorchDispatchMode`` that sees every op, registers each *new* untyped
storage an op returns (aliases of the op's inputs and storages that existed before the window are skipped),
and subtracts it again through a weakref finalizer when the storage dies. It samples after every op, through
forward and backward, and works the same on real, fake and meta tensors, so the peak of a step can be had
without allocating it.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten

from autorecompute.runtime.allocations import allocated_peak  # noqa: F401 — measured steps' tool, here too
from autorecompute.runtime.workspaces import (DISTINCT_OUTPUTS, has_scratch, real_output_bytes, sized_by_running,
                                              warm_up_blas, workspace_bytes)


def _storages(values: Iterable[Any]):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value.untyped_storage()


def _op_tensors(value: Any):
    """Tensors among an op's arguments or results: aten ops nest them at most one list deep (a fast path
    for the tracker, which runs on every op)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (list, tuple)):
                yield from (x for x in item if isinstance(x, torch.Tensor))


class LiveStorageTracker(TorchDispatchMode):
    """Tracks live bytes of tensor storages created inside the ``with`` block.

    Example:
        >>> tracker = LiveStorageTracker()
        >>> with tracker:
        ...     x = torch.ones(256, 256)          # 256 KiB
        ...     y = x * 2                         # another 256 KiB
        ...     del x
        >>> tracker.peak
        524288
        >>> tracker.current
        262144
    """

    # torch.compile's graphs call higher-order ops (the RNG-state wrappers of recomputed dropout): run as they
    # are, their results counted like an op's
    supports_higher_order_operators = True

    def __init__(self, scratch_device: torch.device | None = None) -> None:
        """``scratch_device``: the device meta tensors stand for, whose kernels' scratch is counted."""
        super().__init__()
        self.scratch_device = scratch_device
        self.current = 0
        self.peak = 0
        self._window_peak = 0
        self._live: dict[int, int] = {}

    def reset_window_peak(self) -> int:
        """Returns the peak since the previous call and starts a new window at the current level."""
        peak, self._window_peak = self._window_peak, self.current
        return peak

    def hold(self, nbytes: int) -> None:
        """Counts ``nbytes`` more (fewer, when negative) that no storage of the step stands for: what FSDP2's
        collectives allocate on a rank while a fake step plays them (:mod:`autorecompute.runtime.sharded`)."""
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self._window_peak = max(self._window_peak, self.current)

    def _free(self, key: int) -> None:
        nbytes = self._live.pop(key, None)
        if nbytes is not None:
            self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = list(_op_tensors(args))
        if kwargs:
            inputs.extend(_op_tensors(tuple(kwargs.values())))
        seen = {t.untyped_storage()._cdata for t in inputs}
        outputs = list(_op_tensors(out))
        # an output a fake kernel makes smaller than the real one (an RNN's reserve for backward): its real size
        real = real_output_bytes(func, args, kwargs) \
            if outputs and sized_by_running(func, outputs[0]) and is_fake(outputs[0]) else None
        made = set()
        for i, tensor in enumerate(outputs):
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in made and func in DISTINCT_OUTPUTS:
                # one fake storage for outputs the real kernel makes apart: the other's bytes, freed with it
                self._live[key] += storage.nbytes()
                self.current += storage.nbytes()
                continue
            if key in seen or key in self._live:
                continue
            seen.add(key)
            made.add(key)
            nbytes = storage.nbytes() if real is None or i >= len(real) else max(storage.nbytes(), real[i])
            self._live[key] = nbytes
            self.current += nbytes
            weakref.finalize(storage, self._free, key)
        level = self.current
        if has_scratch(func, inputs):
            # the kernel's own scratch, live with its inputs and outputs (measured on the device)
            level += workspace_bytes(func, args, kwargs, real=self.scratch_device is not None or not is_fake(inputs[0]),
                                     device=self.scratch_device)
        if level > self.peak:
            self.peak = level
        if level > self._window_peak:
            self._window_peak = level
        return out


def in_fake_step() -> bool:
    """Whether a fake step runs (the planner's profile, its verification of a plan): a ``FakeTensorMode`` on
    the dispatch-mode stack."""
    return any(isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack())


def active_trackers() -> list[LiveStorageTracker]:
    """The live-storage trackers measuring what runs now (on the dispatch-mode stack)."""
    return [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, LiveStorageTracker)]


def hold_while_alive(owner: object, nbytes: int) -> None:
    """Counts ``nbytes`` in the active trackers until ``owner`` is collected: memory no op they see made
    stands for (the CPU RNG state a checkpoint keeps, made by ``torch.get_rng_state()``)."""
    trackers = active_trackers()
    for tracker in trackers:
        tracker.hold(nbytes)
    weakref.finalize(owner, _release, trackers, nbytes)


def _release(trackers: list, nbytes: int) -> None:
    for tracker in trackers:
        tracker.hold(-nbytes)


def tensor_bytes(values: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind the tensors in ``values`` (pytrees allowed)."""
    flat, _ = tree_flatten(list(values))
    seen: dict[int, int] = {}
    for storage in _storages(flat):
        seen.setdefault(storage._cdata, storage.nbytes())
    return sum(seen.values())


def module_state(module: torch.nn.Module) -> list[torch.Tensor]:
    """What a module holds before a step: its parameters, buffers and existing gradients (for a captured
    ``fully_shard``-ed model, FSDP2's shards of them: placeholders stand among its parameters)."""
    params = list(module.parameters())
    units = {id(u): u for m in module.modules() if isinstance(m, torch.fx.GraphModule)
             for u in m.meta.get("sharded_units", ())}
    shards = [t for unit in units.values() for t in unit.held_shards()]
    return [*params, *module.buffers(), *[p.grad for p in params if p.grad is not None], *shards]


def step_state(module: torch.nn.Module, args: tuple, kwargs: dict) -> list:
    """What is live before a step: :func:`module_state` and the inputs."""
    return [*module_state(module), args, kwargs]


def resident_bytes(module: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """Bytes live before a step (:func:`step_state`), and on a CUDA device whatever else is allocated there
    (:func:`device_bytes_outside`)."""
    state = step_state(module, args, kwargs)
    return tensor_bytes(state) + device_bytes_outside(state)


ALLOCATOR_SLACK = 2 << 20      # per CUDA device; see device_bytes_outside
OUTSIDE_GRANULE = 1 << 20      # what else is allocated on a device is counted in whole MiB; see device_bytes_outside


def device_bytes_outside(values: Iterable[Any]) -> int:
    """Bytes the CUDA caching allocator has allocated on the devices of the (real) tensors in ``values``
    beyond their own storages: cuBLAS workspaces, optimizer state, the program's other tensors. They are
    on the device through the whole step, so a budget on the device's peak counts them. 0 off CUDA and
    for fake or meta tensors.

    The current stream's cuBLAS handles are created first (:func:`~autorecompute.runtime.workspaces.warm_up_blas`):
    their workspaces are allocated at the first matrix product and stay. Each device also gets
    :data:`ALLOCATOR_SLACK`: the caching allocator serves a request from a cached block up to 1 MiB larger
    without splitting it and counts the whole block, so a step's allocated bytes run a little above the
    sum of its tensors (docs/benchmarks.md measures by how much).

    The bytes outside are rounded up to whole MiB (:data:`OUTSIDE_GRANULE`): planning itself can leave a
    block or two of 512 B allocated per call (not garbage a collection frees; the cause is unknown), so
    unrounded, the minimum one plan reports would be refused by the next plan asked for exactly that budget.
    """
    flat, _ = tree_flatten(list(values))
    own: dict[torch.device, dict[int, int]] = {}
    for t in flat:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda" and not is_fake(t):
            storage = t.untyped_storage()
            own.setdefault(t.device, {}).setdefault(storage._cdata, storage.nbytes())
    outside = 0
    for device, storages in own.items():
        warm_up_blas(device)
        other = max(0, torch.cuda.memory_allocated(device) - sum(storages.values()))
        outside += -(-other // OUTSIDE_GRANULE) * OUTSIDE_GRANULE + ALLOCATOR_SLACK
    return outside


@dataclass(frozen=True)
class StepMemory:
    """Memory of one forward + backward step.

    Attributes:
        resident: bytes live before the step (parameters, buffers, inputs, existing gradients).
        tracked_peak: highest bytes of storages created during the step that were live at once.
        peak: ``resident + tracked_peak``: the quantity a budget bounds.
    """

    resident: int
    tracked_peak: int

    @property
    def peak(self) -> int:
        return self.resident + self.tracked_peak


def output_tensors_for_backward(outputs: Any) -> list[torch.Tensor]:
    """The outputs backward starts from: the model's own loss when it returns one — a scalar that requires
    grad under the key ``"loss"`` of a dict-like output (a Hugging Face model called with ``labels``, whose
    ``outputs.loss.backward()`` never makes a gradient of the logits' size) — else every differentiable
    floating-point output, which a loss computed outside the model would reach (an auxiliary loss beside
    the logits, a one-element prediction: all of them).

    Example:
        >>> logits = torch.randn(2, 3, requires_grad=True)
        >>> [t.shape for t in output_tensors_for_backward({"logits": logits})]
        [torch.Size([2, 3])]
        >>> [t.shape for t in output_tensors_for_backward({"loss": logits.sum(), "logits": logits})]
        [torch.Size([])]
        >>> [t.shape for t in output_tensors_for_backward({"aux_loss": logits.sum(), "logits": logits})]
        [torch.Size([]), torch.Size([2, 3])]
    """
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
    if _differentiable(loss) and loss.dim() == 0:
        return [loss]
    return differentiable_outputs(outputs)


def differentiable_outputs(outputs: Any) -> list[torch.Tensor]:
    """Every differentiable floating-point tensor of ``outputs`` (a loss the model returns among them): what
    a loss computed by the caller may start its backward from.

    Example:
        >>> logits = torch.randn(2, 3, requires_grad=True)
        >>> [t.shape for t in differentiable_outputs({"loss": logits.sum(), "logits": logits, "n": 3})]
        [torch.Size([]), torch.Size([2, 3])]
    """
    flat, _ = tree_flatten(outputs)
    return [t for t in flat if _differentiable(t)]


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point()


AUTO = "auto"
# float32 tensors of an output's size that a loss computed outside the model holds at once in its backward
# (cross-entropy: its log-softmax, the gradient of it and the gradient of the logits), the last of which is
# the gradient the planned step seeds backward with
LOSS_TENSORS = 3
LOSS_SCALARS = 16       # the loss and its unit gradient, float64 at most


def loss_reserve_bytes(outputs: list[torch.Tensor]) -> int:
    """Bytes a loss computed outside the model adds, at the start of backward, to the step the plan models
    (a unit gradient on each output): for each output of more than one element, :data:`LOSS_TENSORS`
    float32 tensors of its size less the gradient the model already counts, and the loss's own scalars. A
    scalar output is a loss already (0).

    Example:
        >>> loss_reserve_bytes([torch.ones(8, 1000)])      # cross-entropy over float32 logits: two more
        64016
        >>> loss_reserve_bytes([torch.ones(8, 1000, dtype=torch.bfloat16)])   # upcast to float32 first
        80016
        >>> loss_reserve_bytes([torch.ones(())])
        0
    """
    tensors = [t for t in outputs if t.numel() > 1]
    if not tensors:
        return 0
    return LOSS_SCALARS + sum(LOSS_TENSORS * 4 * t.numel() - t.numel() * t.element_size() for t in tensors)


def run_step(module: Callable, args: tuple, kwargs: dict, reserve: int | str = 0, keep_outputs: bool = True,
             tracking: contextlib.AbstractContextManager | None = None) -> Any:
    """One training step as the planner models it: forward, then backward with a unit gradient on the
    model's loss if it returns one, else a dense unit gradient on every differentiable output (the gradient
    a loss computed outside hands back; :func:`output_tensors_for_backward`). ``reserve`` bytes are
    allocated beside those gradients and freed before backward runs — what the caller's loss holds at that
    moment (:data:`AUTO`: :func:`loss_reserve_bytes` of the outputs). The outputs backward does not start from
    (the logits beside a returned loss) are held through backward when ``keep_outputs``, as ``out =
    model(...); out.loss.backward()`` holds them, or dropped first, as ``model(...).loss.backward()`` (Hugging
    Face's Trainer) does. ``tracking`` is entered while the unit gradients and the reserve are made (a tracker
    that otherwise runs inside compiled graphs only). Returns the outputs (those backward started from when
    they were dropped)."""
    outputs = module(*args, **kwargs)
    tensors = output_tensors_for_backward(outputs)
    if not keep_outputs:
        outputs = tensors
    if tensors:
        with tracking or contextlib.nullcontext():
            seeds = [torch.ones_like(t) for t in tensors]
            hold_reserve(tensors, reserve)
        torch.autograd.backward(tensors, seeds)
    return outputs


def hold_reserve(tensors: list[torch.Tensor], reserve: int | str) -> int:
    """Allocates and frees ``reserve`` bytes on the outputs' device (a live-storage tracker or the caching
    allocator sees them at the moment the caller's loss would hold them); returns the bytes."""
    nbytes = loss_reserve_bytes(tensors) if reserve == AUTO else int(reserve)
    if nbytes > 0:
        torch.empty(nbytes, dtype=torch.uint8, device=tensors[0].device)
    return nbytes


def measure_step(module: torch.nn.Module, args: tuple, kwargs: dict | None = None,
                 step: Callable[[torch.nn.Module, tuple, dict], Any] = run_step) -> StepMemory:
    """Measures the peak of ``step(module, args, kwargs)`` with a :class:`LiveStorageTracker`.

    Works on real tensors and inside ``FakeTensorMode`` alike.

    Example:
        >>> m = torch.nn.Linear(512, 512)
        >>> mem = measure_step(m, (torch.randn(512, 512),))
        >>> mem.peak > mem.resident
        True
    """
    kwargs = kwargs or {}
    resident = resident_bytes(module, args, kwargs)
    tracker = LiveStorageTracker()
    with tracker:
        outputs = step(module, args, kwargs)
        del outputs
    return StepMemory(resident=resident, tracked_peak=tracker.peak)


def measure_peak(step: Callable[[], Any], *state: Any) -> StepMemory:
    """Runs ``step()`` once and measures its memory as a budget counts it: what ``state`` holds before the
    step (modules: their parameters, buffers and existing gradients; tensors and containers of them: the
    batch) plus the highest bytes the step's own tensors reach, forward and backward and whatever the caller's
    code does between them (a loss over the logits, an optimizer step).

    On CPU (and fake or meta tensors) the step's tensors are counted by a :class:`LiveStorageTracker` (when
    ``state`` has a ``torch.compile``'d module, by :func:`allocated_peak`: dynamo runs eagerly under a tracker); on
    CUDA the caching allocator's ``max_memory_allocated`` is read instead, and ``resident`` is everything
    allocated on the device before the step (optimizer state and workspaces included), as the budget counts
    it there.

    Example:
        >>> model = torch.nn.Linear(512, 512)
        >>> batch = torch.randn(64, 512)
        >>> memory = measure_peak(lambda: model(batch).sum().backward(), model, batch)
        >>> memory.resident == 4 * (512 * 512 + 512 + 64 * 512)
        True
        >>> memory.peak > memory.resident
        True
    """
    flat = [*_state_tensors(state)]
    cuda = sorted({t.device for t in flat if t.device.type == "cuda"}, key=str)
    if cuda:
        return _measure_on_cuda(step, cuda[0])
    resident = tensor_bytes(flat)
    if any(_is_compiled(item) for item in state):
        # under a dispatch mode dynamo runs the module eagerly: the allocator's events see the compiled step
        return StepMemory(resident=resident, tracked_peak=allocated_peak(step))
    tracker = LiveStorageTracker()
    with tracker:
        step()
    return StepMemory(resident=resident, tracked_peak=tracker.peak)


def _is_compiled(item: Any) -> bool:
    """Whether ``item`` is a module ``torch.compile`` wrapped, or has one inside."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(item, torch.nn.Module) and any(isinstance(m, OptimizedModule) for m in item.modules())


def _state_tensors(state: Iterable[Any]):
    """The tensors behind ``state``: a module's parameters, buffers and gradients; tensors in pytrees."""
    for item in state:
        if isinstance(item, torch.nn.Module):
            yield from module_state(item)
        else:
            yield from (t for t in tree_flatten(item)[0] if isinstance(t, torch.Tensor))


def _measure_on_cuda(step: Callable[[], Any], device: torch.device) -> StepMemory:
    torch.cuda.synchronize(device)
    resident = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return StepMemory(resident=resident, tracked_peak=torch.cuda.max_memory_allocated(device) - resident)
