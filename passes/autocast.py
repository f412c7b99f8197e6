"""The caller's ``torch.autocast`` state: part of what a plan is made for (the step's dtypes), and what decides
whether capture may split attention into its ops."""
from __future__ import annotations

import torch

# device types whose enclosing torch.autocast changes the step a plan is made for
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "privateuseone")


def callers_autocast(devices: tuple[str, ...] | set[str] = ()) -> list[tuple[str, torch.dtype]]:
    """The enclosing ``torch.autocast`` regions of this thread, as (device type, dtype), over
    :data:`AUTOCAST_DEVICES` and ``devices``, in name order."""
    entered = []
    for device_type in sorted({*AUTOCAST_DEVICES, *devices}):
        try:
            if torch.is_autocast_enabled(device_type):
                entered.append((device_type, torch.get_autocast_dtype(device_type)))
        except (RuntimeError, ValueError):      # a device type autocast does not know (meta): nothing to record
            continue
    return entered
