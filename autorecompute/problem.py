"""The planning problem as pure data: no FX node, no tensor — names and integers.

A :class:`Problem` is what the solvers see. It is built from a profiled graph by
:func:`autorecompute.passes.build_problem.build_problem`, or by hand in tests.

Timeline: positions ``0 .. num_forward-1`` are the forward ops in order, then one position per backward
event (the backward of an op, in the order autograd ran them). ``fixed[p]`` is the memory at ``p`` that no
decision changes (parameters, inputs, gradients, activations during their forward life, temporaries),
calibrated so that the all-keep plan reproduces the measured peak at every position.

Decisions: ``r[op] = 1`` puts op in a recomputed region (regions are maximal runs of consecutive recomputed
ops in ``chain`` order; a region runs again in backward only up to the last op that saves a tensor for
backward — ``torch.utils.checkpoint`` stops its recomputation there — see :attr:`Problem.saves`);
``stash[activation] = action`` takes an activation that autograd holds off the
device (``"offload"``) or keeps it smaller (``"compress:<dtype>"``) between forward and backward, one of
its :class:`StashOption`; see docs/design-notes.md for the memory rules.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

GRADIENT = "grad:"     # prefix of the parameter gradients among the activations (offloadable, see build_problem)


@dataclass(frozen=True)
class Activation:
    """A tensor created in forward whose lifetime after forward the plan decides.

    Attributes:
        name: tensor name (for people).
        owner: chain op that allocates it.
        nbytes: size.
        hold_start: first position after its last forward use.
        savers: ops whose backward saved it (kept by autograd while any of them is kept).
        readers: chain ops that read it in forward (a recomputed reader's region holds it as an input).
        save_end: last position any saver needs it (a backward position), or -1 without savers.
        read_end: last position a recomputed reader's region may hold it.
        saver_ends: for each saver, its backward position: autograd holds the tensor to the latest backward
            of its *kept* savers (a recomputed saver's region makes its own copy; empty: ``save_end`` for each).
    """

    name: str
    owner: str
    nbytes: int
    hold_start: int
    savers: tuple[str, ...]
    readers: tuple[str, ...]
    save_end: int
    read_end: int
    saver_ends: tuple[int, ...] = ()

    def saver_end(self, i: int) -> int:
        """The backward position of ``savers[i]``: where it stops holding this tensor."""
        return self.saver_ends[i] if self.saver_ends else self.save_end


@dataclass(frozen=True)
class StashOption:
    """One way to hold an activation between forward and backward other than keeping it on the device.

    Chosen for activation ``a``, it replaces ``a``'s held interval ``[hold_start, save_end]`` by
    ``stored_bytes`` on the device over ``[stored_from, save_end]`` (a compressed copy; 0 for offload) and
    the full ``a.nbytes`` over ``[restored_from, save_end]`` (prefetched or decompressed for backward).
    Valid only while a kept saver holds ``a`` and no recomputed region holds it as an input, the ops in
    ``needs_kept`` are kept and the activations in ``needs_unstashed`` are not stashed.

    Attributes:
        action: the name of an :class:`~autorecompute.decisions.Action` (the problem is names and integers;
            the solvers compare names and never parse them, ``Action.parse`` does where a kind is needed):
            ``"offload"``, ``"offload:late"`` (no prefetch), ``"compress:<dtype>"``,
            ``"rematerialize"`` (dropped after forward, recomputed by its op from held inputs when backward
            first needs it), ``"rematerialize:through"`` (the same from the model's inputs and parameters,
            making the saved tensors on the way again as temporaries), or ``"rematerialize:chain"`` (the
            same through a chain of ops back past other saved tensors, which it makes again too:
            ``delivers``).
        stored_bytes: device bytes of the stored copy.
        stored_from: position where the stored copy is made (the first saver's forward).
        restored_from: position from which the full tensor is back on the device.
        cost: extra cost, in ``Problem.cost`` units (exposed transfer time, casts, a lossiness penalty,
            the op run again).
        needs_kept: ops that must not be recomputed (a rematerialized tensor's op, and the savers that
            keep its inputs on the device until its last use).
        needs_unstashed: activations that must stay on the device (a rematerialized tensor's inputs).
        recipe: the ops a rematerialization runs again, in graph order (its own op last).
        delivers: saved activations the recipe makes on its way (``"rematerialize:chain"``): dropped after
            forward too, and back on the device from ``restored_from`` to their own ``save_end``. Valid only
            while no other choice stashes them, a kept saver holds them and no region holds them as inputs.
        transient_bytes: device bytes the recipe's temporaries add at ``restored_from`` while it runs: their
            peak besides its result, less what that backward event allocates after it unpacks its saved
            tensors (``"rematerialize:through"``, which makes saved tensors again on its way without
            handing them over). A scaled compress codec's decoding temporaries, likewise.
        packing_bytes: device bytes a compress codec's encoding temporaries add at ``stored_from`` while it
            runs (:meth:`Codec.transient_bytes`).
    """

    action: str
    stored_bytes: int
    stored_from: int
    restored_from: int
    cost: int
    needs_kept: tuple[str, ...] = ()
    needs_unstashed: tuple[str, ...] = ()
    recipe: tuple[str, ...] = ()
    delivers: tuple[str, ...] = ()
    transient_bytes: int = 0
    packing_bytes: int = 0


@dataclass(frozen=True)
class Problem:
    """Everything a solver needs; see the module docstring."""

    chain: tuple[str, ...]                       # ops in forward order (regions are runs of it)
    recomputable: frozenset[str]                 # ops the solver may recompute
    cost: dict[str, int]                         # relative cost of recomputing each op (> 0)
    flops: dict[str, int]                        # FLOPs of each op (reported as extra FLOPs)
    activations: tuple[Activation, ...]
    fixed: tuple[int, ...]                       # per position
    num_forward: int
    backward_op: dict[int, str] = field(default_factory=dict)   # backward position → op
    bytes_at_rest: dict[str, int] = field(default_factory=dict)  # resident breakdown, for reports
    region_cost: int = 0                         # overhead of one recomputed region (a checkpoint call)
    stash_options: dict[str, tuple[StashOption, ...]] = field(default_factory=dict)  # activation → options
    # op → whether its backward keeps a tensor the op makes (True: saved after it runs) or only tensors made
    # before it (False: saved before it runs); ops that keep nothing are absent. Non-reentrant checkpointing
    # stops a region's recomputation at its last save, so the ops after the region's last saver, and that
    # saver itself when False, are not run again. None: not known, every recomputed op runs again.
    saves: dict[str, bool] | None = None
    # ops a region's recomputation cannot run again to remake its inputs (memory_model.REMAKE): random ops
    # (the region replays its own RNG state, not theirs) and ops that update state
    unremakeable: frozenset[str] = frozenset()
    # ops that draw random numbers: a checkpointed region running one keeps the generator's state from its
    # forward until it frees its inputs, to replay it — ``rng_state_bytes`` of the step's memory (the CPU
    # generator's state on a CPU step; 0 where that state lives outside the device, as CUDA's host copy does)
    random_ops: frozenset[str] = frozenset()
    rng_state_bytes: int = 0
    # groups of ops that play one part in repeated blocks (the first matmul of each transformer layer's
    # attention): the local searches also change a group at once, since on a model of equal layers one layer
    # changed alone cannot lower a peak every layer reaches
    repeats: tuple[tuple[str, ...], ...] = ()
    # the ops of each repeated block of the outermost stacks (a transformer's layers; an encoder's and a
    # decoder's are two stacks), in chain order: per-block checkpointing's regions
    blocks: tuple[tuple[str, ...], ...] = ()
    forward_position: dict[str, int] = field(default_factory=dict)   # chain op → its forward position

    @cached_property
    def backward_positions(self) -> dict[str, int]:
        """op → its (last) backward position (from ``backward_op``)."""
        positions: dict[str, int] = {}
        for position, op in self.backward_op.items():
            positions[op] = max(positions.get(op, -1), position)
        return positions

    @cached_property
    def indexed(self) -> Indexed:
        """The problem by chain indices, which the memory model reads for every decision set."""
        return _indexed(self)

    def derived(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` once for this problem, kept on it under ``key`` (a solver's facts of it)."""
        memo = self.__dict__.setdefault("_derived", {})
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    @property
    def num_positions(self) -> int:
        return len(self.fixed)

    def index(self) -> dict[str, int]:
        """Chain position of each op."""
        return {op: i for i, op in enumerate(self.chain)}

    def stash_option(self, activation: str, action: str | None) -> StashOption | None:
        """The option ``action`` of ``activation``, or None when it has no such option."""
        for option in self.stash_options.get(activation, ()):
            if option.action == action:
                return option
        return None

    def min_saver(self, activation: Activation) -> str | None:
        """The saver whose backward runs last (earliest in the chain): the recomputed copy lives until then."""
        index = self.index()
        in_chain = [s for s in activation.savers if s in index]
        return min(in_chain, key=index.__getitem__) if in_chain else None


@dataclass(frozen=True)
class Indexed:
    """What the memory model looks up for every decision set, once per problem: chain indices, not names.

    Per activation (in ``problem.activations`` order): its owner's chain index (-1: not in the chain), its
    readers' and its earliest saver's (-1: none), each saver's ``(chain index or -1, backward position)``,
    ``read_end`` and whether it can be stashed at all. Per chain op: whether it is recomputable and, for an
    op that saves, its backward position (-1 otherwise). Per position: the chain index of its backward op.
    Per owner: the activations it owns."""

    index: dict[str, int]
    by_name: dict[str, int]
    owner: tuple[int, ...]
    readers: tuple[tuple[int, ...], ...]
    savers: tuple[tuple[tuple[int, int], ...], ...]
    first_saver: tuple[int, ...]
    read_end: tuple[int, ...]
    stashable: tuple[bool, ...]
    recomputable: tuple[bool, ...]
    saving_end: tuple[int, ...]
    backward_chain: tuple[int, ...]
    owned: dict[str, list]


def _indexed(problem: "Problem") -> Indexed:
    index = problem.index()
    backward = problem.backward_positions
    acts = problem.activations
    owned: dict[str, list] = {}
    for act in acts:
        owned.setdefault(act.owner, []).append(act)
    savers = tuple(tuple((index.get(s, -1), act.saver_end(k)) for k, s in enumerate(act.savers)) for act in acts)
    return Indexed(
        index=index,
        by_name={act.name: i for i, act in enumerate(acts)},
        owner=tuple(index.get(act.owner, -1) for act in acts),
        readers=tuple(tuple(index[c] for c in act.readers if c in index) for act in acts),
        savers=savers,
        first_saver=tuple(min((k for k, _ in pairs if k >= 0), default=-1) for pairs in savers),
        read_end=tuple(act.read_end for act in acts),
        stashable=tuple(bool(act.savers) and act.save_end >= act.hold_start for act in acts),
        recomputable=tuple(op in problem.recomputable for op in problem.chain),
        saving_end=tuple(backward.get(op, problem.num_positions - 1)
                         if problem.saves is not None and op in problem.saves else -1 for op in problem.chain),
        backward_chain=tuple(index.get(problem.backward_op.get(p), -1) for p in range(problem.num_positions)),
        owned=owned)
