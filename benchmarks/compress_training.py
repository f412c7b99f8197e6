"""Training with compressed activations: does a small GPT still learn as well as without compression?

Acceptance criterion: "a benchmark trains a small GPT for >= 300 steps on a synthetic task: final loss within
2% of the uncompressed run", for ``compress`` with bfloat16, float8 and int8.

Four runs from the same initial weights, the same optimizer and the same batches:

1. reference: ``autorecompute.compile(model, budget=0.6, actions=("recompute", "offload"))`` (lossless:
   its gradients equal eager's);
2-4. ``actions=("compress",)`` with ``compress_dtypes=("bfloat16",)``, ``("float8",)``, ``("int8",)`` at a
   budget that forces compression (0.8 of the unoptimized peak, or the ``InfeasibleBudgetError.minimum``
   when 0.8 cannot be met).

Final loss = mean training loss of the last 20 steps. Writes ``benchmarks/results/compress_training.json``
and ``docs/benchmarks-compress.md``.

Run: ``python benchmarks/compress_training.py`` (300 steps; a few minutes on 2 CPU cores),
``python benchmarks/compress_training.py --quick`` (40 steps, smoke run; writes nothing unless --write).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import time
import traceback
import warnings

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("AUTORECOMPUTE_CACHE", "off")   # benchmarks time and compare planning itself
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autorecompute  # noqa: E402
from autorecompute.budget import format_bytes  # noqa: E402
from tests.models import GPT  # noqa: E402

RESULTS_JSON = os.path.join(ROOT, "benchmarks", "results", "compress_training.json")
RESULTS_MD = os.path.join(ROOT, "docs", "benchmarks-compress.md")

TOLERANCE = 0.02          # the criterion: |final - reference| / reference <= 2%
FINAL_WINDOW = 20         # final loss = mean of the last this many steps
COMPRESS_FRACTION = 0.8   # budget of the compress runs (fraction of the unoptimized peak), if feasible
REFERENCE_FRACTION = 0.6

# model and task
VOCAB, SEQ, BATCH = 64, 64, 8
LAYERS, WIDTH, HEADS = 4, 64, 4
RULES = 8                 # each sequence follows one of these affine rules x[t+1] = (a x[t] + b) mod VOCAB
NOISE = 0.1               # probability that a token is replaced by a uniformly random one
LR, WEIGHT_DECAY = 3e-3, 0.01
MODEL_SEED, DATA_SEED = 0, 1234


# ---- synthetic task ------------------------------------------------------------------------------------
def make_rules(gen: torch.Generator) -> list[tuple[int, int]]:
    """Affine rules with odd multipliers (bijections mod a power of two), distinct."""
    rules: list[tuple[int, int]] = []
    while len(rules) < RULES:
        a = 2 * int(torch.randint(0, VOCAB // 2, (1,), generator=gen)) + 1
        b = int(torch.randint(0, VOCAB, (1,), generator=gen))
        if (a, b) not in rules and (a, b) != (1, 0):
            rules.append((a, b))
    return rules


def make_data(steps: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """``steps`` batches of (BATCH, SEQ + 1) tokens, fixed by DATA_SEED: each sequence picks a rule and a
    start token, then x[t+1] = (a x[t] + b) mod VOCAB, except that with probability NOISE the next token is
    uniformly random (the chain continues from it). Next-token prediction must infer the rule in context."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    rules = make_rules(gen)
    a_of = torch.tensor([a for a, _ in rules])
    b_of = torch.tensor([b for _, b in rules])
    n = steps * BATCH
    which = torch.randint(0, RULES, (n,), generator=gen)
    a, b = a_of[which], b_of[which]
    tokens = torch.empty(n, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (n,), generator=gen)
    noise = torch.rand(n, SEQ + 1, generator=gen) < NOISE
    random_tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)
    for t in range(SEQ):
        nxt = (a * tokens[:, t] + b) % VOCAB
        tokens[:, t + 1] = torch.where(noise[:, t + 1], random_tokens[:, t + 1], nxt)
    return tokens.view(steps, BATCH, SEQ + 1), rules


def entropy_floor() -> float:
    """Loss (nats/token) of a predictor that knows each sequence's rule: the noise alone."""
    p_right = 1 - NOISE + NOISE / VOCAB
    p_wrong = NOISE / VOCAB
    return -(p_right * math.log(p_right) + (VOCAB - 1) * p_wrong * math.log(p_wrong))


# ---- runs ----------------------------------------------------------------------------------------------
def fresh_model() -> torch.nn.Module:
    torch.manual_seed(MODEL_SEED)
    return GPT(layers=LAYERS, d=WIDTH, heads=HEADS, vocab=VOCAB, seq=SEQ, dropout=0.0)


def compile_for(model, kind: str, example: torch.Tensor, solver_time_limit: float):
    """The compiled module of a run and its plan; compress runs fall back to the minimum feasible budget."""
    if kind == "eager":
        return model, None, None
    if kind == "reference":
        compiled = autorecompute.compile(model, budget=REFERENCE_FRACTION, actions=("recompute", "offload"),
                                         solver_time_limit=solver_time_limit)
        return compiled, compiled.prepare(example), REFERENCE_FRACTION
    budget: float | int = COMPRESS_FRACTION
    compiled = autorecompute.compile(model, budget=budget, actions=("compress",), compress_dtypes=(kind,),
                                     solver_time_limit=solver_time_limit)
    try:
        plan = compiled.prepare(example)
    except autorecompute.InfeasibleBudgetError as error:
        print(f"  {kind}: budget {COMPRESS_FRACTION} infeasible, using the minimum {error.minimum} bytes",
              flush=True)
        budget = int(error.minimum)
        compiled = autorecompute.compile(model, budget=budget, actions=("compress",), compress_dtypes=(kind,),
                                         solver_time_limit=solver_time_limit)
        plan = compiled.prepare(example)
    return compiled, plan, budget


def batch_of(data: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of one step as their own (contiguous) tensors: a slice of ``data`` would keep the
    whole data set's storage alive as the input, and the planner counts an input's full storage as resident."""
    batch = data[step]
    return batch[:, :SEQ].clone(), batch[:, 1:].clone()


def train(kind: str, initial: dict, data: torch.Tensor, solver_time_limit: float) -> dict:
    model = fresh_model()
    model.load_state_dict(initial)
    model.train()
    row: dict = {"run": kind, "ok": False}
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled, plan, requested = compile_for(model, kind, batch_of(data, 0)[0], solver_time_limit)
            plan_seconds = time.perf_counter() - start
            if plan is not None:
                row.update(requested_budget=requested, budget=plan.budget, predicted_peak=plan.predicted_peak,
                           baseline_peak=plan.baseline_peak, minimum_peak=plan.minimum_peak,
                           compressed=plan.count("compress"), offloaded=plan.count("offload"),
                           recomputed=plan.count("recompute"), bytes_by_action=plan.bytes_by_action(),
                           solver_status=plan.solver_status, plan_seconds=round(plan_seconds, 2),
                           summary=plan.summary())
                if kind not in ("reference", "eager") and plan.count("compress") == 0:
                    raise RuntimeError(f"the {kind} plan compresses nothing: the run would not test compression")
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            losses = []
            for step in range(data.shape[0]):
                inputs, targets = batch_of(data, step)
                optimizer.zero_grad(set_to_none=True)   # no gradients held during the step, as when planned
                logits = compiled(inputs)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                if not math.isfinite(losses[-1]):
                    raise RuntimeError(f"loss is {losses[-1]} at step {step}")
            row.update(ok=True, losses=[round(x, 6) for x in losses],
                       final_loss=sum(losses[-FINAL_WINDOW:]) / len(losses[-FINAL_WINDOW:]))
        except Exception as error:  # a failed run is reported, not hidden
            row["error"] = f"{type(error).__name__}: {error}"
            row["traceback"] = traceback.format_exc()
            print(f"  {kind} FAILED: {row['error']}", flush=True)
    row["wall_seconds"] = round(time.perf_counter() - start, 2)
    row["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    return row


# ---- reporting -----------------------------------------------------------------------------------------
def fmt_bytes(n) -> str:
    return "" if n is None else f"{format_bytes(n)} ({n})"


def table(rows: list[dict]) -> list[str]:
    lines = ["| run | final loss | rel. diff vs reference | within 2% | compressed tensors | budget | "
             "predicted peak | baseline peak | wall s |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        final = f"{r['final_loss']:.4f}" if r.get("ok") else "FAILED"
        rel = f"{100 * r['rel_diff']:+.2f}%" if r.get("rel_diff") is not None else ""
        within = "" if r["run"] in ("reference", "eager") or r.get("within") is None else (
            "yes" if r["within"] else "**no**")
        compressed = "" if r.get("compressed") is None else str(r["compressed"])
        lines.append(f"| {r['label']} | {final} | {rel} | {within} | {compressed} | "
                     f"{fmt_bytes(r.get('budget'))} | {fmt_bytes(r.get('predicted_peak'))} | "
                     f"{fmt_bytes(r.get('baseline_peak'))} | {r['wall_seconds']:.1f} |")
    return lines


def label(kind: str) -> str:
    return {"eager": "eager (no autorecompute)",
            "reference": "reference: recompute+offload @0.6 (lossless)"}.get(kind, f"compress {kind}")


def write_markdown(result: dict, rows: list[dict]) -> None:
    setup = result["setup"]
    lines = [
        "# Benchmark: training with compressed activations",
        "",
        f"Generated by `{result['command']}` on {result['date']} "
        f"({setup['machine']}; torch {setup['torch']}, {setup['threads']} threads); "
        f"total wall time {result['total_wall_seconds']:.0f} s. Raw numbers and per-step losses: "
        "`benchmarks/results/compress_training.json`.",
        "",
        "Criterion: *a benchmark trains a small GPT for ≥ 300 steps on a synthetic task: final loss within 2% "
        "of the uncompressed run*, for compression to bfloat16, float8 and int8.",
        "",
        "## Result",
        "",
    ]
    for r in rows:
        if r["run"] in ("reference", "eager"):
            continue
        if not r.get("ok"):
            status = f"**not met** (the run failed: `{r.get('error')}`)"
        elif result["reference_ok"] is False:
            status = "**not measured** (the reference run failed)"
        elif r["within"]:
            status = f"**met** ({100 * r['rel_diff']:+.2f}%)"
        else:
            status = f"**not met** ({100 * r['rel_diff']:+.2f}%)"
        if result["steps"] < 300 and r.get("ok"):
            status += f" — only {result['steps']} steps: the criterion asks for ≥ 300"
        lines.append(f"- {r['run']}: final loss within 2% of the uncompressed run: {status}")
    lines += ["", *table(rows), "",
              "Final loss = mean training loss (nats/token) of the last "
              f"{FINAL_WINDOW} steps; relative difference = (final − reference final) / reference final. "
              "Budget and predicted peak are the plan's (`plan.budget`, `plan.predicted_peak`, bytes), "
              "baseline peak is the unoptimized step's; wall s includes planning.", ""]
    lines += ["## Setup", "",
              f"- Model: `tests.models.GPT` (the demo GPT decoder), {LAYERS} layers, width {WIDTH}, {HEADS} heads, "
              f"vocabulary {VOCAB}, context {SEQ}, dropout 0 (so all runs see the same computation), "
              f"{setup['parameters']:,} parameters, float32, CPU.",
              f"- Task: next-token prediction on synthetic sequences. Each sequence follows one of {RULES} fixed "
              f"affine rules x[t+1] = (a·x[t] + b) mod {VOCAB} (a odd) from a random start token; with "
              f"probability {NOISE} a token is replaced by a uniformly random one and the chain continues "
              f"from it. The model must infer the rule in context. Loss floor (rule known, noise only): "
              f"{setup['entropy_floor']:.4f} nats/token; uniform guessing: {math.log(VOCAB):.4f}.",
              f"- Data: {result['steps']} batches of {BATCH} × {SEQ + 1} tokens generated once from seed "
              f"{DATA_SEED}; every run sees the same batches in the same order.",
              f"- Training: every run starts from the same initial weights (seed {MODEL_SEED}, copied state dict), "
              f"AdamW lr {LR}, weight decay {WEIGHT_DECAY}, {result['steps']} steps, cross entropy over the "
              "logits.",
              f"- Reference (uncompressed): `autorecompute.compile(model, budget={REFERENCE_FRACTION}, "
              "actions=(\"recompute\", \"offload\"))`, which is lossless (gradients equal eager's).",
              f"- Compress runs: `autorecompute.compile(model, budget={COMPRESS_FRACTION}, actions=(\"compress\",), "
              "compress_dtypes=(dtype,))`, falling back to `InfeasibleBudgetError.minimum` if that budget "
              "cannot be met; each plan is checked to compress at least one tensor.",
              f"- Solver time limit {setup['solver_time_limit']} s per plan.", ""]
    lines += ["## Plans", ""]
    for r in rows:
        if r.get("summary"):
            lines += [f"{r['label']}:", "", "```", r["summary"], "```", ""]
    problems = [(r["run"], r["error"]) for r in rows if r.get("error")]
    warned = sorted({w for r in rows for w in r.get("warnings", [])})
    lines += ["## Errors and warnings", ""]
    if not problems and not warned:
        lines += ["None: every run completed, no warnings were raised.", ""]
    for run, error in problems:
        lines.append(f"- {run} failed: `{error}`")
    for w in warned:
        lines.append(f"- warning: `{w}`")
    lines.append("")
    os.makedirs(os.path.dirname(RESULTS_MD), exist_ok=True)
    with open(RESULTS_MD, "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 40 steps, nothing written unless --write")
    parser.add_argument("--write", action="store_true", help="write the JSON and markdown even with --quick")
    parser.add_argument("--eager", action="store_true", help="also train eagerly (no autorecompute) as a check "
                        "that the reference equals eager")
    parser.add_argument("--dtypes", default="bfloat16,float8,int8", help="compress dtypes to run")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--solver-time-limit", type=float, default=8.0)
    args = parser.parse_args(argv)
    steps = 40 if args.quick else args.steps
    write = args.write or not args.quick
    if args.threads:
        torch.set_num_threads(args.threads)

    data, rules = make_data(steps)
    initial = copy.deepcopy(fresh_model().state_dict())
    parameters = sum(p.numel() for p in fresh_model().parameters())
    kinds = (["eager"] if args.eager else []) + ["reference"] + [d for d in args.dtypes.split(",") if d]

    total_start = time.perf_counter()
    rows = []
    for kind in kinds:
        print(f"run {kind}: {steps} steps ...", flush=True)
        row = train(kind, initial, data, args.solver_time_limit)
        row["label"] = label(kind)
        if row.get("ok"):
            print(f"  final loss {row['final_loss']:.4f}, wall {row['wall_seconds']:.1f} s"
                  + (f", {row.get('compressed')} compressed, budget {row.get('budget')}, "
                     f"predicted peak {row.get('predicted_peak')}" if row.get("budget") else ""), flush=True)
        rows.append(row)
    total = time.perf_counter() - total_start

    reference = next(r for r in rows if r["run"] == "reference")
    for r in rows:
        if r.get("ok") and reference.get("ok"):
            r["rel_diff"] = (r["final_loss"] - reference["final_loss"]) / reference["final_loss"]
            r["within"] = abs(r["rel_diff"]) <= TOLERANCE
        else:
            r["rel_diff"], r["within"] = None, (False if r["run"] not in ("reference", "eager") else None)

    print()
    print("\n".join(table(rows)))
    for r in rows:
        for w in r.get("warnings", []):
            print(f"warning in {r['run']}: {w}")

    result = {
        "criterion": "final loss within 2% of the uncompressed run after >= 300 steps",
        "command": "python benchmarks/compress_training.py" + ("" if argv is None and len(sys.argv) == 1
                                                               else " " + " ".join(argv or sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "steps": steps,
        "tolerance": TOLERANCE,
        "final_window": FINAL_WINDOW,
        "total_wall_seconds": round(total, 1),
        "reference_ok": bool(reference.get("ok")),
        "setup": {"model": "tests.models.GPT", "layers": LAYERS, "width": WIDTH, "heads": HEADS, "vocab": VOCAB,
                  "seq": SEQ, "batch": BATCH, "dropout": 0.0, "parameters": parameters, "rules": rules,
                  "noise": NOISE, "entropy_floor": entropy_floor(), "lr": LR, "weight_decay": WEIGHT_DECAY,
                  "model_seed": MODEL_SEED, "data_seed": DATA_SEED, "reference_budget": REFERENCE_FRACTION,
                  "compress_budget": COMPRESS_FRACTION, "solver_time_limit": args.solver_time_limit,
                  "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores"},
        "runs": rows,
    }
    if write:
        os.makedirs(os.path.dirname(RESULTS_JSON), exist_ok=True)
        with open(RESULTS_JSON, "w") as f:
            json.dump(result, f, indent=1)
        write_markdown(result, rows)
        print(f"\nwrote {os.path.relpath(RESULTS_JSON, ROOT)} and {os.path.relpath(RESULTS_MD, ROOT)}")
    failed = [r for r in rows if not r.get("ok") or r.get("within") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
