"""The memory no plan can remove, per benchmark model: the lower bounds under the goals 2a and 2b.

    python benchmarks/floors.py       # writes benchmarks/results/floors.json (seconds)

For each model, the largest value over the step of ``Problem.fixed`` — resident state, activations during
their forward life and autograd's backward temporaries, calibrated on the measured step, and the parameter
gradients where they cannot be offloaded — plus, at a backward position, the activations that op's backward
reads (whatever a plan does with them in between, they are on the device while it runs). Two bounds: with
recompute only (gradients stay on the device from their accumulation: goal 2a) and with offload (goal 2b).
No keep / recompute / rematerialize / offload / compress decision goes below them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import models  # noqa: E402
from autorecompute.passes.build_problem import build_problem  # noqa: E402
from autorecompute.passes.capture import capture  # noqa: E402
from autorecompute.passes.profile import profile_step  # noqa: E402
from autorecompute.transfer import CPU_DISK  # noqa: E402

FULL = ["gpt", "gpt2", "bert", "llama", "resnet", "unet", "mlp", "vgg"]


def floors(name: str) -> dict[str, int]:
    """The model's lower bounds: ``{"recompute": ..., "offload": ...}`` in bytes."""
    case = models.make(name, benchmark=True)
    gm = capture(case.model, case.args, case.kwargs)
    profile_step(gm, case.args, case.kwargs)
    return {"recompute": lower_bound(build_problem(gm)),
            # offload: parameter gradients are decisions too
            "offload": lower_bound(build_problem(gm, offload=CPU_DISK))}


def lower_bound(problem) -> int:
    """max over positions of ``fixed`` plus the bytes the backward op there reads from forward."""
    saved_by: dict[str, int] = {}
    for act in problem.activations:
        for saver in act.savers:
            saved_by[saver] = saved_by.get(saver, 0) + act.nbytes
    return max(fixed + saved_by.get(problem.backward_op.get(p, ""), 0) for p, fixed in enumerate(problem.fixed))


def main() -> None:
    found = {name: floors(name) for name in FULL}
    out = ROOT / "benchmarks" / "results" / "floors.json"
    out.write_text(json.dumps(found, indent=1))
    for name, value in found.items():
        print(f"{name:8s} recompute only {value['recompute'] / 2**20:6.2f} MiB, "
              f"with offload {value['offload'] / 2**20:6.2f} MiB")


if __name__ == "__main__":
    main()
