"""Typed decisions: what the search decides per op and per activation, and what the rewrite needs of them.

One vocabulary, from the search to the rewrite:

* :class:`Op` — the decision for a recomputable op: kept, recomputed in the current region, recomputed
  beginning a region of its own (:attr:`Op.NEW_REGION`), or beginning a region that makes its inputs from the
  region before it again (:attr:`Op.REMAKE`). An ``IntEnum`` whose ``KEEP`` is falsy, so the memory model's hot
  loops read ``if decision:`` at C speed.
* :class:`Action` — what is done with an activation autograd holds, other than keeping it: offload, compress or
  rematerialize, with its variant (``offload:late``, ``compress:bfloat16``, ``rematerialize:chain``). ``str()``
  gives the name plans and JSON use.
* :class:`Rewrite` — a plan's decisions, frozen, as the rewrite passes carry them out: an Op per op with its
  region cuts as they take effect, how each stashed activation is stashed (:class:`Stashed`), the softmaxes
  kept in place. From a :class:`~autorecompute.plan.Plan` (``plan.rewrite``) or from the search's maps
  (:func:`autorecompute.memory_model.rewrite_of`), so a saved plan applies without solving.
* :class:`Move` — a change the local searches try, typed by :class:`MoveKind`.

The searches themselves work on mutable maps ``(recompute, stash)`` — op → Op (or ``True``/``False``),
activation → action name — which the memory model reads and the local searches change in place; a Rewrite is
made of the one they settle on.

Example:

    >>> from autorecompute.decisions import Action, Op, Rewrite
    >>> Action.parse("compress:bfloat16")
    Action(kind=<ActionKind.COMPRESS: 'compress'>, variant='bfloat16')
    >>> str(Action.parse("rematerialize:chain")), bool(Op.KEEP), bool(Op.REMAKE)
    ('rematerialize:chain', False, True)
    >>> plan = Rewrite({"fc1": Op.RECOMPUTE, "act": Op.RECOMPUTE, "fc2": Op.NEW_REGION, "out": Op.KEEP})
    >>> plan.words, plan.region_starts
    ({'fc1': 'recompute', 'act': 'recompute', 'fc2': 'recompute', 'out': 'keep'}, ('fc2',))
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Hashable, Mapping, NamedTuple


class Op(enum.IntEnum):
    """The decision for one recomputable op (``True`` and ``False`` compare equal to RECOMPUTE and KEEP)."""

    KEEP = 0
    RECOMPUTE = 1
    NEW_REGION = 2
    REMAKE = 3

    def __str__(self) -> str:
        return _OP_WORDS[self]

    @property
    def recomputed(self) -> bool:
        return self is not Op.KEEP

    @property
    def starts_region(self) -> bool:
        """Whether the op begins a region of its own even right after another recomputed op."""
        return self is Op.NEW_REGION or self is Op.REMAKE

    @classmethod
    def of(cls, value: bool | int | Op) -> Op:
        """The Op of a search value: ``True``/``False`` or an Op."""
        return cls(int(value))


_OP_WORDS = {Op.KEEP: "keep", Op.RECOMPUTE: "recompute", Op.NEW_REGION: "new region", Op.REMAKE: "remake inputs"}


class ActionKind(enum.Enum):
    OFFLOAD = "offload"
    COMPRESS = "compress"
    REMATERIALIZE = "rematerialize"


@dataclass(frozen=True)
class Action:
    """A way to hold an activation between forward and backward other than keeping it on the device.

    ``variant``: for offload ``"late"`` (copied back when backward needs it, no prefetch); for compress the
    dtype; for rematerialize ``"chain"`` (through ops that make other saved tensors again too) or
    ``"through"`` (from the model's inputs and parameters); empty for the plain way."""

    kind: ActionKind
    variant: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.variant}" if self.variant else self.kind.value

    @classmethod
    def parse(cls, text: str | Action) -> Action:
        """The action named ``text`` (``"offload"``, ``"offload:late"``, ``"compress:bfloat16"``, …)."""
        if isinstance(text, Action):
            return text
        kind, _, variant = str(text).partition(":")
        try:
            return cls(ActionKind(kind), variant)
        except ValueError:
            raise ValueError(f"unknown stash action {text!r}: one of offload[:late], compress:<dtype>, "
                             "rematerialize[:chain|:through]") from None

    @property
    def compress_dtype(self) -> str | None:
        return self.variant if self.kind is ActionKind.COMPRESS else None

    @property
    def exact(self) -> bool:
        """Whether the tensor backward gets is the one forward made, bit for bit."""
        return self.kind is not ActionKind.COMPRESS


@dataclass(frozen=True)
class Stashed:
    """What the rewrite needs to stash one activation: its action, the backward event from which it is
    prefetched, and for a rematerialization the ops it runs again and the saved tensors it makes on the way."""

    action: Action
    prefetch_event: int
    recipe: tuple[str, ...] = ()
    delivers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rewrite:
    """Everything the rewrite passes need to carry out a plan (:func:`autorecompute.passes.apply_plan`):
    an :class:`Op` per recomputable op, how each stashed activation is stashed, and the ops capture made lean
    that stay so (:mod:`autorecompute.passes.rewrite_lean_ops`). ``ops`` are as the rewrite carries them out: NEW_REGION only
    where a region begins right after another, REMAKE only where that region does make its inputs again."""

    ops: Mapping[str, Op]
    stash: Mapping[str, Stashed] = field(default_factory=dict)
    lean_ops: tuple[str, ...] = ()

    @property
    def words(self) -> dict[str, str]:
        """``"keep"`` or ``"recompute"`` per op: a Plan's ``decisions``."""
        return {op: "recompute" if decision else "keep" for op, decision in self.ops.items()}

    @property
    def region_starts(self) -> tuple[str, ...]:
        """Recomputed ops that begin a region right after another recomputed op."""
        return tuple(op for op, decision in self.ops.items() if decision.starts_region)

    @property
    def region_remakes(self) -> tuple[str, ...]:
        """The first ops of the regions that make their inputs from the region before them again."""
        return tuple(op for op, decision in self.ops.items() if decision is Op.REMAKE)


class MoveKind(enum.Enum):
    """The single changes the local searches (:mod:`autorecompute.solvers.greedy`) try."""

    TOGGLE = "toggle"        # an op recomputed or kept
    REGION = "region"        # an op recomputed beginning a region of its own (or, when it does, joining the one before)
    SHIFT = "shift"          # the cut before an op moved to before its neighbour
    REMAKE = "remake"        # a region that makes its inputs again begins at an op (or, when it does, one that holds them)
    STASH = "stash"          # an activation's stash action set (or dropped)
    GROUP = "group"          # one op of every repeated block decided alike, at once


class Move(NamedTuple):
    """One change: ``name`` is an op (a tuple of ops for GROUP, an activation for STASH); ``value`` the other
    op of a SHIFT, the action of a STASH (None: dropped), the decision of a GROUP."""

    kind: MoveKind
    name: Hashable
    value: object = None
