"""Command line: ``autorecompute demo`` and ``autorecompute plan MODULE:FACTORY``."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import torch

DEMO_HELP = "train a small embedded GPT under half its unoptimized peak and compare with sqrt(N) checkpointing"


def _demo_model():
    """The embedded default model: a 6-layer GPT with dropout (batch 8, sequence 128)."""
    from autorecompute._demo_model import GPT

    torch.manual_seed(0)
    model = GPT(layers=6, d=128, heads=4, vocab=512, seq=128)
    return model, torch.randint(0, 512, (8, 128))


class _WithLoss(torch.nn.Module):
    """The demo's model and its loss in one module: what the compiled module runs is the whole step, so the
    plan counts the loss's memory too (a loss computed outside adds its own tensors at the peak)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, targets):
        logits = self.model(tokens)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def demo(args: argparse.Namespace) -> int:
    import autorecompute
    from autorecompute.baselines import SqrtNCheckpointed
    from autorecompute.budget import format_bytes
    from autorecompute.runtime.memory import LiveStorageTracker, tensor_bytes

    model, tokens = _demo_model()
    targets = torch.roll(tokens, -1, dims=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # stateless: all memory of a step is measured

    def step(module) -> tuple[float, int]:
        optimizer.zero_grad(set_to_none=True)
        resident = tensor_bytes([*model.parameters(), *model.buffers(), tokens, targets])
        tracker = LiveStorageTracker()
        with tracker:
            loss = module(tokens, targets)
            loss.backward()
        optimizer.step()
        return loss.item(), resident + tracker.peak

    eager_loss, eager_peak = step(_WithLoss(model))
    budget = eager_peak // 2
    print(f"demo model: 6-layer GPT, batch 8 x 128 tokens; eager step peak {format_bytes(eager_peak)}")
    print(f"budget: half of it, {format_bytes(budget)}\n")
    compiled = autorecompute.compile(_WithLoss(model), budget=budget, solver_time_limit=args.solver_time_limit)
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)          # plan the state each step starts from: no gradients
    compiled.prepare(tokens, targets)
    print(compiled.plan)
    print(f"\nplanned in {time.perf_counter() - started:.1f} s; training {args.steps} steps:")
    worst = 0
    for i in range(args.steps):
        loss, peak = step(compiled)
        worst = max(worst, peak)
        print(f"  step {i + 1}: loss {loss:.4f}, measured peak {format_bytes(peak)} "
              f"({'<=' if peak <= budget else '>'} budget {format_bytes(budget)})")
    sqrt_n = SqrtNCheckpointed(model, "blocks")
    _, sqrt_peak = step(_WithLoss(sqrt_n))
    print(f"\nsqrt(N) checkpointing ({sqrt_n.segments} segments of {len(model.blocks)} blocks): "
          f"peak {format_bytes(sqrt_peak)}")
    print(f"autorecompute: peak {format_bytes(worst)} at budget {format_bytes(budget)}, "
          f"{100 * compiled.plan.extra_flops_ratio:.0f}% extra forward FLOPs")
    ok = worst <= budget
    print("OK: measured peak <= budget" if ok else "FAILED: measured peak above budget")
    return 0 if ok else 1


def plan_command(args: argparse.Namespace) -> int:
    import autorecompute
    from autorecompute.report import SAVE_FORMATS

    def fail(message: str, code: int = 2) -> int:
        print(f"error: {message}", file=sys.stderr)
        return code

    if args.out:
        args.out = os.path.expanduser(args.out)        # (quoted, "~" reaches us unexpanded)
    module_name, _, factory_name = args.factory.partition(":")
    if not module_name or not factory_name:
        return fail(f"expected MODULE:FACTORY, got {args.factory!r}")
    if args.out and Path(args.out).suffix.lower() not in SAVE_FORMATS:     # before minutes of planning
        return fail(f"--out {args.out!r}: a plan is saved as {', '.join(SAVE_FORMATS)}")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        return fail(f"--out {args.out!r}: the directory {str(Path(args.out).resolve().parent)!r} does not exist")
    sys.path.insert(0, ".")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except Exception as error:  # noqa: BLE001 — a missing module or name, or the module's own code failing
        return fail(f"cannot load {args.factory!r}: {type(error).__name__}: {error}")
    try:
        made = factory()
    except Exception as error:  # noqa: BLE001 — the user's code: say so, with its error
        return fail(f"{args.factory}() raised {type(error).__name__}: {error}")
    if isinstance(made, tuple) and len(made) != 2:
        return fail(f"{args.factory}() returned a tuple of {len(made)}; return a model, or (model, example inputs)")
    model, example = (made if isinstance(made, tuple) else (made, None))
    if not isinstance(model, torch.nn.Module):
        return fail(f"{args.factory}() returned {type(model).__name__} where a torch.nn.Module was expected; "
                    "return a model, or (model, example inputs)")
    if args.input_shape is not None:
        try:
            shape = [int(s) for s in args.input_shape.split(",")]
        except ValueError:
            shape = []
        if not shape or any(not 0 < size < 2**40 for size in shape):
            return fail(f"--input-shape {args.input_shape!r}: expected comma-separated positive sizes, e.g. "
                        "8,3,224,224")
        try:
            example = (torch.randn(*shape),)
        except RuntimeError as error:     # more than this machine holds: plan on the meta device instead
            return fail(f"--input-shape {args.input_shape!r}: {str(error).splitlines()[0]}. Fix: return a model and "
                        "inputs on the meta device from the factory (planning allocates nothing)")
    if example is None:
        return fail("the factory returned no inputs; pass --input-shape")
    example = example if isinstance(example, tuple) else (example,)
    try:
        plan = autorecompute.plan(model, *example, budget=args.budget, solver_time_limit=args.solver_time_limit,
                                  actions=_names(args.actions),
                                  compress_dtypes=(None if args.compress_dtypes is None
                                                   else _names(args.compress_dtypes)),
                                  objective=args.objective)
    except (autorecompute.AutorecomputeError, ValueError) as error:
        return fail(str(error), 1)
    print(plan)
    if args.out:
        try:
            plan.save(args.out)
        except OSError as error:
            return fail(f"--out {args.out!r} cannot be written ({error.strerror or error}); the plan is printed above",
                        1)
        print(f"wrote {args.out}")
    return 0


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated CLI list ("recompute, offload"); empty items are kept, for the planner to refuse."""
    return tuple(name.strip() for name in text.split(","))


def budget_arg(text: str) -> int | float:
    """A CLI budget, read as :func:`autorecompute.parse_budget` reads a string: "0.5" a fraction of the
    unoptimized peak, "12000000" bytes, "12GB" a size."""
    from autorecompute.budget import parse_budget

    try:
        return parse_budget(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def steps_arg(text: str) -> int:
    """The demo's number of training steps: a whole number, at least 1 (zero steps would measure nothing)."""
    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps {text!r} is not a whole number") from None
    if steps < 1:
        raise argparse.ArgumentTypeError(f"--steps {steps}: the demo trains at least 1 step")
    return steps


def seconds_arg(text: str) -> float:
    """A solver time limit: a positive number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the solver time limit is a positive, finite number of seconds")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autorecompute", description="Fit PyTorch training into a memory budget.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help=DEMO_HELP, description=DEMO_HELP)
    d.add_argument("--steps", type=steps_arg, default=3, help="training steps to measure (at least 1)")
    d.add_argument("--solver-time-limit", type=seconds_arg, default=4.0)
    d.set_defaults(run=demo)
    p = sub.add_parser("plan", help="plan a model from MODULE:FACTORY without training",
                       description="Plan a model without training. FACTORY is a function of MODULE returning a "
                                   "model, or (model, example inputs).")
    p.add_argument("factory")
    p.add_argument("--budget", required=True, type=budget_arg,
                   help="bytes, '12GB', '1.5GiB', or a fraction of the unoptimized peak like 0.5")
    p.add_argument("--input-shape", help="comma-separated shape of one float input, e.g. 8,3,224,224")
    p.add_argument("--out", help="also write the plan: .html (one page), .json, .dot, .svg or .png (timeline)")
    p.add_argument("--solver-time-limit", type=seconds_arg, default=8.0)
    p.add_argument("--actions", default="recompute,offload",
                   help="comma-separated, among recompute, offload, compress (default: recompute,offload)")
    p.add_argument("--objective", default="time", choices=["time", "flops"],
                   help="least extra time (default: the device's speeds) or least extra FLOPs")
    p.add_argument("--compress-dtypes", default=None,
                   help="with compress: comma-separated among bfloat16, float16, float8, int8 (default bfloat16)")
    p.set_defaults(run=plan_command)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
