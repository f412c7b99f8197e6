"""autorecompute: fit PyTorch training into an absolute memory budget.

    >>> import autorecompute
    >>> autorecompute.parse_budget("12GB")
    12000000000

Importing the package loads neither torch nor the planner: the names below that need them are imported on
first use, so ``autorecompute --help`` answers at once and ``import autorecompute`` costs what torch costs.
"""
from __future__ import annotations

import importlib

from autorecompute._version import __version__
from autorecompute.budget import format_bytes, parse_budget
from autorecompute.errors import (AutorecomputeError, CaptureError, CaptureSideEffectWarning, EngineError,
                                  InfeasibleBudgetError, OffloadError, OverlappingStepsWarning, PartialBackwardWarning,
                                  ReplanningWarning, StepOverBudgetWarning)
from autorecompute.plan import Plan

# the submodule autorecompute.plan, imported above, is not the package's ``plan``: that name is the function
# (__getattr__ below), as it is in the API; importing the submodule again leaves the name alone
del plan   # noqa: F821 — bound by the import of the submodule

# public name → the module that defines it, imported when the name is first read
_LAZY = {"compile": "autorecompute.api", "plan": "autorecompute.api", "minimum_peak": "autorecompute.api",
         "CompiledModule": "autorecompute.api",
         "TransferModel": "autorecompute.throughputs", "measure_peak": "autorecompute.runtime.memory"}

__all__ = ["compile", "plan", "minimum_peak", "measure_peak", "parse_budget", "format_bytes", "Plan",
           "CompiledModule", "TransferModel", "InfeasibleBudgetError", "CaptureError", "OffloadError", "EngineError",
           "AutorecomputeError", "ReplanningWarning", "PartialBackwardWarning", "OverlappingStepsWarning",
           "StepOverBudgetWarning",
           "CaptureSideEffectWarning",
           "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'autorecompute' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value          # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
