"""Verify: the exact peak of a (rewritten) module's training step, on fake tensors.

Fake and real runs allocate the same storages in the same order, so this is the peak a real step reaches
(kernel-internal scratch included on CUDA, where it is measured per op signature), had in seconds and without memory.
:func:`verify_plan` applies a plan and measures it: what the planner does with every candidate.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.fx

from autorecompute.decisions import Rewrite
from autorecompute.passes.apply_plan import apply_plan
from autorecompute.runtime import workspaces
from autorecompute.runtime.memory import StepMemory, measure_step, resident_bytes, run_step
from autorecompute.runtime.stash import StashRuntime
from autorecompute.passes.fake import fake_step


def fake_step_memory(module: torch.nn.Module, args: tuple, kwargs: dict, reserve: int = 0,
                     keep_outputs: bool = True) -> StepMemory:
    """Peak of forward + backward of ``module`` on fake copies of its state and inputs, ``reserve`` bytes
    held beside the outputs' gradients as backward starts (the caller's loss: ``run_step``), the outputs
    backward does not start from held through it or not (``keep_outputs``).

    The resident part is counted on the real state and inputs (fake storages are not tracked as "existing").
    """
    resident = resident_bytes(module, args, kwargs)

    def measured() -> StepMemory:
        with fake_step(module, args, kwargs) as (fake_args, fake_kwargs):
            return measure_step(module, fake_args, fake_kwargs,
                                step=partial(run_step, reserve=reserve, keep_outputs=keep_outputs))

    # CUDA op signatures the profile did not meet (a rewrite's copies) are measured, then the step again
    return StepMemory(resident=resident, tracked_peak=workspaces.with_workspaces(measured).tracked_peak)


def verify_plan(gm: torch.fx.GraphModule, rewrite: Rewrite, runtime: StashRuntime | None, args: tuple,
                kwargs: dict, reserve: int = 0, keep_outputs: bool = True) -> tuple[torch.nn.Module, int]:
    """(the module carrying ``rewrite`` out on a copy of ``gm``, the peak of its training step): a candidate
    plan as the planner measures it. Its calls keep their ``OpOverload`` (``apply_plan(bind_calls=False)``):
    the bindings dispatch the same kernels and allocations, and are found for the module that runs only."""
    module = apply_plan(gm, rewrite, runtime, bind_calls=False)
    return module, fake_step_memory(module, args, kwargs, reserve, keep_outputs).peak
