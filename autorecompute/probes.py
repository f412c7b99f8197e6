"""Timings of this machine that the cost model's throughputs come from: what :func:`autorecompute.transfer.measure`
runs. Each probe times the thing the planner prices — a matmul, a memory-bound op, a dropout, one call, one
checkpointed region, the disk tier, and one offloaded tensor through the stash runtime — rather than scaling
one figure by another: a machine whose matmuls are twice as fast does not run Python hooks twice as fast.

A probe of one op takes the least of repeated runs (a busy moment only adds time); a probe of a difference
times both sides in turn, round after round, and takes the medians (a slow moment hits both alike).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

# a memory-bound op writes this many bytes in the probe: large enough that its dispatch is a small part of it,
# small enough to stay in the caches a recomputed activation of a small model lives in
MEMORY_PROBE_BYTES = 1 << 20
# the stash runtime's probe: a chain of small tensors (bytes cost next to nothing, the hooks and nodes all)
TRANSFER_PROBE_LAYERS = 12
TRANSFER_PROBE_SHAPE = (64, 32)


def _least_seconds(run: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """The least over ``repeats`` of the time ``inner`` calls of ``run`` take, per call (after one warm-up)."""
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(inner):
            run()
        times.append((time.perf_counter() - started) / inner)
    return min(times)


def _paired_medians(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each of ``runs``, timed in turn round after round (a slow moment hits all alike)."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def matmul_flops_per_second(size: int = 1024) -> float:
    """FLOP/s of a ``size``² float32 matmul, the op that dominates recomputed FLOPs."""
    a = torch.randn(size, size)
    return 2 * size**3 / _least_seconds(lambda: a @ a, repeats=8)


def op_seconds() -> float:
    """The fixed cost of one op: a one-element add called as a captured graph calls it (an aten overload,
    its input requiring grad as in a recomputation, so autograd records it) — no bytes to speak of."""
    a, b = torch.ones(1, requires_grad=True), torch.ones(1)
    return _least_seconds(lambda: torch.ops.aten.add.Tensor(a, b), repeats=20, inner=200)


def memory_bytes_per_second(per_op: float) -> float:
    """Bytes a memory-bound op (a product of two tensors) writes per second, its fixed cost ``per_op`` taken
    out."""
    x, y = torch.randn(MEMORY_PROBE_BYTES // 4), torch.randn(MEMORY_PROBE_BYTES // 4)
    seconds = _least_seconds(lambda: torch.mul(x, y), repeats=30)
    return MEMORY_PROBE_BYTES / max(seconds - per_op, seconds / 2)


def random_bytes_per_second(per_op: float, memory: float) -> float:
    """Bytes of random numbers a dropout draws per second (one per element of its result), its call and
    written bytes taken out, as the planner adds the three."""
    x = torch.randn(MEMORY_PROBE_BYTES // 4)
    seconds = _least_seconds(lambda: torch.nn.functional.dropout(x, 0.1, training=True), repeats=30)
    # drawing dominates a dropout on a CPU; should the memory probe have been slow, keep half of it for drawing
    drawing = max(seconds - per_op - MEMORY_PROBE_BYTES / memory, seconds / 2)
    return MEMORY_PROBE_BYTES / drawing


def region_seconds() -> float:
    """Forward + backward cost of one recomputed region beyond its ops: the runtime's own checkpoint call
    around a one-op body against that body run plainly."""
    import torch.fx

    from autorecompute.runtime.regions import CheckpointRegion

    body = torch.fx.symbolic_trace(lambda recomputing, x: (x.sin(),))
    region = CheckpointRegion(body, preserve_rng_state=False)
    x = torch.ones(16, requires_grad=True)
    medians = _paired_medians({"plain": lambda: body(False, x)[0].sum().backward(),
                               "region": lambda: region(x)[0].sum().backward()}, repeats=200)
    return max(0.0, medians["region"] - medians["plain"])


def disk_bytes_per_second(directory: str | None, nbytes: int) -> tuple[float, float]:
    """Write and read speed of the disk tier in ``directory`` for one ``nbytes`` tensor, in the step's
    steady state (the second round, when the file's pages exist)."""
    from autorecompute.runtime.tiers import DiskTier

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
    import autorecompute
    from autorecompute.errors import InfeasibleBudgetError

    width = TRANSFER_PROBE_SHAPE[1]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                      for _ in range(TRANSFER_PROBE_LAYERS)])
    x = torch.randn(TRANSFER_PROBE_SHAPE)
    try:
        autorecompute.plan(model, x, budget=1, actions=("offload",), offload_dir=directory, solver_time_limit=1.0)
        return None                      # cannot happen: one byte is below any model's minimum
    except InfeasibleBudgetError as error:
        minimum = error.minimum
    offloading = autorecompute.compile(model, budget=minimum, actions=("offload",), offload_dir=directory,
                                       solver_time_limit=1.0)
    keeping = autorecompute.compile(model, budget=1.0, actions=("offload",), offload_dir=directory,
                                    solver_time_limit=1.0)

    def step(module):
        return lambda: (module.zero_grad(set_to_none=True), module(x).sum().backward())

    medians = _paired_medians({"offloading": step(offloading), "keeping": step(keeping)}, repeats=60)
    records = [r for r in offloading.plan.stash.values() if r.action.startswith("offload")]
    if not records:
        return None
    moved = sum(r.nbytes for r in records)
    bytes_time = moved / write_bytes_per_second + moved / read_bytes_per_second
    return max(0.0, medians["offloading"] - medians["keeping"] - bytes_time) / (2 * len(records))
