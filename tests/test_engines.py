"""torch.compile over a compiled module: the plan's step under dynamo keeps the budget and eager's gradients.

Dynamo traces the planned graph in pieces: it breaks the graph at every checkpointed region (non-reentrant
``torch.utils.checkpoint`` runs as a higher-order op it does not compile through with the region's side
effects) and at planning (``torch.compiler.disable``), so the regions run as planned and the ops between them
are compiled. Measured here with the live-storage tracker after two warm-up steps (compilation outside the
measured step). With ``aot_eager`` every op runs through the dispatcher, so the tracker sees what the step
holds. Inductor's fused kernels allocate their temporaries in C++, out of the tracker's sight, so a CPU peak
under inductor is not measured here (docs/user-guide.md has what was run by hand).
"""
import pytest
import torch

import autorecompute
import models
from conftest import SOLVER_TIME
from autorecompute.runtime.memory import output_tensors_for_backward
from harness import assert_bitwise_equal, measured_step

pytestmark = pytest.mark.slow


def compiled_twice_warmed(case, budget: float, backend: str):
    """``torch.compile(autorecompute.compile(model))`` after two training steps (planning and compiling)."""
    opt = autorecompute.compile(case.model, budget=budget, actions=("recompute",), loss_reserve=0,
                                solver_time_limit=SOLVER_TIME)
    traced = torch.compile(opt, backend=backend)
    torch._dynamo.reset()
    for _ in range(2):
        torch.manual_seed(1)
        tensors = output_tensors_for_backward(traced(*case.args, **case.kwargs))
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
    case.model.zero_grad(set_to_none=True)
    return opt, traced


@pytest.mark.parametrize("name", ["gpt", "llama", "resnet"])
def test_aot_eager_over_a_plan_keeps_its_budget_and_eager_gradients(name):
    case = models.make(name)
    eager = measured_step(case.model, case.model, case.args, case.kwargs, seed=1)
    case.model.zero_grad(set_to_none=True)
    opt, traced = compiled_twice_warmed(case, 0.6, "aot_eager")
    step = measured_step(traced, case.model, case.args, case.kwargs, seed=1)
    assert opt.plan.count("recompute") > 0
    assert step.peak <= opt.plan.budget < eager.peak
    assert_bitwise_equal(eager, step)
