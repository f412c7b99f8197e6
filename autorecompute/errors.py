"""Typed errors. Each message names the cause and the way out."""
from __future__ import annotations

import math
import os
import sys

from autorecompute.budget import format_bytes


class AutorecomputeError(Exception):
    """Base class of this package's errors."""


class CaptureError(AutorecomputeError, RuntimeError):
    """The model could not be captured as a graph by ``torch.export``."""


class InfeasibleBudgetError(AutorecomputeError, ValueError):
    """No plan with the allowed actions fits the budget.

    Attributes:
        budget: the budget asked for, in bytes.
        minimum: the smallest budget that works, in bytes (pass it back to ``compile``).
        breakdown: bytes by kind at the minimum peak (parameters, buffers, inputs, gradients, activations).
    """

    def __init__(self, budget: int, minimum: int, breakdown: dict[str, int], actions: tuple[str, ...],
                 fraction: float | None = None, baseline: int | None = None):
        self.budget = budget
        self.minimum = minimum
        self.breakdown = dict(breakdown)
        rows = "\n".join(f"    {kind:<12} {format_bytes(n):>12}" for kind, n in breakdown.items())
        # what the model itself holds at the end of backward, whatever the actions and the batch
        state = sum(n for kind, n in breakdown.items() if kind in _MODEL_STATE)
        fixes = [f"pass budget>={minimum}"]
        if fraction is not None and baseline:      # asked as a fraction: answered as one too
            needed = least_fraction(minimum, baseline)
            fixes[0] += (f" (a fraction of at least {needed!r})" if needed < 1 else
                         " (1.0: nothing goes below the unoptimized peak here)")
        elif budget < 1024:     # budget=1 meant as "all of it"
            fixes[0] += " (an int budget is bytes: a fraction of the unoptimized peak is a float, 1.0 for all of it)"
        missing = tuple(a for a in ("recompute", "offload", "compress") if a not in actions)
        if budget < state:
            fixes.append(f"shrink the model: its parameters, buffers and gradients alone take {format_bytes(state)}"
                         ", which no action or batch size lowers")
        else:
            if missing:
                fixes.append(f"allow more actions (e.g. actions={tuple(actions) + missing[:1]!r})")
            fixes.append("shrink the batch")
        super().__init__(
            f"budget {format_bytes(budget)} ({budget} bytes"
            f"{f', {fraction:g} of the unoptimized peak' if fraction else ''}) is below the minimum peak "
            f"{format_bytes(minimum)} "
            f"({minimum} bytes) reachable with actions {actions}.\n"
            f"  The minimum peak is made of:\n{rows}\n"
            f"  Fix: {', or '.join(fixes)}.")
        self._arguments = (budget, minimum, breakdown, actions, fraction, baseline)

    def __reduce__(self):       # (pickled across processes: a DataLoader worker's, multiprocessing's)
        return type(self), self._arguments


def least_fraction(minimum: int, baseline: int) -> float:
    """The shortest decimal fraction ``f`` whose budget, ``int(f * baseline)`` as the planner reads it, is at
    least ``minimum`` (1.0 when nothing is below the baseline)."""
    if minimum >= baseline:
        return 1.0
    for digits in range(3, 10):
        scale = 10 ** digits
        needed = math.ceil(minimum / baseline * scale) / scale
        while int(needed * baseline) < minimum:        # (the float product can land a byte short)
            needed = round(needed + 1 / scale, digits)
        if needed < 1:
            return needed
    return 1.0


_MODEL_STATE = ("parameters", "buffers", "gradients", "new gradients")


class SolverError(AutorecomputeError, RuntimeError):
    """The solver failed in a way that is a bug in autorecompute: please report it."""


class OffloadError(AutorecomputeError, OSError):
    """Offloading an activation failed (a directory that cannot be written, a full disk): the step stops
    rather than lose the tensor. The message names the tensor, the path and the fix."""


class EngineError(AutorecomputeError, RuntimeError):
    """The engine that runs the step (``torch.compile``, a distributed wrapper) cannot carry out what the
    compiled module was asked to do within the budget. The message names the combination that can."""


class ReplanningWarning(UserWarning):
    """A compiled module has planned many input signatures: inputs whose shapes change from step to step are
    captured and solved again each time (seconds), and each plan is kept."""


class StepOverBudgetWarning(UserWarning):
    """A plan's first step, measured as the caller ran it, went over its budget: the caller's code between
    forward and backward held more than the plan's reserve. The step is planned again with what it held."""


class PartialBackwardWarning(UserWarning):
    """A step ran backward from only some of the outputs its plan expects gradients for: the others' saved
    activations stay on the device through that backward, which the plan did not count."""


class OverlappingStepsWarning(UserWarning):
    """A forward began while the graph of an earlier forward of the same compiled module, whose backward has
    not run, was still alive (two forwards, then one backward): the plan covers one forward and its backward,
    so both forwards' saved activations were on the device at once, which the plan did not count."""


class CaptureSideEffectWarning(UserWarning):
    """Python in ``forward`` did, while the model was captured, what the captured graph does not repeat at
    each step: it read the clock, changed a module attribute or global that is not a tensor, or advanced a
    random generator through a call autorecompute could not place. The message names the line and the fix.
    (A draw from Python's ``random`` or numpy's global generator at a line it can name is a ``CaptureError``:
    every step would repeat capture's draw, so training would differ.)"""


def user_stacklevel(in_backward: bool = False) -> int:
    """The ``stacklevel`` of a warning raised by the caller of this function that names the first frame outside
    autorecompute (its passes included), torch.nn (forward runs under nn.Module's call machinery, one frame
    more with hooks or Module.compile()) and torch._dynamo: the user's line that made the step.
    ``in_backward``: a hook the autograd engine calls, outside all of torch (the user's ``loss.backward()``)."""
    return _user_frame(in_backward)[0]


def user_location(in_backward: bool = False) -> tuple[str, int] | None:
    """``(filename, line)`` of the frame :func:`user_stacklevel` names, or None where the stack has none (a
    backward hook on autograd's device threads, which run no Python frame of the user's)."""
    frame = _user_frame(in_backward)[1]
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def _user_frame(in_backward: bool):
    """``(stacklevel, frame)`` of the first frame outside the library paths, counted from the caller of the
    function that called this one (frame None where the stack ends first)."""
    inside = _library_paths(in_backward)
    level, frame = 1, sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        level, frame = level + 1, frame.f_back
    return level, frame


def _library_paths(in_backward: bool) -> tuple[str, ...]:
    """autorecompute, and the torch packages between it and the user: nn.Module's call machinery and dynamo's
    (planning runs under ``torch.compiler.disable``), all of torch from a backward hook."""
    import torch._dynamo
    import torch.nn

    import autorecompute.passes

    torch_parts = [torch.__file__] if in_backward else [torch.nn.__file__, torch._dynamo.__file__]
    return tuple(os.path.join(path, "") for path in (
        os.path.dirname(__file__), *autorecompute.passes.__path__, *map(os.path.dirname, torch_parts)))
