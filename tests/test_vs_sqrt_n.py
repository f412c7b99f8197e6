"""At the peak that naive √N checkpointing reaches, the plan recomputes fewer FLOPs (FlopCounterMode)."""
import pytest
from torch.utils.flop_counter import FlopCounterMode

import autorecompute
import models
from autorecompute.baselines import SqrtNCheckpointed
from autorecompute.runtime.memory import run_step
from harness import measured_step


def step_flops(module, case) -> int:
    with FlopCounterMode(display=False) as counter:
        run_step(module, case.args, case.kwargs)
    return counter.get_total_flops()


@pytest.mark.parametrize("name, blocks", [("gpt", "blocks"), ("mlp", "layers")])
def test_fewer_recompute_flops_than_sqrt_n_at_its_peak(name, blocks):
    case = models.make(name)
    model = case.model
    sqrt_n = SqrtNCheckpointed(model, blocks)
    eager_flops = step_flops(model, case)
    sqrt_n_peak = measured_step(sqrt_n, model, case.args, case.kwargs).peak
    sqrt_n_extra = step_flops(sqrt_n, case) - eager_flops
    compiled = autorecompute.compile(model, budget=sqrt_n_peak, actions=("recompute",))
    ours = measured_step(compiled, model, case.args, case.kwargs)
    ours_extra = step_flops(compiled, case) - eager_flops
    print(f"{name}: √N peak {sqrt_n_peak}, √N extra FLOPs {sqrt_n_extra}; ours peak {ours.peak}, "
          f"extra FLOPs {ours_extra} (plan says {compiled.plan.extra_flops})")
    assert ours.peak <= sqrt_n_peak
    assert ours_extra < sqrt_n_extra


@pytest.mark.parametrize("name", ["gpt", "mlp", "llama"])
def test_plan_counts_the_flops_backward_runs_again(name):
    """The plan's extra FLOPs are FlopCounterMode's: a region is recomputed only up to its last save
    (checkpoint's early stop), so a matmul ending a region is not run again and not counted."""
    case = models.make(name)
    eager_flops = step_flops(case.model, case)
    eager_peak = measured_step(case.model, case.model, case.args, case.kwargs).peak
    compiled = autorecompute.compile(case.model, budget=0.6, actions=("recompute",), objective="flops")
    compiled.prepare(*case.args, **case.kwargs)
    assert compiled.plan.extra_flops > 0
    assert step_flops(compiled, case) - eager_flops == compiled.plan.extra_flops
    assert measured_step(compiled, case.model, case.args, case.kwargs).peak <= 0.6 * eager_peak
