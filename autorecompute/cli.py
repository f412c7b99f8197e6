"""Command line: ``autorecompute demo`` and ``autorecompute plan MODULE:FACTORY``."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from autorecompute._version import __version__

DEMO_HELP = "train a small embedded GPT under half its unoptimized peak and compare with sqrt(N) checkpointing"
INPUT_HELP = ("an input to make: [NAME=]SIZES[:DTYPE[:HIGH]], e.g. 8,3,224,224 (float32 from a normal "
              "distribution), 8,1024:int64:50257 (token ids below 50257), labels=8,1024:int64:50257 (a keyword "
              "input); repeat for several inputs, in order; made on the model's device (meta for a meta model)")


def demo(args: argparse.Namespace) -> int:
    from autorecompute.demo import run

    return run(args.steps, args.solver_time_limit)


def plan_command(args: argparse.Namespace) -> int:
    from autorecompute.report_html import SAVE_FORMATS

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
    try:
        for spec in args.input_shape or ():
            _parse_input(spec)                 # a mistake is told before the model is built
    except ValueError as error:
        return fail(str(error))
    import torch

    import autorecompute

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
    if args.input_shape:
        device = next((p.device for p in model.parameters()), None)
        try:
            example, keywords = make_inputs(args.input_shape, device)
        except ValueError as error:
            return fail(str(error))
    elif example is None:
        return fail("the factory returned no inputs; pass --input-shape")
    else:
        example, keywords = (example if isinstance(example, tuple) else (example,)), {}
    try:
        plan = autorecompute.plan(model, *example, **keywords, budget=args.budget,
                                  solver_time_limit=args.solver_time_limit, actions=_names(args.actions),
                                  compress_dtypes=(None if args.compress_dtypes is None
                                                   else _names(args.compress_dtypes)),
                                  objective=args.objective, loss_reserve=args.loss_reserve, outputs=args.outputs)
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


DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


def make_inputs(specs: list[str], device=None) -> tuple[tuple, dict]:
    """Inputs from ``--input-shape`` specs ([NAME=]SIZES[:DTYPE[:HIGH]]): positional ones in order, named
    ones as keywords. Floats are drawn from a normal distribution, integers uniformly below HIGH (required:
    a token id past the vocabulary fails in the model, not here), bools as coin flips.

    Example:
        >>> args, kwargs = make_inputs(["2,3", "labels=2,5:int64:7"])
        >>> args[0].shape, kwargs["labels"].dtype, int(kwargs["labels"].max()) < 7
        (torch.Size([2, 3]), torch.int64, True)
    """
    import torch

    args, kwargs = [], {}
    for spec in specs:
        name, sizes, dtype, high = _parse_input(spec)
        kind = getattr(torch, dtype)
        try:
            if kind.is_floating_point:
                value = torch.randn(*sizes, dtype=kind, device=device)
            else:
                value = torch.randint(0, high, sizes, dtype=kind, device=device)
        except RuntimeError as error:     # more than this machine holds: plan on the meta device instead
            raise ValueError(f"--input-shape {spec!r}: {str(error).splitlines()[0]}. Fix: return a model on the "
                             "meta device from the factory (its inputs are made there; planning allocates nothing)"
                             ) from None
        if name:
            kwargs[name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def _parse_input(spec: str) -> tuple[str, list[int], str, int]:
    """``[NAME=]SIZES[:DTYPE[:HIGH]]`` → name ("" for a positional input), sizes, dtype name, HIGH."""
    form = "expected [NAME=]SIZES[:DTYPE[:HIGH]] with comma-separated positive sizes, e.g. 8,3,224,224 or " \
           "input_ids=8,1024:int64:50257"
    name, _, rest = spec.rpartition("=")
    sizes_text, dtype, high_text = (rest.split(":") + ["", ""])[:3] if rest.count(":") <= 2 else ("", "", "")
    try:
        sizes = [int(s) for s in sizes_text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(not 0 < size < 2**40 for size in sizes) or not (name.isidentifier() or not name):
        raise ValueError(f"--input-shape {spec!r}: {form}")
    dtype = dtype or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"--input-shape {spec!r}: unknown dtype {dtype!r}; one of {', '.join(DTYPES)}")
    integer = dtype not in DTYPES[:4]
    if integer and dtype != "bool" and not high_text:
        raise ValueError(f"--input-shape {spec!r}: {dtype} inputs need HIGH, the bound their values stay below "
                         f"(a vocabulary size): {sizes_text}:{dtype}:HIGH")
    if high_text and not integer:
        raise ValueError(f"--input-shape {spec!r}: HIGH is for integer inputs; {dtype} is drawn from a normal "
                         "distribution")
    high = 2 if dtype == "bool" else int(high_text) if high_text.isdigit() and int(high_text) > 0 else 0
    if integer and high < 1:
        raise ValueError(f"--input-shape {spec!r}: HIGH {high_text!r} must be a positive whole number")
    return name, sizes, dtype, high


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


def reserve_arg(text: str) -> int | str:
    """``--loss-reserve``: "auto", or a size in bytes ("0", "64MB", "1.5GiB"; not a fraction)."""
    if text in ("auto", "0"):
        return text if text == "auto" else 0
    from autorecompute.budget import parse_budget

    try:
        value = parse_budget(text)
    except ValueError:
        value = None
    if not isinstance(value, int):
        raise argparse.ArgumentTypeError(f"--loss-reserve {text!r}: 'auto', or bytes such as 0, 67108864 or 64MB")
    return value


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
    parser.add_argument("--version", action="version", version=f"autorecompute {__version__}")
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
    p.add_argument("--input-shape", action="append", metavar="[NAME=]SIZES[:DTYPE[:HIGH]]", help=INPUT_HELP)
    p.add_argument("--out", help="also write the plan: .html (one page), .json, .dot, .svg or .png (timeline)")
    p.add_argument("--solver-time-limit", type=seconds_arg, default=None,
                   help="seconds of the whole-model search (default: the planner chooses; by layers where the "
                        "model repeats blocks)")
    p.add_argument("--actions", default="recompute,offload",
                   help="comma-separated, among recompute, offload, compress (default: recompute,offload)")
    p.add_argument("--objective", default="time", choices=["time", "flops"],
                   help="least extra time (default: the device's speeds) or least extra FLOPs")
    p.add_argument("--compress-dtypes", default=None,
                   help="with compress: comma-separated among bfloat16, float16, float8, int8 (default bfloat16)")
    p.add_argument("--loss-reserve", type=reserve_arg, default="auto",
                   help="bytes a loss computed outside the model holds as backward starts: 'auto' (cross-entropy "
                        "over the outputs in float32; none when the model returns its loss), 0, or bytes like 64MB")
    p.add_argument("--outputs", default="kept", choices=["kept", "dropped"],
                   help="whether the step holds the outputs backward does not start from (the logits beside a "
                        "returned loss) through backward (kept: out = model(x); out.loss.backward()) or drops them "
                        "(dropped: model(x).loss.backward(), Hugging Face Trainer's step)")
    p.set_defaults(run=plan_command)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
