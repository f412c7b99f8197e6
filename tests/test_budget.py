import re

import pytest

import autorecompute
from autorecompute.budget import format_bytes, resolve_budget


@pytest.mark.parametrize("text, expected", [
    ("12GB", 12_000_000_000), ("12GiB", 12 * 2**30), ("512 MB", 512_000_000), ("1.5GiB", int(1.5 * 2**30)),
    ("100", 100), ("64KiB", 65536), ("2 tb", 2 * 10**12), (4096, 4096), (0.5, 0.5), (1.0, 1.0),
    ("0.5", 0.5), ("1.0", 1.0), ("1e9", 10**9), ("1.5KB", 1500)])
def test_accepted_forms(text, expected):
    assert autorecompute.parse_budget(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", -1, 0, 1.5, None, 0.0, "", "GB", True, [1], float("nan"), "-5GB",
                                 "1.5", "inf", "0.0", "2.0", "1e400MB", "1.5B", "2.5"])
def test_bad_budgets_name_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="accepted budgets"):
        autorecompute.parse_budget(bad)


def test_fraction_resolves_against_baseline():
    assert resolve_budget(0.5, 1000) == 500
    assert resolve_budget(700, 1000) == 700


def test_format_bytes():
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(512) == "512 B"


def test_compile_rejects_bad_budget_at_once():
    import torch
    with pytest.raises(ValueError, match="accepted budgets"):
        autorecompute.compile(torch.nn.Linear(2, 2), budget="12 parsecs")


def test_unknown_action_is_rejected():
    import torch
    with pytest.raises(ValueError, match="accepted actions"):
        autorecompute.compile(torch.nn.Linear(2, 2), budget="1GB", actions=("teleport",))


def test_numpy_scalars_are_budgets_like_python_numbers():
    np = pytest.importorskip("numpy")
    assert autorecompute.parse_budget(np.int64(10**6)) == 10**6
    assert autorecompute.parse_budget(np.float32(0.5)) == 0.5
    with pytest.raises(ValueError, match="accepted budgets"):
        autorecompute.parse_budget(np.float32(1.5))


@pytest.mark.parametrize("actions, says", [(("keep",), "keeping a tensor"), ((), "keeping a tensor"),
                                           (("recompute", "swap"), "unknown ['swap']")])
def test_actions_that_name_nothing_to_do_are_explained(actions, says):
    import torch
    with pytest.raises(ValueError, match=re.escape(says)):
        autorecompute.compile(torch.nn.Linear(2, 2), budget="1GB", actions=actions)


@pytest.mark.parametrize("limit", ["2", 0, -1.0, float("nan"), float("inf"), True])
def test_a_solver_time_limit_must_be_a_finite_number_of_seconds(limit):
    """Infinity too: the limit also sets the deterministic work CP-SAT's windows may spend (an integer)."""
    import torch
    with pytest.raises(ValueError, match="finite number of seconds > 0"):
        autorecompute.compile(torch.nn.Linear(2, 2), budget="1GB", solver_time_limit=limit)


@pytest.mark.parametrize("options, says", [
    ({"seed": "a"}, "seed='a' must be an int"), ({"seed": 2**70}, "fits 32 bits"), ({"seed": True}, "seed=True"),
    ({"actions": None}, "actions=None must be a tuple of names"),
    ({"actions": ("compress",), "compress_dtypes": "torch.bfloat16"}, "must be a tuple such as"),
    ({"actions": ("compress",), "compress_dtypes": ()}, "empty (None for the default, bfloat16)"),
    ({"offload_dir": 1}, "must be a directory's path"), ({"offload_dir": ""}, "must be a directory's path"),
])
def test_planner_options_of_the_wrong_kind_are_explained(options, says):
    """Each reached the planner before (a raw pybind TypeError from CP-SAT's seed, 'not iterable', or an empty
    offload_dir checked in the working directory and then unused)."""
    import torch
    with pytest.raises(ValueError, match=re.escape(says)):
        autorecompute.compile(torch.nn.Linear(2, 2), budget="1GB", **options)


@pytest.mark.parametrize("model", [None, "torch.nn.Linear", lambda x: x])
def test_compiling_what_is_not_a_module_instance_is_explained(model):
    import torch
    model = torch.nn.Linear if model == "torch.nn.Linear" else model
    with pytest.raises(TypeError, match="plans a torch.nn.Module instance"):
        autorecompute.compile(model, budget="1GB")


@pytest.mark.parametrize("field, value", [("flops_per_second", float("inf")), ("op_seconds", 1e300),
                                          ("flops_per_second", "1e9"), ("overlaps_compute", "no")])
def test_a_transfer_model_that_cannot_be_priced_is_refused(field, value):
    """An infinite or absurd figure made planning fail with a raw OverflowError at the first step."""
    from dataclasses import replace

    from autorecompute.transfer import CPU_DISK
    with pytest.raises(ValueError, match=f"TransferModel.{field}="):
        replace(CPU_DISK, **{field: value})


def test_a_misspelled_planner_option_is_told_not_handed_to_the_model():
    """``plan()`` hands keywords that are not its options to ``forward``: a typo of an option was a capture
    error about tracing, or silently the model's when its forward takes ``**kwargs``."""
    import warnings

    import torch

    class TakesAny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x, **extra):
            return self.linear(x)

    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match=r"solver_timelimit= is neither.*Did you mean solver_time_limit="):
        autorecompute.plan(torch.nn.Linear(4, 4), x, budget=1.0, solver_timelimit=1)
    with pytest.raises(TypeError, match=r"Did you mean actions= \(an option of autorecompute.minimum_peak\)"):
        autorecompute.minimum_peak(torch.nn.Linear(4, 4), x, action=("recompute",))
    with pytest.warns(UserWarning) as told:      # told once, by minimum_peak (which does not call plan())
        autorecompute.minimum_peak(TakesAny(), x, solver_time_limit=0.5, seeds=1)
    assert len(told) == 1 and "autorecompute.minimum_peak" in str(told[0].message)
    # plan()'s own options that minimum_peak has not are the model's there, as any other keyword
    assert autorecompute.minimum_peak(TakesAny(), x, solver_time_limit=0.5, budget=1.0, objective="flops") > 0
    with pytest.warns(UserWarning, match=r"objetive= goes to TakesAny.forward.*Did you mean objective="):
        autorecompute.plan(TakesAny(), x, budget=1.0, solver_time_limit=0.5, objetive="flops")
    with warnings.catch_warnings():
        warnings.simplefilter("error")         # a keyword of the model's own is not told
        autorecompute.plan(TakesAny(), x, budget=1.0, solver_time_limit=0.5, scale=2.0)


def test_accepted_kinds_of_seed_and_action_lists():
    """A numpy int seed passed the check and failed in random.Random; any iterable of names is a list of
    actions (a set in a fixed order)."""
    import numpy as np
    import torch

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6)])
    x = torch.randn(256, 64)
    made = autorecompute.plan(model, x, budget=0.9, seed=np.int64(3), actions=np.array(["offload", "recompute"]),
                              solver_time_limit=0.5)
    assert made.actions == ("offload", "recompute")
    assert autorecompute.plan(model, x, budget=0.9, actions={"recompute", "offload"}, solver_time_limit=0.5).actions \
        == ("offload", "recompute")


def test_a_fraction_answer_is_one_the_planner_reads_as_enough():
    """``int(f * baseline)`` is how a fraction becomes bytes: the fraction named in the error reaches the
    minimum (rounded up to 3 decimals it could land a byte short), and 1.0 is said only when nothing is
    below the baseline."""
    import pickle
    import random

    from autorecompute.errors import least_fraction
    assert least_fraction(7_306_181_600, 8_964_640_000) == 0.816           # 0.815 reads as 7 306 181 599 B
    assert least_fraction(999_500, 1_000_000) == 0.9995 and least_fraction(5, 4) == 1.0
    rng = random.Random(0)
    for _ in range(20_000):
        baseline = rng.randint(1_000, 10**10)
        minimum = rng.randint(1, baseline - 1)
        fraction = least_fraction(minimum, baseline)
        assert fraction < 1 and int(fraction * baseline) >= minimum
    error = autorecompute.InfeasibleBudgetError(200, 2600, {"parameters": 1}, ("recompute",), fraction=0.05,
                                                baseline=4000)
    copied = pickle.loads(pickle.dumps(error))          # (across processes: a DataLoader worker's)
    assert str(copied) == str(error) and copied.minimum == 2600


def test_an_infeasible_budget_a_hair_below_the_minimum_reads_as_two_numbers():
    """Both sizes round to 1.32 MiB; the message gives both in bytes, so it never reads 'X below X'."""
    from autorecompute.errors import InfeasibleBudgetError

    message = str(InfeasibleBudgetError(1_384_448, 1_384_460, {"activations": 1_384_460}, ("recompute",)))
    assert "budget 1.32 MiB (1384448 bytes) is below the minimum peak 1.32 MiB (1384460 bytes)" in message
