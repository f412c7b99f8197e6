"""Budgets: parse what users write into bytes, and print bytes back for people."""
from __future__ import annotations

import math
import numbers
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

ACCEPTED_FORMS = (
    "accepted budgets: an int number of bytes > 0 (12_000_000_000); a string with an SI or IEC unit "
    "('12GB' = 12*10**9 bytes, '12GiB' = 12*2**30, '512 MB', '1.5GiB') or of whole bytes ('12000000'); or a "
    "float in (0, 1] meaning that fraction of the unoptimized peak (0.5, or the string '0.5')")


def parse_budget(budget: int | float | str) -> int | float:
    """Parses a memory budget.

    Returns an ``int`` number of bytes, or for a float in (0, 1] that same float (a fraction of the
    unoptimized peak, resolved once the peak is known).

    Example:
        >>> parse_budget("12GB")
        12000000000
        >>> parse_budget("1.5GiB")
        1610612736
        >>> parse_budget(0.5)
        0.5
        >>> parse_budget("0.5")      # a unitless decimal, as a command line gives it: a fraction
        0.5

    Raises:
        ValueError: for anything else; the message lists the accepted forms.
    """
    if isinstance(budget, bool):
        raise ValueError(f"budget {budget!r} is a bool; {ACCEPTED_FORMS}")
    if isinstance(budget, numbers.Integral) and not isinstance(budget, int):     # numpy.int64, a 0-d array's item
        budget = int(budget)
    elif isinstance(budget, numbers.Real) and not isinstance(budget, (int, float)):     # numpy.float32
        budget = float(budget)
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget {budget!r} must be > 0; {ACCEPTED_FORMS}")
        return budget
    if isinstance(budget, float):
        if not (0.0 < budget <= 1.0) or math.isnan(budget):
            raise ValueError(f"budget {budget!r} is a float outside (0, 1]; {ACCEPTED_FORMS}")
        return budget
    if isinstance(budget, str):
        match = _PATTERN.match(budget)
        unit = match and _UNITS.get(match.group(2).lower())
        if not match or unit is None:
            raise ValueError(f"budget {budget!r} is not understood; {ACCEPTED_FORMS}")
        number = float(match.group(1))
        if not math.isfinite(number):
            raise ValueError(f"budget {budget!r} is too large to be a number of bytes; {ACCEPTED_FORMS}")
        if not match.group(2) and "." in match.group(1):
            # a unitless decimal (from a command line or a config file): a fraction, as the float would be
            if 0.0 < number <= 1.0:
                return number
            raise ValueError(f"budget {budget!r} is a decimal without a unit: a fraction of the unoptimized peak "
                             f"must be in (0, 1], bytes a whole number or a size with a unit; {ACCEPTED_FORMS}")
        if unit == 1 and not number.is_integer():
            raise ValueError(f"budget {budget!r} is not a whole number of bytes; {ACCEPTED_FORMS}")
        nbytes = int(number * unit)
        if nbytes <= 0:
            raise ValueError(f"budget {budget!r} must be > 0 bytes; {ACCEPTED_FORMS}")
        return nbytes
    raise ValueError(f"budget {budget!r} of type {type(budget).__name__} is not understood; {ACCEPTED_FORMS}")


def resolve_budget(budget: int | float, baseline_peak: int) -> int:
    """Turns a parsed budget into bytes: a fraction applies to ``baseline_peak``."""
    return int(budget * baseline_peak) if isinstance(budget, float) else budget


def format_bytes(nbytes: float) -> str:
    """Human-readable IEC size: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    sign = "-" if nbytes < 0 else ""
    value = abs(float(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
