"""At the peak that naive √N checkpointing reaches, the plan recomputes fewer FLOPs (FlopCounterMode)."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import autorecompute
import models
from autorecompute.baselines import SqrtNCheckpointed
from harness import measured_step


def step_flops(module, case) -> int:
    with FlopCounterMode(display=False) as counter:
        out = module(*case.args, **case.kwargs)
        out.backward(torch.ones_like(out))
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
