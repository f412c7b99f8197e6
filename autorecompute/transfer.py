"""The cost model's throughputs (:class:`TransferModel` and each device's defaults), and :func:`measure`, which
times this machine's CPU offload path once (:mod:`autorecompute.probes`) and caches the result.

The throughputs are defined in :mod:`autorecompute.throughputs`, which the planning pipeline imports;
this module adds ``measure``, which runs that pipeline, and is where users find both.
"""
from __future__ import annotations

import json
import numbers
import os
import tempfile
import warnings
from dataclasses import asdict, replace

import torch

from autorecompute import probes
from autorecompute.throughputs import (CPU_DISK, CUDA_HOST, TIE_BREAK_BYTES_PER_FLOP, TransferModel,
                                              counting_flops, default_for)

__all__ = ["TransferModel", "CPU_DISK", "CUDA_HOST", "TIE_BREAK_BYTES_PER_FLOP", "counting_flops", "default_for",
           "measure", "MEASURE_MIN_BYTES", "MEASURE_CACHE_FORMAT"]

MEASURE_MIN_BYTES = 1 << 20
# the layout of measure()'s cache file and what it measures: a cache of another format is measured again
MEASURE_CACHE_FORMAT = 4


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
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < MEASURE_MIN_BYTES:
        # a few bytes time the call, not the disk
        raise ValueError(f"nbytes={nbytes!r} must be an int of at least {MEASURE_MIN_BYTES} (1 MiB): the tensor "
                         "the disk tier is timed on")
    cache = cache or os.path.join(os.path.expanduser("~"), ".cache", "autorecompute", "transfer.json")
    measured_for = {"format": MEASURE_CACHE_FORMAT, "torch": torch.__version__,
                    "directory": os.path.abspath(directory or tempfile.gettempdir()), "nbytes": int(nbytes)}
    cached = _read_cache(cache, measured_for)
    if cached is not None:
        return cached
    with torch.random.fork_rng():         # a calibration leaves the caller's random stream where it was
        write, read = probes.disk_bytes_per_second(directory, nbytes)
        per_transfer = probes.transfer_seconds(directory, write, read)
    if per_transfer is None:         # nothing was offloaded to time: the default, as measured on the CI machine
        per_transfer = CPU_DISK.per_transfer_seconds
    model = replace(CPU_DISK, write_bytes_per_second=write, read_bytes_per_second=read,
                    per_transfer_seconds=per_transfer)
    _write_cache(cache, measured_for, model)
    return model


def _read_cache(cache: str, measured_for: dict) -> TransferModel | None:
    """The model ``cache`` holds when it was measured for ``measured_for``, else None."""
    if not os.path.exists(cache):
        return None
    try:
        with open(cache) as f:
            saved = json.load(f)
        if saved.get("measured_for") == measured_for:
            return TransferModel(**saved["model"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass         # unreadable or another format: measure again
    return None


def _write_cache(cache: str, measured_for: dict, model: TransferModel) -> None:
    try:
        os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
        with open(cache, "w") as f:
            json.dump({"measured_for": measured_for, "model": asdict(model)}, f)
    except OSError as error:     # the figures are good: hand them back, and say why the next call measures again
        warnings.warn(f"measure(): cache={cache!r} cannot be written ({error.strerror or error}); the figures "
                      "are returned but not kept, so the next call measures again. Fix: pass cache= a writable "
                      "file path.", UserWarning, stacklevel=3)
