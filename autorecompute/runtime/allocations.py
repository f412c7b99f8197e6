"""The CPU allocator's view of a step: every allocation ``torch.profiler`` records, tensor storage or not."""
from __future__ import annotations

from typing import Any, Callable

import torch  # noqa: F401 — the example runs in this module's namespace


def allocated_peak(step: Callable[[], Any]) -> int:
    """The most bytes ``step()`` has allocated on the CPU and not yet freed at once, from the allocator's events
    as ``torch.profiler`` records them: every allocation, kernels' scratch and ``torch.compile``'d graphs
    included. A :class:`LiveStorageTracker` sees tensor storages only, and under it dynamo runs a compiled
    module eagerly; this is how a compiled step is measured on a CPU. Memory allocated before the step and
    freed inside it is not subtracted (as the tracker ignores it).

    Example:
        >>> allocated_peak(lambda: torch.ones(256, 256) * 2) >= 2 * 256 * 256 * 4
        True
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr))
        stack.extend(event.children)
    live, current, peak = {}, 0, 0
    for _, size, ptr in sorted(events, key=lambda e: e[0]):   # stable: same-time events keep the tree's order
        if size > 0:
            live[ptr] = live.get(ptr, 0) + size
            current += size
        elif ptr in live:
            current -= live.pop(ptr)
        peak = max(peak, current)
    return peak
