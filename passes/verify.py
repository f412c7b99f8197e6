"""Verify: the exact peak of a (rewritten) module's training step, on fake tensors.

Fake and real runs allocate the same storages in the same order, so this is the peak a real step reaches
(kernel-internal scratch included on CUDA, where it is measured per op signature), had in seconds and without memory.
"""
from __future__ import annotations

from functools import partial

import torch

from autorecompute.runtime import workspaces
from autorecompute.runtime.memory import StepMemory, measure_step, resident_bytes, run_step
from autorecompute.passes.fake import fake_step


def fake_step_memory(module: torch.nn.Module, args: tuple, kwargs: dict, reserve: int = 0) -> StepMemory:
    """Peak of forward + backward of ``module`` on fake copies of its state and inputs, ``reserve`` bytes
    held beside the outputs' gradients as backward starts (the caller's loss: ``run_step``).

    The resident part is counted on the real state and inputs (fake storages are not tracked as "existing").
    """
    resident = resident_bytes(module, args, kwargs)

    def measured() -> StepMemory:
        with fake_step(module, args, kwargs) as (fake_args, fake_kwargs):
            return measure_step(module, fake_args, fake_kwargs, step=partial(run_step, reserve=reserve))

    # CUDA op signatures the profile did not meet (a rewrite's copies) are measured, then the step again
    return StepMemory(resident=resident, tracked_peak=workspaces.with_workspaces(measured).tracked_peak)
