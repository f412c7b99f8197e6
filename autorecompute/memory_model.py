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
  (``transient_bytes``) at ``restored_from``, while it runs.
* a region that makes its inputs from the region before it again (:func:`remakes`) does not hold what
  that region's ops own, holds that region's inputs, makes the tensors it saves among them again with its
  own (alive from its earliest saver of them to its end), and adds the remaking's tensors while it runs
  where its recomputation starts (the backward of its last op that saves).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from autorecompute.problem import Problem


NEW_REGION = "new region"   # a decision: recompute the op, in a region of its own from it on (see region_ids)
REMAKE = "remake inputs"    # the same, and the region makes its inputs from the region before it again (see remakes)


def region_ids(problem: Problem, recompute: Mapping[str, bool | str]) -> list[int]:
    """For each chain position, the id of its recomputed region, or -1 when the op is kept.

    A region is a run of recomputed ops; a run is cut before an op decided :data:`NEW_REGION`, so two
    checkpoints can follow each other with no kept op between them (an MLP's first matmul recomputed in
    its own region rather than in one with the attention before it: at the MLP's backward only the MLP's
    saved tensors are made again)."""
    ids, current, previous_on = [], -1, False
    for op in problem.chain:
        decision = recompute.get(op, False)
        on = bool(decision) and op in problem.recomputable
        if on and (not previous_on or decision in (NEW_REGION, REMAKE)):
            current += 1
        ids.append(current if on else -1)
        previous_on = on
    return ids


def remakes(problem: Problem, recompute: Mapping[str, bool | str], ids: list[int]) -> dict[int, int]:
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
    for k, op in enumerate(problem.chain):
        if k and ids[k] > 0 and ids[k - 1] == ids[k] - 1 and recompute.get(op) == REMAKE:
            found[ids[k]] = ids[k - 1]
    if not found:
        return found
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
    index = problem.index()
    owned = _owned(problem)
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
    if problem.saves is None:
        return [op for op, region in zip(problem.chain, ids) if region >= 0] + remade
    last_saver: dict[int, int] = {}
    for i, (op, region) in enumerate(zip(problem.chain, ids)):
        if region >= 0 and op in problem.saves:
            last_saver[region] = i
    rerun = []
    for i, (op, region) in enumerate(zip(problem.chain, ids)):
        end = last_saver.get(region, -1) if region >= 0 else -1
        if i < end or (i == end and problem.saves[op]):
            rerun.append(op)
    return rerun + remade


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


def region_ends(problem: Problem, region: list[int]) -> dict[int, int] | None:
    """For each recomputed region, the last backward position of an op in it that saves a tensor: its
    checkpoint holds its inputs until then (every saved tensor of the region refers to the checkpoint's
    frame, which refers to the inputs); a region that saves nothing holds nothing. None when
    ``problem.saves`` is not known (a region input is then held to its ``read_end``)."""
    if problem.saves is None:
        return None
    backward = backward_positions(problem)
    ends: dict[int, int] = {}
    for op, r in zip(problem.chain, region):
        if r >= 0 and op in problem.saves:
            ends[r] = max(ends.get(r, -1), backward.get(op, problem.num_positions - 1))
    return ends


def _holders(act, region: list[int], index: Mapping[str, int], ends: Mapping[int, int] | None,
             made: Mapping[int, int] | None = None) -> tuple[int, bool, bool, int]:
    """``(owner's region, held as a region input, held by a kept saver, last position anything holds it)``
    of ``act`` (-1: nothing does); ``ends``: :func:`region_ends`; ``made``: :func:`remakes`."""
    owner_region = region[index[act.owner]] if act.owner in index else -1
    holding = {region[index[c]] for c in act.readers if c in index} - {-1, owner_region}
    if made:
        # a region that remakes what the region before it makes does not hold it, and holds that region's
        # inputs (it makes them from those)
        holding = {h for h in holding if made.get(h, -2) != owner_region}
        holding |= {later for later, earlier in made.items() if earlier in holding}
    input_end = -1 if not holding else act.read_end if ends is None else max(ends.get(h, -1) for h in holding)
    saver_end = max((act.saver_end(i) for i, s in enumerate(act.savers)
                     if s not in index or region[index[s]] < 0), default=-1)
    return owner_region, bool(holding), saver_end >= 0, max(input_end, saver_end)


def stash_valid(option, recompute: Mapping[str, bool], stashed: Stash | set[str]) -> bool:
    """Whether what a stash ``option`` needs holds: the ops it needs are kept and the activations it needs
    are not stashed (``stashed``: the raw choices and what they deliver). Its activation must also be
    stashable (a kept saver packs it, no region holds it as an input: see :func:`effective_stash`)."""
    return (not any(recompute.get(op) for op in option.needs_kept)
            and not any(name in stashed for name in option.needs_unstashed))


def effective_stash(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None) -> dict[str, str]:
    """The stash choices that take effect under ``recompute`` (the others are dropped). A chain
    rematerialization takes effect only when every activation it delivers could be stashed itself and is
    taken by no other choice."""
    if not stash:
        return {}
    index = problem.index()
    region = region_ids(problem, recompute)
    ends = region_ends(problem, region)
    made = remakes(problem, recompute, region)
    by_name = {act.name: act for act in problem.activations}
    chosen = {name: option for name, action in stash.items()
              if (option := problem.stash_option(name, action)) is not None}
    taken: dict[str, int] = {}
    for name, option in chosen.items():
        for taken_name in (name, *option.delivers):
            taken[taken_name] = taken.get(taken_name, 0) + 1
    stashed = set(taken)

    def can_stash(act) -> bool:
        _, as_input, by_saver, _ = _holders(act, region, index, ends, made)
        return bool(act.savers) and act.save_end >= act.hold_start and by_saver and not as_input

    effective = {}
    for name, option in chosen.items():
        act = by_name.get(name)
        if act is None or not can_stash(act) or not stash_valid(option, recompute, stashed):
            continue
        if all(taken[d] == 1 and d in by_name and can_stash(by_name[d]) for d in option.delivers):
            effective[name] = stash[name]
    return effective


def delivered(problem: Problem, effective: Mapping[str, str]) -> dict[str, object]:
    """Activation → the effective chain option that makes it again (``StashOption.delivers``)."""
    made_by = {}
    for name, action in effective.items():
        option = problem.stash_option(name, action)
        made_by.update({d: option for d in option.delivers})
    return made_by


def _pieces(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None = None):
    """Yields ``(activation, start, end, kind, nbytes)`` for every interval an activation occupies beyond
    its forward life: kind "held" (autograd or a region keeps it), "stashed" (its stored copy or restored
    tensor) or "recomputed" (chain indices of the ops at whose backward it is rematerialized)."""
    index = problem.index()
    first_saver = _first_savers(problem, index)
    region = region_ids(problem, recompute)
    ends = region_ends(problem, region)
    effective = effective_stash(problem, recompute, stash)
    made_by = delivered(problem, effective)
    made = remakes(problem, recompute, region)
    if made:
        yield from _remade_pieces(problem, region, made, index)
    for act in problem.activations:
        owner_region, as_input, by_saver, hold_end = _holders(act, region, index, ends, made)
        option = problem.stash_option(act.name, effective.get(act.name))
        if option is not None:     # (effective: a kept saver holds it, no region does)
            yield act, option.stored_from, act.save_end, "stashed", option.stored_bytes
            yield act, option.restored_from, act.save_end, "stashed", act.nbytes
            if option.transient_bytes:   # the recipe's temporaries, while it runs
                yield act, option.restored_from, option.restored_from, "stashed", option.transient_bytes
        elif act.name in made_by:
            yield act, made_by[act.name].restored_from, act.save_end, "stashed", act.nbytes
        elif hold_end >= act.hold_start:
            yield act, act.hold_start, hold_end, "held", act.nbytes
        first = first_saver.get(act.name)
        if owner_region >= 0 and first is not None and index[first] >= index[act.owner]:
            # alive at the backward of every op from the earliest saver to the end of the owner's region
            end = index[act.owner]
            while end + 1 < len(region) and region[end + 1] == owner_region:
                end += 1
            if index[first] <= end:
                yield act, index[first], end, "recomputed", act.nbytes


def _remade_pieces(problem: Problem, region: list[int], made: Mapping[int, int], index: Mapping[str, int]):
    """The :func:`_pieces` of regions that remake their inputs (:func:`remakes`): each input it saves, alive
    from its recomputation to its earliest saver's backward in it, and the remaking's own tensors while
    it runs, when the region's recomputation starts (at the backward of its last op that saves)."""
    remade = remade_ops(problem, region, made)
    owned = _owned(problem)
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
            if kind == "held" and start <= position <= end}


def memory_components(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None = None) -> Timeline:
    """The predicted memory of every position for the decisions ``recompute`` (op → bool) and ``stash``
    (activation → action), by component."""
    index = problem.index()
    delta = [0] * (problem.num_positions + 1)
    stash_delta = [0] * (problem.num_positions + 1)
    remat_delta = [0] * (len(problem.chain) + 1)
    for act, start, end, kind, nbytes in _pieces(problem, recompute, stash):
        target = {"held": delta, "stashed": stash_delta, "recomputed": remat_delta}[kind]
        target[start] += nbytes
        target[end + 1] -= nbytes

    remat, running = [], 0
    for i in range(len(problem.chain)):
        running += remat_delta[i]
        remat.append(running)
    held, stashed, recomputed, running, running_stash = [], [], [], 0, 0
    for p in range(problem.num_positions):
        running += delta[p]
        running_stash += stash_delta[p]
        held.append(running)
        stashed.append(running_stash)
        op = problem.backward_op.get(p)
        recomputed.append(remat[index[op]] if op is not None and op in index else 0)
    return Timeline(fixed=tuple(problem.fixed), held=tuple(held), recomputed=tuple(recomputed),
                    stashed=tuple(stashed))


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


def _per_problem(cache: dict, problem: Problem, compute):
    """``compute()`` once per problem: the last problem's result is kept in ``cache``, and only it (one
    problem at a time: do not keep old graphs alive)."""
    cached = cache.get(id(problem))
    if cached is None or cached[0] is not problem:
        cache.clear()
        cached = cache[id(problem)] = (problem, compute())
    return cached[1]


def _first_savers(problem: Problem, index: Mapping[str, int]) -> dict[str, str | None]:
    def compute() -> dict[str, str | None]:
        savers = {}
        for act in problem.activations:
            in_chain = [s for s in act.savers if s in index]
            savers[act.name] = min(in_chain, key=index.__getitem__) if in_chain else None
        return savers
    return _per_problem(_FIRST_SAVERS, problem, compute)


_FIRST_SAVERS: dict[int, tuple[Problem, dict]] = {}


def _owned(problem: Problem) -> dict[str, list]:
    """op → the activations it owns."""
    def compute() -> dict[str, list]:
        owned: dict[str, list] = {}
        for act in problem.activations:
            owned.setdefault(act.owner, []).append(act)
        return owned
    return _per_problem(_OWNED, problem, compute)


_OWNED: dict[int, tuple[Problem, dict]] = {}


def backward_positions(problem: Problem) -> dict[str, int]:
    """op → its (last) backward position (from ``problem.backward_op``)."""
    def compute() -> dict[str, int]:
        positions: dict[str, int] = {}
        for position, op in problem.backward_op.items():
            positions[op] = max(positions.get(op, -1), position)
        return positions
    return _per_problem(_BACKWARD, problem, compute)


_BACKWARD: dict[int, tuple[Problem, dict]] = {}


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
    return sum(problem.stash_option(name, action).cost
               for name, action in effective_stash(problem, recompute, stash).items())


def extra_cost(problem: Problem, recompute: Mapping[str, bool], stash: Stash | None = None) -> int:
    """The solver's objective: the recompute cost of the ops run again (:func:`rerun_ops`), ``region_cost``
    per recomputed region, and the cost of the stash choices that take effect."""
    ids = region_ids(problem, recompute)
    ops = sum(problem.cost[op] for op in _rerun(problem, ids, remakes(problem, recompute, ids)))
    regions = max(ids, default=-1) + 1
    return ops + problem.region_cost * regions + stash_cost(problem, recompute, stash)
