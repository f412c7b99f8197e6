"""The planning pipeline for one input signature: capture → profile → problem → search → Plan.

The search (:mod:`autorecompute.search`) verifies every candidate — carried out on the graph, its step
measured on fake tensors — so a returned plan never predicts more than its budget. The Plan is built from
the chosen decisions' :class:`~autorecompute.decisions.Rewrite`, the same object the rewrite carries out.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import numbers
import os
import time
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch
import torch.fx
from torch.utils._pytree import tree_map_only

from autorecompute.budget import format_bytes, parse_budget, resolve_budget
from autorecompute.decisions import Rewrite
from autorecompute.errors import InfeasibleBudgetError, user_stacklevel
from autorecompute.loss import plan_name
from autorecompute.memory_model import (extra_cost, extra_flops, held_at, memory_components, memory_timeline,
                                         predicted_peak, rewrite_of)
from autorecompute import plan_cache
from autorecompute.passes.apply_plan import apply_plan, graph_module_of
from autorecompute.passes.autocast import callers_autocast
from autorecompute.passes.build_problem import build_problem
from autorecompute.passes.capture import capture
from autorecompute.passes.meta import node_info, step_profile
from autorecompute.passes.profile import profile_step
from autorecompute.passes.rewrite_calls import rewrite_calls
from autorecompute.passes.rewrite_lean_ops import lean_op_nodes, rewrite_lean_ops
from autorecompute.passes.verify import fake_step_memory, verify_plan
from autorecompute.passes.verify_compiled import compiled_step_memory
from autorecompute.plan import NodeRecord, Plan, StashRecord
from autorecompute.problem import GRADIENT, Problem
from autorecompute.rank_plans import RankShare
from autorecompute.runtime.codecs import CODECS
from autorecompute.runtime.memory import AUTO
from autorecompute.runtime.stash import StashRuntime, distributed
from autorecompute.runtime.tiers import check_writable
from autorecompute.search import TRIVIAL, Found, Search, SearchPlan, Strategies
from autorecompute.solvers import layered
from autorecompute.throughputs import TransferModel, counting_flops, default_for

log = logging.getLogger("autorecompute")

SUPPORTED_ACTIONS = ("recompute", "offload", "compress")
OBJECTIVES = ("time", "flops")
ENGINES = ("eager", "torch.compile")     # what runs the planned step (Plan.engine)
OUTPUTS = ("kept", "dropped")     # held by the caller through backward (out = model(...)), or not (model(...).loss)
DEFAULT_ACTIONS = ("recompute", "offload")      # the lossless ones
WHOLE_MODEL_TIME_LIMIT = 8.0     # the default solver_time_limit of a graph planned as a whole
BY_LAYERS_TIME_LIMIT = 0.5       # ... of one planned by its layers: the local searches' work after the DP
WHOLE_MODEL_BELOW = 0.5          # budgets from this fraction of the layers' minimum get the whole-model search too
COMPILED_SEARCHES = 4            # searches for torch.compile, each under the budget less what the last one's compiled step held beyond it



@dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the planner, validated once at ``compile``/``plan`` time."""

    actions: tuple[str, ...] = DEFAULT_ACTIONS
    solver_time_limit: float | None = None     # None: the planner's choice (:func:`search_setup`)
    seed: int = 0
    compress_dtypes: tuple[str, ...] | None = None
    offload_dir: str | None = None
    transfer: TransferModel | None = None
    objective: str = "time"
    loss_reserve: int | str = "auto"
    outputs: str = "kept"       # what the caller does with the outputs backward does not start from: OUTPUTS
    engine: str = "eager"       # what runs the step: ENGINES (CompiledModule plans for torch.compile under dynamo)
    strategies: Strategies = Strategies()     # the searches combined (tests pass stubs)

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
        if self.solver_time_limit is not None and (
                isinstance(self.solver_time_limit, bool) or not isinstance(self.solver_time_limit, numbers.Real)
                or not 0 < self.solver_time_limit < math.inf):
            # infinite is refused too: the limit is also the deterministic work CP-SAT may spend, an integer
            raise ValueError(f"solver_time_limit={self.solver_time_limit!r} must be a finite number of seconds > 0 "
                             "(the best plan found by then is used: for a longer search pass more, e.g. 60)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) \
                or not -2**31 <= self.seed < 2**31:
            raise ValueError(f"seed={self.seed!r} must be an int that fits 32 bits (CP-SAT's random seed)")
        object.__setattr__(self, "seed", int(self.seed))      # a numpy int too (random.Random takes no other)
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r}; accepted: {ENGINES}")
        if self.engine == "torch.compile" and tuple(self.actions) != ("recompute",):
            raise ValueError(f"engine='torch.compile' with actions={self.actions!r}: a compiled graph recomputes "
                             "checkpointed regions and runs no stash hooks, so its plans take actions=('recompute',)")
        if self.outputs not in OUTPUTS:
            raise ValueError(f"outputs={self.outputs!r}; accepted: 'kept' (the caller holds the outputs through "
                             "backward: out = model(x); out.loss.backward()), 'dropped' (only the loss the model "
                             "returns lives on: model(x).loss.backward(), Hugging Face Trainer's step) or, for "
                             "compile, 'auto' (kept until the first step shows them dropped)")
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
    step_measured: bool = False      # whether its first step's peak was measured (CompiledModule)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return graph_module_of(self.module)


def _device_type(args: tuple, kwargs: dict) -> str:
    from torch.utils._pytree import tree_flatten

    for value in tree_flatten((args, kwargs))[0]:
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def make_plan(model: torch.nn.Module, args: tuple, kwargs: dict, budget, options: PlannerOptions,
              signature: str = "") -> Planned:
    """Plans ``model`` for inputs ``(args, kwargs)`` under ``budget`` (see :func:`autorecompute.compile`).

    A plan is for a training step whatever the caller's grad mode: under ``torch.no_grad()`` (a ``prepare``
    or ``plan`` call beside evaluation code) the capture would save nothing for backward, and that plan,
    kept for these inputs, would be the training step's, and the step would exceed its budget."""
    with _unseen_by_callers_modes(), _unseen_by_callers_hooks(), torch.inference_mode(False), torch.enable_grad():
        # inputs made under inference_mode cannot be saved for backward: planned on ordinary copies, as the
        # training step's inputs will be
        args, kwargs = tree_map_only(
            torch.Tensor, lambda t: t.clone() if t.is_inference() else t, (args, kwargs))
        return _make_plan(model, args, kwargs, budget, options, signature)


def _unseen_by_callers_hooks() -> contextlib.AbstractContextManager:
    """Planning's fake steps out of the caller's saved-tensor hooks: ``torch.utils.checkpoint`` around a
    compiled module would count them among what its forward saves, and its recomputation (which finds the plan
    made) saves fewer: ``CheckpointError``. Only the innermost hooks pack, so identity hooks shield them."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)   # (what checkpoint.py reads)
    if top is not None and top(False) is None:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def _unseen_by_callers_modes() -> Iterator[None]:
    """Planning's own steps (capture, fake steps, rewritten candidates) out of the caller's dispatch modes: a
    ``LiveStorageTracker`` or ``FlopCounterMode`` around a first training call would count the planner's
    fake tensors as the step's. A caller's ``FakeTensorMode`` (planning on fake inputs) stays: its tensors
    need it."""
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
    """capture → profile → problem → search → Plan, then the calls bound on the module that runs."""
    started = time.perf_counter()
    entered = callers_autocast()
    _warn_of_autocast_on_meta(args, kwargs, entered)
    gm = capture(model, args, kwargs)
    log.info("capture: %d nodes, %.2f s", len(gm.graph.nodes), time.perf_counter() - started)
    profiled = time.perf_counter()
    profile = profile_step(gm, args, kwargs, options.loss_reserve, options.outputs == "kept")
    key = _plan_key(gm, signature, budget, options, entered, _device_type(args, kwargs),
                    checkpoints_itself(model, gm))
    share = RankShare(key, dict(profile.resident))
    cached = (plan_cache.load(key) if key else None) or share.plan_of_another_rank()
    if cached is not None and cached.resident == dict(profile.resident) \
            and cached.loss_reserve == profile.loss_reserve and cached.outputs == options.outputs:
        # (a step that holds more besides the plan — optimizer state made since, other tensors on the device —
        # is planned again)
        runtime = StashRuntime(options.offload_dir) if cached.stash else None
        log.info("plan for %s loaded from the plan cache (%s) or another rank", signature, plan_cache.cache_dir())
        return Planned(plan=cached, module=apply_plan(gm, cached.rewrite, runtime,
                                                      bind_calls=cached.engine == "eager"))
    planned = None
    try:
        planned = _solve(model, gm, profile, args, kwargs, budget, options, signature, entered, (started, profiled),
                         key)
    finally:
        # (none: the other ranks plan themselves, and meet the same error)
        share.publish(planned.plan if planned is not None else None)
    return planned


def _solve(model: torch.nn.Module, gm: torch.fx.GraphModule, profile, args: tuple, kwargs: dict, budget,
           options: PlannerOptions, signature: str, entered: list, times: tuple[float, float],
           key: str | None) -> Planned:
    """problem → search → Plan for a captured and profiled step, stored in the plan cache under ``key``."""
    started, t = times
    parsed = parse_budget(budget)
    keep = options.outputs == "kept"
    transfer, speeds = _speeds(options, _device_type(args, kwargs))
    problem = _build(gm, options, transfer, speeds)
    log.info("profile + problem: %.2f s, %d ops in chain, %d recomputable, %d activations, %d stashable",
              time.perf_counter() - t, len(problem.chain), len(problem.recomputable), len(problem.activations),
              len(problem.stash_options))
    reserve = profile.loss_reserve
    baseline_peak = _unoptimized_peak(gm, args, kwargs, profile.peak, reserve, keep)
    base = _fraction_base(model, gm, args, kwargs, parsed, baseline_peak, reserve, keep)
    budget_bytes = resolve_budget(parsed, base)
    runtime = StashRuntime(options.offload_dir) if problem.stash_options else None
    verify = _verifier(gm, problem, runtime, args, kwargs, reserve, keep)
    in_thread = partial(_under_autocast, entered)
    if options.engine == "torch.compile":
        measure = _compiled_peak(gm, problem, args, kwargs, reserve, keep)
        search, found, peak = _search_compiled(problem, budget_bytes, baseline_peak, gm, verify, options, in_thread,
                                               measure)
    else:
        search, found = _search(problem, budget_bytes, baseline_peak, gm, verify, options, in_thread)
    if found is None:
        _, peak, decisions = search.minimum()
        if options.engine == "torch.compile":
            peak = measure(decisions, peak)
        raise InfeasibleBudgetError(budget_bytes, peak, _breakdown(profile, peak), options.actions,
                                    fraction=parsed if isinstance(parsed, float) else None, baseline=base)
    if options.engine == "eager":
        lean, peak = _lean_ops(found, args, kwargs, budget_bytes, reserve, keep, room=baseline_peak - profile.peak)
    else:
        lean = ()
    recompute, stash = found.decisions
    rewrite = rewrite_of(problem, recompute, stash, lean)
    plan = Plan(
        budget=budget_bytes, predicted_peak=peak, baseline_peak=baseline_peak,
        minimum_peak=search.minimum_peak(peak), model_peak=predicted_peak(problem, recompute, stash),
        decisions=rewrite.words, region_starts=rewrite.region_starts, region_remakes=rewrite.region_remakes,
        lean_ops=rewrite.lean_ops, loss_reserve=reserve, outputs=options.outputs,
        extra_flops=extra_flops(problem, recompute, stash), baseline_flops=sum(problem.flops.values()),
        solver_status=found.status, solver_time=search.solve_time, solver_gap=found.gap,
        plan_time=time.perf_counter() - started, actions=options.actions, objective=options.objective,
        resident=dict(profile.resident), nodes=_node_records(gm, problem), model_name=plan_name(model),
        signature=signature, edges=_edges(gm, problem), engine=options.engine,
        timeline=_timeline(problem, recompute, stash, profile.resident_bytes), num_forward=problem.num_forward,
        at_peak=_at_peak(problem, recompute, stash), stash=_stash_records(gm, problem, rewrite),
        extra_seconds=transfer.compute_seconds(extra_cost(
            problem if speeds is transfer else _build(gm, options, transfer, transfer), recompute, stash)))
    log.info("plan: %s predicted under %s (unoptimized %s), +%.1f%% FLOPs, %s; %.2f s", format_bytes(peak),
             format_bytes(budget_bytes), format_bytes(baseline_peak), 100 * plan.extra_flops_ratio, found.status,
             plan.plan_time)
    if log.isEnabledFor(logging.DEBUG):     # (the summary of thousands of ops takes a tenth of a second)
        log.debug("plan: %s", plan.summary())
    if key:
        plan_cache.store(key, plan)     # (nothing when the cache is off)
    if options.engine == "torch.compile":
        # the regions dynamo traces: every lean op in autograd's form, as measured
        return Planned(plan=plan, module=apply_plan(gm, rewrite, bind_calls=False))
    # last, on the module that runs: each op called through eager's own binding where that dispatches the same
    # ops (the same kernels and allocations as verified; a microsecond less per call)
    rewrite_calls(graph_module_of(found.module))
    return Planned(plan=plan, module=found.module)


def _search(problem: Problem, budget: int, baseline: int, gm: torch.fx.GraphModule, verify, options: PlannerOptions,
            in_thread) -> tuple[Search, object]:
    """The search :func:`search_setup` chooses, run; where planning by layers finds nothing under a budget
    below the least peak its menu reaches (from :data:`WHOLE_MODEL_BELOW` of it), the whole-model search,
    whose minimum can be lower (√N's segments on a deep MLP): such a budget is refused only when that finds
    nothing either. Far below (``minimum_peak``'s one-byte budget), the layers' minimum is the answer, in
    their time."""
    time_limit, strategies = search_setup(problem, options)
    search = Search(problem, budget, baseline, gm, verify, time_limit, options.seed, options.objective, strategies,
                    in_thread=in_thread)
    found = search.run()
    if found is None and strategies == Strategies.by_layers() and budget >= WHOLE_MODEL_BELOW * search.minimum()[1]:
        log.info("nothing by layers under %s (their minimum %s): the whole-model search", format_bytes(budget),
                 format_bytes(search.minimum()[1]))
        search = Search(problem, budget, baseline, gm, verify, WHOLE_MODEL_TIME_LIMIT, options.seed,
                        options.objective, Strategies(), in_thread=in_thread)
        found = search.run()
    return search, found


def _search_compiled(problem: Problem, budget: int, baseline: int, gm: torch.fx.GraphModule, verify,
                     options: PlannerOptions, in_thread, measure) -> tuple[Search, object, int]:
    """(search, found, the compiled step's peak) for a step torch.compile runs: each plan found is measured as
    compiled (``measure(decisions, eager_peak)``: its partition can hold other tensors than eager autograd around
    the regions);
    where that exceeds ``budget``, the search runs again under a budget lowered by the excess, up to
    :data:`COMPILED_SEARCHES` times. None found: no plan's compiled step fits."""
    target = budget
    for _ in range(COMPILED_SEARCHES):
        search, found = _search(problem, target, baseline, gm, verify, options, in_thread)
        if found is None:
            break
        peak = measure(found.decisions, found.peak)
        log.info("torch.compile's step of the plan under %s: %s (eager's %s)", format_bytes(target),
                 format_bytes(peak), format_bytes(found.peak))
        if peak <= budget:
            return search, found, peak
        target -= peak - budget
    return search, None, 0


def _compiled_peak(gm: torch.fx.GraphModule, problem: Problem, args: tuple, kwargs: dict, reserve: int,
                   keep_outputs: bool):
    """``measure(decisions, eager_peak) -> peak``: the plan's step as torch.compile runs it
    (:mod:`~autorecompute.passes.verify_compiled`); where dynamo cannot trace it as one graph, ``eager_peak``."""
    def measure(decisions: SearchPlan, eager_peak: int) -> int:
        rewrite = rewrite_of(problem, *decisions, ())
        try:
            return compiled_step_memory(gm, rewrite, args, kwargs, reserve, keep_outputs).peak
        except Exception as error:     # noqa: BLE001 — dynamo cannot trace it whole: eager's measure stands
            log.warning("autorecompute could not measure the step as torch.compile runs it (%s: %s); the plan "
                        "is held to the eager step's peak, which the compiled step can exceed",
                        type(error).__name__, str(error).splitlines()[0][:200])
            return eager_peak
    return measure


def search_setup(problem: Problem, options: PlannerOptions) -> tuple[float, Strategies]:
    """(the search's time limit, its strategies). Without a ``solver_time_limit``, a model of repeated blocks
    (:func:`~autorecompute.solvers.layered.find_stack`) is planned by its layers with a short polish — seconds
    at any depth — and any other graph as a whole (CP-SAT, :data:`WHOLE_MODEL_TIME_LIMIT`). A limit given is
    the whole-model search's, for every graph: the way to ask for a longer search."""
    if options.solver_time_limit is not None or options.strategies != Strategies():
        return options.solver_time_limit or WHOLE_MODEL_TIME_LIMIT, options.strategies
    if layered.planner_of(problem) is not None:
        return BY_LAYERS_TIME_LIMIT, Strategies.by_layers()
    return WHOLE_MODEL_TIME_LIMIT, options.strategies


def _plan_key(gm: torch.fx.GraphModule, signature: str, budget, options: PlannerOptions, autocast: list,
              device_type: str, own_checkpoints: bool) -> str | None:
    """The key of this step's plan (in the plan cache, between ranks), or None for a search with its strategies
    replaced (tests'), whose plans are neither cached nor shared."""
    if options.strategies != Strategies():
        return None
    searched = {"sharded": [unit.key() for unit in gm.meta.get("sharded_units", ())],
                "actions": options.actions, "solver_time_limit": options.solver_time_limit, "seed": options.seed,
                "compress_dtypes": options.compress_dtypes, "objective": options.objective,
                "loss_reserve": options.loss_reserve, "outputs": options.outputs, "transfer": repr(options.transfer),
                "autocast": repr(autocast), "distributed": distributed(), "engine": options.engine,
                # a fraction of the model's own checkpointed step is another budget than of the same graph's
                "own_checkpoints": own_checkpoints}
    return plan_cache.plan_key(gm, signature, budget, searched, device_type)


def _warn_of_autocast_on_meta(args: tuple, kwargs: dict, entered: list) -> None:
    if _device_type(args, kwargs) == "meta" and entered:
        warnings.warn("torch.autocast does not apply to tensors on the meta device: this plan is for the step "
                      "without autocast (its activations in the model's dtype, so larger). Fix: plan on the device "
                      "the steps run on, or convert the model to the low-precision dtype (model.bfloat16()) to "
                      "size it on meta.", UserWarning, stacklevel=user_stacklevel())


def _speeds(options: PlannerOptions, device_type: str) -> tuple[TransferModel, TransferModel]:
    """(the device's transfer model, the speeds recomputation is priced at: its own, or FLOPs alone)."""
    transfer = options.transfer or default_for(device_type)
    if device_type == "cpu" and transfer.overlaps_compute:
        # the CPU's disk tier copies on the training thread (runtime/tiers.py): nothing hides a copy there,
        # whatever a hand-made TransferModel says
        transfer = dataclasses.replace(transfer, overlaps_compute=False)
    return transfer, transfer if options.objective == "time" else counting_flops(transfer)


def _under_autocast(entered: list, fn, *args):
    """``fn`` under the caller's ``torch.autocast`` (thread-local state), for a check run in another thread:
    a step planned under autocast is measured as it runs."""
    with contextlib.ExitStack() as stack:
        for device_type, dtype in entered:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        return fn(*args)


def _verifier(gm: torch.fx.GraphModule, problem: Problem, runtime: StashRuntime | None, args: tuple, kwargs: dict,
              reserve: int, keep_outputs: bool):
    """``verify(plan) -> (module, peak)``: the plan carried out on a copy of ``gm``, its step measured, every
    op capture made lean left so (as the profile counts them)."""
    captured = tuple(lean_op_nodes(gm))

    def verify(decisions: SearchPlan) -> tuple[torch.nn.Module, int]:
        return verify_plan(gm, rewrite_of(problem, *decisions, captured), runtime, args, kwargs, reserve, keep_outputs)
    return verify


def checkpoints_itself(model: torch.nn.Module, gm: torch.fx.GraphModule | None = None) -> bool:
    """Whether the model runs ``torch.utils.checkpoint`` itself: its forward called it while captured
    (``gm``), or it is a Hugging Face model after ``activation_checkpointing_enable()`` /
    ``gradient_checkpointing_enable()``. Capture traces through the checkpoints, so the plan decides what is
    recomputed."""
    if gm is not None and gm.meta.get("checkpoints_itself"):
        return True
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def _fraction_base(model: torch.nn.Module, gm: torch.fx.GraphModule, args: tuple, kwargs: dict, parsed,
                   unoptimized: int, reserve: int, keep_outputs: bool) -> int:
    """What a fractional budget is a fraction of: the unoptimized step's peak, or, for a model that checkpoints
    itself, the peak of its own step with its checkpoints where that is lower (measured on fake tensors), so
    that compiling it never asks for more than the step it had at the same fraction."""
    if not isinstance(parsed, float) or not checkpoints_itself(model, gm) or gm.meta.get("sharded_units"):
        return unoptimized      # (a sharded model's own step is FSDP2's, which only its captured graph plays)
    own = fake_step_memory(model, args, kwargs, reserve, keep_outputs).peak
    log.info("%s checkpoints itself: its own step peaks at %s (unoptimized %s); budget=%s is a fraction of the "
             "lower", type(model).__name__, format_bytes(own), format_bytes(unoptimized), parsed)
    return min(own, unoptimized)


def _unoptimized_peak(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, profiled: int, reserve: int,
                      keep_outputs: bool) -> int:
    """The step's peak as eager runs it, which fractional budgets are fractions of: the profile's, or, where
    capture made ops lean (the profile's step), the step measured with autograd's forms."""
    names = lean_op_nodes(gm)
    if not names:
        return profiled
    rewrite_lean_ops(gm, lean=())
    try:
        return max(profiled, fake_step_memory(gm, args, kwargs, reserve, keep_outputs).peak)
    finally:
        rewrite_lean_ops(gm, lean=names)


def _lean_ops(found: Found, args: tuple, kwargs: dict, budget: int, reserve: int, keep_outputs: bool,
              room: int) -> tuple[tuple[str, ...], int]:
    """(the ops that stay in the lean form capture gave them, the step's verified peak).

    The profile and the plan count every op capture made lean at its lower memory; where the step also fits
    ``budget`` with all of them back in autograd's form (measured, as every plan is), they go back: autograd's
    softmax backward is called from C++, ~35 µs a softmax less on a CPU (2% of a GPT-style step at √N's peak),
    and its cross-entropy makes the log-softmax once. Else all stay lean. A plan with less ``room`` under the
    budget than autograd's forms took in the unoptimized step keeps them lean unmeasured: a step of thousands
    of ops takes seconds to measure, for microseconds a step. The unoptimized plan (``found`` under a budget
    above the unoptimized step) has its peak measured already, with autograd's forms."""
    module, peak = found.module, found.peak
    gm = graph_module_of(module)
    names = lean_op_nodes(gm)
    if found.status == TRIVIAL:
        rewrite_lean_ops(gm, lean=())
        return (), peak
    if not names or budget - peak < room:
        return tuple(names), peak
    rewrite_lean_ops(gm, lean=())
    autograds = fake_step_memory(module, args, kwargs, reserve, keep_outputs).peak
    if autograds <= budget:
        return (), autograds
    rewrite_lean_ops(gm, lean=names)
    return tuple(names), peak


def _build(gm: torch.fx.GraphModule, options: PlannerOptions, transfer, speeds) -> Problem:
    """The problem of a profiled ``gm``, recomputation priced at ``speeds``, transfers at ``transfer``."""
    return build_problem(gm, recompute="recompute" in options.actions,
                         offload=transfer if "offload" in options.actions else None,
                         compress_dtypes=options.dtypes, device=speeds, offload_gradients=not distributed(),
                         regions_only=options.engine == "torch.compile")


def _stash_records(gm: torch.fx.GraphModule, problem: Problem, rewrite: Rewrite) -> dict[str, StashRecord]:
    """The Plan's record of each stashed tensor: what ``rewrite`` carries out, with the tensor's sizes."""
    profile = step_profile(gm)
    records = {}
    for name, stashed in rewrite.stash.items():
        action, prefetch = str(stashed.action), stashed.prefetch_event
        if name.startswith(GRADIENT):
            param = gm.get_parameter(name[len(GRADIENT):])
            records[name] = StashRecord(action=action, owner=name, nbytes=param.numel() * param.element_size(),
                                        stored_bytes=0, shape=tuple(param.shape), dtype=str(param.dtype).split(".")[-1],
                                        expected_error="exact", prefetch_event=prefetch)
            continue
        tensor = profile.tensors[name]
        dtype = stashed.action.compress_dtype
        records[name] = StashRecord(action=action, owner=tensor.owner, nbytes=tensor.nbytes,
                                    stored_bytes=problem.stash_option(name, action).stored_bytes,
                                    shape=tuple(tensor.shape), dtype=tensor.dtype,
                                    expected_error=CODECS[dtype].expected_error if dtype else "exact",
                                    prefetch_event=prefetch, recipe=stashed.recipe, delivers=stashed.delivers)
        for other in stashed.delivers:     # made again by this recipe, on its way
            made = profile.tensors[other]
            records[other] = StashRecord(action=action, owner=made.owner, nbytes=made.nbytes, stored_bytes=0,
                                         shape=tuple(made.shape), dtype=made.dtype, expected_error="exact",
                                         prefetch_event=prefetch, delivered_by=name)
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
