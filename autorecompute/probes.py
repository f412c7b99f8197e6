"""Timings of this machine that :func:`autorecompute.transfer.measure` sets the offload figures of the cost model
from: the disk tier's throughput on one large tensor, and the fixed cost of one transfer timed through the
runtime — an offload plan of a chain of small tensors against the same chain kept, the bytes' time taken out
(its hooks, stash nodes, bookkeeping and system calls: what a copy costs besides its bytes).

Recomputation is not timed here. Its figures (kernels' speeds, a call, a region) are the defaults, fitted on
whole steps of the CI CPU: kernels and calls timed one by one miss what a call inside a checkpoint pays for
its hooks and a region for its inputs and outputs, scaling the defaults by a matmul's speed misses them too,
and factors fitted on recompute plans of probe models move from run to run. A fit that holds from model to
model needs evidence from more machines than one.

Each difference is timed on both sides in turn, round after round, and the medians taken (a slow moment hits
both alike).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from autorecompute.decisions import ActionKind
from autorecompute.runtime.tiers import DiskTier

# the transfer probe: a chain of small tensors (bytes cost next to nothing, the hooks and nodes all)
TRANSFER_PROBE_LAYERS = 12
TRANSFER_PROBE_SHAPE = (64, 32)


def _paired_medians(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each of ``runs``, timed in turn round after round (after one warm-up round)."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def _training_step(module, x) -> Callable[[], object]:
    def step():
        module.zero_grad(set_to_none=True)
        module(x).sum().backward()
    return step


def disk_bytes_per_second(directory: str | None, nbytes: int) -> tuple[float, float]:
    """Write and read speed of the disk tier in ``directory`` for one ``nbytes`` tensor, in the step's
    steady state (the second round, when the file's pages exist)."""
    data = torch.randn(nbytes // 4)
    target = torch.empty_like(data)
    tier = DiskTier(directory)
    try:
        for _ in range(2):
            started = time.perf_counter()
            stored, _ = tier.store(data, "probe")
            write = time.perf_counter() - started
            started = time.perf_counter()
            tier.load(stored, target, "probe").wait()
            read = time.perf_counter() - started
            tier.release(stored)
    finally:
        tier.close()
    return nbytes / write, nbytes / read


def transfer_seconds(directory: str | None, write_bytes_per_second: float,
                     read_bytes_per_second: float) -> float | None:
    """The fixed cost of one transfer (half an offloaded tensor's round trip) through the stash runtime:
    its hooks, stash nodes, bookkeeping and system calls, on a chain of small tensors planned at its
    offload-only minimum, against the same chain planned to keep everything; the bytes' time taken out.

    Returns None when the plan offloaded nothing (nothing to time)."""
    # the planner, imported when a probe runs: importing autorecompute.transfer, which imports this module,
    # does not load it
    from autorecompute import api

    width = TRANSFER_PROBE_SHAPE[1]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                      for _ in range(TRANSFER_PROBE_LAYERS)])
        x = torch.randn(TRANSFER_PROBE_SHAPE)
    options = dict(actions=("offload",), offload_dir=directory, solver_time_limit=1.0)
    offloading = api.compile(model, budget=api.minimum_peak(model, x, **options), **options)
    keeping = api.compile(model, budget=1.0, **options)
    medians = _paired_medians({"offloading": _training_step(offloading, x),
                               "keeping": _training_step(keeping, x)}, repeats=60)
    records = [r for r in offloading.plan.stash.values() if r.kind is ActionKind.OFFLOAD]
    if not records:
        return None
    moved = sum(r.nbytes for r in records)
    bytes_time = moved / write_bytes_per_second + moved / read_bytes_per_second
    return max(0.0, medians["offloading"] - medians["keeping"] - bytes_time) / (2 * len(records))
