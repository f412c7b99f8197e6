"""The first step of a plan, measured as the caller runs it: from its forward to the end of its backward.

The plan bounds the step it models: the module's forward and backward, and a reserve for what the caller's
code holds between them (a loss over the outputs: ``loss_reserve="auto"``). A caller's code can hold more (a
custom loss with large temporaries, logits kept in two dtypes). On CUDA, :class:`FirstStep` reads what the
step really reaches, the caller's code included, from the caching allocator's peak, so that a step that went
over its budget is planned again with what it held (``CompiledModule``).

Not on the CPU: a live-storage tracker would have to stay on the thread's dispatch-mode stack from the forward
to the end of a backward, but the autograd engine runs backward on its own copy of that stack, so a tracker
could only leave it at the caller's next call, and one left there (after the last step) would slow and
change everything the program runs afterwards.
"""
from __future__ import annotations

import torch

from autorecompute.runtime.memory import output_tensors_for_backward


class FirstStep:
    """The peak of one training step on a CUDA device, from :meth:`start` (before the forward) to the end of
    the backward that reaches one of the outputs given to :meth:`watch`: ``torch.cuda.max_memory_allocated``,
    everything on the device counted, as the budget counts it there."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak: int | None = None
        self._open = True

    @classmethod
    def start(cls, model: torch.nn.Module, args: tuple, kwargs: dict) -> "FirstStep | None":
        """Starts measuring; None off CUDA (see the module's docstring)."""
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type != "cuda":
            return None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return cls(device)

    @property
    def done(self) -> bool:
        return self.peak is not None

    def watch(self, outputs) -> None:
        """Ends the measurement when backward, started from any of ``outputs``' differentiable tensors, ends."""
        tensors = [t for t in output_tensors_for_backward(outputs) if t.grad_fn is not None]
        if not tensors:
            self.close()
            return
        queued = []

        def reached(grad):
            if not queued:
                queued.append(True)
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        for tensor in tensors:
            tensor.register_hook(reached)

    def _finish(self) -> None:
        if self._open:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self._open = False

    def close(self) -> None:
        """Stops measuring (without a result if backward has not ended: the next step is measured instead)."""
        self._open = False
