"""torch.compile's own memory option, ``torch._functorch.config.activation_memory_budget``, measured.

    python benchmarks/compile_budget.py [--models gpt gpt2 gpt-nodropout] [--backends aot_eager inductor]
    python benchmarks/compile_budget.py --backends inductor --fractions 1.0 0.3 --merge   # add rows

Inductor compiles C++ on the CPU: about 2.5 minutes per (model, fraction) on 2 shared cores, hence not in
the default run.

Writes benchmarks/results/compile_budget.json and prints a table: one row per (model, backend, fraction).

Why not our usual tools: any TorchDispatchMode (the LiveStorageTracker, FlopCounterMode) active while a
torch.compile'd module runs makes dynamo fall back to eager, so both quantities are measured another way.

Step. Forward, then ``out.backward(torch.ones_like(out))`` on the output (GPT-2: its ``.logits``): a dense
unit gradient, the same step ``autorecompute.runtime.memory.run_step`` takes. Gradients are set to None
before every step, so they are counted as memory created during the step.

Peak. ``torch.profiler.profile(activities=[CPU], profile_memory=True)`` around one warm step (compiled
and run once before, under the same budget), then the raw ``Allocation`` events of
``prof.profiler.kineto_results.experimental_event_tree()`` in time order: +size on an allocation, -size
on the free of a pointer allocated inside the window (frees of older memory are ignored, as the tracker
ignores storages that existed before it). Peak = ``resident_bytes(model, args, kwargs)`` + the max of
that running sum. Validation: on the eager model this walk is compared with
``measure_step(model, args, kwargs).peak`` (the LiveStorageTracker) for every model; both columns are in
the table (``eager_peak`` is the profiler's, ``tracker_peak`` the tracker's). The profiler counts every
c10 CPU allocation; buffers an inductor C++ kernel keeps on its own stack are not seen.

Gradients. One more step of the compiled model and one of eager, both from ``torch.manual_seed(1)``:
the largest absolute difference of the parameter gradients. Below 1.0 the partitioner may recompute a
dropout in backward with fresh random numbers (pytorch/pytorch#190758, open): the gradients are then not
eager's, and such a point is no valid comparison (``benchmarks/report.py`` sets it apart). Hence the
``-nodropout`` variants (every ``nn.Dropout`` at p=0), on which torch.compile's gradients are eager's.

FLOPs. A custom backend: ``aot_autograd`` with ``min_cut_rematerialization_partition`` and compilers that
record the forward and backward fx graphs and run them as they are (``aot_eager``-equivalent); for
inductor, ``compile_fx`` with an ``inner_compile`` that records the graph before handing it on. Each
recorded graph's FLOPs are ``torch.utils.flop_counter.flop_registry`` applied to every node with the fake
values of ``node.meta["val"]`` (what FlopCounterMode would count, without running it). Extra FLOPs =
(forward + backward graphs of the compiled step) - (FlopCounterMode on the eager step). At fraction 1.0
this difference is the counting skew between the two methods (0 when they agree).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch._dynamo
import torch._functorch.config as functorch_config
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode, flop_registry

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import models  # noqa: E402
from autorecompute.runtime.memory import allocated_peak, measure_step, resident_bytes  # noqa: E402

FRACTIONS = [1.0, 0.7, 0.5, 0.3, 0.1, 0.0]
NO_CACHE = {"enable_autograd_cache": False}  # a cached graph would skip our recording compilers


def step(model, args, kwargs):
    """Forward + backward with a unit gradient on the output (``.logits`` for HF models)."""
    out = model(*args, **kwargs)
    out = getattr(out, "logits", out)
    out.backward(torch.ones_like(out))


NO_DROPOUT = "-nodropout"


def make_case(name: str):
    """``models.make(name)``; ``<model>-nodropout``: the same model with every dropout at p=0."""
    if not name.endswith(NO_DROPOUT):
        return models.make(name, benchmark=True)
    case = models.make(name[:-len(NO_DROPOUT)], benchmark=True)
    for module in case.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return models.Case(name, case.model, case.args, case.kwargs)


def gradients(model, module, args, kwargs) -> dict[str, torch.Tensor]:
    """Parameter gradients of one step of ``module`` (``model`` or a compiled ``model``) from seed 1."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    step(module, args, kwargs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def graph_flops(gm: torch.fx.GraphModule, unknown: set) -> int:
    """FLOPs of an fx graph from the flop registry and the fake values recorded on its nodes."""
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            if isinstance(node.target, torch._ops.HigherOrderOperator):
                unknown.add(str(node.target))           # a HOP body would be missed: reported in notes
            continue
        packet = node.target.overloadpacket
        if packet in flop_registry:
            args, kwargs = tree_map_only(torch.fx.Node, lambda n: n.meta["val"], (node.args, node.kwargs))
            total += flop_registry[packet](*args, **kwargs, out_val=node.meta["val"])
    return total


class Recorder:
    """A backend that records the FLOPs of every forward/backward graph the partitioner produces."""

    def __init__(self, name: str):
        self.name, self.flops, self.graphs, self.unknown = name, {"fw": 0, "bw": 0}, 0, set()

    def _record(self, gm, kind):
        self.flops[kind] += graph_flops(gm, self.unknown)
        self.graphs += 1

    def __call__(self, gm, example_inputs):
        if self.name == "inductor":
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner(g, inputs, **kw):
                self._record(g, "bw" if kw.get("is_backward") else "fw")
                return compile_fx_inner(g, inputs, **kw)
            return compile_fx(gm, example_inputs, inner_compile=inner)

        def compiler(kind):
            def compile_(g, inputs):
                self._record(g, kind)
                return boxed_nop(g, inputs)     # aot_eager's: each input freed after its last use
            return compile_
        return aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"),
                            partition_fn=min_cut_rematerialization_partition,
                            keep_inference_input_mutations=True)(gm, example_inputs)


def eager_reference(case) -> dict:
    model, args, kwargs = case.model, case.args, case.kwargs
    step(model, args, kwargs)                           # warm-up (lazy inits, allocator)
    model.zero_grad(set_to_none=True)
    tracker = measure_step(model, args, kwargs, step=step).peak
    model.zero_grad(set_to_none=True)
    resident = resident_bytes(model, args, kwargs)
    peak = resident + allocated_peak(lambda: step(model, args, kwargs))
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        step(model, args, kwargs)
    model.zero_grad(set_to_none=True)
    return {"eager_peak": peak, "tracker_peak": tracker, "eager_flops": counter.get_total_flops(),
            "resident": resident, "grads": gradients(model, model, args, kwargs)}


def compiled_row(case, backend: str, fraction: float, ref: dict) -> dict:
    model, args, kwargs = case.model, case.args, case.kwargs
    torch._dynamo.reset()
    recorder = Recorder(backend)
    compiled = torch.compile(model, backend=recorder)
    patches = {"activation_memory_budget": fraction, **NO_CACHE}
    with functorch_config.patch(**patches), torch._inductor.config.patch(fx_graph_cache=False):
        step(compiled, args, kwargs)                    # compile + first run
        model.zero_grad(set_to_none=True)
        graphs = recorder.graphs
        peak = ref["resident"] + allocated_peak(lambda: step(compiled, args, kwargs))
        model.zero_grad(set_to_none=True)
        grads = gradients(model, compiled, args, kwargs)
    grad_diff = max(float((grads[n] - g).abs().max()) for n, g in ref["grads"].items())
    grad_scale = max(float(g.abs().max()) for g in ref["grads"].values())
    flops = recorder.flops["fw"] + recorder.flops["bw"]
    notes = [f"{recorder.graphs} fx graphs (fw+bw)"]
    if recorder.graphs != graphs:
        notes.append("recompiled during the measured step")
    if recorder.graphs == 0:
        notes.append("nothing compiled: peak and FLOPs are eager's")
    if recorder.unknown:
        notes.append("HOPs not counted: " + ", ".join(sorted(recorder.unknown)))
    return {"model": case.name, "fraction": fraction, "backend": backend, "measured_peak_bytes": peak,
            "peak_vs_eager": round(peak / ref["eager_peak"], 4), "extra_flops": flops - ref["eager_flops"],
            "extra_flops_ratio": round((flops - ref["eager_flops"]) / ref["eager_flops"], 4),
            "fw_flops": recorder.flops["fw"], "bw_flops": recorder.flops["bw"],
            "eager_peak": ref["eager_peak"], "tracker_peak": ref["tracker_peak"],
            "eager_flops": ref["eager_flops"], "grad_max_abs_diff": grad_diff, "grad_max_abs": grad_scale,
            "notes": "; ".join(notes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "gpt2", "gpt" + NO_DROPOUT, "gpt2" + NO_DROPOUT])
    parser.add_argument("--backends", nargs="+", default=["aot_eager"], choices=["aot_eager", "inductor"])
    parser.add_argument("--fractions", nargs="+", type=float, default=FRACTIONS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile_budget.json"))
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of --out that this run does not redo (same model, backend, fraction)")
    opts = parser.parse_args()

    rows = []
    for name in opts.models:
        case = make_case(name)
        ref = eager_reference(case)
        gap = ref["eager_peak"] / ref["tracker_peak"] - 1
        print(f"[{name}] eager peak: profiler walk {ref['eager_peak']:,} B, tracker {ref['tracker_peak']:,} B "
              f"({gap:+.4%}); eager FLOPs {ref['eager_flops']:,}", flush=True)
        for backend in opts.backends:
            for fraction in opts.fractions:
                try:
                    row = compiled_row(case, backend, fraction, ref)
                except Exception as exc:                # e.g. inductor without a working C++ toolchain
                    row = {"model": name, "fraction": fraction, "backend": backend, "measured_peak_bytes": None,
                           "extra_flops": None, "extra_flops_ratio": None, "eager_peak": ref["eager_peak"],
                           "tracker_peak": ref["tracker_peak"], "eager_flops": ref["eager_flops"],
                           "notes": f"failed: {type(exc).__name__}: {str(exc)[:200]}"}
                rows.append(row)
                print(f"  {backend:9s} {fraction:4.2f}  peak {row['measured_peak_bytes']}  "
                      f"extra_flops {row['extra_flops']}  grad diff {row.get('grad_max_abs_diff')}  "
                      f"({row['notes']})", flush=True)

    if opts.merge and Path(opts.out).exists():
        redone = {(r["model"], r["backend"], r["fraction"]) for r in rows}
        old = [r for r in json.loads(Path(opts.out).read_text())
               if (r["model"], r["backend"], r["fraction"]) not in redone]
        rows = sorted(old + rows, key=lambda r: (r["model"], r["backend"], -r["fraction"]))
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\n{'model':6s} {'backend':9s} {'frac':>4s} {'peak MiB':>9s} {'peak/eager':>10s} "
          f"{'extra GFLOP':>11s} {'extra/eager':>11s}")
    for r in rows:
        if r["measured_peak_bytes"] is None:
            print(f"{r['model']:6s} {r['backend']:9s} {r['fraction']:4.2f}  {r['notes']}")
            continue
        print(f"{r['model']:6s} {r['backend']:9s} {r['fraction']:4.2f} {r['measured_peak_bytes'] / 2**20:9.3f} "
              f"{r['peak_vs_eager']:10.4f} {r['extra_flops'] / 1e9:11.4f} {r['extra_flops_ratio']:11.4f}")
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
