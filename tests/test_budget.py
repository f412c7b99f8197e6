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
