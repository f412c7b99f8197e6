"""The search for one problem: the lowest peak reachable, then the cheapest plan whose measured peak fits.

Every candidate plan is verified — carried out on the graph and its step measured on fake tensors — since
the memory model can be optimistic. A cost solve whose plan measures over the budget runs again under a
tighter internal budget; the lowest verified minimum-peak plan is the fallback.

The strategies are injected (:class:`Strategies`): start heuristics, CP-SAT over the whole model, local
searches, and the refinements tried after a cost solve that is not optimal (CP-SAT over windows of the chain,
across repeated layers). A new strategy is one more entry; tests pass stubs.

Plans here are the search's maps ``(recompute, stash)`` (:data:`SearchPlan`): op → :class:`~autorecompute.
decisions.Op` (or ``True``/``False``) and activation → stash action, the form the memory model and the local
searches read and change in place.
"""
from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable

from autorecompute.budget import format_bytes
from autorecompute.memory_model import effective_stash, extra_cost, predicted_peak
from autorecompute.problem import Problem
from autorecompute.solvers import cpsat, greedy, layered

log = logging.getLogger("autorecompute")

SearchPlan = greedy.SearchPlan      # (op → Op or bool, activation → stash action)
MAX_TIGHTENINGS = 4
NEAR_MINIMUM = 1.15   # budgets below this multiple of the heuristic minimum get a CP-SAT minimum-peak solve
# the minimum-peak local search's work per second of solver time (greedy.lower_peak: evaluations × problem
# size): about half a second per second of limit on a 2-core CPU (recompute only) when it runs to the end
LOCAL_SEARCH_WORK = 2_000_000
# the cost local search's work per second of solver time (greedy.lower_cost, after each cost solve that is not
# optimal): about 0.4 s per second of limit on a 2-core CPU when it runs to the end
COST_SEARCH_WORK = 500_000


@dataclass(frozen=True)
class CostRound:
    """One cost solve's state, as the refinements after it see it."""

    problem: Problem
    budget: int                     # the internal budget of this round
    best: SearchPlan                # the cheapest plan so far
    solved: bool                    # whether CP-SAT's whole model found a plan
    from_segments: bool             # whether the hint was a segment heuristic's (not the minimum's descent)
    lowest: SearchPlan              # the minimum-peak plan so far
    time_limit: float
    seed: int


@dataclass(frozen=True)
class Refinement:
    """A search tried after a cost solve that is not optimal; its plan replaces the best when it is cheaper
    (and fits the round's budget in the memory model, when ``must_fit``)."""

    status: str
    run: Callable[[CostRound], SearchPlan | None]
    must_fit: bool = True


def local_cost_search(round_: CostRound) -> SearchPlan:
    """:func:`greedy.lower_cost` from the best plan; where CP-SAT found nothing and the start was a segment
    heuristic's (under a budget near √N's peak, √N's own plan), from the minimum-peak plan too."""
    work = int(COST_SEARCH_WORK * round_.time_limit)
    problem, budget = round_.problem, round_.budget
    polished = greedy.lower_cost(problem, budget, round_.best, work=work)
    if not round_.solved and round_.from_segments:
        other = greedy.lower_cost(problem, budget, greedy.descend(problem, budget, round_.lowest), work=work)
        if fits_cheaper(problem, budget, other, than=polished):
            polished = other
    return polished


def polish_cost(round_: CostRound) -> SearchPlan:
    """:func:`greedy.lower_cost` from the best plan alone (the layered search's refinement)."""
    return greedy.lower_cost(round_.problem, round_.budget, round_.best, work=int(COST_SEARCH_WORK * round_.time_limit))


def polish_peak(problem: Problem, start: SearchPlan, *, seed: int, work: int) -> SearchPlan:
    """:func:`greedy.lower_peak` with a quarter of the work (the layered search's: its start is near the
    lowest its menu reaches)."""
    return greedy.lower_peak(problem, start, seed=seed, work=work // 4)


def chain_windows(round_: CostRound) -> SearchPlan | None:
    """CP-SAT over windows of the chain, the rest fixed: where the whole model found nothing on a long chain."""
    if round_.solved or len(round_.problem.recomputable) <= cpsat.WINDOW_OPS:
        return None
    return cpsat.solve_in_windows(round_.problem, round_.best, budget=round_.budget, time_limit=round_.time_limit,
                                  seed=round_.seed)


def layer_windows(round_: CostRound) -> SearchPlan | None:
    """CP-SAT over the same stretch of every repeated layer at once: the trades between layers far apart that
    neither the whole model (too large for the limit) nor a window of the chain (a layer or two) makes."""
    return cpsat.solve_in_windows(round_.problem, round_.best, budget=round_.budget, seed=round_.seed,
                                  time_limit=round_.time_limit, windows=cpsat.block_windows(round_.problem))


def not_solved(problem: Problem, **_) -> cpsat.SolverResult:
    """The layered search's whole-model solve: none (a model of every op is what planning by layers replaces)."""
    return cpsat.SolverResult(None, "not run", float("inf"), 0.0, 1.0, 0.0)


@dataclass(frozen=True)
class Strategies:
    """The searches :class:`Search` combines. Each is a function of the problem (see the defaults);
    :meth:`by_layers` plans models of repeated blocks by their layers. ``hint_status`` names a start that no
    solve improved (None: "heuristic (cp-sat <its status>)")."""

    lowest_start: Callable[[Problem], SearchPlan] = greedy.lowest_start
    solve: Callable[..., cpsat.SolverResult] = cpsat.solve_in_stages
    lower_peak: Callable[..., SearchPlan] = greedy.lower_peak
    segment_start: Callable[[Problem, int], SearchPlan | None] = greedy.best_under
    descend: Callable[[Problem, int, SearchPlan], SearchPlan] = greedy.descend
    refinements: tuple[Refinement, ...] = (
        Refinement("feasible (local search)", local_cost_search, must_fit=False),
        Refinement("feasible (cp-sat windows)", chain_windows),
        Refinement("feasible (cp-sat across layers)", layer_windows),
    )
    hint_status: str | None = None
    # budgets below this multiple of the minimum-peak start get the minimum-peak solve first (None: NEAR_MINIMUM)
    near_minimum: float | None = None
    # the start verified while CP-SAT runs (False: after the refinements, and only where it is still the plan:
    # with no solve to overlap, verifying a start a refinement replaces costs a whole fake step)
    verify_start_while_solving: bool = True

    @classmethod
    def by_layers(cls) -> "Strategies":
        """Planning by layers (:mod:`~autorecompute.solvers.layered`): its minimum-peak start (lowered by the
        local search only for a budget below it) and its cheapest plan under each budget, polished by the local
        search; no model of every op."""
        return cls(lowest_start=layered.lowest_start, solve=not_solved, lower_peak=polish_peak,
                   segment_start=layered.cheapest_under, hint_status="feasible (by layers)", near_minimum=1.0,
                   refinements=(Refinement("feasible (by layers, local search)", polish_cost, must_fit=False),),
                   verify_start_while_solving=False)


def fits_cheaper(problem: Problem, budget: int, plan: SearchPlan, than: SearchPlan) -> bool:
    """Whether ``plan`` fits ``budget`` in the memory model and costs less than ``than``."""
    return predicted_peak(problem, *plan) <= budget and extra_cost(problem, *plan) < extra_cost(problem, *than)


@dataclass
class Lowest:
    """The minimum-peak plan known so far (in the memory model) and what is known of it."""

    decisions: SearchPlan
    peak: int
    status: str = "heuristic"
    gap: float = 1.0
    time: float = 0.0
    verified: bool = False


TRIVIAL = "trivial"      # Found.status of the unoptimized plan, under a budget above the unoptimized step


@dataclass
class Found:
    """The plan the search settles on: its decisions, the module that carries it out, its verified peak."""

    decisions: SearchPlan
    module: object
    peak: int
    status: str
    gap: float


@dataclass
class Search:
    """The search over one problem under ``budget`` bytes.

    ``verify(plan) -> (module, peak)`` carries a plan out and measures its step; ``in_thread(fn, *args)`` runs
    ``fn`` as the caller's thread would (its autocast), for the check made on the other core while CP-SAT
    runs. ``keep_all`` is the unoptimized plan, ``baseline`` its measured peak and ``unplanned`` its module.
    """

    problem: Problem
    budget: int
    baseline: int
    unplanned: object
    verify: Callable[[SearchPlan], tuple[object, int]]
    time_limit: float
    seed: int = 0
    objective: str = "time"
    strategies: Strategies = field(default_factory=Strategies)
    in_thread: Callable = staticmethod(lambda fn, *args: fn(*args))
    progress: bool = field(default_factory=lambda: sys.stderr.isatty())   # a live status line, not in logs

    def __post_init__(self):
        start = self.strategies.lowest_start(self.problem)
        self.lowest = Lowest(start, predicted_peak(self.problem, *start))
        # every minimum-peak plan verified so far, (module, verified peak, decisions): a later one can be lower
        # in the model and higher when measured, so the fallback is the lowest measured, not the latest
        self.verified_minimum: list[tuple[object, int, SearchPlan]] = []
        # minimum-peak plans a lower one (in the model) replaced before they were verified: verified with it,
        # so the start is a fallback when the model is optimistic
        self.replaced_unverified: list[SearchPlan] = []
        self.cost_time = 0.0

    @property
    def keep_all(self) -> SearchPlan:
        return {op: False for op in self.problem.chain if op in self.problem.recomputable}, {}

    @property
    def solve_time(self) -> float:
        return self.lowest.time + self.cost_time

    # ---- the lowest peak --------------------------------------------------------------------------------
    def _replace_lowest(self, decisions: SearchPlan, peak: int, status: str, gap: float,
                        verified: bool = False) -> None:
        if not self.lowest.verified:
            self.replaced_unverified.append(self.lowest.decisions)
        self.lowest = Lowest(decisions, peak, status, gap, self.lowest.time, verified)

    def lower_minimum(self, time_limit: float) -> None:
        """Asks CP-SAT for a lower minimum-peak plan than the best so far (which hints it), then a local
        search from the best (CP-SAT can stop where one change lowers the peak)."""
        problem, (hint, hint_stash) = self.problem, self.lowest.decisions
        solved = self.strategies.solve(problem, minimize="peak", time_limit=time_limit, seed=self.seed, hint=hint,
                                       hint_stash=hint_stash, progress=self.progress)
        self.lowest.time += solved.wall_time
        if solved.recompute is not None and solved.objective <= self.lowest.peak:
            self._replace_lowest((solved.recompute, effective_stash(problem, solved.recompute, solved.stash)),
                                 solved.objective, solved.status, solved.gap)
        started = time.perf_counter()
        polished = self.strategies.lower_peak(problem, self.lowest.decisions, seed=self.seed,
                                              work=int(LOCAL_SEARCH_WORK * max(1.0, time_limit)))
        self.lowest.time += time.perf_counter() - started
        peak = predicted_peak(problem, *polished)
        if peak < self.lowest.peak:
            self._replace_lowest(polished, peak, "feasible (local search)", self.lowest.gap)

    def minimum(self) -> tuple[object, int, SearchPlan]:
        """The lowest measured minimum-peak plan ``(module, peak, decisions)``; the plans found since the last
        call (the latest and those it replaced) are verified when a decision first needs the minimum (plans
        equal in the model can differ when measured)."""
        if not self.lowest.verified or self.replaced_unverified:
            latest = [] if self.lowest.verified else [self.lowest.decisions]
            for decisions in latest + self.replaced_unverified:
                model_peak = predicted_peak(self.problem, *decisions)
                module, peak = self.verify(decisions) if model_peak < self.baseline else (self.unplanned,
                                                                                           self.baseline)
                self.verified_minimum.append((module, peak, decisions) if peak < self.baseline else
                                             (self.unplanned, self.baseline, self.keep_all))
                log.debug("minimum-peak plan: %d in the model, %d measured", model_peak, peak)
            self.replaced_unverified.clear()
            self.lowest.verified = True
        return min(self.verified_minimum, key=lambda entry: entry[1])

    # ---- the cheapest plan that fits --------------------------------------------------------------------
    def cheapest_fitting(self, internal: int) -> tuple[Found | None, int]:
        """The cheapest plan whose verified peak fits the budget, solved again under a tighter internal
        budget while verification finds the model optimistic; None when the tightening reaches the model's
        minimum."""
        if internal < self.lowest.peak and self.lowest.verified and self.minimum()[1] <= internal:
            # the model over-predicts near its minimum (the minimum-peak plan measures lower than it says):
            # search under the budget as the model sees it there; verification still decides
            internal += self.lowest.peak - self.minimum()[1]
        for _ in range(MAX_TIGHTENINGS):
            if internal < self.lowest.peak:
                return None, internal   # tighter than the model's own minimum: the minimum-peak plan is the answer
            found, model_peak, measured = self._cost_round(internal)
            if found.peak <= self.budget:
                return found, internal
            # below this plan's own model peak, so the next solve cannot return it again
            internal = min(internal, model_peak) - (measured - self.budget) \
                - max(1, (self.budget - self.lowest.peak) // 16)
        return None, internal

    def _cost_round(self, internal: int) -> tuple[Found, int, int]:
        """One cost solve under ``internal`` with its hint verified meanwhile, the refinements, the result
        verified: (the plan, its model peak, its measured peak)."""
        problem = self.problem
        segments = self.strategies.segment_start(problem, internal)
        hint = segments or self.strategies.descend(problem, internal, self.lowest.decisions)
        # the hint is verified on the other core while CP-SAT (which releases the GIL) tries to beat it, where the
        # strategies ask for it
        with ThreadPoolExecutor(max_workers=1) as pool:
            hint_verified = pool.submit(self.in_thread, self.verify, hint) \
                if self.strategies.verify_start_while_solving else None
            result = self.strategies.solve(problem, budget=internal, minimize="cost", time_limit=self.time_limit,
                                           seed=self.seed, hint=hint[0], hint_stash=hint[1], progress=self.progress,
                                           zero_flops_first=self.objective == "flops")
            best, status = self._better_of(hint, result, internal)
            module, peak = hint_verified.result() if hint_verified else (None, None)
        self.cost_time += result.wall_time
        if status != "optimal":
            started = time.perf_counter()
            best, status = self._refined(CostRound(problem, internal, best, result.recompute is not None,
                                                   bool(segments), self.lowest.decisions, self.time_limit,
                                                   self.seed), status)
            self.cost_time += time.perf_counter() - started
        cost = extra_cost(problem, *best)
        gap = 0.0 if status == "optimal" else max(0.0, (cost - result.bound) / cost) if cost else 0.0
        if best is not hint or module is None:
            module, peak = self.verify(best)
        model_peak = predicted_peak(problem, *best)
        log.info("cost solve under %s: %s, %s in the model, %s measured (%.1f s so far)", format_bytes(internal),
                 status, format_bytes(model_peak), format_bytes(peak), self.solve_time)
        if model_peak < self.lowest.peak:
            # below the minimum-peak solve's best: the lowest plan known now (verified: it was just measured)
            self._replace_lowest(best, model_peak, "feasible", self.lowest.gap, verified=True)
            self.verified_minimum.append((module, peak, best))
        return Found(best, module, peak, status, gap), model_peak, peak

    def _better_of(self, hint: SearchPlan, result: cpsat.SolverResult, internal: int) -> tuple[SearchPlan, str]:
        """The hint or CP-SAT's plan, whichever fits and costs less, and its status."""
        best, status = hint, self.strategies.hint_status or f"heuristic (cp-sat {result.status})"
        if result.recompute is not None:
            solved = (result.recompute, effective_stash(self.problem, result.recompute, result.stash))
            if predicted_peak(self.problem, *solved) <= internal:
                if extra_cost(self.problem, *solved) < extra_cost(self.problem, *hint):
                    best, status = solved, result.status
                elif result.status == "optimal":
                    status = "optimal"     # the hint costs no more than CP-SAT's proven optimum
        return best, status

    def _refined(self, round_: CostRound, status: str) -> tuple[SearchPlan, str]:
        """The refinements in turn, each from the best plan so far."""
        best = round_.best
        for refinement in self.strategies.refinements:
            plan = refinement.run(round_)
            if plan is None:
                continue
            better = fits_cheaper(self.problem, round_.budget, plan, than=best) if refinement.must_fit else \
                extra_cost(self.problem, *plan) < extra_cost(self.problem, *best)
            if better:
                best, status = plan, refinement.status
                round_ = replace(round_, best=best)
        return best, status

    # ---- the search --------------------------------------------------------------------------------------
    def run(self) -> Found | None:
        """The cheapest verified plan under the budget; the minimum-peak plan when nothing cheaper fits; None
        when even that is over the budget (:meth:`minimum` then says how low a step goes)."""
        started = time.perf_counter()
        near = NEAR_MINIMUM if self.strategies.near_minimum is None else self.strategies.near_minimum
        if self.budget < near * self.lowest.peak:
            # the minimum matters only when the budget is close to it (or below it: then the same searches as at
            # any budget under the minimum, so a minimum an error names, given as the budget, finds its plan)
            self.lower_minimum(self.time_limit / 4)
        log.info("minimum peak %s in the model (%s), %.2f s", format_bytes(self.lowest.peak), self.lowest.status,
                 time.perf_counter() - started)
        if self.budget >= self.baseline:
            return Found(self.keep_all, self.unplanned, self.baseline, TRIVIAL, 0.0)
        found, internal = self.cheapest_fitting(self.budget)
        if found is None and self.lowest.status != "optimal":
            # before falling back to the minimum-peak plan or refusing, the full time limit on the minimum: a
            # short solve can leave it well above the true one (not when the budget is the verified minimum,
            # within 1%: no room for a cheaper plan)
            room = self.budget - self.minimum()[1]
            if room < 0 or room >= self.budget // 100:
                self.lower_minimum(self.time_limit)
                found, _ = self.cheapest_fitting(min(internal, self.budget))
        if found is not None:
            return found
        module, peak, decisions = self.minimum()
        if peak > self.budget:
            return None
        return Found(decisions, module, peak, "fallback (minimum-peak plan)", self.lowest.gap)

    def minimum_peak(self, plan_peak: int) -> int:
        """The lowest verified minimum-peak plan's peak, the latest one's (model) if not verified, or the plan's."""
        return min([entry[1] for entry in self.verified_minimum] + [plan_peak]
                   + ([] if self.lowest.verified else [self.lowest.peak]))
