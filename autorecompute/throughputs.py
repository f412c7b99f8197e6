"""The throughputs the cost model turns FLOPs, bytes and calls into time with: what recomputing an op costs,
and what an offload transfer costs against the compute that can hide it.

Defaults are conservative figures for each device, not measured: plans stay reproducible from machine to
machine. :func:`autorecompute.transfer.measure` times this machine's CPU offload path. This module imports
nothing of autorecompute: the planning pipeline prices with it, and ``measure``, which runs that pipeline,
builds on it.
"""
from __future__ import annotations

import math
import numbers
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


# CPU (measured on the 2-core CI machine): ~100 GFLOP/s on mid-sized matmuls; the disk
# tier writes and reads its file in the page cache at 8-15 GB/s on the calling thread for tensors of 256 KiB
# and more (smaller ones pay the fixed cost below), and an offloaded tensor costs ~60-80 µs of hooks, stash
# nodes and system calls besides its bytes; GELU writes ~4 GB/s after ~10 µs of
# dispatch, dropout draws ~0.3 GB/s of numbers (bernoulli), a non-reentrant checkpoint call costs ~430 µs of
# forward + backward overhead, a rematerialized tensor ~200 µs of hooks and bookkeeping besides its op.
CPU_DISK = TransferModel(flops_per_second=100e9, write_bytes_per_second=8e9, read_bytes_per_second=8e9,
                         per_transfer_seconds=40e-6, memory_bytes_per_second=4e9, random_bytes_per_second=0.35e9,
                         op_seconds=10e-6, region_seconds=400e-6, stash_seconds=200e-6, overlaps_compute=False)
# CUDA: PCIe Gen4/5 pinned copies ~20 GB/s each way; a large GPU sustains ~100 TFLOP/s in bf16 matmuls and
# ~2 TB/s in elementwise kernels (Philox dropout about as fast); a launch from eager Python ~10 µs.
CUDA_HOST = TransferModel(flops_per_second=100e12, write_bytes_per_second=20e9, read_bytes_per_second=20e9,
                          per_transfer_seconds=20e-6, memory_bytes_per_second=1e12, random_bytes_per_second=1e12,
                          op_seconds=10e-6, region_seconds=200e-6, stash_seconds=50e-6)


# Bytes a memory-bound op writes per FLOP-equivalent under the FLOPs objective: at one byte per FLOP, rewriting
# 4 MiB of elementwise results would weigh as much as a 4-MFLOP matmul, and a least-FLOPs plan could run the
# matmul again instead of the elementwise ops.
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
