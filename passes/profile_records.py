"""What the profile pass records: :class:`TensorInfo` per activation storage, :class:`NodeInfo` per op,
:class:`StepProfile` for the step. Each record is built once, when the step has run, and never changed:
later passes read the same profile whatever order they run in."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorInfo:
    """One activation storage created during forward."""

    name: str                 # the first graph value that is this tensor (producer or its getitem)
    owner: str                # the op node that allocates it (the node whose recomputation drops it)
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    birth: int                # forward position of ``owner``
    last_forward_use: int     # last forward position that reads it (graph outputs: the last position)
    savers: list[str] = field(default_factory=list)     # op nodes whose backward saved it
    readers: list[str] = field(default_factory=list)    # op nodes that read it in forward
    is_output: bool = False


@dataclass(frozen=True)
class NodeInfo:
    """What the profile pass learned about one ``call_function`` node."""

    position: int
    flops: int
    creates: list[str]        # tensors (by name) whose storage this node allocates
    reads: list[str]          # activation tensors it reads
    saves: list[str]          # activation tensors autograd keeps for its backward
    saves_static_bytes: int   # bytes it saves that are parameters / inputs (always resident)
    backward_event: int | None  # index into StepProfile.backward_events, None if it has no backward
    forward_peak: int         # tracked bytes at the peak of its execution
    module_path: str
    # FLOPs it has run when autograd packs its last saved tensor: what checkpoint's early stop runs of it
    # again when it is a region's last saver (a 4-D matmul saves its internal copy before its bmm: 0)
    flops_before_last_save: int = 0


@dataclass(frozen=True)
class StepProfile:
    """Graph-level result of the profile pass (``gm.meta["autorecompute"]``)."""

    resident: dict[str, int]                      # parameters, buffers, inputs, gradients (existing)
    tensors: dict[str, TensorInfo]
    order: list[str]                              # call_function nodes in forward order
    forward_peaks: list[int]                      # tracked bytes per forward position
    backward_events: list[str]                    # node names, in the order their backward ran
    backward_peaks: list[int]                     # tracked bytes per backward event
    parameter_grad_bytes: int
    tracked_peak: int
    # tracked bytes as each backward event starts: a saved tensor is unpacked then, before the event's own
    # allocations (its gradients), so what a recipe makes at that moment shares the event's headroom
    backward_starts: list[int] = field(default_factory=list)
    # bytes held beside the outputs' gradients as backward starts: the caller's loss (``run_step``)
    loss_reserve: int = 0

    def headroom(self, event: int) -> int:
        """Bytes backward event ``event`` allocates above what was live as it started (0 when unknown)."""
        if not 0 <= event < min(len(self.backward_peaks), len(self.backward_starts)):
            return 0
        return max(0, self.backward_peaks[event] - self.backward_starts[event])

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    @property
    def peak(self) -> int:
        return self.resident_bytes + self.tracked_peak
