"""The plan cache: a training script's second run loads its plan instead of planning, and gets the same plan,
module and gradients; the cache can be moved and turned off, and a damaged entry is planned again."""
import json
import os
import subprocess
import sys
import textwrap

import torch

from autorecompute import plan_cache
from conftest import SOLVER_TIME

SCRIPT = textwrap.dedent(f"""
    import hashlib, json, sys, torch, autorecompute
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(6)])
    x = torch.randn(128, 64)
    compiled = autorecompute.compile(model, budget=float(sys.argv[1]), actions=("recompute",),
                                     solver_time_limit={SOLVER_TIME})
    compiled(x).square().mean().backward()
    grads = b"".join(p.grad.numpy().tobytes() for p in model.parameters())
    print(json.dumps({{"plan": compiled.plan.to_json(), "grads": hashlib.sha256(grads).hexdigest(),
                      "code": compiled.graph_module.code}}))
""")
LOADED = "loaded from the plan cache"


def run(tmp_path, budget="0.8", **env):
    """The script in a fresh process, with the cache in ``tmp_path`` unless ``env`` says otherwise."""
    environ = {k: v for k, v in os.environ.items() if k != "AUTORECOMPUTE_CACHE"}
    environ.update(AUTORECOMPUTE_CACHE_DIR=str(tmp_path), AUTORECOMPUTE_LOG="info", **env)
    done = subprocess.run([sys.executable, "-c", SCRIPT, budget], capture_output=True, text=True, env=environ,
                          timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def without_times(result: dict) -> dict:
    """A run's result without the plan's wall times (a plan made again takes its own)."""
    plan = {k: v for k, v in json.loads(result["plan"]).items() if k not in ("plan_time", "solver_time")}
    return {**result, "plan": plan}


def test_the_second_run_loads_the_plan_and_trains_the_same(tmp_path):
    first, first_log = run(tmp_path)
    second, second_log = run(tmp_path)
    assert LOADED not in first_log and LOADED in second_log
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert second == first                           # the plan (all of it), the module's code, the gradients
    assert json.loads(first["plan"])["decisions"]     # a plan that does something
    other_budget, other_log = run(tmp_path, budget="0.9")
    assert LOADED not in other_log and len(list(tmp_path.glob("*.json"))) == 2


def test_the_cache_is_off_with_its_switch_and_a_damaged_entry_is_planned_again(tmp_path):
    _, log = run(tmp_path, AUTORECOMPUTE_CACHE="off")
    assert LOADED not in log and not list(tmp_path.iterdir())
    first, _ = run(tmp_path)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text("{ not json")
    again, log = run(tmp_path)
    assert LOADED not in log and "does not read" in log
    assert without_times(again) == without_times(first)
    assert json.loads(entry.read_text())["budget"] > 0   # written anew


def test_a_key_names_the_graph_the_state_the_signature_the_budget_and_the_options(tmp_path):
    from autorecompute.passes.capture import capture

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    gm = capture(model, (x,), {})
    key = plan_cache.plan_key(gm, "f32[4, 8]", 0.5, {"actions": ("recompute",)}, "cpu")
    assert key == plan_cache.plan_key(capture(model, (x,), {}), "f32[4, 8]", 0.5, {"actions": ("recompute",)}, "cpu")
    assert len({key, plan_cache.plan_key(gm, "f32[5, 8]", 0.5, {"actions": ("recompute",)}, "cpu"),
                plan_cache.plan_key(gm, "f32[4, 8]", 0.6, {"actions": ("recompute",)}, "cpu"),
                plan_cache.plan_key(gm, "f32[4, 8]", 0.5, {"actions": ("offload",)}, "cpu"),
                plan_cache.plan_key(gm, "f32[4, 8]", 0.5, {"actions": ("recompute",)}, "meta"),
                plan_cache.plan_key(capture(model.double(), (x.double(),), {}), "f32[4, 8]", 0.5,
                                    {"actions": ("recompute",)}, "cpu")}) == 6
