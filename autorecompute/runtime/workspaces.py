"""Kernel workspaces: device memory an op allocates and frees inside itself, which no tensor shows.

On CUDA many kernels take scratch memory from the caching allocator for the length of one call: cuDNN
convolutions (their backward above all), layer-norm and embedding backward, reductions, fused attention.
``torch.cuda.max_memory_allocated`` counts it, fake tensors cannot see it. So the first time a plan meets an
op signature on a CUDA device (the op, its tensors' shapes, strides and dtypes, its other arguments), the
op is run once on the real device with made-up inputs and its scratch measured: the allocator's peak
during the call less what is still allocated after it (the outputs). The
:class:`~autorecompute.runtime.memory.LiveStorageTracker` adds that scratch to the live bytes at every call
of the op, on fake and real tensors alike, so profiles, verification and measurements all include it.

Probing resets the device's peak-memory statistics (``torch.cuda.reset_peak_memory_stats``); it runs while
planning, before a step. Ops that draw random numbers or whose outputs depend on their data are not
probed (made-up inputs could trip them); integer inputs are zeros (valid indices) and floating-point
inputs lie in [0, 1) (valid probabilities), so the probe never feeds an op what it would reject.

Example (measures nothing off CUDA):
    >>> workspace_bytes(torch.ops.aten.mm.default, (torch.ones(2, 2), torch.ones(2, 2)), {})
    0
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

log = logging.getLogger(__name__)
T = TypeVar("T")

_SKIPPED_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
_SKIPPED_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}

_lock = threading.Lock()
_measured: dict[tuple, int] = {}          # signature → scratch bytes
_pending: dict[tuple, tuple] = {}         # signature → (op, treespec, leaves) to probe
_warmed: set = set()                      # (device, stream) whose BLAS handles exist


@dataclass(frozen=True)
class _TensorLike:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def _probed_op(func) -> bool:
    return (isinstance(func, torch._ops.OpOverload) and func.namespace == "aten" and not func.is_view
            and func not in _SKIPPED_OPS and not any(tag in func.tags for tag in _SKIPPED_TAGS))


def _signature(func, args, kwargs, cuda_only: bool = True,
               device: torch.device | None = None) -> tuple[tuple, Any, list] | None:
    """(key, treespec, leaves) for an op call whose scratch is measured — one with a tensor on a CUDA device,
    or a CPU kernel of :data:`CPU_SCRATCH_OPS` — (any call: ``cuda_only=False``), else None; the key is the op
    and the leaves (tensors described by shape, stride, dtype and device: ``device`` where given, for meta
    tensors standing for that device's)."""
    leaves, spec = tree_flatten((args, kwargs))
    described = [_TensorLike(tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, device or leaf.device)
                 if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    if cuda_only and _device_of(func, described) is None:
        return None
    key = (func, *described)
    try:
        hash(key)
    except TypeError:          # an argument that cannot key a table (a list inside a leaf): not probed
        return None
    return key, spec, described


def _device_of(func, described: list) -> torch.device | None:
    """The device whose scratch a call takes, where it is measured: CUDA, or the CPU for
    :data:`CPU_SCRATCH_OPS`."""
    devices = [leaf.device for leaf in described if isinstance(leaf, _TensorLike)]
    cuda = next((device for device in devices if device.type == "cuda"), None)
    if cuda is not None:
        return cuda
    if func in CPU_SCRATCH_OPS and devices and all(device.type == "cpu" for device in devices):
        return devices[0]
    return None


def has_scratch(func, inputs: list[torch.Tensor]) -> bool:
    """Whether a call of ``func`` on ``inputs`` may take scratch that is measured (the tracker's test)."""
    return func in CPU_SCRATCH_OPS or any(t.device.type == "cuda" for t in inputs)


def workspace_bytes(func, args, kwargs, real: bool = False, device: torch.device | None = None) -> int:
    """The scratch bytes one call of ``func`` takes on its CUDA device (or on the CPU, for
    :data:`CPU_SCRATCH_OPS`), as measured; 0 for ops not probed, and for a signature not measured yet: it is
    then queued for :func:`probe_pending`, or, for a CPU call on ``real`` tensors (a measured step, which is
    not run again), measured at once (milliseconds). ``device``: the device meta tensors stand for."""
    if not _probed_op(func):
        return 0
    signature = _signature(func, args, kwargs or {}, device=device)
    if signature is None:
        return 0
    key, spec, described = signature
    with _lock:
        scratch = _measured.get(key)
        if scratch is not None:
            return scratch
        _pending.setdefault(key, (func, spec, described))
    if real and _device_of(func, described).type == "cpu":
        probe_pending()
        return _measured.get(key, 0)
    return 0


def has_pending() -> bool:
    return bool(_pending)


def with_workspaces(run: Callable[[], T]) -> T:
    """``run()`` (a fake step under a tracker), and again once the CUDA op signatures it met for the first
    time are measured, so its peak includes their workspaces."""
    result = run()
    if has_pending():
        probe_pending()
        result = run()
    return result


def probe_pending() -> int:
    """Measures every queued signature on its device; returns how many were measured. Signatures that
    cannot be measured (no CUDA here, the op refuses made-up inputs) count 0 scratch, logged."""
    with _lock:
        pending = list(_pending.items())
        _pending.clear()
    for key, (func, spec, described) in pending:
        try:
            device = _device_of(func, described)
            if device.type == "cpu":
                scratch = _probe_cpu(func, spec, described)
            else:
                scratch = _probe(func, spec, described) if torch.cuda.is_available() else 0
        except Exception as error:    # noqa: BLE001 — a probe must never stop planning; logged, counted 0
            log.warning("could not measure the workspace of %s: %s", func, error)
            scratch = 0
        with _lock:
            _measured[key] = scratch
        if scratch:
            log.debug("workspace of %s: %d bytes", func, scratch)
    return len(pending)


def _materialize(leaf):
    if not isinstance(leaf, _TensorLike):
        return leaf
    numel = 1 + sum((size - 1) * stride for size, stride in zip(leaf.shape, leaf.stride)) \
        if all(leaf.shape) else 0
    if leaf.dtype.is_floating_point or leaf.dtype.is_complex:
        base = torch.rand(numel, dtype=leaf.dtype, device=leaf.device)
    else:
        base = torch.zeros(numel, dtype=leaf.dtype, device=leaf.device)
    return base.as_strided(leaf.shape, leaf.stride)


def _probe(func, spec, described) -> int:
    device = next(leaf.device for leaf in described if isinstance(leaf, _TensorLike) and leaf.device.type == "cuda")
    args, kwargs = tree_unflatten([_materialize(leaf) for leaf in described], spec)
    scratch = 0
    # twice: a first call may pick its algorithm (cudnn.benchmark) with trial workspaces a later one skips
    for _ in range(2):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = func(*args, **kwargs)
        torch.cuda.synchronize(device)
        scratch = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
        del out
    return max(0, scratch)


def _probe_cpu(func, spec, described) -> int:
    """The most bytes a CPU call allocates beyond its outputs, from the allocator's events (twice: a first
    call may create oneDNN primitives a later one reuses)."""
    from autorecompute.runtime.allocations import allocated_peak

    args, kwargs = tree_unflatten([_materialize(leaf) for leaf in described], spec)
    scratch = 0
    for _ in range(2):
        held: list = []
        peak = allocated_peak(lambda: held.append(func(*args, **kwargs)))
        outputs = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                   for t in tree_flatten(held)[0] if isinstance(t, torch.Tensor)}
        scratch = peak - sum(outputs.values())
    return max(0, scratch)


# CPU kernels that take memory no tensor shows, for the length of a call: oneDNN's convolutions (inputs and
# weights reordered to its blocked layouts, im2col buffers), forward and backward.
CPU_SCRATCH_OPS = frozenset({torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default})


# Ops whose fake (meta) kernel makes an output smaller than the real kernel does: the RNN kernels' reserve
# ("workspace") saved for backward, which grows with the units, steps and batch, is empty on fake tensors:
# PyTorch cannot ask oneDNN or cuDNN its size without running it.
# (Only forward kernels: a backward probed on made-up inputs would get the fake, empty reserve, and oneDNN's
# crashes on it.)
SIZED_BY_RUNNING = frozenset({torch.ops.aten.mkldnn_rnn_layer.default, torch.ops.aten._cudnn_rnn.default,
                              torch.ops.aten.miopen_rnn.default})
# CPU kernels that return a tensor in a larger storage than its own (those whose real and fake outputs on the
# CPU differ): a reduced pointwise loss keeps its unreduced buffer (its input's size under a 0-d mean),
# ``F.fold``'s col2im a buffer k² its output, an embedding bag's offset2bag one more index.
# (CPU only: not measured on a GPU, where a probe's made-up inputs would also take device memory.)
SIZED_BY_RUNNING_ON_CPU = frozenset({
    torch.ops.aten.mse_loss.default, torch.ops.aten.smooth_l1_loss.default,
    torch.ops.aten.binary_cross_entropy.default, torch.ops.aten.soft_margin_loss.default,
    torch.ops.aten.col2im.default, torch.ops.aten._embedding_bag.default,
    torch.ops.aten._embedding_bag_forward_only.default})


def sized_by_running(func, output: torch.Tensor) -> bool:
    """Whether ``func``'s outputs (``output`` the first) are sized by :func:`real_output_bytes` (a set lookup
    first: the tracker asks at every op)."""
    return func in SIZED_BY_RUNNING or (func in SIZED_BY_RUNNING_ON_CPU and output.device.type == "cpu")


# Ops whose fake kernel returns one tensor for outputs the real kernel makes apart: the CPU LSTM backward's
# two bias gradients.
DISTINCT_OUTPUTS = frozenset({torch.ops.aten.mkldnn_rnn_layer_backward.default})
_output_bytes: dict[tuple, tuple[int, ...] | None] = {}     # signature → real storage bytes of each output


def real_output_bytes(func, args, kwargs) -> tuple[int, ...] | None:
    """For an op of :data:`SIZED_BY_RUNNING` called on fake tensors: the storage bytes of each of its tensor
    outputs (in :func:`~autorecompute.runtime.memory` order) when it runs for real — measured once per
    signature, by running it on made-up inputs on the device; None for other ops, or when it cannot run."""
    if func not in SIZED_BY_RUNNING and func not in SIZED_BY_RUNNING_ON_CPU:
        return None
    signature = _signature(func, args, kwargs or {}, cuda_only=False)
    if signature is None:
        return None
    key, spec, described = signature
    if key not in _output_bytes:
        from torch.utils._python_dispatch import _disable_current_modes

        try:
            # real tensors, out of the fake mode and trackers (with grad mode as the call had it: under no_grad
            # the oneDNN kernel makes no reserve)
            with _disable_current_modes():
                real_args, real_kwargs = tree_unflatten([_materialize(leaf) for leaf in described], spec)
                out = func(*real_args, **real_kwargs)
                flat, _ = tree_flatten(out)
                _output_bytes[key] = tuple(t.untyped_storage().nbytes() for t in flat if isinstance(t, torch.Tensor))
        except Exception as error:    # noqa: BLE001 — a probe must never stop planning; logged, fake sizes kept
            log.warning("could not measure the outputs of %s: %s", func, error)
            _output_bytes[key] = None
    return _output_bytes[key]


def warm_up_blas(device: torch.device) -> None:
    """Creates the cuBLAS and cuBLASLt handles (and their workspaces, tens of MB that stay allocated) of the
    current stream on ``device``, so that memory counted as already allocated includes them."""
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    if key in _warmed:
        return
    _warmed.add(key)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        try:
            a = torch.zeros(16, 16, dtype=dtype, device=device)
            torch.mm(a, a)
            torch.addmm(a[0], a, a)
            torch.bmm(a[None], a[None])
        except RuntimeError:   # a dtype the device lacks
            continue
    torch.cuda.synchronize(device)

