"""The planning pipeline for one input signature: capture → profile → problem → solve → rewrite → verify.

Every candidate plan is rewritten and its step re-measured on fake tensors; if the memory model was
optimistic the solver runs again under a tighter internal budget, and the verified minimum-peak plan is the
fallback. A returned plan therefore never predicts more than its budget.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import numbers
import os
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.fx
from torch.utils._pytree import tree_map_only

from autorecompute.budget import parse_budget, resolve_budget
from autorecompute.errors import InfeasibleBudgetError, user_stacklevel
from autorecompute.memory_model import (REMAKE, effective_stash, extra_cost, extra_flops, held_at, memory_components,
                                         memory_timeline, predicted_peak, region_ids, remakes)
from autorecompute.passes.build_problem import build_problem
from autorecompute.passes.capture import callers_autocast, capture
from autorecompute.passes.profile import node_info, step_profile, profile_step
from autorecompute.passes.rewrite_calls import rewrite_calls
from autorecompute.passes.rewrite_recompute import rewrite_recompute
from autorecompute.passes.rewrite_softmax import rewrite_softmax, softmax_in_place_nodes
from autorecompute.passes.rewrite_stash import rewrite_stash
from autorecompute.passes.verify import fake_step_memory
from autorecompute.plan import NodeRecord, Plan, StashRecord
from autorecompute.problem import GRADIENT, Problem
from autorecompute.runtime.codecs import CODECS
from autorecompute.runtime.memory import AUTO
from autorecompute.runtime.stash import StashedModule, StashRuntime, distributed
from autorecompute.runtime.tiers import check_writable
from autorecompute.solvers import cpsat, greedy
from autorecompute.transfer import TransferModel, counting_flops, default_for

log = logging.getLogger("autorecompute")

SUPPORTED_ACTIONS = ("recompute", "offload", "compress")
OBJECTIVES = ("time", "flops")
DEFAULT_ACTIONS = ("recompute", "offload")      # the lossless ones
MAX_TIGHTENINGS = 4
NEAR_MINIMUM = 1.15   # budgets below this multiple of the heuristic minimum get a CP-SAT minimum-peak solve
# the minimum-peak local search's work per second of solver time (greedy.lower_peak: evaluations × problem
# size), at least one second's: about half a second per second of limit on a 2-core CPU (recompute only)
# when it runs to the end; on the benchmark models it ends sooner, where no single or group change lowers
# the peak
LOCAL_SEARCH_WORK = 2_000_000
# the cost local search's work per second of solver time (greedy.lower_cost, after each cost solve that is not
# optimal): about 0.4 s per second of limit on a 2-core CPU when it runs to the end; in the benchmark suite,
# Llama's least-FLOPs plan at √N's peak runs 34.6 MFLOP again instead of 37.7 (31.5 with 4× the limit)
COST_SEARCH_WORK = 500_000

Decisions = tuple[dict[str, bool], dict[str, str]]     # (op → recomputed, activation → stash action)


@dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the planner, validated once at ``compile``/``plan`` time."""

    actions: tuple[str, ...] = DEFAULT_ACTIONS
    solver_time_limit: float = 8.0
    seed: int = 0
    compress_dtypes: tuple[str, ...] | None = None
    offload_dir: str | None = None
    transfer: TransferModel | None = None
    objective: str = "time"
    loss_reserve: int | str = "auto"

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r}; accepted objectives are {OBJECTIVES}: 'time' (the "
                             "device's speeds: FLOPs, memory-bound bytes, calls) or 'flops' (FLOPs alone)")
        if isinstance(self.actions, str):
            raise ValueError(f"actions={self.actions!r} must be a tuple such as ('recompute', 'offload')")
        unknown = [a for a in self.actions if a not in SUPPORTED_ACTIONS]
        if "keep" in self.actions or not self.actions:
            raise ValueError(f"actions={self.actions!r}: list what may be done besides keeping a tensor (keeping "
                             f"is always allowed, and not an action to name), among {SUPPORTED_ACTIONS}")
        if unknown:
            raise ValueError(f"actions={self.actions!r}: unknown {unknown}; accepted actions are "
                             f"{SUPPORTED_ACTIONS} (keeping a tensor is always allowed)")
        if self.compress_dtypes is not None:
            if isinstance(self.compress_dtypes, str):
                raise ValueError(f"compress_dtypes={self.compress_dtypes!r} must be a tuple such as ('bfloat16',)")
            bad = [d for d in self.compress_dtypes if d not in CODECS]
            if bad or not self.compress_dtypes:
                what = f"unknown {bad}" if bad else "empty (None for the default, bfloat16)"
                raise ValueError(f"compress_dtypes={self.compress_dtypes!r}: {what}; accepted compress "
                                 f"dtypes are {tuple(CODECS)}")
            if "compress" not in self.actions:
                raise ValueError(f"compress_dtypes={self.compress_dtypes!r} given but 'compress' is not in "
                                 f"actions={self.actions!r}: add it (compression is lossy, so it is opt-in)")
        if self.offload_dir is not None:
            if not isinstance(self.offload_dir, (str, os.PathLike)) or not str(self.offload_dir):
                raise ValueError(f"offload_dir={self.offload_dir!r} must be a directory's path (None: the system "
                                 "temporary directory)")
            if "offload" not in self.actions:
                raise ValueError(f"offload_dir={self.offload_dir!r} given but 'offload' is not in "
                                 f"actions={self.actions!r}")
            check_writable(self.offload_dir)
        if self.transfer is not None and not isinstance(self.transfer, TransferModel):
            raise ValueError(f"transfer={self.transfer!r} must be an autorecompute.transfer.TransferModel")
        if isinstance(self.solver_time_limit, bool) or not isinstance(self.solver_time_limit, numbers.Real) \
                or not 0 < self.solver_time_limit < math.inf:
            # infinite is refused too: the limit is also the deterministic work CP-SAT may spend, an integer
            raise ValueError(f"solver_time_limit={self.solver_time_limit!r} must be a finite number of seconds > 0 "
                             "(the best plan found by then is used: for a longer search pass more, e.g. 60)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) \
                or not -2**31 <= self.seed < 2**31:
            raise ValueError(f"seed={self.seed!r} must be an int that fits 32 bits (CP-SAT's random seed)")
        object.__setattr__(self, "seed", int(self.seed))      # a numpy int too (random.Random takes no other)
        if self.loss_reserve != AUTO and (isinstance(self.loss_reserve, bool) or not isinstance(
                self.loss_reserve, numbers.Integral) or self.loss_reserve < 0):
            raise ValueError(f"loss_reserve={self.loss_reserve!r} must be 'auto' (sized from the outputs for a loss "
                             "computed outside the model), 0 (the model returns its loss) or the bytes the caller's "
                             "loss holds at the start of backward")

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The compress dtypes in effect (bfloat16 when compress is allowed and none were named)."""
        if "compress" not in self.actions:
            return ()
        return tuple(self.compress_dtypes or ("bfloat16",))


@dataclass
class Planned:
    """A plan and the module that carries it out (a GraphModule, or a :class:`StashedModule` around one)."""

    plan: Plan
    module: torch.nn.Module
    backward_watched: bool = False   # whether its first step's backward was checked (CompiledModule)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self.module.graph_module if isinstance(self.module, StashedModule) else self.module


def clone_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph, sharing its parameters and buffers."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    if isinstance(output, tuple):
        output_value, _ = output
        graph.output(output_value)
    graph._codegen = gm.graph._codegen      # pytree in/out specs: immutable, shared
    clone = torch.fx.GraphModule(gm, graph)
    clone.meta = dict(gm.meta)
    return clone


def _keep_all(problem: Problem) -> Decisions:
    return {op: False for op in problem.chain if op in problem.recomputable}, {}


def _device_type(args: tuple, kwargs: dict) -> str:
    from torch.utils._pytree import tree_flatten

    for value in tree_flatten((args, kwargs))[0]:
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def _decisions(problem: Problem, recompute: dict[str, bool]) -> dict[str, str]:
    return {op: ("recompute" if recompute.get(op) else "keep") for op in problem.chain if op in problem.recomputable}


def _region_starts(problem: Problem, recompute: dict[str, bool]) -> tuple[str, ...]:
    """Recomputed ops that begin a region though the op before them is recomputed too."""
    ids = region_ids(problem, recompute)
    return tuple(op for k, op in enumerate(problem.chain) if k and ids[k] >= 0 and ids[k - 1] >= 0
                 and ids[k] != ids[k - 1])


def _region_remakes(problem: Problem, recompute: dict[str, bool]) -> tuple[str, ...]:
    """The first ops of the regions that make their inputs from the region before them again (``remakes``)."""
    ids = region_ids(problem, recompute)
    made = remakes(problem, recompute, ids)     # (regions that begin with an op decided REMAKE)
    return tuple(op for k, op in enumerate(problem.chain) if recompute.get(op) == REMAKE and ids[k] in made)


def make_plan(model: torch.nn.Module, args: tuple, kwargs: dict, budget, options: PlannerOptions,
              signature: str = "") -> Planned:
    """Plans ``model`` for inputs ``(args, kwargs)`` under ``budget`` (see :func:`autorecompute.compile`).

    A plan is for a training step whatever the caller's grad mode: under ``torch.no_grad()`` (a ``prepare``
    or ``plan`` call beside evaluation code) the capture would save nothing for backward, and that plan,
    kept for these inputs, would be the training step's (1.17 MB measured against a 1 MB budget)."""
    with _unseen_by_callers_modes(), _unseen_by_callers_hooks(), torch.inference_mode(False), torch.enable_grad():
        # inputs made under inference_mode cannot be saved for backward: planned on ordinary copies, as the
        # training step's inputs will be
        args, kwargs = tree_map_only(
            torch.Tensor, lambda t: t.clone() if t.is_inference() else t, (args, kwargs))
        return _make_plan(model, args, kwargs, budget, options, signature)


def _unseen_by_callers_hooks() -> contextlib.AbstractContextManager:
    """Planning's fake steps out of the caller's saved-tensor hooks: ``torch.utils.checkpoint`` around a
    compiled module counted them among what its forward saved, and its recomputation (which finds the plan
    made) saved fewer: ``CheckpointError``. Only the innermost hooks pack, so identity hooks shield them."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)   # (what checkpoint.py reads)
    if top is not None and top(False) is None:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def _unseen_by_callers_modes() -> Iterator[None]:
    """Planning's own steps (capture, fake steps, rewritten candidates) out of the caller's dispatch modes:
    a ``LiveStorageTracker`` or ``FlopCounterMode`` around a first training call measured the planner's
    fake tensors as the step's (a 6.26 MiB "peak" against a 2.38 MiB budget). A caller's ``FakeTensorMode``
    (planning on fake inputs) stays: its tensors need it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

    stack = _get_current_dispatch_mode_stack()
    if not stack or any(isinstance(mode, FakeTensorMode) for mode in stack):
        yield
        return
    with _disable_current_modes():
        yield


def _make_plan(model: torch.nn.Module, args: tuple, kwargs: dict, budget, options: PlannerOptions,
               signature: str) -> Planned:
    started = time.perf_counter()
    entered = callers_autocast()
    if _device_type(args, kwargs) == "meta" and entered:
        warnings.warn("torch.autocast does not apply to tensors on the meta device: this plan is for the step "
                      "without autocast (its activations in the model's dtype, so larger). Fix: plan on the device "
                      "the steps run on, or convert the model to the low-precision dtype (model.bfloat16()) to "
                      "size it on meta.", UserWarning, stacklevel=user_stacklevel())
    parsed = parse_budget(budget)
    gm = capture(model, args, kwargs)
    log.debug("capture: %.2f s, %d nodes", time.perf_counter() - started, len(gm.graph.nodes))
    t = time.perf_counter()
    profile = profile_step(gm, args, kwargs, options.loss_reserve)
    reserve = profile.loss_reserve
    device_type = _device_type(args, kwargs)
    transfer = options.transfer or default_for(device_type)
    if device_type == "cpu" and transfer.overlaps_compute:
        # the CPU's disk tier copies on the training thread (runtime/tiers.py): nothing hides a copy there,
        # whatever a hand-made TransferModel says
        transfer = dataclasses.replace(transfer, overlaps_compute=False)
    speeds = transfer if options.objective == "time" else counting_flops(transfer)
    problem = _build(gm, options, transfer, speeds)
    log.debug("profile + problem: %.2f s, %d ops in chain, %d recomputable, %d activations, %d stashable",
              time.perf_counter() - t, len(problem.chain), len(problem.recomputable), len(problem.activations),
              len(problem.stash_options))
    baseline_peak = _unoptimized_peak(gm, args, kwargs, profile.peak, reserve)
    budget_bytes = resolve_budget(parsed, baseline_peak)
    runtime = StashRuntime(options.offload_dir) if problem.stash_options else None

    def under_autocast(fn, *args):
        """``fn`` in another thread under the caller's ``torch.autocast`` (thread-local state): a step planned
        under autocast is measured as it runs (the hint's check in the pool measured it in float32)."""
        with contextlib.ExitStack() as stack:
            for device_type, dtype in entered:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            return fn(*args)

    def verify(decisions: Decisions) -> tuple[torch.nn.Module, int]:
        recompute, stash = decisions
        candidate = rewrite_recompute(clone_graph_module(gm), _decisions(problem, recompute),
                                      _region_starts(problem, recompute), _region_remakes(problem, recompute))
        if stash:
            prefetch = {name: problem.stash_option(name, action).restored_from - problem.num_forward
                        for name, action in stash.items()}
            chosen = {name: problem.stash_option(name, action) for name, action in stash.items()}
            recipes = {name: option.recipe for name, option in chosen.items() if option.recipe}
            delivers = {name: option.delivers for name, option in chosen.items() if option.delivers}
            candidate = StashedModule(rewrite_stash(candidate, stash, prefetch, runtime, recipes, delivers))
        return candidate, fake_step_memory(candidate, args, kwargs, reserve).peak

    # 1. The lowest peak reachable: the minimum budget, the fallback, and the hint of the cost solve.
    t = time.perf_counter()
    heuristic = greedy.lowest_start(problem)
    progress = sys.stderr.isatty()    # a live status line for people, nothing in logs and pipes
    lowest = {"decisions": heuristic, "peak": predicted_peak(problem, *heuristic), "status": "heuristic",
              "gap": 1.0, "time": 0.0, "verified": False}
    # every minimum-peak plan verified so far, (module, verified peak, decisions): a later one can be lower in
    # the model and higher when measured, so the fallback is the lowest measured, not the latest
    verified_minimum: list[tuple[torch.nn.Module, int, Decisions]] = []
    # minimum-peak plans a lower one (in the model) replaced before they were verified: verified with it, so
    # the start — √N's over articulation points among them — is a fallback when the model is optimistic
    replaced_unverified: list[Decisions] = []

    def replace_lowest(decisions: Decisions, peak: int, status: str, gap: float) -> None:
        if not lowest["verified"]:
            replaced_unverified.append(lowest["decisions"])
        lowest.update(decisions=decisions, peak=peak, status=status, gap=gap, verified=False)

    def lower_minimum(time_limit: float) -> None:
        """Asks CP-SAT for a lower minimum-peak plan than the best so far (which hints it), then a local
        search from the best (CP-SAT can stop where one change lowers the peak)."""
        decisions = lowest["decisions"]
        solved = cpsat.solve_in_stages(problem, minimize="peak", time_limit=time_limit, seed=options.seed,
                             hint=decisions[0], hint_stash=decisions[1], progress=progress)
        lowest["time"] += solved.wall_time
        if solved.recompute is not None and solved.objective <= lowest["peak"]:
            replace_lowest((solved.recompute, effective_stash(problem, solved.recompute, solved.stash)),
                           solved.objective, solved.status, solved.gap)
        t = time.perf_counter()
        polished = greedy.lower_peak(problem, lowest["decisions"], work=int(LOCAL_SEARCH_WORK * max(1.0, time_limit)),
                                     seed=options.seed)
        lowest["time"] += time.perf_counter() - t
        peak = predicted_peak(problem, *polished)
        if peak < lowest["peak"]:
            replace_lowest(polished, peak, "feasible (local search)", lowest["gap"])

    if budget_bytes < NEAR_MINIMUM * lowest["peak"]:
        # the minimum matters only when the budget is close to it: then ask CP-SAT for a lower one (a budget far
        # below it too: the same searches as at any budget under the minimum, so that the minimum an
        # InfeasibleBudgetError names, given as the budget, finds the plan it was measured from)
        lower_minimum(options.solver_time_limit / 4)
    log.debug("minimum peak (model) %d, %s in %.2f s", lowest["peak"], lowest["status"], time.perf_counter() - t)

    def minimum() -> tuple[torch.nn.Module, int, Decisions]:
        """The lowest measured minimum-peak plan; the plans found since the last call (the latest and those
        it replaced) are verified when a decision first needs the minimum."""
        if not lowest["verified"] or replaced_unverified:
            # the plans it replaced too: a fake step each (well under a second on the benchmark models), and
            # plans equal in the model can differ when measured (VGG with offload: 3.98, 4.17 and 4.50 MB at
            # one model peak of 4.50 MB)
            for decisions in ([] if lowest["verified"] else [lowest["decisions"]]) + replaced_unverified:
                model_peak = predicted_peak(problem, *decisions)
                module, peak = verify(decisions) if model_peak < baseline_peak else (gm, baseline_peak)
                verified_minimum.append((module, peak, decisions) if peak < baseline_peak else
                                        (gm, baseline_peak, _keep_all(problem)))
                log.debug("minimum-peak plan: %d in the model, %d measured", model_peak, peak)
            replaced_unverified.clear()
            lowest["verified"] = True
        return min(verified_minimum, key=lambda entry: entry[1])

    def infeasible() -> InfeasibleBudgetError:
        peak = minimum()[1]
        return InfeasibleBudgetError(budget_bytes, peak, _breakdown(profile, peak), options.actions,
                                     fraction=parsed if isinstance(parsed, float) else None,
                                     baseline=baseline_peak)

    cost_solve_time = 0.0

    def cheapest_fitting(internal: int):
        """The cheapest plan whose verified peak fits the budget, re-solved under a tighter internal budget
        while verification finds the model optimistic; None when the tightening reaches the model's minimum."""
        nonlocal cost_solve_time
        if internal < lowest["peak"] and lowest["verified"] and minimum()[1] <= internal:
            # The model over-predicts near its minimum (the minimum-peak plan measures lower than it says):
            # search under the budget as the model sees it there; verification below still decides. (Only
            # once the minimum is verified anyway: a budget far below it must not pay for a verification.)
            internal += lowest["peak"] - minimum()[1]
        for _ in range(MAX_TIGHTENINGS):
            if internal < lowest["peak"]:
                return None, internal   # tighter than the model's own minimum: the minimum-peak plan is the answer
            segments = greedy.best_under(problem, internal)
            hint = segments or greedy.descend(problem, internal, lowest["decisions"])
            # Verify the hint on the other core while CP-SAT (which releases the GIL) tries to beat it.
            with ThreadPoolExecutor(max_workers=1) as pool:
                hint_verified = pool.submit(under_autocast, verify, hint)
                result = cpsat.solve_in_stages(problem, budget=internal, minimize="cost",
                                     time_limit=options.solver_time_limit, seed=options.seed, hint=hint[0],
                                     hint_stash=hint[1], progress=progress,
                                     zero_flops_first=options.objective == "flops")
                best, status = hint, f"heuristic (cp-sat {result.status})"
                if result.recompute is not None:
                    solved = (result.recompute, effective_stash(problem, result.recompute, result.stash))
                    if predicted_peak(problem, *solved) <= internal:
                        if extra_cost(problem, *solved) < extra_cost(problem, *hint):
                            best, status = solved, result.status
                        elif result.status == "optimal":
                            status = "optimal"     # the hint costs no more than CP-SAT's proven optimum
                candidate, candidate_peak = hint_verified.result()
            cost_solve_time += result.wall_time
            if status != "optimal":
                # CP-SAT on a long chain stops where keeping one op, with one change that makes room, is cheaper
                t = time.perf_counter()
                polished = greedy.lower_cost(problem, internal, best,
                                             work=int(COST_SEARCH_WORK * options.solver_time_limit))
                if result.recompute is None and segments:
                    # CP-SAT found nothing (a deep chain: its presolve does not finish; or its region bound
                    # counts the start over the budget) and the local search ran from the segment plans' start,
                    # which under a budget near √N's peak is √N's plan: the other start too (when the hint was
                    # not it already), the minimum-peak plan with the dearest ops kept while they fit (12-layer
                    # Llama at √N's peak: 269 → 240 MFLOP)
                    other = greedy.lower_cost(problem, internal, greedy.descend(problem, internal, lowest["decisions"]),
                                              work=int(COST_SEARCH_WORK * options.solver_time_limit))
                    if _fits_cheaper(problem, internal, other, than=polished):
                        polished = other
                if extra_cost(problem, *polished) < extra_cost(problem, *best):
                    best, status = polished, "feasible (local search)"
                if result.recompute is None and len(problem.recomputable) > cpsat.WINDOW_OPS:
                    # CP-SAT found nothing on the whole chain: CP-SAT over windows of it, the rest fixed
                    # (6-layer Llama at batch 16, at √N's peak: 407 → 344 MFLOP)
                    windowed = cpsat.solve_in_windows(problem, best, budget=internal,
                                                      time_limit=options.solver_time_limit, seed=options.seed)
                    if _fits_cheaper(problem, internal, windowed, than=best):
                        best, status = windowed, "feasible (cp-sat windows)"
                # CP-SAT over the same stretch of every repeated layer at once: the trades between layers far
                # apart that neither the whole chain's model (too large for the limit) nor a window of the
                # chain (a layer or two) makes (cpsat.block_windows: 6-layer GPT at √N's peak, least FLOPs,
                # 35.7 → 0 MFLOP run again)
                across = cpsat.solve_in_windows(problem, best, budget=internal, seed=options.seed,
                                                time_limit=options.solver_time_limit,
                                                windows=cpsat.block_windows(problem))
                if _fits_cheaper(problem, internal, across, than=best):
                    best, status = across, "feasible (cp-sat across layers)"
                cost_solve_time += time.perf_counter() - t
            cost = extra_cost(problem, *best)
            gap = 0.0 if status == "optimal" else max(0.0, (cost - result.bound) / cost) if cost else 0.0
            if best is not hint:
                candidate, candidate_peak = verify(best)
            model_peak = predicted_peak(problem, *best)
            log.debug("cost solve under %d: %s, model peak %d, verified %d", internal, status, model_peak,
                      candidate_peak)
            if model_peak < lowest["peak"]:
                # below the minimum-peak solve's best (it had less time): the lowest plan known now; the one it
                # replaces, if not verified yet, is verified with the next (lower in the model is not lower
                # measured: a minimum_peak() answer given as the budget was refused without it)
                if not lowest["verified"]:
                    replaced_unverified.append(lowest["decisions"])
                lowest.update(decisions=best, peak=model_peak, status="feasible", verified=True)
                verified_minimum.append((candidate, candidate_peak, best))
            if candidate_peak <= budget_bytes:
                return (best, candidate, candidate_peak, status, gap), internal
            # below this plan's own model peak, so the next solve cannot return it again
            internal = min(internal, model_peak) - (candidate_peak - budget_bytes) \
                - max(1, (budget_bytes - lowest["peak"]) // 16)
        return None, internal

    # 2. The cheapest plan under the budget; the verified minimum-peak plan is the last resort.
    status, gap = "trivial", 0.0
    chosen, module, peak = _keep_all(problem), gm, baseline_peak
    if budget_bytes < baseline_peak:
        found, internal = cheapest_fitting(budget_bytes)
        if found is None and lowest["status"] != "optimal":
            # Before falling back to the minimum-peak plan or saying "infeasible", spend the full time limit on
            # the minimum: a short solve (or the heuristic alone) can leave it well above the true one — the
            # fallback would cost more than needed (GPT-2 at 55% of eager: +67% of its FLOPs, not +25%) and the
            # error would name a wrong minimum. (Not when the budget is the verified minimum, within 1%: no
            # room for a cheaper plan.)
            room = budget_bytes - minimum()[1]
            if room < 0 or room >= budget_bytes // 100:
                lower_minimum(options.solver_time_limit)
                found, _ = cheapest_fitting(min(internal, budget_bytes))
        if found is not None:
            chosen, module, peak, status, gap = found
        else:
            module, peak, chosen = minimum()
            if peak > budget_bytes:
                raise infeasible()
            status, gap = "fallback (minimum-peak plan)", lowest["gap"]
    solve_time = lowest["time"] + cost_solve_time
    softmax_in_place, peak = _softmax_in_place(module, args, kwargs, budget_bytes, peak, reserve)
    # the lowest verified minimum-peak plan, the latest one (model estimate) if not verified, the plan itself
    minimum_peak = min([entry[1] for entry in verified_minimum] + [peak]
                       + ([] if lowest["verified"] else [lowest["peak"]]))
    recompute, stash = chosen

    plan = Plan(
        budget=budget_bytes, predicted_peak=peak, baseline_peak=baseline_peak, minimum_peak=minimum_peak,
        model_peak=predicted_peak(problem, recompute, stash), decisions=_decisions(problem, recompute),
        region_starts=_region_starts(problem, recompute), region_remakes=_region_remakes(problem, recompute),
        softmax_in_place=softmax_in_place, loss_reserve=reserve,
        extra_flops=extra_flops(problem, recompute, stash), baseline_flops=sum(problem.flops.values()),
        solver_status=status, solver_time=solve_time, solver_gap=gap,
        plan_time=time.perf_counter() - started, actions=options.actions, objective=options.objective, resident=dict(profile.resident),
        nodes=_node_records(gm, problem), model_name=type(model).__name__, signature=signature,
        edges=_edges(gm, problem), timeline=_timeline(problem, recompute, stash, profile.resident_bytes),
        num_forward=problem.num_forward, at_peak=_at_peak(problem, recompute, stash),
        stash=_stash_records(gm, problem, stash),
        extra_seconds=transfer.compute_seconds(extra_cost(
            problem if speeds is transfer else _build(gm, options, transfer, transfer), recompute, stash)))
    log.debug("plan: %s", plan.summary())
    # last, on the module that runs: each op called through eager's own binding where that dispatches the same
    # ops (the same kernels and allocations as verified; a microsecond less per call)
    rewrite_calls(module.graph_module if isinstance(module, StashedModule) else module)
    return Planned(plan=plan, module=module)


def _unoptimized_peak(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, profiled: int, reserve: int) -> int:
    """The step's peak as eager runs it, which fractional budgets are fractions of: the profile's, or, where
    capture wrote softmax backwards into their gradients (the profile's step), the step measured with
    autograd's."""
    names = softmax_in_place_nodes(gm)
    if not names:
        return profiled
    rewrite_softmax(gm, in_place=())
    try:
        return max(profiled, fake_step_memory(gm, args, kwargs, reserve).peak)
    finally:
        rewrite_softmax(gm, in_place=names)


def _softmax_in_place(module: torch.nn.Module, args: tuple, kwargs: dict, budget: int,
                      peak: int, reserve: int) -> tuple[tuple[str, ...], int]:
    """(the softmaxes whose backward stays written into their gradient, the step's verified peak).

    The profile and the plan count every softmax capture made ``softmax_backward_in_place`` at its lower
    memory; where the step also fits ``budget`` with all of them back on autograd's backward (measured, as
    every plan is), they go back: autograd's is called from C++, ~35 µs a softmax less on a CPU (2% of a
    GPT-style step at √N's peak). Else all stay in place."""
    gm = module.graph_module if isinstance(module, StashedModule) else module
    names = softmax_in_place_nodes(gm)
    if not names:
        return (), peak
    rewrite_softmax(gm, in_place=())
    autograds = fake_step_memory(module, args, kwargs, reserve).peak
    if autograds <= budget:
        return (), autograds
    rewrite_softmax(gm, in_place=names)
    return tuple(names), peak


def _build(gm: torch.fx.GraphModule, options: PlannerOptions, transfer, speeds) -> Problem:
    """The problem of a profiled ``gm``, recomputation priced at ``speeds``, transfers at ``transfer``."""
    return build_problem(gm, recompute="recompute" in options.actions,
                         offload=transfer if "offload" in options.actions else None,
                         compress_dtypes=options.dtypes, device=speeds, offload_gradients=not distributed())


def _fits_cheaper(problem: Problem, budget: int, plan: Decisions, than: Decisions) -> bool:
    """Whether ``plan`` fits ``budget`` in the memory model and costs less than ``than``."""
    return predicted_peak(problem, *plan) <= budget and extra_cost(problem, *plan) < extra_cost(problem, *than)


def _stash_records(gm: torch.fx.GraphModule, problem: Problem, stash: dict[str, str]) -> dict[str, StashRecord]:
    profile = step_profile(gm)
    records = {}
    for name, action in stash.items():
        option = problem.stash_option(name, action)
        if name.startswith(GRADIENT):
            param = gm.get_parameter(name[len(GRADIENT):])
            records[name] = StashRecord(action=action, owner=name, nbytes=param.numel() * param.element_size(),
                                        stored_bytes=0, shape=tuple(param.shape), dtype=str(param.dtype).split(".")[-1],
                                        expected_error="exact", prefetch_event=option.restored_from - problem.num_forward)
            continue
        tensor = profile.tensors[name]
        error = CODECS[action.split(":", 1)[1]].expected_error if action.startswith("compress:") else "exact"
        records[name] = StashRecord(action=action, owner=tensor.owner, nbytes=tensor.nbytes,
                                    stored_bytes=option.stored_bytes, shape=tuple(tensor.shape), dtype=tensor.dtype,
                                    expected_error=error,
                                    prefetch_event=option.restored_from - problem.num_forward,
                                    recipe=option.recipe, delivers=option.delivers)
        for other in option.delivers:     # made again by this recipe, on its way
            made = profile.tensors[other]
            records[other] = StashRecord(action=action, owner=made.owner, nbytes=made.nbytes, stored_bytes=0,
                                         shape=tuple(made.shape), dtype=made.dtype, expected_error="exact",
                                         prefetch_event=option.restored_from - problem.num_forward,
                                         delivered_by=name)
    return records


def _at_peak(problem: Problem, recompute: dict[str, bool], stash: dict[str, str]) -> tuple[str, ...]:
    total = memory_timeline(problem, recompute, stash)
    position = max(range(len(total)), key=total.__getitem__)
    held = held_at(problem, recompute, position, stash)
    return tuple(op for op in problem.chain if op in held and not recompute.get(op))


def _timeline(problem: Problem, recompute: dict[str, bool], stash: dict[str, str],
              resident: int) -> dict[str, list[int]]:
    parts = memory_components(problem, recompute, stash)
    return {"resident": [resident] * problem.num_positions, "fixed": list(parts.fixed), "held": list(parts.held),
            "recomputed": list(parts.recomputed), "stashed": list(parts.stashed),
            "baseline": memory_timeline(problem, {})}


def _edges(gm: torch.fx.GraphModule, problem: Problem) -> tuple[tuple[str, str, int], ...]:
    totals: dict[tuple[str, str], int] = {}
    for t in step_profile(gm).tensors.values():
        if t.owner in problem.recomputable:
            for reader in t.readers:
                if reader in problem.recomputable and reader != t.owner:
                    totals[(t.owner, reader)] = totals.get((t.owner, reader), 0) + t.nbytes
    return tuple((a, b, n) for (a, b), n in totals.items())


def _breakdown(profile, minimum_peak: int) -> dict[str, int]:
    rows = {k: v for k, v in profile.resident.items()}
    rows["new gradients"] = profile.parameter_grad_bytes
    rows["activations"] = max(0, minimum_peak - sum(rows.values()))
    return rows


def _node_records(gm: torch.fx.GraphModule, problem: Problem) -> dict[str, NodeRecord]:
    profile = step_profile(gm)
    held: dict[str, int] = {}
    for act in problem.activations:
        if act.savers:
            held[act.owner] = held.get(act.owner, 0) + act.nbytes
    records = {}
    owners = {act.owner for act in problem.activations}      # (the ops offload or compress can act on)
    for node in gm.graph.nodes:
        if node.name not in problem.recomputable and node.name not in owners:
            continue
        info = node_info(node)
        first = profile.tensors[info.creates[0]] if info.creates else None
        records[node.name] = NodeRecord(
            shape=tuple(first.shape) if first else (), dtype=first.dtype if first else "",
            nbytes=sum(profile.tensors[c].nbytes for c in info.creates), held_bytes=held.get(node.name, 0),
            flops=info.flops, module=info.module_path)
    return records
