"""Python side effects of forward (issue #40): Python in forward runs once, at capture, and the captured graph
replays only tensor ops. A Python random draw is refused (training would silently differ); a clock read, a
changed attribute or a rebound global is warned of; each message names the line in forward."""
import inspect
import logging
import random
import re
import time
import warnings
from datetime import datetime
from time import perf_counter

import numpy as np
import pytest
import torch

import autorecompute
import models
from autorecompute.errors import CaptureError, CaptureSideEffectWarning
from autorecompute.passes.capture import capture
from harness import assert_bitwise_equal, measured_step

CALLS = 0       # the global a forward below counts its calls in
GENERATOR = random.random.__self__      # random's global generator, whose methods no wrapper stands for


def at_line(obj, text: str) -> str:
    """A pattern matching ``test_side_effects.py:<line>`` of the line of ``obj``'s source holding ``text``."""
    lines, first = inspect.getsourcelines(obj)
    line = first + next(i for i, source in enumerate(lines) if text in source)
    return re.escape(f"test_side_effects.py:{line}")


class Blocks(torch.nn.Module):
    def __init__(self, layers: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))


class PythonLayerDrop(Blocks):
    def forward(self, x):
        for block in self.blocks:
            if random.random() < 0.5:             # LayerDrop: skip the block
                continue
            x = x + torch.tanh(block(x))
        return x


class TorchLayerDrop(Blocks):
    """The same LayerDrop drawn with torch, as the error's fix says."""

    def forward(self, x):
        for block in self.blocks:
            x = torch.where(torch.rand(()) < 0.5, x, x + torch.tanh(block(x)))
        return x


def test_layerdrop_with_python_random_is_refused_naming_its_line():
    """The graph would keep capture's draw at every step (eager's losses differed on 2 of 4 steps): a
    CaptureError, raised at the compiled module's first call, naming the line of the draw and the fix; the
    patched functions are put back."""
    setattr_before, random_before = torch.nn.Module.__setattr__, random.random
    compiled = autorecompute.compile(PythonLayerDrop(), budget=1.0)
    with pytest.raises(CaptureError, match=at_line(PythonLayerDrop, "random.random()")) as refused:
        compiled(torch.randn(4, 8))
    assert "random.random() (3 times)" in str(refused.value) and "torch.rand" in str(refused.value)
    assert torch.nn.Module.__setattr__ is setattr_before and random.random is random_before


def test_numpy_draw_is_refused_naming_its_line():
    class Noise(Blocks):
        def forward(self, x):
            return self.blocks[0](x) * np.random.uniform(0.9, 1.1)

    with pytest.raises(CaptureError, match=at_line(Noise, "np.random.uniform")):
        capture(Noise(), (torch.randn(4, 8),), {})


def test_layerdrop_drawn_with_torch_captures_and_trains_as_eager():
    """The fix the error names: drawn with torch, the draw is part of the graph, replayed at each step."""
    model, x = TorchLayerDrop(), torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureSideEffectWarning)
        compiled = autorecompute.compile(model, budget=1.0)
        for seed in range(3):
            assert_bitwise_equal(measured_step(model, model, (x,), {}, seed),
                                 measured_step(compiled, model, (x,), {}, seed))


class CallCounter(Blocks):
    def __init__(self):
        super().__init__(layers=1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.blocks[0](x)


def test_call_counter_warns_naming_its_line():
    """torch.export undoes the attribute's change and the graph never makes it: after four calls of the
    compiled module the counter is still 0. A warning (the counter may only be bookkeeping), naming the line."""
    model = CallCounter()
    compiled = autorecompute.compile(model, budget=1.0)
    with pytest.warns(CaptureSideEffectWarning, match=at_line(CallCounter, "self.calls += 1")) as told:
        for _ in range(4):
            compiled(torch.randn(4, 8))
    assert "attribute calls of CallCounter (the model)" in str(told[0].message) and model.calls == 0


def test_counter_in_a_buffer_counts_every_call_silently():
    """The fix the warning names: a registered buffer updated with a tensor op is part of the graph."""
    class BufferCounter(Blocks):
        def __init__(self):
            super().__init__(layers=1)
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.calls.add_(1)
            return self.blocks[0](x)

    model = BufferCounter()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureSideEffectWarning)
        compiled = autorecompute.compile(model, budget=1.0)
        for _ in range(4):
            compiled(torch.randn(4, 8))
    assert model.calls.item() == 4


def test_global_counter_warns_naming_its_line():
    """A global rebound in forward changes once, at capture, and never again."""
    class GlobalCounter(Blocks):
        def forward(self, x):
            global CALLS
            CALLS += 1
            return self.blocks[0](x)

    with pytest.warns(CaptureSideEffectWarning, match=at_line(GlobalCounter, "CALLS += 1")) as told:
        capture(GlobalCounter(), (torch.randn(4, 8),), {})
    assert f"global CALLS of module {__name__}" in str(told[0].message)


def test_clock_read_warns_naming_its_line():
    """time.time() is read once, at capture; what forward computes from it is a constant of the graph."""
    class Clocked(Blocks):
        def forward(self, x):
            return self.blocks[0](x) * (time.time() % 1.0)

    with pytest.warns(CaptureSideEffectWarning, match=at_line(Clocked, "time.time()")):
        capture(Clocked(), (torch.randn(4, 8),), {})


def test_clocks_imported_by_name_warn_naming_their_lines():
    """``from time import perf_counter`` and ``from datetime import datetime`` in forward's module are seen
    too; what datetime makes while it is wrapped is a datetime still."""
    class Timed(Blocks):
        def forward(self, x):
            start = perf_counter()
            assert isinstance(datetime.now(), datetime)
            self.elapsed = perf_counter() - start
            return self.blocks[0](x)

    with pytest.warns(CaptureSideEffectWarning) as told:
        capture(Timed(), (torch.randn(4, 8),), {})
    clock = next(str(w.message) for w in told if "reads the clock" in str(w.message))
    assert re.search(at_line(Timed, "start = perf_counter()"), clock)
    assert re.search(at_line(Timed, "datetime.now()"), clock)


def test_draw_the_recorder_cannot_place_warns():
    """A draw through a function the export did not see called (bound elsewhere) still advances the
    generator: warned of, since it may be a library's own."""
    class Hidden(Blocks):
        def forward(self, x):
            return self.blocks[0](x) * GENERATOR.random()

    with pytest.warns(CaptureSideEffectWarning, match="could not see"):
        capture(Hidden(), (torch.randn(4, 8),), {})


def test_models_without_python_side_effects_capture_silently():
    """The zoo's GPT, and a forward that logs (the clock read is logging's, in the standard library)."""
    class Logging(Blocks):
        def forward(self, x):
            logging.getLogger(__name__).warning("forward")
            return self.blocks[0](x)

    case = models.make("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureSideEffectWarning)
        capture(case.model, case.args, case.kwargs)
        capture(Logging(), (torch.randn(4, 8),), {})
