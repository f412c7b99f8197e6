"""Segment heuristic: √N-style checkpoints placed by bytes, scored with the memory model.

Splits the chain into ``k`` segments of about equal held bytes; each segment's last op is kept (the
checkpoint), the rest recomputed. Tries every ``k`` and returns the best plan for the goal. Used as the
CP-SAT hint, and as the fallback when the solver finds nothing in time.
"""
from __future__ import annotations

from autorecompute.memory_model import extra_cost, predicted_peak
from autorecompute.problem import Problem


def segment_plan(problem: Problem, segments: int) -> dict[str, bool]:
    """Recompute everything except one checkpoint op per segment of about equal held bytes."""
    held: dict[str, int] = {}
    for act in problem.activations:
        if act.savers:
            held[act.owner] = held.get(act.owner, 0) + act.nbytes
    total = sum(held.get(op, 0) for op in problem.chain) or 1
    step = total / max(1, segments)
    recompute, running, boundary = {}, 0.0, step
    for op in problem.chain:
        running += held.get(op, 0)
        if op not in problem.recomputable:
            continue
        if running >= boundary:
            recompute[op] = False
            while boundary <= running:
                boundary += step
        else:
            recompute[op] = True
    return recompute


def candidates(problem: Problem, max_segments: int = 64) -> list[dict[str, bool]]:
    keep_all = {op: False for op in problem.recomputable}
    n = max(1, min(max_segments, len(problem.recomputable)))
    return [keep_all] + [segment_plan(problem, k) for k in range(1, n + 1)]


_SCORED: dict[int, tuple[Problem, list]] = {}


def scored_candidates(problem: Problem) -> list[tuple[dict[str, bool], int, int]]:
    """``(plan, predicted peak, cost)`` of every candidate, computed once per problem."""
    cached = _SCORED.get(id(problem))
    if cached is None or cached[0] is not problem:
        scored = [(r, predicted_peak(problem, r), extra_cost(problem, r)) for r in candidates(problem)]
        _SCORED.clear()          # one problem at a time: do not keep old graphs alive
        cached = _SCORED[id(problem)] = (problem, scored)
    return cached[1]


def lowest_peak(problem: Problem) -> dict[str, bool]:
    """The candidate with the lowest predicted peak (then least cost)."""
    return min(scored_candidates(problem), key=lambda s: (s[1], s[2]))[0]


def cheapest_under(problem: Problem, budget: int) -> dict[str, bool] | None:
    """The cheapest candidate whose predicted peak fits ``budget``, or None."""
    fitting = [s for s in scored_candidates(problem) if s[1] <= budget]
    return min(fitting, key=lambda s: s[2])[0] if fitting else None


def descend(problem: Problem, budget: int, start: dict[str, bool], max_tries: int = 160) -> dict[str, bool]:
    """Local search from a plan that fits: un-recompute ops, most expensive first, while the plan fits.

    Only the ``max_tries`` most expensive ops are tried: they carry nearly all the cost, and each try is a
    full evaluation of the memory model.
    """
    current = dict(start)
    expensive = sorted((op for op, on in current.items() if on), key=lambda op: -problem.cost[op])[:max_tries]
    for op in expensive:
        current[op] = False
        if predicted_peak(problem, current) > budget:
            current[op] = True
    return current


def best_under(problem: Problem, budget: int, work: int = 400_000) -> dict[str, bool] | None:
    """Multi-start local search: :func:`descend` from the cheapest fitting segment plans — as many starts
    as ``work`` allows (evaluations × problem size: a count, not a clock, so the result is reproducible)
    — and the cheapest result. None when no segment plan fits."""
    fitting = [r for r, peak, cost in sorted(scored_candidates(problem), key=lambda s: s[2]) if peak <= budget]
    per_start = min(160, len(problem.recomputable)) * (problem.num_positions + len(problem.activations))
    starts = max(1, min(6, work // max(1, per_start)))
    best = None
    for start in fitting[:starts]:
        plan = descend(problem, budget, start)
        if best is None or extra_cost(problem, plan) < extra_cost(problem, best):
            best = plan
    return best
