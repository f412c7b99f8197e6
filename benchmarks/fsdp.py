"""FSDP2 per rank: ``autorecompute.compile`` of a ``fully_shard``-ed Hugging Face GPT-2 against plain FSDP2.

    python benchmarks/fsdp.py [--layers 6 --width 512 --tokens 512 --batch 2]   # 2 ranks, gloo, CPU

Each rank (2 processes over gloo) builds GPT-2 (vocabulary 50257, dropout on), shards each block and the root,
and trains two steps (SGD between them) with plain FSDP2, then through ``autorecompute.compile(...,
outputs="dropped")`` (the step is ``model(...).loss.backward()``) at fractions of the plain step's peak on the
rank. Peak per rank: its parameter shards and inputs plus the most the step allocates beyond them
(``allocated_peak``: the allocator's events). Per budget: the plan's prediction, both steps measured, losses and
gradient shards against plain FSDP2's bit for bit, the time each rank waited for its plan and the plan's own
planning time (the same on both ranks: the second applies the first's). Writes benchmarks/results/fsdp.json.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "fsdp.json"
FRACTIONS = (0.8, 0.6)
WORLD = 2


def sharded_gpt2(args) -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers
    from torch.distributed.fsdp import fully_shard

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=8, vocab_size=50257,
                                     n_positions=args.tokens, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).train()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model, torch.randint(0, 50257, (args.batch, args.tokens))


def train(module, model, ids, rank: int) -> dict:
    """Two steps: losses, gradient shards and peaks (resident + allocated) of each."""
    from autorecompute.runtime.allocations import allocated_peak
    from autorecompute.runtime.memory import tensor_bytes

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    out = {"losses": [], "grads": [], "peaks": []}
    for step in range(2):
        torch.manual_seed(100 * step + rank)

        def forward_backward():
            loss = module(ids, labels=ids).loss
            loss.backward()
            out["losses"].append(loss.detach())

        resident = tensor_bytes([*(p.to_local() for p in model.parameters()), ids])
        out["peaks"].append(resident + allocated_peak(forward_backward))
        out["grads"].append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def bitwise(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"])) and all(
        ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga) for ga, gb in zip(a["grads"], b["grads"]))


def rank_main(rank: int, store: str, args) -> None:
    import autorecompute

    os.environ["AUTORECOMPUTE_CACHE"] = "off"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    model, ids = sharded_gpt2(args)
    plain = train(model, model, ids, rank)
    rows = [{"rank": rank, "budget": "plain FSDP2", "peaks": plain["peaks"]}]
    for fraction in FRACTIONS:
        model, ids = sharded_gpt2(args)
        budget = int(fraction * plain["peaks"][1])
        # the step drops the logits before backward (``module(...).loss``): planned so from the first step
        compiled = autorecompute.compile(model, budget=budget, outputs="dropped")
        started = time.perf_counter()
        try:
            plan = compiled.prepare(ids, labels=ids)
        except autorecompute.InfeasibleBudgetError as refused:
            rows.append({"rank": rank, "budget": budget, "fraction": fraction, "refused": True,
                         "minimum": refused.minimum})
            continue
        planned = time.perf_counter() - started
        ours = train(compiled, model, ids, rank)
        rows.append({"rank": rank, "budget": budget, "fraction": fraction, "predicted": plan.predicted_peak,
                     "peaks": ours["peaks"], "within": max(ours["peaks"]) <= budget, "bitwise": bitwise(ours, plain),
                     "plan_seconds": round(planned, 1), "plan_time_in_plan": round(plan.plan_time, 1),
                     "extra_flops": plan.extra_flops_ratio, "minimum": plan.minimum_peak})
    Path(f"{store}.rank{rank}.json").write_text(json.dumps(rows))
    torch.distributed.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    store = tempfile.mktemp()
    mp.start_processes(rank_main, args=(store, args), nprocs=WORLD, start_method="spawn")
    rows = [row for rank in range(WORLD) for row in json.loads(Path(f"{store}.rank{rank}.json").read_text())]
    RESULTS.write_text(json.dumps({"model": vars(args), "rows": rows}, indent=1))
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
