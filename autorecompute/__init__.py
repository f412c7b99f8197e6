"""autorecompute: fit PyTorch training into an absolute memory budget.

    >>> import autorecompute
    >>> autorecompute.parse_budget("12GB")
    12000000000
"""
from autorecompute.api import CompiledModule, compile, minimum_peak, plan
from autorecompute.budget import format_bytes, parse_budget
from autorecompute.errors import (AutorecomputeError, CaptureError, InfeasibleBudgetError,
                                  OffloadError, OverlappingStepsWarning, PartialBackwardWarning,
                                  ReplanningWarning)
from autorecompute.plan import Plan
from autorecompute.transfer import TransferModel

__all__ = ["compile", "plan", "minimum_peak", "parse_budget", "format_bytes", "Plan", "CompiledModule", "TransferModel",
           "InfeasibleBudgetError", "CaptureError", "OffloadError", "AutorecomputeError", "ReplanningWarning",
           "PartialBackwardWarning", "OverlappingStepsWarning"]
__version__ = "0.2.0"
