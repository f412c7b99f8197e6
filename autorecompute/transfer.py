"""Throughputs the cost model turns FLOPs, bytes and calls into time with: what recomputing an op costs, and
what an offload transfer costs against the compute that can hide it.

Defaults are conservative figures for each device, not measured: plans stay reproducible from machine to
machine. :func:`measure` times this machine's CPU offload path once (``autorecompute.probes``) and caches
the result.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class TransferModel:
    """How fast the device computes, runs memory-bound ops and calls, and how fast activations go out to and
    come back from the offload tier. Costs are in FLOP-equivalents: seconds × ``flops_per_second``.

    Attributes:
        flops_per_second: sustained compute (FLOP-equivalents of ``Problem.cost``) per second.
        write_bytes_per_second: device → offload tier.
        read_bytes_per_second: offload tier → device.
        per_transfer_seconds: fixed overhead of one transfer (hooks, file or stream bookkeeping).
        memory_bytes_per_second: bytes a memory-bound op (elementwise, norm, softmax) writes per second.
        random_bytes_per_second: bytes of random numbers a random op (dropout) draws per second (one
            number per element of its result).
        op_seconds: fixed cost of running one op again (dispatch, launch).
        region_seconds: fixed cost of one recomputed region (a checkpoint call: hooks, RNG state, replay).
        stash_seconds: fixed cost of one rematerialized or compressed tensor (hooks, bookkeeping).
        overlaps_compute: whether transfers run beside the compute (a GPU's copy engines) and so can be
            hidden behind it and prefetched; False where they take the compute's own cores, so every transfer
            is paid in full. The planner takes it as False for CPU tensors, whose disk tier copies on the
            training thread.
    """

    flops_per_second: float
    write_bytes_per_second: float
    read_bytes_per_second: float
    per_transfer_seconds: float
    memory_bytes_per_second: float = 4e9
    random_bytes_per_second: float = 0.35e9
    op_seconds: float = 10e-6
    region_seconds: float = 400e-6
    stash_seconds: float = 200e-6
    overlaps_compute: bool = True

    def __post_init__(self):
        for name, value in asdict(self).items():
            if name == "overlaps_compute":
                if not isinstance(value, bool):
                    raise ValueError(f"TransferModel.overlaps_compute={value!r} must be True or False")
                continue
            seconds = name.endswith("seconds")
            # finite and below an hour a call: the prices become the solver's integers (cost units of FLOPs)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                    or value < 0 or (not seconds and value < 1) or (seconds and value > 3600):
                raise ValueError(f"TransferModel.{name}={value!r} must be a finite number "
                                 + ("of seconds, 0 to 3600" if seconds else "of at least 1 (per second)"))

    def seconds_to_cost(self, seconds: float) -> int:
        return int(round(seconds * self.flops_per_second))

    def compute_seconds(self, cost: int) -> float:
        return cost / self.flops_per_second


# CPU (measured on the 2-core CI machine, torch 2.14): ~100 GFLOP/s on mid-sized matmuls; the disk tier
# writes and reads its file in the page cache at 4-9 GB/s on the calling thread, and an offloaded tensor costs
# ~80 µs of hooks, stash nodes and system calls besides its bytes (12-layer GPT-2 with 311 tensors offloaded:
# +35 ms over eager measured, +33 ms priced); GELU writes ~4 GB/s after ~10 µs of dispatch, dropout draws ~0.3 GB/s of numbers (bernoulli; 256 KiB in ~0.8 ms), a
# non-reentrant checkpoint call ~430 µs of forward + backward overhead, a rematerialized tensor ~200 µs of
# hooks and bookkeeping besides its op.
CPU_DISK = TransferModel(flops_per_second=100e9, write_bytes_per_second=4e9, read_bytes_per_second=4e9,
                         per_transfer_seconds=40e-6, memory_bytes_per_second=4e9, random_bytes_per_second=0.35e9,
                         op_seconds=10e-6, region_seconds=400e-6, stash_seconds=200e-6, overlaps_compute=False)
# CUDA: PCIe Gen4/5 pinned copies ~20 GB/s each way; a large GPU sustains ~100 TFLOP/s in bf16 matmuls and
# ~2 TB/s in elementwise kernels (Philox dropout about as fast); a launch from eager Python ~10 µs.
CUDA_HOST = TransferModel(flops_per_second=100e12, write_bytes_per_second=20e9, read_bytes_per_second=20e9,
                          per_transfer_seconds=20e-6, memory_bytes_per_second=1e12, random_bytes_per_second=1e12,
                          op_seconds=10e-6, region_seconds=200e-6, stash_seconds=50e-6)


# At one byte per FLOP, rewriting 4 MiB of elementwise results weighed as much as a 4-MFLOP matmul, and the
# least-FLOPs plan for GPT-2 at torch.compile's 0.7 point ran that matmul again instead (+0.7% FLOPs, 0 possible).
TIE_BREAK_BYTES_PER_FLOP = 16


def counting_flops(model: TransferModel) -> TransferModel:
    """``model`` with recomputation priced by its FLOPs (no call, region or random-number cost; the bytes a
    memory-bound op writes at one FLOP-equivalent per ``TIE_BREAK_BYTES_PER_FLOP``: a tie-break that keeps
    zero-FLOP recomputation from being free and elementwise recipes short without outweighing FLOPs): about
    the plan with the fewest extra FLOPs as ``FlopCounterMode`` counts them — the fastest plan where
    elementwise recomputation is fused away (``torch.compile``), not in eager mode on a CPU."""
    return replace(model, memory_bytes_per_second=model.flops_per_second * TIE_BREAK_BYTES_PER_FLOP,
                   random_bytes_per_second=model.flops_per_second * 1e6, op_seconds=0.0,
                   region_seconds=1.0 / model.flops_per_second, stash_seconds=0.0)


def default_for(device_type: str) -> TransferModel:
    """The default model for tensors on ``device_type``: "cuda" and "meta" (planning a model meant for an
    accelerator) use the host tier's; anything else the disk tier's."""
    return CUDA_HOST if device_type in ("cuda", "meta") else CPU_DISK


MEASURE_MIN_BYTES = 1 << 20
MEASURE_CACHE_FORMAT = 4     # the layout of measure()'s cache file (1: the bare TransferModel fields; 2: no overlap;
#                              3: the disk tier and a matmul timed, every other figure scaled by the matmul's speed)


def measure(directory: str | None = None, nbytes: int = 64 << 20, cache: str | None = None) -> TransferModel:
    """Times this machine's CPU offload path once and caches the result in ``cache`` (default
    ``~/.cache/autorecompute/transfer.json``); pass it as ``compile(..., transfer=...)`` for a model trained
    on the CPU (it times no GPU: on CUDA keep :data:`CUDA_HOST` or pass a model of your own). The disk tier's
    throughput is timed on one ``nbytes`` tensor, the fixed cost of a transfer through the runtime on an
    offload plan against the same model kept (``autorecompute.probes``, a few seconds); recomputation keeps
    the CPU defaults, fitted on whole steps of the CI machine (why: ``autorecompute/probes.py``).

    The cache holds what it was measured for (this format, the torch version, the directory's disk, the
    probe's size): a cache from another version, directory, size or an older format is measured again, not
    misread.

    Example:
        >>> import autorecompute, tempfile
        >>> model = measure(cache=tempfile.mktemp())
        >>> model.overlaps_compute, model.per_transfer_seconds > 0
        (False, True)
    """
    import torch

    from autorecompute import probes

    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < MEASURE_MIN_BYTES:
        # a few bytes time the call, not the disk (3 bytes read as 256 KB/s, and were cached)
        raise ValueError(f"nbytes={nbytes!r} must be an int of at least {MEASURE_MIN_BYTES} (1 MiB): the tensor "
                         "the disk tier is timed on")
    cache = cache or os.path.join(os.path.expanduser("~"), ".cache", "autorecompute", "transfer.json")
    measured_for = {"format": MEASURE_CACHE_FORMAT, "torch": torch.__version__,
                    "directory": os.path.abspath(directory or tempfile.gettempdir()), "nbytes": int(nbytes)}
    if os.path.exists(cache):
        try:
            with open(cache) as f:
                saved = json.load(f)
            if saved.get("measured_for") == measured_for:
                return TransferModel(**saved["model"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            pass         # unreadable or another format: measure again
    with torch.random.fork_rng():         # a calibration leaves the caller's random stream where it was
        write, read = probes.disk_bytes_per_second(directory, nbytes)
        per_transfer = probes.transfer_seconds(directory, write, read)
    if per_transfer is None:         # nothing was offloaded to time: the default, as measured on the CI machine
        per_transfer = CPU_DISK.per_transfer_seconds
    model = replace(CPU_DISK, write_bytes_per_second=write, read_bytes_per_second=read,
                    per_transfer_seconds=per_transfer)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
        with open(cache, "w") as f:
            json.dump({"measured_for": measured_for, "model": asdict(model)}, f)
    except OSError as error:     # the figures are good: hand them back, and say why the next call measures again
        warnings.warn(f"measure(): cache={cache!r} cannot be written ({error.strerror or error}); the figures "
                      "are returned but not kept, so the next call measures again. Fix: pass cache= a writable "
                      "file path.", UserWarning, stacklevel=2)
    return model
