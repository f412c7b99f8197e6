"""Segment heuristic: √N-style checkpoints placed by bytes, scored with the memory model.

Splits the chain into ``k`` segments of about equal held bytes; each segment's last op is kept (the
checkpoint), the rest recomputed. Tries every ``k``, each alone and with every held activation stashed
(offloaded or compressed, where the problem allows it), and returns the best plan for the goal; a local
search then undoes the most expensive decisions while the plan fits. Used as the CP-SAT hint, and as the
fallback when the solver finds nothing in time.

A plan here is a pair ``(recompute, stash)``: op → bool and activation → stash action.
"""
from __future__ import annotations

import random
from typing import Callable, Collection

from autorecompute.decisions import Move, MoveKind, Op
from autorecompute.memory_model import (NEW_REGION, REMAKE, effective_stash, extra_cost, held_at, memory_timeline,
                                         predicted_peak, rerun_ops)
from autorecompute.problem import Problem

SearchPlan = tuple[dict[str, Op | bool], dict[str, str]]    # (op → decision, activation → stash action name)


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


def device_bytes(act, option) -> int:
    """Byte-positions ``act`` occupies on the device between forward and backward when stashed by ``option``."""
    return (option.stored_bytes * (act.save_end - option.stored_from + 1)
            + act.nbytes * (act.save_end - option.restored_from + 1) + option.transient_bytes + option.packing_bytes)


def stash_all(problem: Problem, recompute: dict[str, bool], prefer: str = "memory",
              only: str | None = None) -> dict[str, str]:
    """Every held activation stashed: the way that leaves the fewest bytes on the device over time
    (``prefer="memory"``), or the cheapest way (``prefer="cost"``); only with action ``only`` if given.
    A rematerialization whose inputs end up stashed falls back to the activation's next best way."""
    ranked: dict[str, list] = {}
    for act in problem.activations:
        # chain rematerializations are left to CP-SAT: what they deliver would need its choices undone here
        options = [o for o in problem.stash_options.get(act.name, ())
                   if not o.delivers and (only is None or o.action == only)]
        if options:
            def key(o, act=act):
                return (device_bytes(act, o), o.cost) if prefer == "memory" else (o.cost, device_bytes(act, o))
            ranked[act.name] = sorted(options, key=key)
    choices = {name: options[0] for name, options in ranked.items()}
    for name, options in ranked.items():
        if any(n in choices for n in choices[name].needs_unstashed):
            fallback = [o for o in options if not o.needs_unstashed]
            if fallback:
                choices[name] = fallback[0]
            else:
                del choices[name]
    return effective_stash(problem, recompute, {name: o.action for name, o in choices.items()})


def stash_chains(problem: Problem, recompute: dict[str, bool], only: Collection[str] | None = None) \
        -> dict[str, str]:
    """Chain rematerializations, the latest activations first, each where nothing it delivers or reads is
    taken yet; then every other held activation its least-memory single-op way where that undoes no chain.
    On a Linear + activation stack this keeps one linear output in two (each chain reads the one before).
    With ``only``, those of the activations named there (:func:`effective_stash`'s ``only``)."""
    return effective_stash(problem, recompute, problem.derived("greedy.stash_chains", lambda: _chains(problem)),
                           only)


def _chains(problem: Problem) -> dict[str, str]:
    """:func:`stash_chains`' choices before the decisions drop those that cannot take effect: the same for
    every plan of a problem."""
    taken: set[str] = set()      # stashed, or delivered by a chain
    pinned: set[str] = set()     # read by a chosen recipe: stays on the device
    choices: dict[str, str] = {}
    later_first = sorted(problem.activations, key=lambda a: a.hold_start, reverse=True)
    for act in later_first:
        for option in problem.stash_options.get(act.name, ()):
            touched = {act.name, *option.delivers}
            if option.delivers and not touched & (taken | pinned) and not set(option.needs_unstashed) & taken:
                choices[act.name] = option.action
                taken |= touched
                pinned |= set(option.needs_unstashed)
                break
    for act in later_first:
        if act.name in taken or act.name in pinned:
            continue
        options = [o for o in problem.stash_options.get(act.name, ())
                   if not o.delivers and not set(o.needs_unstashed) & taken]
        if options:
            option = min(options, key=lambda o: (device_bytes(act, o), o.cost))
            choices[act.name] = option.action
            taken.add(act.name)
            pinned |= set(option.needs_unstashed)
    return choices


def span_plans(problem: Problem, max_cuts: int = 24, max_segments: int = 3) -> list[dict[str, bool]]:
    """√N-style plans over part of the chain, as ``checkpoint_sequential`` does over a prefix: the ops
    between two articulation points (cuts every path goes through) in 1 to ``max_segments`` regions, the
    rest kept. Few regions: cheap in calls, and in memory where the span's activations dominate."""
    from autorecompute.solvers.segment_plans import articulation_ops

    cuts = articulation_ops(problem)
    if len(cuts) > max_cuts:       # evenly spaced ones: the candidates stay O(max_cuts²)
        cuts = [cuts[round(i * (len(cuts) - 1) / (max_cuts - 1))] for i in range(max_cuts)]
    index = problem.index()
    plans = []
    for a in range(len(cuts)):
        for b in range(a + 1, len(cuts)):
            inside = [op for op in problem.chain[index[cuts[a]] + 1:index[cuts[b]]] if op in problem.recomputable]
            if not inside:
                continue
            for k in range(1, min(max_segments, len(inside)) + 1):
                # k regions of about equal length, split by keeping the last op of each
                kept = {inside[len(inside) * j // k - 1] for j in range(1, k)}
                plan = {op: False for op in problem.recomputable}
                plan.update({op: op not in kept for op in inside})
                plans.append(plan)
    return plans


def candidates(problem: Problem, max_segments: int = 64) -> list[SearchPlan]:
    keep_all = {op: False for op in problem.recomputable}
    n = max(1, min(max_segments, len(problem.recomputable)))
    plans = [keep_all] + [segment_plan(problem, k) for k in range(1, n + 1)]
    ways = [("memory", None), ("cost", None)]
    if any(o.action == "rematerialize" for options in problem.stash_options.values() for o in options):
        ways.append(("cost", "rematerialize"))
    with_stash = [(r, stash_all(problem, r, prefer, only)) for r in plans for prefer, only in ways
                  ] if problem.stash_options else []
    if any(o.delivers for options in problem.stash_options.values() for o in options):
        with_stash += [(r, stash_chains(problem, r)) for r in plans]
    return [(r, {}) for r in plans + span_plans(problem)] + [(r, s) for r, s in with_stash if s]


def scored_candidates(problem: Problem) -> list[tuple[SearchPlan, int, int]]:
    """``(plan, predicted peak, cost)`` of every candidate, computed once per problem."""
    return problem.derived("greedy.scored_candidates", lambda: [
        ((r, s), predicted_peak(problem, r, s), extra_cost(problem, r, s)) for r, s in candidates(problem)])


def lowest_peak(problem: Problem) -> SearchPlan:
    """The candidate with the lowest predicted peak (then least cost)."""
    return min(scored_candidates(problem), key=lambda s: (s[1], s[2]))[0]


def lowest_start(problem: Problem) -> SearchPlan:
    """The minimum-peak search's start: :func:`lowest_peak`, naive √N over articulation points
    (:func:`segment_plans.sqrt_n_plan`, every number of checkpoints) or per-block checkpointing
    (:func:`segment_plans.per_block_plan`), whichever is lowest in the model (ties: the segment plan). A checkpoint
    at an articulation point is the one tensor everything after it depends on, where one placed by bytes alone
    (:func:`segment_plan`) can leave a region's other inputs held and end higher: with naive √N among the
    starts, no budget it meets is refused. Per-block checkpointing is what Hugging Face's
    ``gradient_checkpointing_enable()`` does: on a GPT-2 the search from it ends well below where it ends from
    any √N or segment start. Only the start: as candidates of every search they move CP-SAT's later stages
    elsewhere."""
    from autorecompute.solvers.segment_plans import articulation_ops, per_block_plan, sqrt_n_plan

    cuts = articulation_ops(problem)
    articulated = [(sqrt_n_plan(problem, k, cuts), {}) for k in range(1, min(64, len(cuts)) + 1)]
    per_block = per_block_plan(problem)
    blocks = [(per_block, {})] if per_block is not None else []
    return min((lowest_peak(problem), *articulated, *blocks),
               key=lambda d: (predicted_peak(problem, *d), extra_cost(problem, *d)))


def lower_peak(problem: Problem, start: SearchPlan, work: int = 8_000_000, near: int = 4096,
               seed: int = 0) -> SearchPlan:
    """Local search for a lower peak from ``start``: one decision changed at a time (an op recomputed or
    kept, an activation's stash action set or dropped), each change kept when it lowers the peak — or,
    at the same peak, the number of positions within ``near`` bytes of it, so that a flat top can be taken
    down one position at a time — until a pass over every decision changes nothing, or ``work``
    (evaluations × problem size: a count, not a clock, so the result is reproducible) is spent.

    CP-SAT's minimum-peak search on a long chain can stop where a single change lowers the peak, and more
    CP-SAT time from the same start need not find it.

    Where no single change helps, an iterated local search spends up to an eighth of ``work`` (or stops
    after ``STALE_KICKS`` kicks in a row find nothing lower): a kick
    toggles ``KICK_OPS`` consecutive ops at a (seeded) random place, a descent over the decisions within
    ``KICK_WINDOW`` ops of it follows, and the result is kept when it is lower; a last descent over every
    decision ends it. From a short CP-SAT solve's plan, which no single change lowers, the kicks reach the plan
    a solve several times as long finds. With region cuts, a cut moved by one op (``shift``) is a move of its
    own: it can lower a minimum where no pair of changes among one layer's decisions does.

    Example: ``h`` is held through the bump at position 3, where nothing reads it; made again by its op
    when backward first needs it (position 4), it is not there, and the peak falls from 160 to 110 bytes.

        >>> from autorecompute.memory_model import predicted_peak
        >>> from autorecompute.problem import Activation, Problem, StashOption
        >>> act = Activation("h", owner="fc", nbytes=100, hold_start=2, savers=("act",), readers=("act",),
        ...                  save_end=4, read_end=4)
        >>> again = StashOption("rematerialize", stored_bytes=0, stored_from=2, restored_from=4, cost=1,
        ...                     needs_kept=("fc",))
        >>> problem = Problem(chain=("fc", "act", "out"), recomputable=frozenset({"fc"}),
        ...                   cost={"fc": 1, "act": 1, "out": 1}, flops={}, activations=(act,),
        ...                   fixed=(10, 10, 10, 60, 10, 10), num_forward=3, stash_options={"h": (again,)})
        >>> start = ({"fc": False}, {})
        >>> lowered = lower_peak(problem, start)
        >>> lowered, predicted_peak(problem, *start), predicted_peak(problem, *lowered)
        (({'fc': False}, {'h': 'rematerialize'}), 160, 110)
    """
    recompute, stash = dict(start[0]), dict(start[1])
    chain = [op for op in problem.chain if op in problem.recomputable]
    owner = {act.name: act.owner for act in problem.activations}
    everything = _moves(problem, owner) + _group_moves(problem)   # (a kick's descent: moves near it only)
    total = max(1, work // (problem.num_positions + len(problem.activations)))
    best, used = _descend(problem, recompute, stash, everything, total, near)
    spare = min(total - used, total // 8)
    rng = random.Random(seed)
    kicked, stale = False, 0
    while spare > 0 and len(chain) > KICK_OPS and stale < STALE_KICKS:
        at = rng.randrange(len(chain) - KICK_OPS + 1)
        trial, trial_stash = dict(recompute), dict(stash)
        for op in chain[at:at + KICK_OPS]:
            trial[op] = not trial.get(op, False)
        window = set(chain[max(0, at - KICK_WINDOW):at + KICK_OPS + KICK_WINDOW])
        found, spent = _descend(problem, trial, trial_stash, _moves(problem, owner, window), spare, near)
        spare, used = spare - spent, used + spent
        stale += 1
        if found < best:
            recompute, stash, best, kicked, stale = trial, trial_stash, found, True, 0
    if kicked:      # the kicks' descents changed decisions near them only
        _descend(problem, recompute, stash, everything, max(1, total - used), near)
    return recompute, effective_stash(problem, recompute, stash)


KICK_OPS = 3        # ops an iterated local search toggles at once, to leave a local minimum
KICK_WINDOW = 12    # ops on either side of a kick whose decisions the descent after it may change
STALE_KICKS = 48    # kicks in a row that find nothing lower end the search


def _moves(problem: Problem, owner: dict[str, str], within: set[str] | None = None) -> list[Move]:
    """The single changes of ``lower_peak``, among ops in ``within`` (None: all): ``Move(TOGGLE, op)``
    toggles it, ``Move(REGION, op)`` recomputes it starting a region (or, when it does, in the region
    before it), ``Move(SHIFT, op, other)`` moves the cut before ``op`` to before its neighbour ``other``,
    ``Move(REMAKE, op)`` starts a region at it that makes its inputs from the region before again
    (:data:`~autorecompute.memory_model.REMAKE`; or, when it does, one that holds them), ``Move(STASH, name,
    action)`` sets a stash action of an activation those ops own (None: drops it)."""
    moves = [Move(MoveKind.TOGGLE, op) for op in sorted(problem.recomputable) if within is None or op in within]
    # recompute in a region of its own (or rejoin the region before): where the op before can be recomputed
    pairs = [(before, op) for before, op in zip(problem.chain, problem.chain[1:])
             if op in problem.recomputable and before in problem.recomputable and (within is None or op in within)]
    moves += [Move(MoveKind.REGION, op) for _, op in pairs]
    # a cut moved by one op, both ways (a pair of changes neither of which lowers the peak alone: on Llama the
    # cut before the MLP's norm scale, moved after it, makes the scaled input the MLP region's one input)
    moves += [Move(MoveKind.SHIFT, before, op) for before, op in pairs]
    moves += [Move(MoveKind.SHIFT, op, before) for before, op in pairs]
    # a region that makes its inputs from the region before again (on Llama the first layer's attention,
    # cut at the query projection: its norm and embedding are not held through softmax's backward)
    moves += [Move(MoveKind.REMAKE, op) for _, op in pairs]
    moves += [Move(MoveKind.STASH, name, action) for name, options in sorted(problem.stash_options.items())
              if within is None or owner.get(name) in within
              for action in (*(o.action for o in options), None)]
    return moves


def _group_moves(problem: Problem) -> list[Move]:
    """``Move(GROUP, ops, decision)``: each op of a group of ``Problem.repeats`` — one op of every repeated
    block — decided alike, at once. Where every layer reaches the peak, no change to one layer lowers it: a
    GPT's attention and MLP split into regions of their own lower its peak only in every layer at once (in
    some of the layers, they raise it)."""
    return [Move(MoveKind.GROUP, ops, decision) for ops in problem.repeats for decision in (True, NEW_REGION, REMAKE, False)]


def _descend(problem: Problem, recompute: dict[str, bool], stash: dict[str, str], moves: list[Move],
             tries: int, near: int) -> tuple[tuple[int, int], int]:
    """Applies each of ``moves`` that lowers the score (peak, positions within ``near`` of it), in passes,
    until a pass changes nothing or ``tries`` evaluations are spent. Changes ``recompute`` and ``stash`` in
    place; returns the score and the evaluations spent."""
    def score() -> tuple[int, int]:
        timeline = memory_timeline(problem, recompute, stash)   # (it keeps the choices that take effect)
        top = max(timeline)
        return top, sum(1 for v in timeline if v > top - near)

    best, used, changed = score(), 0, True
    while changed and used < tries:
        changed = False
        for kind, name, value in moves:
            if used >= tries:
                break
            undo = _apply(recompute, stash, kind, name, value)
            if undo is None:
                continue
            used += 1
            now = score()
            if now < best:
                best, changed = now, True
            else:
                undo()
    return best, used


def _set(table: dict, name: str, value) -> None:
    """``table[name] = value``; None removes it."""
    if value is None:
        table.pop(name, None)
    else:
        table[name] = value


def cheapest_under(problem: Problem, budget: int) -> SearchPlan | None:
    """The cheapest candidate whose predicted peak fits ``budget``, or None."""
    fitting = [s for s in scored_candidates(problem) if s[1] <= budget]
    return min(fitting, key=lambda s: s[2])[0] if fitting else None


def descend(problem: Problem, budget: int, start: SearchPlan, max_tries: int = 160) -> SearchPlan:
    """Local search from a plan that fits: un-recompute ops and un-stash activations, most expensive first,
    while the plan fits.

    Only the ``max_tries`` most expensive decisions are tried: they carry nearly all the cost, and each try
    is a full evaluation of the memory model.
    """
    recompute, stash = dict(start[0]), dict(start[1])
    moves = [(problem.cost[op], "recompute", op) for op, on in recompute.items() if on]
    moves += [(problem.stash_option(name, action).cost, "stash", name) for name, action in stash.items()]
    for _, kind, name in sorted(moves, key=lambda m: (-m[0], m[1], m[2]))[:max_tries]:
        if kind == "recompute":
            recompute[name], was = False, recompute[name]     # (True, or NEW_REGION)
            if predicted_peak(problem, recompute, stash) > budget:
                recompute[name] = was
        else:
            action = stash.pop(name)
            if predicted_peak(problem, recompute, stash) > budget:
                stash[name] = action
    return recompute, effective_stash(problem, recompute, stash)


def lower_cost(problem: Problem, budget: int, start: SearchPlan, work: int = 2_000_000,
               window: int = KICK_WINDOW) -> SearchPlan:
    """Local search for a cheaper plan under ``budget`` from one that fits, in passes over what the plan pays
    for, the dearest first: an op run again (kept) and a stash choice (dropped, the tensor held on the device).
    A pass undoes the first of them the plan still fits without, at a lower cost (as :func:`descend` does),
    or, where none is, the first that fits again at a lower cost with one change near where undoing it goes
    over the budget (an op toggled, a region cut placed or moved, a stash action set or dropped); passes run
    until one changes nothing with every stash choice taking effect, or ``work`` (evaluations × problem size: a
    count, not a clock) is spent. The single undos come first because each costs one evaluation where a pair
    costs many.

    CP-SAT's cost solve on a long chain can stop where such a pair lowers the cost (a middle layer's query
    projection kept, the first layer's MLP norm scale recomputed to make room for it), and more CP-SAT time
    from there need not find it; a plan a layer menu offloads with room to spare holds tensors it need not
    offload. After each change the search starts again from the dearest.

    Example: four ops, each 100-B output saved by the next. Under 200 B, recomputing op1 and op2 fits at a
    cost of 6; keeping op2 alone goes over, and fits with op0 recomputed instead: a cost of 3.

        >>> from autorecompute.memory_model import extra_cost, predicted_peak
        >>> from autorecompute.problem import Activation, Problem
        >>> ops = ("op0", "op1", "op2", "op3")
        >>> acts = tuple(Activation(f"t{i}", owner=ops[i], nbytes=100, hold_start=i + 2, savers=(ops[i + 1],),
        ...                         readers=(ops[i + 1],), save_end=6 - i, read_end=6 - i) for i in range(3))
        >>> problem = Problem(chain=ops, recomputable=frozenset(ops[:3]), cost=dict(zip(ops, (2, 1, 5, 1))),
        ...                   flops={}, activations=acts, fixed=(0,) * 8, num_forward=4,
        ...                   backward_op={7 - i: op for i, op in enumerate(ops)})
        >>> start = ({"op0": False, "op1": True, "op2": True}, {})
        >>> cheaper = lower_cost(problem, 200, start)
        >>> cheaper[0], extra_cost(problem, *start), extra_cost(problem, *cheaper), predicted_peak(problem, *cheaper)
        ({'op0': True, 'op1': True, 'op2': False}, 6, 3, 200)
    """
    recompute, stash = dict(start[0]), dict(start[1])
    owner = {act.name: act.owner for act in problem.activations}
    index = problem.index()
    tries = max(1, work // (problem.num_positions + len(problem.activations)))
    cost = extra_cost(problem, recompute, stash)
    while tries > 0:
        paid = _dearest_paid(problem, recompute, stash, owner, index)
        now, tries = _first_cheaper_fit(problem, budget, recompute, stash, paid, cost, tries)    # alone
        if now is None:
            now, tries = _first_undo_with_room(problem, budget, recompute, stash, paid, cost, tries, owner, index,
                                               window)
        if now is not None:
            cost = now
            continue
        effective = effective_stash(problem, recompute, stash)
        if stash == effective:
            break
        # once more over the choices that take effect alone: dropping one may bring in another it shut out (a
        # rematerialization that needs it on the device), where dropping both saves
        stash = dict(effective)
    return recompute, effective_stash(problem, recompute, stash)


def _first_undo_with_room(problem: Problem, budget: int, recompute: dict, stash: dict, paid: list[Move],
                          cost: int, tries: int, owner: dict[str, str], index: dict[str, int],
                          window: int) -> tuple[int | None, int]:
    """Makes the first of ``paid`` that, going over ``budget``, fits again with one change near where it goes
    over at less than ``cost`` (both in place): (that cost, or None when none does, and the tries left)."""
    for move in paid:
        if tries <= 0:
            break
        undo = _apply(recompute, stash, *move)
        if undo is None:
            continue
        timeline = memory_timeline(problem, recompute, stash)   # (it keeps the choices that take effect)
        tries -= 1
        over = [p for p, v in enumerate(timeline) if v > budget]
        if over:
            moves = _moves_making_room(problem, recompute, stash, timeline, over, owner, index, window)
            now, tries = _first_cheaper_fit(problem, budget, recompute, stash, moves, cost, tries)
            if now is not None:
                return now, tries
        undo()
    return None, tries


def _dearest_paid(problem: Problem, recompute: dict, stash: dict, owner: dict[str, str],
                  index: dict[str, int]) -> list[Move]:
    """What a plan pays for, dearest first, as the move that stops paying: each op run again kept (a TOGGLE)
    and each stash choice that takes effect dropped (a STASH to None: the tensor held on the device). Ties in
    the order of the chain (what no op of it owns, a parameter's gradient, last), a stash choice before an op,
    then by name."""
    ops = [(problem.cost[op], index[op], Move(MoveKind.TOGGLE, op))
           for op in set(rerun_ops(problem, recompute)) if problem.cost.get(op)]
    stashed = [(problem.stash_option(name, action).cost, index.get(owner.get(name), len(index)),
                Move(MoveKind.STASH, name, None))
               for name, action in effective_stash(problem, recompute, stash).items()]
    paid = [entry for entry in ops + stashed if entry[0]]
    return [move for _, _, move in sorted(paid, key=lambda e: (-e[0], e[1], e[2].kind.value, e[2].name))]


def _moves_making_room(problem: Problem, recompute: dict, stash: dict, timeline: list[int], over: list[int],
                       owner: dict[str, str], index: dict[str, int], window: int) -> list[Move]:
    """The changes that may bring a plan over the budget back under it: first those of the owners of what is
    held at the highest position over it (often far back in the chain: an output held through it), then
    those of the ops near each backward op where the plan goes over."""
    held = held_at(problem, recompute, max(over, key=timeline.__getitem__), stash)
    near = set()
    for position in over:
        at = index.get(problem.backward_op.get(position, ""), -1)
        if at >= 0:
            near.update(problem.chain[max(0, at - window):at + window + 1])
    return _moves(problem, owner, held) + _moves(problem, owner, near - held)


def _first_cheaper_fit(problem: Problem, budget: int, recompute: dict, stash: dict, moves: list[Move], cost: int,
                       tries: int) -> tuple[int | None, int]:
    """Makes the first of ``moves`` after which the plan fits ``budget`` at less than ``cost`` (in place):
    (its cost, or None when none does, and the tries left)."""
    for kind, name, value in moves:
        if tries <= 0:
            break
        undo = _apply(recompute, stash, kind, name, value)
        if undo is None:
            continue
        tries -= 1
        if predicted_peak(problem, recompute, stash) <= budget \
                and (now := extra_cost(problem, recompute, stash)) < cost:
            return now, tries
        undo()
    return None, tries


def _apply(recompute: dict, stash: dict, kind: MoveKind, name, value) -> Callable[[], None] | None:
    """Makes the change ``(kind, name, value)`` of :func:`_moves` in place and returns what undoes it; None
    where it does not apply (a shift of a cut that is not there, a stash action already set)."""
    if kind is MoveKind.GROUP:      # every op of ``name`` decided ``value``
        previous = {op: recompute.get(op) for op in name}
        if all(recompute.get(op, False) == value for op in name):
            return None
        recompute.update(dict.fromkeys(name, value))

        def restore() -> None:
            for op, decision in previous.items():
                _set(recompute, op, decision)
        return restore
    if kind is MoveKind.SHIFT:      # the cut before ``name`` moved to before ``value``
        cut = recompute.get(name)
        if cut not in (NEW_REGION, REMAKE) or recompute.get(value) != Op.RECOMPUTE:
            return None
        recompute[name], recompute[value] = True, cut

        def undo() -> None:
            recompute[name], recompute[value] = cut, True
        return undo
    table = stash if kind is MoveKind.STASH else recompute
    if kind is MoveKind.TOGGLE:
        value = not recompute.get(name, False)
    elif kind is MoveKind.REGION:
        value = True if recompute.get(name) == NEW_REGION else NEW_REGION
    elif kind is MoveKind.REMAKE:
        value = NEW_REGION if recompute.get(name) == REMAKE else REMAKE
    elif stash.get(name) == value:
        return None
    previous = table.get(name)
    _set(table, name, value)
    return lambda: _set(table, name, previous)


def best_under(problem: Problem, budget: int, work: int = 400_000) -> SearchPlan | None:
    """Multi-start local search: :func:`descend` from the cheapest fitting candidates — as many starts
    as ``work`` allows (evaluations × problem size: a count, not a clock, so the result is reproducible)
    — and the cheapest result. None when no candidate fits."""
    fitting = [plan for plan, peak, cost in sorted(scored_candidates(problem), key=lambda s: s[2]) if peak <= budget]
    moves = min(160, len(problem.recomputable) + len(problem.stash_options))
    per_start = moves * (problem.num_positions + len(problem.activations))
    starts = max(1, min(6, work // max(1, per_start)))
    best, best_cost = None, None
    for start in fitting[:starts]:
        plan = descend(problem, budget, start)
        cost = extra_cost(problem, *plan)
        if best is None or cost < best_cost:
            best, best_cost = plan, cost
    return best


def few_candidates_under(problem: Problem, budget: int) -> SearchPlan | None:
    """The cheapest of a few plans after :func:`descend`: nothing or everything recomputed, each with the
    held activations stashed by chains first (:func:`stash_chains`) or each its least-memory way; None when
    none fits. A cheap start on a restricted problem (only the ops without FLOPs recomputable), where scoring
    every candidate (:func:`best_under`) would cost as much as the solve it starts."""
    everything = {op: True for op in problem.recomputable}
    fitting = [(r, stash) for r in ({}, everything) for stash in (stash_chains(problem, r), stash_all(problem, r))
               if predicted_peak(problem, r, stash) <= budget]
    descended = [descend(problem, budget, plan) for plan in fitting]
    return min(descended, key=lambda plan: extra_cost(problem, *plan), default=None)
