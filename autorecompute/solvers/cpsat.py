"""CP-SAT model of the planning problem (OR-Tools), encoding ``memory_model`` exactly.

Data → variables → constraints → objective → solve → extract, in the manner of OR-Tools' own examples:
:class:`Encoding` holds the model, its variables and one method per constraint family, and :func:`solve`
adds the families in order, runs CP-SAT and reads the plan back.
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
from autorecompute.problem import GRADIENT, Activation, Problem, StashOption
from autorecompute.solvers import greedy

log = logging.getLogger("autorecompute")
DTIME_PER_SECOND = 0.12   # CP-SAT deterministic time per wall second, measured on the 2-core CI machine
# CP-SAT's subsolvers that solve linear relaxations, left out of least-cost solves on chains longer than
# LP_UP_TO ops. There the relaxation of the cost model is weak (it bounds the cost far below the best plan's),
# so within a few seconds those workers prove nothing and take the time slices that the neighbourhood
# searches, which find the cheaper plans, need. On shorter chains (the CNNs and the MLP) they prove plans
# optimal within the limit, so they stay; least-peak solves keep them everywhere (the peak's bound is tight).
LP_SUBSOLVERS = ("default_lp", "max_lp", "reduced_costs", "pseudo_costs", "core", "quick_restart")
LP_UP_TO = 100
ONE_WORKER_UP_TO = 16     # chains this short are solved by one worker (see _solver)

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


def _negated(literal):
    """``¬literal`` for a Boolean variable or the constants 0 and 1."""
    return 1 - literal if isinstance(literal, int) else ~literal


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
# one per saver a region may reach): on long chains the exact rule's model is larger than its time limit
# allows, so its plans are dearer and its solves slower. The memory model that scores, searches and
# verifies CP-SAT's plans is exact on every chain.
EXACT_REGIONS_UP_TO = 64


def byte_unit(problem: Problem) -> int:
    """Divisor for bytes: keeps the largest memory figure near 2**22 so the model stays small-integer."""
    largest = max(max(problem.fixed, default=0), sum(a.nbytes for a in problem.activations), 1)
    return max(1, largest >> 22)


class Encoding:
    """The CP-SAT model of one solve: the problem's data, the decision variables and the constraint families
    that make the model's memory and cost those of :mod:`~autorecompute.memory_model`.

    Decisions: ``r[op]`` (op recomputed, in a region) and ``x[a, action]`` (activation ``a`` stashed that way).
    Memory is gathered as pieces — ``units × literal`` over positions ``start..end`` — that
    :meth:`add_memory_levels` sums position by position. Each family makes the auxiliary variables it needs
    when it is added, so the order :func:`solve` adds them in is the model's variable order.

    Args:
        budget: bytes every position must stay under (None: no bound on the peak).
        minimize: ``"cost"`` or ``"peak"`` (see :func:`solve`).
        hint, hint_stash: the starting plan (the decisions outside ``window`` are fixed to it).
        window: the ops this model decides (None: all).
    """

    def __init__(self, problem: Problem, *, budget: int | None = None, minimize: str = "cost",
                 hint: Mapping[str, bool] | None = None, hint_stash: Mapping[str, str] | None = None,
                 window: frozenset[str] | None = None):
        self.problem, self.budget, self.minimize, self.window = problem, budget, minimize, window
        self.hint, self.hint_stash = hint or {}, hint_stash or {}
        self.unit = byte_unit(problem)
        self.index = problem.index()
        self.model = cp_model.CpModel()
        # decisions outside the window: the hint's (op → False, True or a region cut)
        self.fixed = {} if window is None else {op: self.hint.get(op, False) for op in problem.chain
                                                if op in problem.recomputable and op not in window}
        self.cuts = {op for op, decision in self.fixed.items() if decision in (NEW_REGION, REMAKE)}
        self.exact_regions = problem.saves is not None and len(problem.chain) <= EXACT_REGIONS_UP_TO
        self.backward = backward_positions(problem)
        # rematerialized units at one backward op are at most every activation's
        self.upper = sum(-(-a.nbytes // self.unit) for a in problem.activations) + 1
        # memory pieces, by the position where each starts and where it ends
        self.starts: dict[int, list] = {}
        self.ends: dict[int, list] = {}
        # the variables, made by the add_* methods
        self.r: dict[str, cp_model.IntVar] = {}
        self.runs: dict[str, object] = {}     # op → literal: op runs again in backward (checkpoint's early stop)
        self.x: dict[tuple[str, str], cp_model.IntVar] = {}
        self.takers: dict[str, list] = {}     # activation → the x that take it off the device
        self.deliveries: dict[str, list[tuple[StashOption, cp_model.IntVar]]] = {}
        self.remat: dict[str, cp_model.IntVar] = {}
        self.region_starts: dict[str, cp_model.IntVar] = {}
        self.peak: cp_model.IntVar | None = None
        self.prefix: list = []
        self.breakers_before: list[int] = []
        self.cuts_before: list[int] = []
        self.cost_scale = 1        # the objective's unit is cost_scale / 2**30 of the problem's cost units
        self.tie_weight = 1        # the peak objective's weight on the peak (the cost breaks its ties)
        self._same: dict[tuple[int, int], object] = {}
        self._reach: dict[str, list[tuple[int, int]]] = {}

    # -- decisions and regions --

    def add_recompute_decisions(self) -> None:
        """``r[op]`` = 1 puts op in a recomputed region; the ops that cannot be recomputed, and those the window
        leaves kept, have none (the constant 0), so the model has only the decisions it may make."""
        problem, model, fixed = self.problem, self.model, self.fixed
        self.r = {op: model.new_bool_var(f"recompute[{op}]") for op in problem.chain
                  if op in problem.recomputable and fixed.get(op, True)}
        for op in self.r:
            if op in fixed:
                # recomputed, as the hint has it (outside the window); in chain order, so that the model, and
                # the plan, do not depend on the process's string hashing
                model.add(self.r[op] == 1)
        self.runs = dict(self.r)

    def add_region_prefix(self) -> None:
        """Prefix counts of recomputed ops along the chain: a run of ops is one region iff all of it is
        recomputed, which two prefixes tell (:meth:`same`) with one linear constraint instead of one per op."""
        model, chain = self.model, self.problem.chain
        self.prefix = [model.new_constant(0)]
        for i, op in enumerate(chain):
            nxt = model.new_int_var(0, i + 1, f"prefix[{i}]")
            model.add(nxt == self.prefix[-1] + self.r.get(op, 0))
            self.prefix.append(nxt)
        self.breakers_before = [0]     # ops with no r variable (never in a region) before each chain index
        for op in chain:
            self.breakers_before.append(self.breakers_before[-1] + (op not in self.r))
        self.cuts_before = [0]         # region cuts: op k starts a region of its own
        for op in chain:
            self.cuts_before.append(self.cuts_before[-1] + (op in self.cuts))

    def joined(self, i: int, j: int) -> bool:
        """Whether chain ops i <= j can be in one region: every op between is recomputable, none a cut."""
        return (self.breakers_before[j + 1] == self.breakers_before[i]
                and self.cuts_before[j + 1] == self.cuts_before[i + 1])

    def same(self, a: str, b: str):
        """Boolean: ops a..b (chain order, a <= b) are one recomputed region (made on first use, once)."""
        i, j = self.index[a], self.index[b]
        if not self.joined(i, j):
            return 0
        if i == j:
            return self.r[a]
        if (i, j) not in self._same:
            s = self.model.new_bool_var(f"same[{a},{b}]")
            # s ⇔ every op in a..b is recomputed
            self.model.add(self.prefix[j + 1] - self.prefix[i] == j - i + 1).only_enforce_if(s)
            self.model.add(self.prefix[j + 1] - self.prefix[i] <= j - i).only_enforce_if(~s)
            self._same[(i, j)] = s
        return self._same[(i, j)]

    def add_reruns(self) -> None:
        """Which recomputed ops run again in backward: checkpoint's recomputation of a region stops at its last
        save, so an op runs again only if it keeps a tensor it makes itself or a later op of its region saves
        anything — the cost counts only those (all recomputed ops when ``Problem.saves`` is not known)."""
        problem, model, r = self.problem, self.model, self.r
        if problem.saves is None:
            return
        later = 0    # literal: the next op is in this op's region and it or an op after it there saves
        for op in reversed(problem.chain):
            if op not in r:
                later = 0
                continue
            if not problem.saves.get(op):
                self.runs[op] = _both(model, r[op], later, f"rerun[{op}]")
            # for the op before: this one shares its region (r[op]) and saves, or a later one does
            later = r[op] if op in problem.saves else _both(model, r[op], later, f"saves_after[{op}]")
            if op in self.cuts:
                later = 0      # the op before is in another region

    def add_stash_decisions(self) -> None:
        """``x[a, action]`` = 1 takes activation ``a`` off the device that way (offloaded, compressed,
        rematerialized), for the activations autograd holds after forward; outside the window, as the hint
        has it. Also who takes each activation off: its own options and the chain rematerializations that
        make it again on their way (``StashOption.delivers``)."""
        problem, model = self.problem, self.model
        self.x = {(act.name, option.action): model.new_bool_var(f"stash[{act.name},{option.action}]")
                  for act in problem.activations if act.savers and act.save_end >= act.hold_start
                  for option in problem.stash_options.get(act.name, ())}
        if self.window is not None:
            # a parameter's gradient belongs to the window of the op whose backward makes it (fixed to the
            # hint's choice, gradients a start offloads would stay offloaded in every window)
            owners = {act.name: problem.backward_op.get(act.hold_start - 1, act.owner)
                      if act.name.startswith(GRADIENT) else act.owner for act in problem.activations}
            for (name, action), var in self.x.items():
                if owners[name] not in self.window:
                    # stashed as the hint has it (an activation no op of the window makes)
                    model.add(var == int(self.hint_stash.get(name) == action))
        for (name, action), var in self.x.items():
            self.takers.setdefault(name, []).append(var)
            option = problem.stash_option(name, action)
            for other in option.delivers:
                self.takers.setdefault(other, []).append(var)
                self.deliveries.setdefault(other, []).append((option, var))

    # -- activations: how long each is on the device --

    def add_activations(self) -> None:
        """Each activation's families in turn — held as a region input, held on the device, its stash choices'
        rules and memory — one activation's variables and constraints together. (CP-SAT's search follows the
        model's order, so the plan a seed gives depends on it: the order is kept as it is.)"""
        for act in self.problem.activations:
            as_input, reason_of = self._region_inputs(act)
            self._held(act, self._holders(act, as_input, reason_of))
            if act.savers:
                self._stash_rules(act, as_input)
                self._stash_memory(act)

    def _region_inputs(self, act: Activation) -> tuple[object, dict[str, object]]:
        """``held_as_input[a]``: a recomputed reader of ``a`` outside its owner's region holds ``a`` as a region
        input (the checkpoint keeps its inputs), so ``a`` stays on the device and cannot be stashed. Returns it,
        and each such reader's reason literal (``r[c] ∧ ¬same(owner, c)``)."""
        model, r, index = self.model, self.r, self.index
        input_reasons, reason_of = [], {}
        for c in act.readers:
            if c not in r:
                continue
            reason = model.new_bool_var(f"input_hold[{act.name},{c}]")
            together = self.same(act.owner, c) if act.owner in index and index[act.owner] <= index[c] else 0
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
        return as_input, reason_of

    def _savers_kept(self, act: Activation) -> list:
        """For each saver of ``act``: the literal "kept" (1 when it cannot be recomputed)."""
        return [~self.r[s] if s in self.r else 1 for s in act.savers]

    def saver_end_of(self, k: int) -> int:
        """The backward position of chain op k if it saves for backward (-1 if it saves nothing)."""
        op = self.problem.chain[k]
        return self.backward.get(op, self.problem.num_positions - 1) if op in self.problem.saves else -1

    def region_reach(self, c: str) -> list[tuple[int, int]]:
        """(e, k) pairs for op c: its region reaching chain index k means it holds its inputs to e or later.

        A recomputed region holds its inputs until the last backward of an op in it that saves
        (``memory_model.region_ends``). Walking away from c the running maximum of the savers' ends only
        grows, so one pair per new maximum ("the region reaches op k" is ``same(k, c)``). Past
        :data:`REGION_WINDOW` ops, one pair with the latest end of any saver up to the next kept op: a bound
        from above, exact on shorter runs, that keeps the pairs per reader few."""
        if c not in self._reach:
            chain, pairs, i = self.problem.chain, [], self.index[c]
            for step in (-1, 1):
                best, k = -1, (i if step < 0 else i + 1)
                while 0 <= k < len(chain) and self.joined(min(i, k), max(i, k)):
                    if abs(k - i) > REGION_WINDOW:
                        run_end, j = -1, k
                        while 0 <= j < len(chain) and self.joined(min(i, j), max(i, j)):
                            run_end, j = max(run_end, self.saver_end_of(j)), j + step
                        if run_end > best:
                            pairs.append((run_end, k))
                        break
                    if self.saver_end_of(k) > best:
                        best = self.saver_end_of(k)
                        pairs.append((best, k))
                    k += step
            self._reach[c] = pairs
        return self._reach[c]

    def _holders(self, act: Activation, as_input, reason_of: Mapping[str, object]) -> list[tuple[int, object]]:
        """(end, literal) pairs: the literal true holds ``act`` on the device from its last forward use to end —
        a kept saver to its backward, a region holding it as an input to the last backward of what that region
        saves (on long chains, or when saves are not known, to ``read_end``)."""
        model, chain, index = self.model, self.problem.chain, self.index
        holders = [*zip((act.saver_end(i) for i in range(len(act.savers))), self._savers_kept(act))]
        if not self.exact_regions:
            holders.append((act.read_end, as_input))
        for c, reason in (reason_of.items() if self.exact_regions else ()):
            owner_at = index[act.owner] if act.owner in index else -1
            for end, k in self.region_reach(c):
                if k <= owner_at:
                    continue       # c's region reaching k takes in the owner: t is then no input of it
                reach = self.same(chain[min(k, index[c])], chain[max(k, index[c])])
                # held to end ⇐ c holds t as an input and its region reaches a saver ending there
                holders.append((end, reason if k == index[c] else
                                _both(model, reason, reach, f"input_to[{act.name},{c},{k}]")))
        return [(end, h) for end, h in holders if end >= act.hold_start and not (isinstance(h, int) and h == 0)]

    def _held(self, act: Activation, holders: list[tuple[int, object]]) -> None:
        """``act`` is on the device from ``hold_start`` to the latest end of what holds it, unless stashed: over
        (e_next, e] for each distinct end e by "a holder ending at e or later holds it and it is not stashed"."""
        stashed = sum(self.takers.get(act.name, ()))    # 0 or 1 (at most one taker: _stash_rules)
        hold_ends = sorted({end for end, _ in holders}, reverse=True)
        reaches = 0
        for k, end in enumerate(hold_ends):
            # held to end or later ⇔ held to the next later end, or a holder ending here holds it
            reaching = ([reaches] if k else []) + [h for e, h in holders if e == end]
            reaches = 1 if any(isinstance(h, int) for h in reaching) else \
                _any(self.model, reaching, f"held_to[{act.name},{end}]")
            on_device = reaches if isinstance(stashed, int) else _unless(self.model, reaches, stashed,
                                                                         f"held_on_device[{act.name},{end}]")
            self.add_piece(hold_ends[k + 1] + 1 if k + 1 < len(hold_ends) else act.hold_start, end, act.nbytes,
                           on_device)

    def _options(self, act: Activation) -> list[tuple[StashOption, cp_model.IntVar]]:
        """``act``'s stash options that have a variable, with it."""
        return [(option, self.x[(act.name, option.action)]) for option in self.problem.stash_options.get(act.name, ())
                if (act.name, option.action) in self.x]

    def _stash_rules(self, act: Activation, as_input) -> None:
        """A stash choice is valid only as ``memory_model.stash_valid`` has it: one way at most, a kept saver
        holding the tensor (autograd packs it) and no region holding it as an input; a rematerialization also
        needs its recipe's ops and its inputs' savers kept, and its inputs on the device."""
        model, takers = self.model, self.takers
        if act.name in takers:
            # at most one way to take a off the device
            model.add_at_most_one(takers[act.name])
        saver_kept = self._savers_kept(act)
        for var in takers.get(act.name, ()):
            model.add_implication(var, ~as_input)
            if not any(isinstance(k, int) for k in saver_kept):
                model.add_bool_or([~var, *saver_kept])
        for option, var in self._options(act):
            for op in option.needs_kept:
                if op in self.r:
                    model.add_implication(var, ~self.r[op])
            for name in option.needs_unstashed:
                for other in takers.get(name, ()):
                    model.add_implication(var, ~other)

    def _stash_memory(self, act: Activation) -> None:
        """A stashed ``act`` is on the device as its stored copy from ``stored_from`` and whole again from
        ``restored_from``, plus its codec's or recipe's temporaries while they run; made again by a chain
        rematerialization, whole from where that one is."""
        for option, var in self._options(act):
            self.add_piece(option.stored_from, act.save_end, option.stored_bytes, var)
            self.add_piece(option.restored_from, act.save_end, act.nbytes, var)
            self.add_piece(option.restored_from, option.restored_from, option.transient_bytes, var)
            self.add_piece(option.stored_from, option.stored_from, option.packing_bytes, var)
        for option, var in self.deliveries.get(act.name, ()):
            self.add_piece(option.restored_from, act.save_end, act.nbytes, var)

    def add_piece(self, start: int, end: int, nbytes: int, literal) -> None:
        """``nbytes`` (in units, rounded up) on the device over positions start..end while ``literal`` holds."""
        if end < start or nbytes <= 0:
            return
        units = -(-nbytes // self.unit)
        self.starts.setdefault(start, []).append(units * literal)
        self.ends.setdefault(end, []).append(units * literal)

    def add_rng_states(self) -> None:
        """The generator state a region that draws random numbers keeps (``Problem.rng_state_bytes``): one
        piece per region, on its first random op, from the start of the longest run of ops that region can be
        part of to the latest backward of an op there that saves — conservative, where the memory model that
        scores CP-SAT's plans sizes each region's own span."""
        problem = self.problem
        if not problem.rng_state_bytes or not problem.random_ops or problem.saves is None:
            return
        saving_end = problem.indexed.saving_end
        for run in self._joinable_runs():
            end = max(saving_end[k] for k in run)
            start = problem.forward_position.get(problem.chain[run[0]], run[0])
            previous = None        # the run's random op before: a region through both keeps one state
            for k in run:
                op = problem.chain[k]
                if op not in problem.random_ops:
                    continue
                first = self.r[op] if previous is None else _both(
                    self.model, self.r[op], _negated(self.same(previous, op)), f"first_random[{op}]")
                self.add_piece(start, end, problem.rng_state_bytes, first)
                previous = op

    def _joinable_runs(self) -> list[list[int]]:
        """Chain indices of the runs of ops with a decision and no cut inside: the most one region spans."""
        runs: list[list[int]] = []
        for k, op in enumerate(self.problem.chain):
            if op not in self.r:
                continue
            if not runs or runs[-1][-1] != k - 1 or op in self.cuts:
                runs.append([])
            runs[-1].append(k)
        return runs

    def add_unheld_deliveries(self) -> None:
        """No delivery to a tensor autograd does not hold after forward: there is nothing to take off the
        device, and the chain's pieces for it would count memory that is not there."""
        by_name = {act.name: act for act in self.problem.activations}
        for name, variables in self.takers.items():
            held_by_autograd = by_name.get(name)
            if held_by_autograd is None or not held_by_autograd.savers or (
                    held_by_autograd.save_end < held_by_autograd.hold_start):
                self.model.add(sum(variables) == 0)

    # -- memory at every position --

    def add_rematerialized_bytes(self) -> None:
        """``remat[op]``: bytes a recomputed region has made again at op's backward. Each lives from the
        recomputation to its earliest saver's backward, so along a region the amount only grows: at op j it is
        at least that of the op before in the region plus what j's backward frees last."""
        problem, model, index = self.problem, self.model, self.index
        new_at: dict[str, list] = {}
        for act in problem.activations:
            first = problem.min_saver(act)
            if first is None or act.owner not in self.r or index[first] < index[act.owner]:
                continue
            new_at.setdefault(first, []).append((-(-act.nbytes // self.unit), act.owner))
        previous = None
        for op in problem.chain:
            if op not in self.r:
                previous = None
                continue
            if op in self.cuts:
                previous = None
            a = model.new_int_var(0, self.upper, f"remat[{op}]")
            terms = [units * self.same(owner, op) for units, owner in new_at.get(op, [])]
            # what was alive at the previous op of this region stays alive; add what op's backward frees last
            model.add(a >= (previous if previous is not None else 0) + sum(terms)).only_enforce_if(self.r[op])
            self.remat[op] = a
            previous = a

    def add_memory_levels(self) -> None:
        """``peak`` is at least the memory at every position: the pieces through a running sum (linear in the
        number of pieces), the fixed bytes, and at a backward op what its region made again."""
        problem, model, unit = self.problem, self.model, self.unit
        transients = sum(-(-o.transient_bytes // unit) - (-o.packing_bytes // unit)
                         for options in problem.stash_options.values() for o in options)
        ceiling = (max(max(problem.fixed), 0) // unit + 1 + 2 * self.upper + transients)
        self.peak = model.new_int_var(0, ceiling, "peak")
        running = 0
        for p in range(problem.num_positions):
            running = running + sum(self.starts.get(p, [])) - (sum(self.ends.get(p - 1, [])) if p else 0)
            level = model.new_int_var(0, ceiling, f"memory[{p}]")
            model.add(level == running)
            running = level
            total = level + math.ceil(problem.fixed[p] / unit)
            op = problem.backward_op.get(p)
            if op in self.remat:
                total = total + self.remat[op]
            # the step's memory at p stays under the peak
            model.add(total <= self.peak)

    def add_budget(self) -> None:
        """The peak stays under the budget (rounded down to whole units, so the plan fits in bytes too)."""
        if self.budget is not None:
            self.model.add(self.peak <= self.budget // self.unit)

    # -- cost and objective --

    def add_region_starts(self) -> None:
        """``region_start[op]`` = 1 where a recomputed run begins: each region costs one checkpoint call
        (only when ``Problem.region_cost`` prices it)."""
        previous = 0
        for op in self.problem.chain:
            if op in self.r and self.problem.region_cost:
                start = self.model.new_bool_var(f"region_start[{op}]")
                self.model.add(start >= self.r[op] - (0 if op in self.cuts else previous))
                self.region_starts[op] = start
            previous = self.r.get(op, 0)

    def set_objective(self) -> None:
        """Least cost under the budget, or least peak then least cost. Costs are scaled to at most 2**30 in
        total (each at least 1: recomputing and stashing are never free), so the objective stays integral."""
        problem, minimize, r, x = self.problem, self.minimize, self.r, self.x
        stash_cost = {key: problem.stash_option(*key).cost for key in x}
        total = (sum(problem.cost[op] for op in r) + problem.region_cost * len(self.region_starts)
                 + sum(stash_cost.values())) or 1
        decisions = {**self.runs, **x}
        unscaled = {**{op: problem.cost[op] for op in r}, **stash_cost}
        scaled = {key: max(1, -(-unscaled[key] * 2**30 // total)) for key in decisions}
        region_scaled = -(-problem.region_cost * 2**30 // total) if problem.region_cost else 0
        self.cost_scale = total
        if minimize == "peak":
            # least peak first, least cost among equal peaks (cost folded below one byte unit)
            tie = {key: max(1, scaled[key] >> 20) for key in decisions}
            self.tie_weight = sum(tie.values()) + 1
            self.model.minimize(self.peak * self.tie_weight + sum(tie[key] * var for key, var in decisions.items()))
        elif minimize == "cost":
            if self.budget is None:
                raise ValueError("minimize='cost' needs a budget")
            self.model.minimize(sum(scaled[key] * var for key, var in decisions.items())
                                + region_scaled * sum(self.region_starts.values()))
        else:
            raise ValueError(f"minimize={minimize!r}; expected 'cost' or 'peak'")

    # -- hint and result --

    def complete_hint(self, seconds: float, seed: int) -> None:
        """Hints every variable, not just the decisions: CP-SAT keeps a complete feasible hint as its first
        solution, while a partial one is often lost in presolve. The completion is a solve with the decisions
        fixed to the hint (fast: propagation does the work). A hint that does not fit is dropped."""
        model = self.model
        for op, var in self.r.items():
            model.add_hint(var, bool(self.hint.get(op, False)))
        for (name, action), var in self.x.items():
            model.add_hint(var, self.hint_stash.get(name) == action)
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

    def result(self, solver: cp_model.CpSolver, status, wall: float) -> SolverResult:
        """The plan CP-SAT found, its objective and bound back in the problem's units (cost, or bytes for the
        peak objective)."""
        name = _STATUS.get(status, "unknown")
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return SolverResult(None, name, math.inf, 0.0, math.inf, wall)
        recompute = {op: bool(solver.value(var)) for op, var in self.r.items() if op not in self.fixed}
        recompute.update(self.fixed)       # outside the window: the hint's decisions, region cuts included
        stash = {activation: action for (activation, action), var in self.x.items() if solver.value(var)}
        objective = solver.objective_value * self.cost_scale / 2**30
        bound = solver.best_objective_bound * self.cost_scale / 2**30
        if self.minimize == "peak":
            objective, bound = solver.value(self.peak) * self.unit, (bound // self.tie_weight) * self.unit
        gap = 0.0 if status == cp_model.OPTIMAL else (objective - bound) / max(abs(objective), 1e-9)
        return SolverResult(recompute, name, objective, bound, max(gap, 0.0), wall, stash)


def _solver(minimize: str, chain_length: int, *, time_limit: float, seed: int, workers: int) -> cp_model.CpSolver:
    """CP-SAT with the solve's parameters. The deterministic limit (CP-SAT work units; DTIME_PER_SECOND
    converts) ends the search, so a plan does not depend on the machine's load; the wall-clock limit is only
    a safety net. Interleaved workers keep the search deterministic."""
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = time_limit * DTIME_PER_SECOND
    solver.parameters.max_time_in_seconds = 4 * time_limit + 30
    solver.parameters.random_seed = seed
    # a chain this short is solved to optimality by one worker in milliseconds; a second, interleaved, only adds
    # the core-based subsolver, which can spend seconds of wall time on a few units of deterministic time there
    solver.parameters.num_workers = 1 if chain_length <= ONE_WORKER_UP_TO else workers
    solver.parameters.interleave_search = True
    if minimize == "cost" and chain_length > LP_UP_TO:
        solver.parameters.ignore_subsolvers.extend(LP_SUBSOLVERS)
    return solver


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
            plain recomputation, without the hint's cuts there (kept as boundaries, they would pin the window
            to the start's regions, where it finds little to improve). A cut that remakes its inputs
            (:data:`~autorecompute.memory_model.REMAKE`) is encoded as a plain one, which holds more than it:
            the caller scores the result with the memory model (and a start that fits only thanks to such a
            cut leaves every window's model infeasible).
    """
    encoding = Encoding(problem, budget=budget, minimize=minimize, hint=hint, hint_stash=hint_stash, window=window)
    encoding.add_recompute_decisions()
    encoding.add_region_prefix()
    encoding.add_reruns()
    encoding.add_stash_decisions()
    encoding.add_activations()
    encoding.add_unheld_deliveries()
    encoding.add_rng_states()
    encoding.add_rematerialized_bytes()
    encoding.add_memory_levels()
    encoding.add_budget()
    encoding.add_region_starts()
    encoding.set_objective()

    started = time.perf_counter()
    if hint:
        encoding.complete_hint(max(0.5, min(1.0, time_limit / 2)), seed)
    solver = _solver(minimize, len(problem.chain), time_limit=time_limit, seed=seed, workers=workers)
    reporter = _Progress(minimize, started) if progress else None
    status = solver.solve(encoding.model, reporter) if reporter else solver.solve(encoding.model)
    if reporter:
        reporter.close()
    wall = time.perf_counter() - started
    log.debug("cp-sat (%s) %s in %.2f s\n%s", minimize, _STATUS.get(status, "unknown"), wall,
              solver.response_stats())
    return encoding.result(solver, status, wall)


def _without_flops(problem: Problem) -> Problem | None:
    """``problem`` with recomputation restricted to ops that run no FLOPs (None when that leaves none, or
    nothing to restrict)."""
    free = frozenset(op for op in problem.recomputable if not problem.flops.get(op, 0))
    if not free or free == problem.recomputable:
        return None
    options = {name: kept for name, options in problem.stash_options.items()
               if (kept := tuple(o for o in options if not any(problem.flops.get(op, 0) for op in o.recipe)))}
    return replace(problem, recomputable=free, stash_options=options)


def _stages(problem: Problem, time_limit: float, minimize: str, budget: int | None,
            zero_flops_first: bool) -> tuple[list[tuple[Problem, float]], Problem | None, greedy.SearchPlan | None]:
    """The stages of :func:`solve_in_stages` — (model, seconds), 1.5× the limit at most — with the zero-FLOP
    model and its start (None, None when there is no such stage)."""
    plain = {name: tuple(o for o in options if not o.delivers) for name, options in problem.stash_options.items()}
    has_chains = plain != problem.stash_options
    counted = replace(problem, saves=None)
    plain_counted = replace(counted, stash_options={name: options for name, options in plain.items() if options})
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
    return stages, no_flops, zero_start


def _stage_score(problem: Problem, minimize: str, budget: int | None, decisions: greedy.SearchPlan) -> tuple:
    """A plan's rank under the full model (lower is better): peak then cost, or over the budget then cost."""
    recompute, stash = decisions[0], effective_stash(problem, decisions[0], decisions[1])
    peak = predicted_peak(problem, recompute, stash)
    if minimize == "peak":
        return peak, extra_cost(problem, recompute, stash)
    return peak > budget, extra_cost(problem, recompute, stash)


def _stage_start(stage: Problem, start: greedy.SearchPlan | None, minimize: str,
                 budget: int | None) -> greedy.SearchPlan | None:
    """``start``, or the heuristic's plan where ``start`` has chains the stage's model lacks: without them it
    holds what they delivered, a poor start."""
    if start is not None and any(stage.stash_option(n, a) is None for n, a in start[1].items()):
        return greedy.lowest_peak(stage) if minimize == "peak" else (
            greedy.best_under(stage, budget) or (start[0], {}))
    return start


def _in_full_terms(problem: Problem, best: greedy.SearchPlan, found: SolverResult, full: SolverResult | None,
                   minimize: str, budget: int | None, wall: float) -> SolverResult:
    """``best`` as ``found``'s result, its status, objective, bound and gap in the full model's terms (an easier
    model's bound bounds its own cost, not the full model's)."""
    recompute, stash = best[0], effective_stash(problem, best[0], best[1])
    objective = predicted_peak(problem, recompute, stash) if minimize == "peak" else extra_cost(problem, recompute,
                                                                                                  stash)
    bound = full.bound if full is not None and full.recompute is not None else 0.0
    proven = full is not None and full.status == "optimal" and (
        _stage_score(problem, minimize, budget, best)
        <= _stage_score(problem, minimize, budget, (full.recompute, full.stash)))
    gap = 0.0 if proven else max(0.0, (objective - bound) / max(abs(objective), 1e-9))
    return replace(found, recompute=best[0], stash=best[1], status="optimal" if proven else "feasible",
                   objective=objective, bound=bound, gap=gap, wall_time=wall)


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
    the earlier plan): the full model from the hint for the time limit (on some graphs it finds what the
    easier models' plans lead away from); without both for a quarter of it (from the heuristic's plan when
    the best so far has chains); with chains for a quarter. 1.5× ``time_limit`` in all (1.25× without chain
    options).

    ``zero_flops_first`` (least-FLOPs plans): before the full model, a quarter of the limit (taken from the
    full model's) on the model whose only recomputation runs no FLOPs — elementwise ops, views, random ops
    replayed, recipes of those. Where such a plan fits, the full model starts from it: within the limit the
    full search often settles on a plan that runs a matmul again where rewriting elementwise results would do.
    """
    stages, no_flops, zero_start = _stages(problem, time_limit, minimize, budget, zero_flops_first)

    def score(decisions):
        return _stage_score(problem, minimize, budget, decisions)

    best = (hint, hint_stash or {}) if hint is not None else None
    if zero_start is not None and (best is None or score(zero_start) < score(best)):
        best = zero_start        # the heuristic's zero-FLOP plan is a plan too, whatever CP-SAT makes of it
    best_from, last, full, wall = None, None, None, 0.0     # best_from: the result that found ``best``
    for stage, limit in stages:
        start = _stage_start(stage, zero_start if stage is no_flops else best, minimize, budget)
        last = solve(stage, time_limit=limit, hint=start[0] if start else None,
                     hint_stash=start[1] if start else None, minimize=minimize, budget=budget, **kwargs)
        wall += last.wall_time
        full = last if stage is problem else full
        if last.recompute is not None and (best is None or score((last.recompute, last.stash)) < score(best)):
            best, best_from = (last.recompute, last.stash), last
    if best_from is None and (zero_start is None or best is not zero_start):
        return replace(last, wall_time=wall)   # nothing better than the hint: the caller keeps the hint
    return _in_full_terms(problem, best, best_from or last, full, minimize, budget, wall)


# A window's model is sized to be solved within its limit: larger windows at longer limits end at the same
# plans, and much larger ones at dearer plans (their model is again too large for its limit).
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
    last's — which the least-cost plan at a peak every layer's backward reaches is made of.

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


def solve_in_windows(problem: Problem, start: greedy.SearchPlan, *, budget: int | None = None,
                     minimize: str = "cost", time_limit: float = 5.0, seed: int = 0,
                     width: int = WINDOW_OPS, windows: list[frozenset[str]] | None = None) -> greedy.SearchPlan:
    """CP-SAT over windows of the chain, the rest of the plan fixed: a large-neighbourhood search for chains
    whose whole model CP-SAT cannot solve in the limit.

    The windows are ``windows``, or :func:`chain_windows` of ``width`` (None). In each, :func:`solve` decides
    the window's ops and the stash choices of the activations they make (and of the parameter gradients
    their backward makes), from the best plan so far, which keeps the rest. A result is kept when the memory
    model scores it better (under ``budget``: cheaper; ``minimize="peak"``: lower). Passes over the windows
    until one changes nothing, or ``time_limit`` — each window counted at :data:`WINDOW_SECONDS`, the
    deterministic time it may use, so the result does not depend on the machine — is spent three times over:
    the full model is given that long.

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
    windows = chain_windows(problem, width) if windows is None else windows
    if not windows:
        return start
    best = (dict(start[0]), effective_stash(problem, start[0], start[1]))
    best_score = _window_score(problem, minimize, budget, best)
    rounds = max(1, math.ceil(3 * time_limit / WINDOW_SECONDS))
    unchanged = 0     # windows in a row that found nothing better: a whole pass of them ends the search
    for window in itertools.islice(itertools.cycle(windows), rounds):
        if unchanged >= len(windows):
            break
        found = _solve_window(problem, window, best, budget=budget, minimize=minimize, seed=seed)
        found_score = None if found is None else _window_score(problem, minimize, budget, found)
        if found_score is not None and found_score < best_score:
            best, best_score, unchanged = found, found_score, 0
        else:
            unchanged += 1
    return best


def _window_score(problem: Problem, minimize: str, budget: int | None, decisions: greedy.SearchPlan) -> tuple:
    """A plan's rank in :func:`solve_in_windows` (lower is better): peak then cost, or over the budget then cost
    (``decisions``' stash choices are the effective ones)."""
    peak, cost = predicted_peak(problem, *decisions), extra_cost(problem, *decisions)
    return (peak, cost) if minimize == "peak" else (peak > budget, cost)


def _solve_window(problem: Problem, window: frozenset[str], best: greedy.SearchPlan, *, budget: int | None,
                  minimize: str, seed: int) -> greedy.SearchPlan | None:
    """:func:`solve` over ``window`` from ``best``: its plan with the stash choices that take effect, or None."""
    result = solve(problem, budget=budget, minimize=minimize, time_limit=WINDOW_SECONDS, seed=seed,
                   hint=best[0], hint_stash=best[1], window=window)
    return None if result.recompute is None else (
        result.recompute, effective_stash(problem, result.recompute, result.stash))
