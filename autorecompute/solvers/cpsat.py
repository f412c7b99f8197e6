"""CP-SAT model of the planning problem (OR-Tools), encoding ``memory_model`` exactly.

Data → variables → constraints → objective → solve → extract, in the manner of OR-Tools' own examples.
Integers only: bytes are divided by a unit (rounded so that the model never under-counts).
"""
from __future__ import annotations

import itertools
import logging
import math
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Mapping

from ortools.sat.python import cp_model

from autorecompute.memory_model import (NEW_REGION, REMAKE, backward_positions, effective_stash, extra_cost,
                                         predicted_peak)
from autorecompute.problem import GRADIENT, Problem
from autorecompute.solvers import greedy

log = logging.getLogger("autorecompute")
DTIME_PER_SECOND = 0.12   # CP-SAT deterministic time per wall second, measured on the 2-core CI machine
# CP-SAT's subsolvers that solve linear relaxations, left out of least-cost solves on long chains. There the
# relaxation of the cost model is weak (on Llama at √N's peak it bounds the cost at a fifth of the best
# plan's), so within a few seconds those workers prove nothing and take most of the time slices (at 6 s none
# of the neighbourhood searches ran). Without them, on the four transformers (187–248 ops) × 3 objectives/
# action sets × 2 budgets: 18 of 24 plans cheaper (by up to 44%: GPT-2 least-FLOPs at a quarter of its
# range), 2 dearer (by 1.4% and 4.5%). On chains up to LP_UP_TO ops (the CNNs and the MLP: 36–52) they prove
# plans optimal within the limit, where without them the same plans are found unproven (and the MLP's a
# little dearer), so they stay; least-peak solves keep them everywhere (the peak's bound is tight).
LP_SUBSOLVERS = ("default_lp", "max_lp", "reduced_costs", "pseudo_costs", "core", "quick_restart")
LP_UP_TO = 100

_STATUS = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible",
           cp_model.MODEL_INVALID: "invalid", cp_model.UNKNOWN: "unknown"}


@dataclass(frozen=True)
class SolverResult:
    """What one CP-SAT solve returns.

    Attributes:
        recompute: op → bool, or None when no solution was found.
        stash: activation → stash action, for the activations stashed (empty when none).
        status: "optimal", "feasible", "infeasible" or "unknown" (time limit before any solution).
        objective: value of the objective: recompute cost (``Problem.cost`` units), or bytes for the
            peak objective.
        bound: best proven lower bound on it, same units.
        gap: relative optimality gap ``(objective - bound) / objective`` (0 when optimal).
        wall_time: seconds spent in the solver.
    """

    recompute: dict[str, bool] | None
    status: str
    objective: float
    bound: float
    gap: float
    wall_time: float
    stash: dict[str, str] = field(default_factory=dict)


class _Progress(cp_model.CpSolverSolutionCallback):
    """One status line on stderr, rewritten on each new solution, once the solve has run a second."""

    def __init__(self, objective: str, started: float):
        super().__init__()
        self.objective, self.started, self.shown = objective, started, False

    def on_solution_callback(self) -> None:
        elapsed = time.perf_counter() - self.started
        if elapsed < 1.0:
            return
        sys.stderr.write(f"\r[autorecompute] cp-sat minimizing {self.objective}: best {self.objective_value:.4g}, "
                         f"bound {self.best_objective_bound:.4g}, {elapsed:.1f} s ")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")


def _complete_hint(model: cp_model.CpModel, r: dict, hint: Mapping[str, bool], x: dict,
                   hint_stash: Mapping[str, str], seconds: float, seed: int) -> None:
    """Hints every variable, not just the decisions: CP-SAT keeps a complete feasible hint as its first
    solution, while a partial one is often lost in presolve. The completion is a solve with the decisions
    fixed to the hint (fast: propagation does the work). A hint that does not fit is dropped."""
    for op, var in r.items():
        model.add_hint(var, bool(hint.get(op, False)))
    for (name, action), var in x.items():
        model.add_hint(var, hint_stash.get(name) == action)
    completion = cp_model.CpSolver()
    completion.parameters.fix_variables_to_their_hinted_value = True
    completion.parameters.max_deterministic_time = seconds * DTIME_PER_SECOND
    completion.parameters.max_time_in_seconds = 4 * seconds + 30
    completion.parameters.num_workers = 1
    completion.parameters.random_seed = seed
    status = completion.solve(model)
    if status == cp_model.UNKNOWN:
        return   # no completion in time: keep the partial hint
    model.clear_hints()
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        # the hint does not fit the integer model: no hint at all — OR-Tools 9.15 aborts
        # ("heuristics.fixed_search != nullptr") when an interleaved search of an infeasible model starts
        # from a partial one
        return
    for i in range(len(model.proto.variables)):
        var = model.get_int_var_from_proto_index(i)
        model.add_hint(var, completion.value(var))


def _both(model: cp_model.CpModel, a, b, name: str):
    """A literal equal to ``a ∧ b`` (0 when ``b`` is the constant 0)."""
    if isinstance(b, int):
        return a if b else 0
    both = model.new_bool_var(name)
    # both ⇔ a ∧ b
    model.add_bool_or([~a, ~b, both])
    model.add_implication(both, a)
    model.add_implication(both, b)
    return both


def _any(model: cp_model.CpModel, literals: list, name: str):
    """A Boolean equal to the OR of ``literals`` (the literal itself when there is one)."""
    if len(literals) == 1:
        return literals[0]
    var = model.new_bool_var(name)
    model.add_max_equality(var, literals)
    return var


def _unless(model: cp_model.CpModel, literal, stashed, name: str):
    """A Boolean equal to ``literal ∧ ¬stashed`` (``stashed``: a sum of at most one true Boolean)."""
    var = model.new_bool_var(name)
    model.add(var <= literal)
    model.add(var + stashed <= 1)
    model.add(var >= literal - stashed)
    return var


REGION_WINDOW = 24     # ops either side of a reader within which a region's end is encoded exactly
# Chains longer than this hold a region input to its ``read_end`` in CP-SAT (one literal per activation, not
# one per saver a region may reach): the exact rule's model made the 6-s plans of the benchmark zoo worse
# (GPT's least-FLOPs plan at torch.compile's 0.5 point +0.8% → +3.4% FLOPs) and the suite 30% slower. The
# memory model that scores, searches and verifies CP-SAT's plans is exact on every chain.
EXACT_REGIONS_UP_TO = 64


def byte_unit(problem: Problem) -> int:
    """Divisor for bytes: keeps the largest memory figure near 2**22 so the model stays small-integer."""
    largest = max(max(problem.fixed, default=0), sum(a.nbytes for a in problem.activations), 1)
    return max(1, largest >> 22)


def solve(problem: Problem, *, budget: int | None = None, minimize: str = "cost", time_limit: float = 5.0,
          seed: int = 0, hint: Mapping[str, bool] | None = None, hint_stash: Mapping[str, str] | None = None,
          workers: int = 2, progress: bool = False, window: frozenset[str] | None = None) -> SolverResult:
    """Solves ``problem``.

    Args:
        budget: bytes every position must stay under (required for ``minimize="cost"``).
        minimize: ``"cost"`` — least recompute cost under ``budget``; ``"peak"`` — least predicted peak
            (then least cost), ``budget`` optional.
        time_limit: seconds; the best solution found is returned when it is hit.
        seed: random seed (same problem and seed → same plan).
        hint: a starting solution (op → bool); ``hint_stash`` its stash choices (activation → action).
        workers: search workers, interleaved so the search is deterministic.
        progress: show the best objective, bound and elapsed time on stderr once the solve passes 1 s.
        window: the ops CP-SAT decides (None: all). The others keep the hint's decisions, its region cuts
            included, and the activations they own its stash choices: a neighbourhood of a plan, small enough
            to solve where the whole chain is not (:func:`solve_in_windows`). Inside the window CP-SAT decides
            plain recomputation, without the hint's cuts there (kept as boundaries, they left GPT-2's windows
            at half its peak no cheaper than the local search's plan: 33.6 MFLOP against 18.9). A cut that
            remakes its inputs (:data:`~autorecompute.memory_model.REMAKE`) is encoded as a plain one, which
            holds more than it: the caller scores the result with the memory model (and a start that fits
            only thanks to such a cut leaves every window's model infeasible).
    """
    unit = byte_unit(problem)
    index = problem.index()
    chain = problem.chain
    model = cp_model.CpModel()

    # Decisions outside the window: the hint's (op → False, True or a region cut).
    fixed = {} if window is None else {op: (hint or {}).get(op, False) for op in chain
                                       if op in problem.recomputable and op not in window}
    cuts = {op for op, decision in fixed.items() if decision in (NEW_REGION, REMAKE)}

    # Variables: r[op] = 1 if op is recomputed (in a checkpointed region); 0 is a constant for the others
    # (the ops that cannot be, and those the window leaves kept).
    r = {op: model.new_bool_var(f"recompute[{op}]") for op in chain
         if op in problem.recomputable and fixed.get(op, True)}
    for op in r.keys() & fixed.keys():
        # recomputed, as the hint has it (outside the window)
        model.add(r[op] == 1)

    def lit(op: str):
        return r.get(op, 0)

    # Prefix counts over the chain: a run from a to b is one region iff all of it is recomputed.
    prefix = [model.new_constant(0)]
    for i, op in enumerate(chain):
        nxt = model.new_int_var(0, i + 1, f"prefix[{i}]")
        model.add(nxt == prefix[-1] + lit(op))
        prefix.append(nxt)
    breakers_before = [0]
    for op in chain:
        breakers_before.append(breakers_before[-1] + (op not in r))
    cuts_before = [0]        # region cuts: op k starts a region of its own
    for op in chain:
        cuts_before.append(cuts_before[-1] + (op in cuts))

    def joined(i: int, j: int) -> bool:
        """Whether chain ops i <= j can be in one region: every op between is recomputable, none a cut."""
        return breakers_before[j + 1] == breakers_before[i] and cuts_before[j + 1] == cuts_before[i + 1]

    same_cache: dict[tuple[int, int], object] = {}

    def same(a: str, b: str):
        """Boolean: ops a..b (chain order, a <= b) are one recomputed region."""
        i, j = index[a], index[b]
        if not joined(i, j):
            return 0
        if i == j:
            return r[a]
        if (i, j) not in same_cache:
            s = model.new_bool_var(f"same[{a},{b}]")
            # s ⇔ every op in a..b is recomputed
            model.add(prefix[j + 1] - prefix[i] == j - i + 1).only_enforce_if(s)
            model.add(prefix[j + 1] - prefix[i] <= j - i).only_enforce_if(~s)
            same_cache[(i, j)] = s
        return same_cache[(i, j)]

    # Ops run again in backward: checkpoint's recomputation of a region stops at its last save, so an op
    # runs again only if it keeps a tensor it makes itself or a later op of its region saves anything.
    runs: dict[str, object] = dict(r)
    if problem.saves is not None:
        later = 0    # literal: the next op is in this op's region and it or an op after it there saves
        for op in reversed(chain):
            if op not in r:
                later = 0
                continue
            if not problem.saves.get(op):
                runs[op] = _both(model, r[op], later, f"rerun[{op}]")
            # for the op before: this one shares its region (r[op]) and saves, or a later one does
            later = r[op] if op in problem.saves else _both(model, r[op], later, f"saves_after[{op}]")
            if op in cuts:
                later = 0      # the op before is in another region

    # Memory pieces: (start, end, units, literal) added to a difference array over positions.
    starts: dict[int, list] = {}
    ends: dict[int, list] = {}

    def add_piece(start: int, end: int, nbytes: int, literal) -> None:
        if end < start or nbytes <= 0:
            return
        units = -(-nbytes // unit)
        starts.setdefault(start, []).append(units * literal)
        ends.setdefault(end, []).append(units * literal)

    # Variables: x[a, action] = 1 if activation a is stashed that way (offloaded, compressed, rematerialized).
    x = {(act.name, option.action): model.new_bool_var(f"stash[{act.name},{option.action}]")
         for act in problem.activations if act.savers and act.save_end >= act.hold_start
         for option in problem.stash_options.get(act.name, ())}
    if window is not None:
        # a parameter's gradient belongs to the window of the op whose backward makes it (fixed to the hint's
        # choice, a start that offloads every gradient kept them all: 12-layer BERT, 191 gradients offloaded
        # at twice the cost of the plan that offloads activations instead)
        owners = {act.name: problem.backward_op.get(act.hold_start - 1, act.owner) if act.name.startswith(GRADIENT)
                  else act.owner for act in problem.activations}
        for (name, action), var in x.items():
            if owners[name] not in window:
                # stashed as the hint has it (an activation no op of the window makes)
                model.add(var == int((hint_stash or {}).get(name) == action))

    # Who takes each activation off the device: its own options, and the chain rematerializations that make
    # it again on their way (``StashOption.delivers``).
    takers: dict[str, list] = {}
    deliveries: dict[str, list] = {}
    for (name, action), var in x.items():
        takers.setdefault(name, []).append(var)
        option = problem.stash_option(name, action)
        for other in option.delivers:
            takers.setdefault(other, []).append(var)
            deliveries.setdefault(other, []).append((option, var))

    # How long a recomputed region holds its inputs: until the last backward of an op in it that saves
    # (memory_model.region_ends). For each op c, pairs (e, lit): lit ⇒ c's region reaches a saver whose
    # backward is at e or later. Walking away from c the running maximum of the savers' ends only grows, so
    # one pair per new maximum: "the region reaches op k" is same(k, c). Past REGION_WINDOW ops, one pair
    # with the latest end of any saver up to the next kept op: a bound from above, exact on shorter runs.
    exact_regions = problem.saves is not None and len(chain) <= EXACT_REGIONS_UP_TO
    backward = backward_positions(problem)
    last_position = problem.num_positions - 1
    reach_cache: dict[str, list] = {}

    def saver_end_of(k: int) -> int:
        return backward.get(chain[k], last_position) if chain[k] in problem.saves else -1

    def region_reach(c: str) -> list[tuple[int, int]]:
        """(e, k) pairs for op c: its region reaching chain index k means it holds its inputs to e or later."""
        if c not in reach_cache:
            pairs, i = [], index[c]
            for step in (-1, 1):
                best, k = -1, (i if step < 0 else i + 1)
                while 0 <= k < len(chain) and joined(min(i, k), max(i, k)):
                    if abs(k - i) > REGION_WINDOW:
                        run_end, j = -1, k
                        while 0 <= j < len(chain) and joined(min(i, j), max(i, j)):
                            run_end, j = max(run_end, saver_end_of(j)), j + step
                        if run_end > best:
                            pairs.append((run_end, k))
                        break
                    if saver_end_of(k) > best:
                        best = saver_end_of(k)
                        pairs.append((best, k))
                    k += step
            reach_cache[c] = pairs
        return reach_cache[c]

    for act in problem.activations:
        # Region-input reasons: a recomputed reader outside the owner's region holds t as a region input.
        input_reasons = []
        reason_of = {}
        for c in act.readers:
            if c not in r:
                continue
            reason = model.new_bool_var(f"input_hold[{act.name},{c}]")
            together = same(act.owner, c) if act.owner in index and index[act.owner] <= index[c] else 0
            # reason ⇔ r[c] ∧ ¬same(owner, c)
            model.add_implication(reason, r[c])
            if not isinstance(together, int):
                model.add_bool_or([~reason, ~together])
                model.add_bool_or([reason, ~r[c], together])
            else:
                model.add_implication(r[c], reason)
            input_reasons.append(reason)
            reason_of[c] = reason
        as_input = model.new_bool_var(f"held_as_input[{act.name}]")
        # held as input ⇔ any reason
        model.add_max_equality(as_input, input_reasons) if input_reasons else model.add(as_input == 0)
        saver_kept = [~r[s] if s in r else 1 for s in act.savers]
        stashed = sum(takers.get(act.name, ()))    # 0 or 1 (at most one taker, below)
        # Held from its last forward use to the latest end of what holds it (a kept saver, a region holding
        # it as an input), unless stashed: over (e_next, e] for each distinct end e by "a holder ending at
        # e or later holds it and it is not stashed".
        holders = [*zip((act.saver_end(i) for i in range(len(act.savers))), saver_kept)]
        if not exact_regions:      # not known what a region saves, or a long chain: held to read_end
            holders.append((act.read_end, as_input))
        for c, reason in (reason_of.items() if exact_regions else ()):
            owner_at = index[act.owner] if act.owner in index else -1
            for end, k in region_reach(c):
                if k <= owner_at:
                    continue       # c's region reaching k takes in the owner: t is then no input of it
                reach = same(chain[min(k, index[c])], chain[max(k, index[c])])
                # held to end ⇐ c holds t as an input and its region reaches a saver ending there
                holders.append((end, reason if k == index[c] else
                                _both(model, reason, reach, f"input_to[{act.name},{c},{k}]")))
        holders = [(end, h) for end, h in holders if end >= act.hold_start and not (isinstance(h, int) and h == 0)]
        hold_ends = sorted({end for end, _ in holders}, reverse=True)
        reaches = 0
        for k, end in enumerate(hold_ends):
            # held to end or later ⇔ held to the next later end, or a holder ending here holds it
            reaching = ([reaches] if k else []) + [h for e, h in holders if e == end]
            reaches = 1 if any(isinstance(h, int) for h in reaching) else \
                _any(model, reaching, f"held_to[{act.name},{end}]")
            on_device = reaches if isinstance(stashed, int) else _unless(model, reaches, stashed,
                                                                         f"held_on_device[{act.name},{end}]")
            add_piece(hold_ends[k + 1] + 1 if k + 1 < len(hold_ends) else act.hold_start, end, act.nbytes,
                      on_device)
        if act.savers:
            options = [(option, x[(act.name, option.action)]) for option in problem.stash_options.get(act.name, ())
                       if (act.name, option.action) in x]
            if act.name in takers:
                # at most one way to take a off the device
                model.add_at_most_one(takers[act.name])
            for var in takers.get(act.name, ()):
                # stashing needs a kept saver (autograd packs it) and no region holding a as an input
                model.add_implication(var, ~as_input)
                if not any(isinstance(k, int) for k in saver_kept):
                    model.add_bool_or([~var, *saver_kept])
            for option, var in options:
                # a rematerialized tensor needs its recipe's ops and its inputs' savers kept
                for op in option.needs_kept:
                    if op in r:
                        model.add_implication(var, ~r[op])
                # ... and its inputs on the device
                for name in option.needs_unstashed:
                    for other in takers.get(name, ()):
                        model.add_implication(var, ~other)
                add_piece(option.stored_from, act.save_end, option.stored_bytes, var)
                add_piece(option.restored_from, act.save_end, act.nbytes, var)
                # ... and its recipe's (its codec's) temporaries while it runs
                add_piece(option.restored_from, option.restored_from, option.transient_bytes, var)
                add_piece(option.stored_from, option.stored_from, option.packing_bytes, var)
            for option, var in deliveries.get(act.name, ()):
                # made again by a chain rematerialization: back from where that one is
                add_piece(option.restored_from, act.save_end, act.nbytes, var)
    by_name = {act.name: act for act in problem.activations}
    for name, variables in takers.items():
        held_by_autograd = by_name.get(name)
        if held_by_autograd is None or not held_by_autograd.savers or (
                held_by_autograd.save_end < held_by_autograd.hold_start):
            model.add(sum(variables) == 0)   # a delivery to a tensor autograd does not hold after forward

    # Rematerialized bytes at the backward of op j: A[j] ≥ A[j-1] + new ones, when j is recomputed.
    new_at: dict[str, list] = {}
    for act in problem.activations:
        first = problem.min_saver(act)
        if first is None or act.owner not in r or index[first] < index[act.owner]:
            continue
        new_at.setdefault(first, []).append((-(-act.nbytes // unit), act.owner))
    upper = sum(-(-a.nbytes // unit) for a in problem.activations) + 1
    remat: dict[str, cp_model.IntVar] = {}
    previous = None
    for op in chain:
        if op not in r:
            previous = None
            continue
        if op in cuts:
            previous = None
        a = model.new_int_var(0, upper, f"remat[{op}]")
        terms = [units * same(owner, op) for units, owner in new_at.get(op, [])]
        # what was alive at the previous op of this region stays alive; add what op's backward frees last
        model.add(a >= (previous if previous is not None else 0) + sum(terms)).only_enforce_if(r[op])
        remat[op] = a
        previous = a

    # Memory at every position, through a running sum (linear in the number of pieces).
    transients = sum(-(-o.transient_bytes // unit) - (-o.packing_bytes // unit)
                     for options in problem.stash_options.values() for o in options)
    ceiling = (max(max(problem.fixed), 0) // unit + 1 + 2 * upper + transients)
    peak = model.new_int_var(0, ceiling, "peak")
    running = 0
    for p in range(problem.num_positions):
        running = running + sum(starts.get(p, [])) - (sum(ends.get(p - 1, [])) if p else 0)
        level = model.new_int_var(0, ceiling, f"memory[{p}]")
        model.add(level == running)
        running = level
        total = level + math.ceil(problem.fixed[p] / unit)
        op = problem.backward_op.get(p)
        if op in remat:
            total = total + remat[op]
        # the step's memory at p stays under the peak (and the peak under the budget)
        model.add(total <= peak)
    if budget is not None:
        model.add(peak <= budget // unit)

    # Region starts: start[op] = 1 where a recomputed run begins (each region costs one checkpoint call).
    starts_at = {}
    previous = 0
    for op in chain:
        if op in r and problem.region_cost:
            start = model.new_bool_var(f"region_start[{op}]")
            model.add(start >= r[op] - (0 if op in cuts else previous))
            starts_at[op] = start
        previous = r.get(op, 0)

    # Costs scaled to at most 2**30 in total (each at least 1: recomputing and stashing are never free).
    stash_cost = {key: problem.stash_option(*key).cost for key in x}
    total = (sum(problem.cost[op] for op in r) + problem.region_cost * len(starts_at)
             + sum(stash_cost.values())) or 1
    decisions = {**runs, **x}
    unscaled = {**{op: problem.cost[op] for op in r}, **stash_cost}
    scaled = {key: max(1, -(-unscaled[key] * 2**30 // total)) for key in decisions}
    region_scaled = -(-problem.region_cost * 2**30 // total) if problem.region_cost else 0
    cost = sum(scaled[key] * var for key, var in decisions.items()) + region_scaled * sum(starts_at.values())
    if minimize == "peak":
        # least peak first, least cost among equal peaks (cost folded below one byte unit)
        tie = {key: max(1, scaled[key] >> 20) for key in decisions}
        tie_weight = sum(tie.values()) + 1
        model.minimize(peak * tie_weight + sum(tie[key] * var for key, var in decisions.items()))
    elif minimize == "cost":
        if budget is None:
            raise ValueError("minimize='cost' needs a budget")
        model.minimize(cost)
    else:
        raise ValueError(f"minimize={minimize!r}; expected 'cost' or 'peak'")

    started = time.perf_counter()
    if hint:
        _complete_hint(model, r, hint, x, hint_stash or {}, max(0.5, min(1.0, time_limit / 2)), seed)

    solver = cp_model.CpSolver()
    # The deterministic limit (CP-SAT work units; DTIME_PER_SECOND converts) ends the search,
    # so a plan does not depend on the machine's load; the wall-clock limit is only a safety net.
    solver.parameters.max_deterministic_time = time_limit * DTIME_PER_SECOND
    solver.parameters.max_time_in_seconds = 4 * time_limit + 30
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers
    solver.parameters.interleave_search = True
    if minimize == "cost" and len(chain) > LP_UP_TO:
        solver.parameters.ignore_subsolvers.extend(LP_SUBSOLVERS)
    reporter = _Progress(minimize, started) if progress else None
    status = solver.solve(model, reporter) if reporter else solver.solve(model)
    if reporter:
        reporter.close()
    wall = time.perf_counter() - started
    log.debug("cp-sat (%s) %s in %.2f s\n%s", minimize, _STATUS.get(status, "unknown"), wall,
              solver.response_stats())
    name = _STATUS.get(status, "unknown")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolverResult(None, name, math.inf, 0.0, math.inf, wall)
    recompute = {op: bool(solver.value(var)) for op, var in r.items() if op not in fixed}
    recompute.update(fixed)       # outside the window: the hint's decisions, region cuts included
    stash = {name: action for (name, action), var in x.items() if solver.value(var)}
    # back to the problem's units: cost, or bytes for the peak objective
    objective = solver.objective_value * total / 2**30
    bound = solver.best_objective_bound * total / 2**30
    if minimize == "peak":
        objective, bound = solver.value(peak) * unit, (bound // tie_weight) * unit
    gap = 0.0 if status == cp_model.OPTIMAL else (objective - bound) / max(abs(objective), 1e-9)
    return SolverResult(recompute, name, objective, bound, max(gap, 0.0), wall, stash)


def _without_flops(problem: Problem) -> Problem | None:
    """``problem`` with recomputation restricted to ops that run no FLOPs (None when that leaves none, or
    nothing to restrict)."""
    free = frozenset(op for op in problem.recomputable if not problem.flops.get(op, 0))
    if not free or free == problem.recomputable:
        return None
    options = {name: kept for name, options in problem.stash_options.items()
               if (kept := tuple(o for o in options if not any(problem.flops.get(op, 0) for op in o.recipe)))}
    return replace(problem, recomputable=free, stash_options=options)


def solve_in_stages(problem: Problem, *, time_limit: float = 5.0, hint: Mapping[str, bool] | None = None,
                    hint_stash: Mapping[str, str] | None = None, minimize: str = "cost", budget: int | None = None,
                    zero_flops_first: bool = False, **kwargs) -> SolverResult:
    """:func:`solve` on the full model, then on easier ones, each stage starting from the best plan so far.

    Two parts of the full model slow the search down on deep chains, and within the time limit it lands on
    worse plans than an easier model finds:

    * chain rematerializations (a variable and a dozen constraints per activation);
    * checkpoint's early stop (:attr:`Problem.saves`): an op's cost hangs on a conjunction, whose linear
      relaxation is weak. Without it every recomputed op is charged — the easier model over-counts, so its
      plans cost no more than it says.

    Stages, each from the best plan so far under the full model (so each can only improve on it; ties keep
    the earlier plan): the full model from the hint for the time limit (on some graphs — GPT-2 — it finds
    what the easier models' plans lead away from); without both for a quarter of it (from the heuristic's
    plan when the best so far has chains); with chains for a quarter. 1.5× ``time_limit`` in all (1.25×
    without chain options).

    ``zero_flops_first`` (least-FLOPs plans): before the full model, a quarter of the limit (taken from the
    full model's) on the model whose only recomputation runs no FLOPs — elementwise ops, views, random ops
    replayed, recipes of those. Where such a plan fits, the full model starts from it: within the limit the
    full search often settles on a plan that runs a matmul again where rewriting elementwise results would do
    (GPT-2 at ``torch.compile``'s 0.7 point: +4.2 MFLOP in 6 s, 0 in 20 s or after this stage).
    """
    plain = {name: tuple(o for o in options if not o.delivers) for name, options in problem.stash_options.items()}
    has_chains = plain != problem.stash_options
    counted = replace(problem, saves=None)
    plain_counted = replace(counted, stash_options={name: options for name, options in plain.items() if options})
    # (model, seconds): 1.5× the limit at most
    if problem.saves is None:
        stages = [(plain_counted, time_limit), (problem, time_limit / 2)] if has_chains else [(problem, time_limit)]
    elif has_chains:
        stages = [(problem, time_limit), (plain_counted, time_limit / 4), (counted, time_limit / 4)]
    else:
        stages = [(problem, time_limit), (counted, time_limit / 4)]
    no_flops = _without_flops(problem) if zero_flops_first and minimize == "cost" else None
    # its start: the heuristic's plan in the restricted model (the caller's hint recomputes FLOP ops, and a
    # hint that breaks the model's constraints leaves CP-SAT searching blind); none fits: no such stage
    zero_start = greedy.few_candidates_under(no_flops, budget) if no_flops is not None else None
    if zero_start is not None:
        stages = [(no_flops, time_limit / 4), (stages[0][0], stages[0][1] * 3 / 4), *stages[1:]]

    def score(decisions):
        recompute, stash = decisions[0], effective_stash(problem, decisions[0], decisions[1])
        peak = predicted_peak(problem, recompute, stash)
        if minimize == "peak":
            return peak, extra_cost(problem, recompute, stash)
        return peak > budget, extra_cost(problem, recompute, stash)

    best = (hint, hint_stash or {}) if hint is not None else None
    if zero_start is not None and (best is None or score(zero_start) < score(best)):
        best = zero_start        # the heuristic's zero-FLOP plan is a plan too, whatever CP-SAT makes of it
    best_from, last, full, wall = None, None, None, 0.0     # best_from: the result that found ``best``
    for model_problem, limit in stages:
        start = zero_start if model_problem is no_flops else best
        if start is not None and any(model_problem.stash_option(n, a) is None for n, a in start[1].items()):
            # the start has chains this model lacks: without them it holds what they delivered, a poor
            # start; the heuristic's plan is better
            start = greedy.lowest_peak(model_problem) if minimize == "peak" else (
                greedy.best_under(model_problem, budget) or (start[0], {}))
        last = solve(model_problem, time_limit=limit, hint=start[0] if start else None,
                     hint_stash=start[1] if start else None, minimize=minimize, budget=budget, **kwargs)
        wall += last.wall_time
        full = last if model_problem is problem else full
        if last.recompute is not None and (best is None or score((last.recompute, last.stash)) < score(best)):
            best, best_from = (last.recompute, last.stash), last
    if best_from is None and (zero_start is None or best is not zero_start):
        return replace(last, wall_time=wall)   # nothing better than the hint: the caller keeps the hint
    # status, objective, bound and gap in the full model's terms (an easier model's bound bounds its own cost)
    recompute, stash = best[0], effective_stash(problem, best[0], best[1])
    objective = predicted_peak(problem, recompute, stash) if minimize == "peak" else extra_cost(problem, recompute,
                                                                                                  stash)
    bound = full.bound if full is not None and full.recompute is not None else 0.0
    proven = full is not None and full.status == "optimal" and score(best) <= score((full.recompute, full.stash))
    gap = 0.0 if proven else max(0.0, (objective - bound) / max(abs(objective), 1e-9))
    return replace(best_from or last, recompute=best[0], stash=best[1], status="optimal" if proven else "feasible",
                   objective=objective, bound=bound, gap=gap, wall_time=wall)


WINDOW_OPS = 80         # recomputable ops a window of solve_in_windows spans
WINDOW_SECONDS = 1.0    # one window's time limit (in deterministic time, as solve's)


def chain_windows(problem: Problem, width: int = WINDOW_OPS) -> list[frozenset[str]]:
    """Windows of consecutive ops: each spans ``width`` recomputable ops (and the ops between them), half
    overlapping the one before."""
    decidable = [k for k, op in enumerate(problem.chain) if op in problem.recomputable]
    if not decidable:
        return []
    step = max(1, width // 2)
    return [frozenset(problem.chain[decidable[lo]:decidable[min(lo + width, len(decidable)) - 1] + 1])
            for lo in range(0, max(1, len(decidable) - width + step), step)]


def block_windows(problem: Problem, width: int = WINDOW_OPS) -> list[frozenset[str]]:
    """Windows across repeated blocks: the same stretch of every block of a stack at once, about ``width``
    ops in all.

    A chain window holds a layer or two, and the whole chain is too large a model for the limit, so neither
    trades between layers far apart — keep more of the first layers' matmul outputs, recompute more of the
    last's — which the least-cost plan at a peak every layer's backward reaches is made of. The planner's plans
    at √N's peak (least FLOPs), before and after them: the GPT-style model 35.7 → 0 MFLOP run again, BERT
    8.4 → 4.2, Llama 33.6 → 31.5; least time: Llama −17%, BERT −14% (3 to 12 windows, 1–4 s).

    A stack is the blocks of one length (alike blocks have one length; unlike ones of equal length are
    windowed together: valid windows, less to the point), taken ``width`` blocks at a time when it has more.
    Each block's stretch is ``width // blocks`` ops. The windows side by side come first, then those
    overlapping them by half: a search cut short by its time limit (``solve_in_windows``) has then seen every
    part of the blocks once.

    Example: two blocks of four ops; windows of two ops of each, side by side, then the one between.

        >>> from autorecompute.problem import Problem
        >>> ops = ("a0", "b0", "c0", "d0", "a1", "b1", "c1", "d1")
        >>> problem = Problem(chain=ops, recomputable=frozenset(ops), cost={}, flops={}, activations=(),
        ...                   fixed=(0,) * 16, num_forward=8, blocks=(ops[:4], ops[4:]))
        >>> [sorted(w) for w in block_windows(problem, width=4)]
        [['a0', 'a1', 'b0', 'b1'], ['c0', 'c1', 'd0', 'd1'], ['b0', 'b1', 'c0', 'c1']]
    """
    stacks: dict[int, list[tuple[str, ...]]] = {}
    for block in problem.blocks:
        stacks.setdefault(len(block), []).append(block)
    windows = []
    for length, stack in stacks.items():
        for first in range(0, len(stack), width):
            blocks = stack[first:first + width]
            if len(blocks) < 2:
                continue
            span = max(1, width // len(blocks))
            last = max(0, length - span)
            side_by_side = [*range(0, last, span), last]
            between = range(span // 2, last, span) if span > 1 else ()
            for lo in [*side_by_side, *between]:
                window = frozenset(op for block in blocks for op in block[lo:lo + span] if op in problem.recomputable)
                if window and window not in windows:
                    windows.append(window)
    return windows


def solve_in_windows(problem: Problem, start: greedy.Decisions, *, budget: int | None = None,
                     minimize: str = "cost", time_limit: float = 5.0, seed: int = 0,
                     width: int = WINDOW_OPS, windows: list[frozenset[str]] | None = None) -> greedy.Decisions:
    """CP-SAT over windows of the chain, the rest of the plan fixed: a large-neighbourhood search for chains
    whose whole model CP-SAT cannot solve in the limit.

    The windows are ``windows``, or :func:`chain_windows` of ``width`` (None). In each, :func:`solve` decides
    the window's ops and the stash choices of the activations they make (and of the parameter gradients
    their backward makes), from the best plan so far, which keeps the rest. A
    result is kept when the memory model scores it better (under ``budget``: cheaper; ``minimize="peak"``:
    lower). Passes over the windows until one changes nothing,
    or ``time_limit`` — each window counted at :data:`WINDOW_SECONDS`, the deterministic time it may use,
    so the result does not depend on the machine — is spent three times over: the full model had that long.

    On 6-layer Llama (449 ops, batch 16) at √N's peak, where the full model finds nothing in the limit,
    the local search's least-FLOPs plan runs 407 MFLOP again; the first pass takes it to 344, the second
    changes nothing (24 windows at an 8-s limit, 8 s). On 12 layers (850 ops): 240 to 210 MFLOP (24
    windows, 13 s). Windows of 160 ops at 3 s each end at the same plan; of 250 ops, dearer (361 MFLOP):
    a larger window's model is again too large for its limit.

    Example: four ops, each 100-B output saved by the next (:func:`greedy.lower_cost`'s example), windows of
    two ops, from everything recomputed (cost 8). Under 200 B the windows keep op0 (cost 6); the optimum,
    op2 kept and op0 recomputed (cost 3), changes two ops no window holds together.

        >>> from autorecompute.memory_model import extra_cost
        >>> from autorecompute.problem import Activation, Problem
        >>> ops = ("op0", "op1", "op2", "op3")
        >>> acts = tuple(Activation(f"t{i}", owner=ops[i], nbytes=100, hold_start=i + 2, savers=(ops[i + 1],),
        ...                         readers=(ops[i + 1],), save_end=6 - i, read_end=6 - i) for i in range(3))
        >>> problem = Problem(chain=ops, recomputable=frozenset(ops[:3]), cost=dict(zip(ops, (2, 1, 5, 1))),
        ...                   flops={}, activations=acts, fixed=(0,) * 8, num_forward=4,
        ...                   backward_op={7 - i: op for i, op in enumerate(ops)})
        >>> start = ({"op0": True, "op1": True, "op2": True}, {})
        >>> windowed = solve_in_windows(problem, start, budget=200, width=2)
        >>> sorted(windowed[0].items()), extra_cost(problem, *windowed)
        ([('op0', False), ('op1', True), ('op2', True)], 6)
    """
    if minimize == "cost" and budget is None:
        raise ValueError("minimize='cost' needs a budget")

    def score(decisions: greedy.Decisions) -> tuple:
        peak, cost = predicted_peak(problem, *decisions), extra_cost(problem, *decisions)
        return (peak, cost) if minimize == "peak" else (peak > budget, cost)

    windows = chain_windows(problem, width) if windows is None else windows
    if not windows:
        return start
    best = (dict(start[0]), effective_stash(problem, start[0], start[1]))
    best_score = score(best)
    left = max(1, math.ceil(3 * time_limit / WINDOW_SECONDS))
    unchanged = 0     # windows in a row that found nothing better: a whole pass of them ends the search
    for window in itertools.cycle(windows):
        if left <= 0 or unchanged >= len(windows):
            break
        left -= 1
        result = solve(problem, budget=budget, minimize=minimize, time_limit=WINDOW_SECONDS, seed=seed,
                       hint=best[0], hint_stash=best[1], window=window)
        found = None if result.recompute is None else (
            result.recompute, effective_stash(problem, result.recompute, result.stash))
        found_score = None if found is None else score(found)
        if found_score is not None and found_score < best_score:
            best, best_score, unchanged = found, found_score, 0
        else:
            unchanged += 1
    return best
