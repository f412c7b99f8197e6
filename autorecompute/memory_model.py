"""The memory model: the predicted memory at every position of the step for a set of decisions.

This is the simulator the CP-SAT model encodes (``solvers/cpsat.py`` must agree with it exactly; a test
checks both on every assignment of small problems). Regions are the maximal runs of recomputed ops in
``problem.chain``. For an activation ``t`` owned by op ``o``:

* ``t`` is *held by autograd* after its last forward use while a saver of ``t`` is not recomputed, until
  the latest backward of its kept savers (``saver_end``; a recomputed saver's region makes its own copy);
* ``t`` is *held as a region input* when a recomputed reader of ``t`` lies in another region than ``o``
  (or ``o`` is kept): the checkpoint keeps its inputs until the region's backward is done (``read_end``,
  at least ``save_end``);
* held, it is on the device from ``hold_start`` to the latest end of what holds it;
* when ``o``'s region is recomputed in backward, ``t`` is materialized again and lives until its earliest
  saver's backward: at the backward of op ``j`` it counts iff ``o`` and ``j`` are in one region and the
  earliest saver of ``t`` is at or before ``j`` in the chain;
* when ``t`` is stashed (``stash[t.name]`` names one of its :class:`~autorecompute.problem.StashOption`),
  is held by a kept saver and by no region, its held interval ``[hold_start, save_end]`` is replaced by
  the stored copy over ``[stored_from, save_end]`` and the restored tensor over ``[restored_from,
  save_end]``; a stash choice that is not valid for the decisions (see :func:`stash_valid`) has no effect
  (and no cost);
* a chain rematerialization of ``t`` (``"rematerialize:chain"``) also replaces the held interval of each
  activation ``d`` it delivers by ``[t's restored_from, d.save_end]`` (see :func:`effective_stash`);
* a rematerialization from the model's inputs (``"rematerialize:through"``) adds its recipe's temporaries
  (``transient_bytes``) at ``restored_from``, while it runs; a scaled compress codec its decoding's there and
  its encoding's (``packing_bytes``) at ``stored_from``.
* a region that makes its inputs from the region before it again (:func:`remakes`) does not hold what
  that region's ops own, holds that region's inputs, makes the tensors it saves among them again with its
  own (alive from its earliest saver of them to its end), and adds the remaking's tensors while it runs
  where its recomputation starts (the backward of its last op that saves).
"""
from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from itertools import repeat
from typing import Collection, Mapping, NamedTuple

import numpy as np

from autorecompute.decisions import Action, Op, Rewrite, Stashed
from autorecompute.problem import Indexed, Problem

NEW_REGION = Op.NEW_REGION   # recompute the op, in a region of its own from it on (see region_ids)
REMAKE = Op.REMAKE           # the same, and the region makes its inputs from the region before it again (remakes)


def region_ids(problem: Problem, recompute: Mapping[str, bool | str]) -> list[int]:
    """For each chain position, the id of its recomputed region, or -1 when the op is kept.

    A region is a run of recomputed ops; a run is cut before an op decided :data:`NEW_REGION`, so two
    checkpoints can follow each other with no kept op between them (an MLP's first matmul recomputed in
    its own region rather than in one with the attention before it: at the MLP's backward only the MLP's
    saved tensors are made again)."""
    return _region_array(problem, recompute).tolist()


def _region_array(problem: Problem, recompute: Mapping[str, bool | str]) -> np.ndarray:
    """:func:`region_ids` as an array (the searches price thousands of plans of thousands of ops)."""
    chain = problem.chain
    if not chain:
        return np.zeros(0, dtype=np.int64)
    decisions = np.fromiter(map(recompute.get, chain, repeat(0)), dtype=np.int64, count=len(chain))
    on = _arrays(problem).recomputable & (decisions != 0)
    starts = on & (np.concatenate(([True], ~on[:-1])) | (decisions >= NEW_REGION))
    return np.where(on, np.cumsum(starts) - 1, -1)


class _Arrays(NamedTuple):
    """Per chain op, as arrays: whether it is recomputable, whether it saves a tensor (``problem.saves``) and
    one of its own, its backward position if it saves (``Indexed.saving_end``; -1 otherwise), its recompute
    cost."""

    recomputable: np.ndarray
    saves: np.ndarray
    saves_own: np.ndarray
    saving_end: np.ndarray
    cost: np.ndarray


def _arrays(problem: Problem) -> _Arrays:
    def make() -> _Arrays:
        static, saves, chain = _static(problem), problem.saves or {}, problem.chain
        return _Arrays(recomputable=np.asarray(static.recomputable, dtype=bool),
                       saves=np.asarray([op in saves for op in chain], dtype=bool),
                       saves_own=np.asarray([bool(saves.get(op)) for op in chain], dtype=bool),
                       saving_end=np.asarray(static.saving_end, dtype=np.int64),
                       cost=np.asarray([problem.cost.get(op, 0) for op in chain], dtype=np.int64))
    return problem.derived("memory_model.arrays", make)


def _per_region(region: np.ndarray, values: np.ndarray, mask: np.ndarray, reduce, empty: int) -> np.ndarray:
    """For each region id, ``reduce`` (``np.maximum`` / ``np.minimum``) of ``values`` at its positions where
    ``mask`` holds; ``empty`` for a region with none."""
    count = int(region.max()) + 1 if len(region) else 0
    out = np.full(count, empty, dtype=np.int64)
    where = mask & (region >= 0)
    reduce.at(out, region[where], values[where])
    return out


def remakes(problem: Problem, recompute: Mapping[str, bool | str], ids: list[int] | np.ndarray) \
        -> dict[int, int]:
    """Region → the region before it, for each region that begins with an op decided :data:`REMAKE` right
    after another region none of whose ops is in ``problem.unremakeable`` and that remakes nothing itself,
    and saves a tensor for backward (else it is never recomputed).

    Such a region does not hold the inputs the region before it makes: when it is recomputed in backward it
    first runs the ops of the region before that make them again (without autograd, from that region's
    inputs, which that region's checkpoint holds anyway) and drops them once it has run. A region that
    recomputes q and k for softmax's backward then leaves the normalized input and the projections they are
    made from to be made again later, for their own backward, instead of holding them through it.
    """
    found: dict[int, int] = {}
    region = np.asarray(ids, dtype=np.int64)
    # (a region begins right after another only where the ids step by one between neighbours)
    for k in (np.nonzero((region[1:] > 0) & (region[:-1] == region[1:] - 1))[0] + 1).tolist():
        if recompute.get(problem.chain[k]) == REMAKE:
            found[int(region[k])] = int(region[k - 1])
    if not found:
        return found
    ids = region.tolist()
    unremakeable = {ids[k] for k, op in enumerate(problem.chain) if op in problem.unremakeable and ids[k] >= 0}
    # a region that saves nothing is never recomputed: it would hold the region before's inputs for nothing
    saving = set(found) if problem.saves is None else {
        ids[k] for k, op in enumerate(problem.chain) if op in problem.saves and ids[k] >= 0}
    # not from a region that remakes its own inputs: those are among the inputs this one would hold
    return {later: earlier for later, earlier in found.items()
            if earlier not in unremakeable and later in saving and earlier not in found}


def remade_ops(problem: Problem, ids: list[int], made: Mapping[int, int]) -> dict[int, list[str]]:
    """For each region in ``made`` (:func:`remakes`), the ops of the region before it that its recomputation
    runs again: those that make what it reads, and the ops they read from, within that region."""
    if not made:
        return {}
    index = _static(problem).index
    owned = _static(problem).owned
    found = {}
    for later, earlier in made.items():
        members = [op for op, r in zip(problem.chain, ids) if r == earlier]
        needed: set[str] = set()
        for op in reversed(members):     # readers come after what they read
            if any(r in needed or (r in index and ids[index[r]] == later)
                   for act in owned.get(op, ()) for r in act.readers):
                needed.add(op)
        found[later] = [op for op in members if op in needed]
    return found


def rerun_ops(problem: Problem, recompute: Mapping[str, bool]) -> list[str]:
    """The recomputed ops that run again in backward, in chain order, then the ops regions run again to
    remake their inputs (:func:`remakes`: those run a third time when their own region runs again too).

    Non-reentrant ``torch.utils.checkpoint`` stops recomputing a region once every tensor the region saved
    in forward is saved again (its early stop): the ops after the region's last saver never run again, and
    neither does that saver when it keeps only tensors made before it (inputs are saved before an op runs).
    A region ending in a matmul whose input the region makes therefore costs nothing for the matmul.
    """
    ids = region_ids(problem, recompute)
    return _rerun(problem, ids, remakes(problem, recompute, ids))


def _rerun(problem: Problem, ids: list[int], made: Mapping[int, int] | None = None) -> list[str]:
    """:func:`rerun_ops` from the chain's region ids (:func:`region_ids`) and :func:`remakes`."""
    remade = [op for ops in remade_ops(problem, ids, made or {}).values() for op in ops]
    return [problem.chain[k] for k in np.nonzero(_rerun_mask(problem, np.asarray(ids, dtype=np.int64)))[0]] + remade


def _rerun_mask(problem: Problem, region: np.ndarray) -> np.ndarray:
    """Per chain op, whether its region runs it again (:func:`rerun_ops`, without the remade ops): every op of
    a region before its last op that saves, and that op where it keeps a tensor of its own."""
    if problem.saves is None:
        return region >= 0
    arrays = _arrays(problem)
    positions = np.arange(len(region))
    last_saver = _per_region(region, positions, arrays.saves, np.maximum, -1)
    end = np.where(region >= 0, last_saver[np.maximum(region, 0)] if len(last_saver) else -1, -1)
    return (region >= 0) & ((positions < end) | ((positions == end) & arrays.saves_own))


@dataclass(frozen=True)
class Timeline:
    """Predicted bytes per position, split by what decides them.

    ``fixed``: no decision changes it (resident state, gradients, activations in their forward life,
    temporaries); ``held``: activations kept after their last forward use (by autograd or as region
    inputs); ``recomputed``: activations rematerialized in backward; ``stashed``: compressed copies and
    offloaded or compressed activations restored for backward.
    ``total = fixed + held + recomputed + stashed``.
    """

    fixed: tuple[int, ...]
    held: tuple[int, ...]
    recomputed: tuple[int, ...]
    stashed: tuple[int, ...] = ()

    @property
    def total(self) -> list[int]:
        stashed = self.stashed or (0,) * len(self.fixed)
        return [f + h + r + s for f, h, r, s in zip(self.fixed, self.held, self.recomputed, stashed)]


Stash = Mapping[str, str]   # activation name → StashOption.action


def region_ends(problem: Problem, region: list[int] | np.ndarray) -> dict[int, int] | None:
    """For each recomputed region, the last backward position of an op in it that saves a tensor: its
    checkpoint holds its inputs until then (every saved tensor of the region refers to the checkpoint's
    frame, which refers to the inputs); a region that saves nothing holds nothing. None when
    ``problem.saves`` is not known (a region input is then held to its ``read_end``)."""
    if problem.saves is None:
        return None
    saving_end = _arrays(problem).saving_end
    ends = _per_region(np.asarray(region, dtype=np.int64), saving_end, saving_end >= 0, np.maximum, -1)
    return {r: end for r, end in enumerate(ends.tolist()) if end >= 0}


def _holders(static: Indexed, i: int, region: list[int], ends: Mapping[int, int] | None,
             made: Mapping[int, int] | None = None) -> tuple[int, bool, bool, int]:
    """``(owner's region, held as a region input, held by a kept saver, last position anything holds it)``
    of activation ``i`` (-1: nothing does); ``ends``: :func:`region_ends`; ``made``: :func:`remakes`."""
    owner = static.owner[i]
    owner_region = region[owner] if owner >= 0 else -1
    readers = static.readers[i]
    holding = {region[c] for c in readers} if readers else set()
    holding.discard(-1)
    holding.discard(owner_region)
    if made and holding:
        # a region that remakes what the region before it makes does not hold it, and holds that region's
        # inputs (it makes them from those)
        holding = {h for h in holding if made.get(h, -2) != owner_region}
        holding |= {later for later, earlier in made.items() if earlier in holding}
    input_end = -1 if not holding else static.read_end[i] if ends is None else max(ends.get(h, -1) for h in holding)
    saver_end = -1
    for saver, end in static.savers[i]:
        if (saver < 0 or region[saver] < 0) and end > saver_end:
            saver_end = end
    return owner_region, bool(holding), saver_end >= 0, max(input_end, saver_end)


def stash_valid(option, recompute: Mapping[str, bool], stashed: Collection[str]) -> bool:
    """Whether what a stash ``option`` needs holds: the ops it needs are kept and the activations it needs
    are not stashed (``stashed``: the raw choices and what they deliver). Its activation must also be
    stashable (a kept saver packs it, no region holds it as an input: see :func:`effective_stash`)."""
    return (not any(recompute.get(op) for op in option.needs_kept)
            and not any(name in stashed for name in option.needs_unstashed))


def effective_stash(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None,
                    only: Collection[str] | None = None) -> dict[str, str]:
    """The stash choices that take effect under ``recompute`` (the others are dropped). A chain
    rematerialization takes effect only when every activation it delivers could be stashed itself and is
    taken by no other choice. With ``only``, those among the choices for the activations named there: the same
    as the whole result's, in the time of as many."""
    return _regions(problem, recompute, stash, only=only)[3] if stash else {}


def effective_stashes(problem: Problem, recompute: Mapping[str, bool], stashes: list[Stash]) -> list[dict[str, str]]:
    """:func:`effective_stash` of each of ``stashes`` under one ``recompute``: its regions laid out once."""
    if not any(stashes):
        return [{} for _ in stashes]
    region, ends, made, _, _ = _regions(problem, recompute, None)
    return [_effective_stash(problem, recompute, stash, region, ends, made) for stash in stashes]


def _regions(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None, ends_needed: bool = True,
             only: Collection[str] | None = None) \
        -> tuple[list[int], dict[int, int] | None, dict[int, int], dict[str, str], np.ndarray]:
    """(:func:`region_ids`, :func:`region_ends`, :func:`remakes`, :func:`effective_stash`, the region ids as an
    array) of the decisions;
    without ``ends_needed`` the region ends only where a stash needs them (else None: the cost reads none, and
    they take a pass over the chain on the searches' hot path)."""
    ids = _region_array(problem, recompute)
    ends = region_ends(problem, ids) if ends_needed or stash else None
    made = remakes(problem, recompute, ids)
    region = ids.tolist()
    return region, ends, made, _effective_stash(problem, recompute, stash, region, ends, made, only), ids


def _effective_stash(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None, region: list[int],
                     ends: Mapping[int, int] | None, made: Mapping[int, int],
                     only: Collection[str] | None = None, taken: Mapping[str, int] | None = None) -> dict[str, str]:
    """:func:`effective_stash` from the decisions' :func:`region_ids`, :func:`region_ends` and :func:`remakes`;
    ``taken``: :func:`_taken` of ``stash``, where the caller has it."""
    if not stash:
        return {}
    static = _static(problem)
    if taken is None:
        taken = _taken(problem, stash)
    stashed = taken.keys()
    # (what is taken counts every choice; only those named in ``only`` are judged)
    names = stash.keys() if only is None else [name for name in only if name in stash]
    chosen = {name: option for name in names if (option := problem.stash_option(name, stash[name])) is not None}

    def can_stash(i: int) -> bool:
        _, as_input, by_saver, _ = _holders(static, i, region, ends, made)
        return static.stashable[i] and by_saver and not as_input

    effective = {}
    for name, option in chosen.items():
        i = static.by_name.get(name)
        if i is None or not can_stash(i) or not stash_valid(option, recompute, stashed):
            continue
        if all(taken[d] == 1 and d in static.by_name and can_stash(static.by_name[d]) for d in option.delivers):
            effective[name] = stash[name]
    return effective


def _taken(problem: Problem, stash: Stash) -> dict[str, int]:
    """Activation → how many of the choices in ``stash`` take it (stash it, or deliver it)."""
    taken: dict[str, int] = {}
    for name, action in stash.items():
        for taken_name in _takes(problem, name, action):
            taken[taken_name] = taken.get(taken_name, 0) + 1
    return taken


def _takes(problem: Problem, name: str, action: str | None) -> tuple[str, ...]:
    """The activations the choice ``action`` for ``name`` takes: its own and those it delivers (none where
    ``name`` has no such option)."""
    option = problem.stash_option(name, action)
    return (name, *option.delivers) if option is not None else ()


def delivered(problem: Problem, effective: Mapping[str, str]) -> dict[str, object]:
    """Activation → the effective chain option that makes it again (``StashOption.delivers``)."""
    made_by = {}
    for name, action in effective.items():
        option = problem.stash_option(name, action)
        made_by.update({d: option for d in option.delivers})
    return made_by


class _Decided(NamedTuple):
    """What the memory model derives from one set of decisions before it sizes any activation."""

    region: list[int]
    ends: dict[int, int] | None
    made: dict[int, int]
    effective: dict[str, str]
    made_by: dict[str, object]
    region_last: list[int]       # per chain index: the last chain index of its op's region
    ids: np.ndarray              # ``region`` as an array


def _decided(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None) -> _Decided:
    return _judged(problem, recompute, stash, _laid_out(problem, recompute))


def _laid_out(problem: Problem, recompute: Mapping[str, bool]) -> _Decided:
    """The regions of the decisions, their ends and remakes, with no stash choice judged yet."""
    ids = _region_array(problem, recompute)
    return _Decided(ids.tolist(), region_ends(problem, ids), remakes(problem, recompute, ids), {}, {},
                    _region_last(ids), ids)


def _judged(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None, laid_out: _Decided) -> _Decided:
    """``laid_out`` with the choices in ``stash`` that take effect there."""
    effective = _effective_stash(problem, recompute, stash, laid_out.region, laid_out.ends, laid_out.made)
    return laid_out._replace(effective=effective, made_by=delivered(problem, effective))


def _region_last(ids: np.ndarray) -> list[int]:
    """Per chain index, the last chain index of its op's region (its own index: kept)."""
    positions = np.arange(len(ids))
    last = _per_region(ids, positions, ids >= 0, np.maximum, -1)
    return np.where(ids >= 0, last[np.maximum(ids, 0)] if len(last) else positions, positions).tolist()


def _pieces(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None = None):
    """Yields ``(activation, start, end, kind, nbytes)`` for every interval an activation occupies beyond
    its forward life: kind "held" (autograd or a region keeps it), "stashed" (its stored copy or restored
    tensor) or "recomputed" (chain indices of the ops at whose backward it is rematerialized)."""
    decided = _decided(problem, recompute, stash)
    if decided.made:
        yield from _remade_pieces(problem, decided.region, decided.made)
    yield from _rng_state_pieces(problem, decided)
    yield from _activation_pieces(problem, decided, range(len(problem.activations)))


def _rng_state_pieces(problem: Problem, decided: _Decided):
    """The generator state each region that draws random numbers keeps to replay them
    (``problem.rng_state_bytes``), a "held" piece without an activation: from the region's forward until its
    checkpoint frees its inputs (:func:`region_ends`; a region that saves nothing frees them at once)."""
    if not problem.rng_state_bytes or not problem.random_ops or decided.ends is None:
        return
    static, region = _static(problem), decided.region
    random_regions = {region[static.index[op]] for op in problem.random_ops if op in static.index}
    for first, r in enumerate(region):
        if r in random_regions and r >= 0 and (first == 0 or region[first - 1] != r) and r in decided.ends:
            start = problem.forward_position.get(problem.chain[first], first)
            yield None, start, decided.ends[r], "held", problem.rng_state_bytes


def _activation_pieces(problem: Problem, decided: _Decided, indices):
    """The :func:`_pieces` of the activations ``indices`` (into ``problem.activations``)."""
    static = _static(problem)
    region, ends, made = decided.region, decided.ends, decided.made
    for i in indices:
        act = problem.activations[i]
        owner_region, as_input, by_saver, hold_end = _holders(static, i, region, ends, made)
        action = decided.effective.get(act.name)
        option = problem.stash_option(act.name, action) if action is not None else None
        if option is not None:     # (effective: a kept saver holds it, no region does)
            yield act, option.stored_from, act.save_end, "stashed", option.stored_bytes
            yield act, option.restored_from, act.save_end, "stashed", act.nbytes
            if option.transient_bytes:   # the recipe's (the decoding's) temporaries, while it runs
                yield act, option.restored_from, option.restored_from, "stashed", option.transient_bytes
            if option.packing_bytes:     # the encoding's, in forward
                yield act, option.stored_from, option.stored_from, "stashed", option.packing_bytes
        elif act.name in decided.made_by:
            yield act, decided.made_by[act.name].restored_from, act.save_end, "stashed", act.nbytes
        elif hold_end >= act.hold_start:
            yield act, act.hold_start, hold_end, "held", act.nbytes
        first = static.first_saver[i]
        if owner_region >= 0 and first >= static.owner[i]:
            # alive at the backward of every op from the earliest saver to the end of the owner's region
            end = decided.region_last[static.owner[i]]
            if first <= end:
                yield act, first, end, "recomputed", act.nbytes


class TimelineChanges:
    """Prices changes of one base plan: ``changes.change(plan)`` is ``memory_timeline(problem, *plan)`` less
    ``memory_timeline(problem, *base)`` for ``(recompute, stash)`` plans, with :func:`extra_cost`'s change
    besides, sized from the activations the change can touch — those an op whose region differs owns, reads
    or saves, and those stashed differently — with the stash choices judged again only where the change can
    alter their effect, so the layered planner prices hundreds of one-block changes of a base in a fraction
    of as many timelines' time.

    Example:
        >>> from autorecompute.problem import Activation, Problem
        >>> act = Activation("h", owner="fc", nbytes=100, hold_start=1, savers=("act",), readers=("act",),
        ...                  save_end=3, read_end=3)
        >>> problem = Problem(chain=("fc", "act"), recomputable=frozenset({"fc", "act"}),
        ...                   cost={"fc": 1, "act": 1}, flops={}, activations=(act,), fixed=(10, 10, 10, 10),
        ...                   num_forward=2, backward_op={2: "act", 3: "fc"})
        >>> keep, both = ({"fc": False, "act": False}, {}), ({"fc": True, "act": True}, {})
        >>> memory_timeline(problem, *keep), memory_timeline(problem, *both)
        ([10, 110, 110, 110], [10, 10, 110, 10])
        >>> delta, cost = TimelineChanges(problem, keep).change(both)
        >>> delta.tolist(), cost
        ([0, -100, 0, -100], 2)
    """

    def __init__(self, problem: Problem, base: tuple):
        self.problem, self.base = problem, base
        self.before = _decided(problem, *base)
        self.base_cost = _extra_cost(problem, self.before.ids, self.before.made, self.before.effective)
        self.spans = _region_spans(self.before)
        self.before_bytes: dict[tuple[int, ...], np.ndarray] = {}
        self.before_rng = _rng_state_bytes(problem, self.before)

    def change(self, changed: tuple) -> tuple[np.ndarray, int]:
        """(the timeline's change, :func:`extra_cost`'s change)."""
        problem, before = self.problem, self.before
        after, moved = self._after(changed)
        cost = _extra_cost(problem, after.ids, after.made, after.effective) - self.base_cost
        if before.made or after.made:
            return (np.asarray(memory_timeline(problem, *changed), dtype=np.int64)
                    - np.asarray(memory_timeline(problem, *self.base), dtype=np.int64)), cost
        touched = tuple(self._touched(after, moved))
        if touched not in self.before_bytes:
            self.before_bytes[touched] = _decided_bytes(problem, before, touched)
        delta = _decided_bytes(problem, after, touched) - self.before_bytes[touched]
        if problem.rng_state_bytes and problem.random_ops:
            delta += _rng_state_bytes(problem, after) - self.before_rng
        return delta, cost

    def _after(self, changed: tuple) -> tuple[_Decided, list[int]]:
        """(``changed``'s :class:`_Decided`, the chain indices whose region differs from the base's). Its
        stash choices are judged again only where the change can make them take effect or not
        (:meth:`_affected`); the others do as in the base."""
        problem, before = self.problem, self.before
        recompute, stash = changed
        decided = _laid_out(problem, recompute)
        first, last = _region_spans(decided)
        moved = np.nonzero((first != self.spans[0]) | (last != self.spans[1]))[0].tolist()
        if decided.made or before.made or not stash:
            return _judged(problem, recompute, stash, decided), moved
        affected, taken = self._affected(recompute, stash, moved)
        judged = _effective_stash(problem, recompute, stash, decided.region, decided.ends, decided.made, affected,
                                  taken)
        effective = {name: action for name, action in before.effective.items() if name not in affected}
        made_by = dict(before.made_by)
        for name in before.effective.keys() - effective.keys():
            for gone in problem.stash_option(name, before.effective[name]).delivers:
                del made_by[gone]
        effective.update(judged)
        made_by.update(delivered(problem, judged))
        return decided._replace(effective=effective, made_by=made_by), moved

    def _affected(self, recompute: Mapping[str, bool], stash: Stash, moved: list[int]) \
            -> tuple[set[str], dict[str, int]]:
        """(the choices whose effect the change can alter, :func:`_taken` of ``stash``). Those choices: the
        ones that differ from the base's; those of an activation (or one it delivers) an op at a ``moved``
        index owns, reads or saves; those needing kept an op recomputed in one plan only; and those sharing,
        or needing unstashed, an activation a differing choice takes."""
        problem, base_recompute, base_stash, by = self.problem, self.base[0], self.base[1] or {}, self._by
        touching = _touching(problem)
        acts = {problem.activations[i].name for k in moved for i in touching[k]}
        differ = {name for name in stash.keys() | base_stash.keys() if stash.get(name) != base_stash.get(name)}
        taken, retaken = dict(by.taken), set(differ)
        for name in differ:
            for action, count in ((base_stash.get(name), -1), (stash.get(name), 1)):
                for taken_name in _takes(problem, name, action):
                    taken[taken_name] = taken.get(taken_name, 0) + count
                    retaken.add(taken_name)
        affected = set(differ)
        for name in acts | retaken:
            affected |= by.activation.get(name, set())
        for name in retaken:
            affected |= by.unstashed.get(name, set())
        for op, names in by.kept.items():
            if bool(recompute.get(op)) != bool(base_recompute.get(op)):
                affected |= names
        return affected, {name: count for name, count in taken.items() if count}

    @functools.cached_property
    def _by(self) -> _BaseChoices:
        """The base's stash choices indexed (:class:`_BaseChoices`)."""
        by_activation: dict[str, set[str]] = defaultdict(set)
        by_kept: dict[str, set[str]] = defaultdict(set)
        by_unstashed: dict[str, set[str]] = defaultdict(set)
        stash = self.base[1] or {}
        for name, action in stash.items():
            option = self.problem.stash_option(name, action)
            if option is None:
                continue
            for taken in _takes(self.problem, name, action):
                by_activation[taken].add(name)
            for op in option.needs_kept:
                by_kept[op].add(name)
            for needed in option.needs_unstashed:
                by_unstashed[needed].add(name)
        return _BaseChoices(by_activation, by_kept, by_unstashed, _taken(self.problem, stash))

    def _touched(self, after: _Decided, moved: list[int]) -> list[int]:
        before, touching = self.before, _touching(self.problem)
        names = {n for n in before.effective.keys() | after.effective.keys()
                 if before.effective.get(n) != after.effective.get(n)}
        names |= {n for n in before.made_by.keys() | after.made_by.keys()
                  if before.made_by.get(n) != after.made_by.get(n)}
        by_name = _static(self.problem).by_name
        return sorted({i for k in moved for i in touching[k]} | {by_name[n] for n in names if n in by_name})


class _BaseChoices(NamedTuple):
    """A base plan's stash choices by the activations they take (theirs and those they deliver), by the ops
    they need kept and by the activations they need unstashed; and :func:`_taken` of them."""

    activation: dict[str, set[str]]
    kept: dict[str, set[str]]
    unstashed: dict[str, set[str]]
    taken: dict[str, int]


def _region_spans(decided: _Decided) -> tuple[np.ndarray, np.ndarray]:
    """Per chain index, the first and the last chain index of its op's region (-1 and -1: kept)."""
    ids = decided.ids
    positions = np.arange(len(ids))
    first = _per_region(ids, positions, ids >= 0, np.minimum, len(ids))
    kept = ids < 0
    return (np.where(kept, -1, first[np.maximum(ids, 0)] if len(first) else -1),
            np.where(kept, -1, np.asarray(decided.region_last, dtype=np.int64)))


def _touching(problem: Problem) -> list[list[int]]:
    """Per chain index, the activations its op owns, reads or saves (whose pieces its region can change)."""
    def make() -> list[list[int]]:
        static = _static(problem)
        touching: list[list[int]] = [[] for _ in problem.chain]
        for i in range(len(problem.activations)):
            ops = {static.owner[i], *static.readers[i], *(k for k, _ in static.savers[i])}
            for k in ops - {-1}:
                touching[k].append(i)
        return touching
    return problem.derived("memory_model.touching", make)


def _decided_bytes(problem: Problem, decided: _Decided, indices) -> np.ndarray:
    """Bytes per position of the pieces of activations ``indices``: :func:`memory_components`' held,
    recomputed and stashed parts, restricted to them."""
    return sum(_accumulated(problem, _activation_pieces(problem, decided, indices)))


def _rng_state_bytes(problem: Problem, decided: _Decided) -> np.ndarray:
    """Bytes per position of the generator states the regions keep (:func:`_rng_state_pieces`)."""
    return _accumulated(problem, _rng_state_pieces(problem, decided))[0]


_KINDS = ("held", "stashed", "recomputed")


def _accumulated(problem: Problem, pieces) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(held, stashed, recomputed) bytes per position of ``pieces`` (:func:`_pieces`' tuples): a recomputed
    piece spans chain indices, counted at the backward of each (``backward_chain``)."""
    code = {kind: k for k, kind in enumerate(_KINDS)}
    rows = np.array([(code[kind], start, end + 1, nbytes) for _, start, end, kind, nbytes in pieces],
                    dtype=np.int64).reshape(-1, 4)
    positions = problem.num_positions
    summed = []
    for k, length in enumerate((positions, positions, len(problem.chain))):
        _, starts, ends, sizes = rows[rows[:, 0] == k].T
        delta = np.zeros(length + 1, dtype=np.int64)
        np.add.at(delta, starts, sizes)
        np.subtract.at(delta, ends, sizes)
        summed.append(np.cumsum(delta))
    held, stashed, by_chain = summed
    backward_chain = np.asarray(_static(problem).backward_chain, dtype=np.int64)
    return held[:positions], stashed[:positions], np.where(backward_chain >= 0, by_chain[backward_chain], 0)


def _remade_pieces(problem: Problem, region: list[int], made: Mapping[int, int]):
    """The :func:`_pieces` of regions that remake their inputs (:func:`remakes`): each input it saves, alive
    from its recomputation to its earliest saver's backward in it, and the remaking's own tensors while
    it runs, when the region's recomputation starts (at the backward of its last op that saves)."""
    remade = remade_ops(problem, region, made)
    index, owned = _static(problem).index, _static(problem).owned
    for later, earlier in made.items():
        members = [k for k, r in enumerate(region) if r == later]
        end = members[-1]
        savers = [k for k in members if problem.saves is None or problem.chain[k] in problem.saves]
        start = savers[-1] if savers else end
        ops = remade[later]
        steps = {op: i for i, op in enumerate(ops)}
        live, peak, saved, frees = 0, 0, 0, [0] * (len(ops) + 1)
        for i, op in enumerate(ops):
            for act in owned.get(op, ()):
                in_later = any(c in index and region[index[c]] == later for c in (*act.readers, *act.savers))
                last = len(ops) if in_later else max((steps[c] for c in act.readers if c in steps), default=i)
                live += act.nbytes
                frees[last] += act.nbytes
                saved_in_later = [index[s] for s in act.savers if s in index and region[index[s]] == later]
                if saved_in_later:
                    saved += act.nbytes
                    yield act, min(saved_in_later), end, "recomputed", act.nbytes
            peak = max(peak, live)
            live -= frees[i]
        # the remade inputs live on while the region runs (those it saves are counted above, from ``start``)
        yield None, start, start, "recomputed", peak - saved


def held_at(problem: Problem, recompute: Mapping[str, bool], position: int,
            stash: Stash | None = None) -> set[str]:
    """Owners of the activations held (not recomputed) at ``position``: what the peak is made of."""
    return {act.owner for act, start, end, kind, _ in _pieces(problem, recompute, stash)
            if kind == "held" and act is not None and start <= position <= end}


def memory_components(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None = None) -> Timeline:
    """The predicted memory of every position for the decisions ``recompute`` (op → bool) and ``stash``
    (activation → action), by component."""
    held, stashed, recomputed = _accumulated(problem, _pieces(problem, recompute, stash))
    return Timeline(fixed=tuple(problem.fixed), held=tuple(held.tolist()), recomputed=tuple(recomputed.tolist()),
                    stashed=tuple(stashed.tolist()))


def memory_timeline(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None = None) -> list[int]:
    """Predicted bytes at every position for the decisions ``recompute`` (op → bool) and ``stash``.

    Example:
        >>> from autorecompute.problem import Activation, Problem
        >>> act = Activation("h", owner="fc", nbytes=100, hold_start=2, savers=("act",), readers=("act",),
        ...                  save_end=3, read_end=3)
        >>> problem = Problem(chain=("fc", "act"), recomputable=frozenset({"fc"}), cost={"fc": 1, "act": 1},
        ...                   flops={}, activations=(act,), fixed=(10, 10, 10, 10), num_forward=2)
        >>> memory_timeline(problem, {"fc": False}), memory_timeline(problem, {"fc": True})
        ([10, 10, 110, 110], [10, 10, 110, 110])
    """
    return memory_components(problem, recompute, stash).total


def _static(problem: Problem) -> Indexed:
    return problem.indexed


def backward_positions(problem: Problem) -> dict[str, int]:
    """op → its (last) backward position (from ``problem.backward_op``)."""
    return problem.backward_positions


def predicted_peak(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None = None) -> int:
    """Highest predicted bytes over the step."""
    return max(memory_timeline(problem, recompute, stash))


def extra_flops(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None = None) -> int:
    """FLOPs run again in backward: recomputed regions (up to their last saver, :func:`rerun_ops`), and the
    recipes of rematerialized activations."""
    again = sum(problem.flops.get(op, 0) for op in rerun_ops(problem, recompute))
    recipes = [problem.stash_option(name, action).recipe
               for name, action in effective_stash(problem, recompute, stash).items()]
    return again + sum(problem.flops.get(op, 0) for recipe in recipes for op in recipe)


def stash_cost(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None) -> int:
    """Cost of the stash choices that take effect."""
    return _cost_of(problem, effective_stash(problem, recompute, stash))


def _cost_of(problem: Problem, effective: Stash) -> int:
    return sum(problem.stash_option(name, action).cost for name, action in effective.items())


def extra_cost(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None = None) -> int:
    """The solver's objective: the recompute cost of the ops run again (:func:`rerun_ops`), ``region_cost``
    per recomputed region, and the cost of the stash choices that take effect."""
    _, _, made, effective, ids = _regions(problem, recompute, stash, ends_needed=False)
    return _extra_cost(problem, ids, made, effective)


def _extra_cost(problem: Problem, region: np.ndarray, made: Mapping[int, int], effective: Stash) -> int:
    """:func:`extra_cost` from the decisions' :func:`region_ids` (an array), :func:`remakes` and effective
    stash."""
    remade = [op for ops in remade_ops(problem, region.tolist(), made).values() for op in ops] if made else []
    ops = int(_arrays(problem).cost[_rerun_mask(problem, region)].sum()) + sum(problem.cost[op] for op in remade)
    regions = int(region.max()) + 1 if len(region) else 0
    return ops + problem.region_cost * regions + _cost_of(problem, effective)


def rewrite_of(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None = None,
               lean_ops: tuple[str, ...] = ()) -> Rewrite:
    """What the rewrite passes need to carry out the search's decisions: an :class:`Op` per recomputable op
    as the regions take effect (a cut only where a region begins right after another, a remake only where
    :func:`remakes` allows it), and each stash choice with its prefetch event and recipe."""
    ids = region_ids(problem, recompute)
    made = remakes(problem, recompute, ids)
    ops = {}
    for k, op in enumerate(problem.chain):
        if op not in problem.recomputable:
            continue
        if ids[k] < 0:
            ops[op] = Op.KEEP
        elif k and ids[k - 1] >= 0 and ids[k] != ids[k - 1]:
            ops[op] = Op.REMAKE if recompute.get(op) == REMAKE and ids[k] in made else Op.NEW_REGION
        else:
            ops[op] = Op.RECOMPUTE
    stashed = {}
    for name, action in (stash or {}).items():
        option = problem.stash_option(name, action)
        stashed[name] = Stashed(Action.parse(action), option.restored_from - problem.num_forward, option.recipe,
                                option.delivers)
    return Rewrite(ops, stashed, tuple(lean_ops))
