"""Repeated layers of a plan folded into one, for people reading the plan of a deep model.

Layers are found from module paths, not class names: ``transformer.h.3.attn.c_attn`` is op ``attn.c_attn`` of
layer 3 of ``transformer.h``. Layers of one container with the same ops (the same sub-module, op kind, shape
and dtype, in the same order) fold into one :class:`Fold`; where their decisions differ, the fold lists
the layers that differ op by op.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Union

from autorecompute.fates import NOTHING_HELD

Row = dict[str, Any]
_NUMBERED = re.compile(r"(_\d+)+$")


def op_kind(name: str) -> str:
    """A node name without the number FX gives its repeats: ``layer_norm_3`` → ``layer_norm``."""
    return _NUMBERED.sub("", name) or name


def fate_label(row: Row) -> str:
    """What happens to a row's held bytes, in the plan's words ("offloaded", "recomputed + offloaded")."""
    return " + ".join(row.get("fates", ())) or NOTHING_HELD


def shows(row: Row) -> bool:
    """Whether a row is worth a line by default: it holds something for backward or is recomputed (views and
    temporaries that hold nothing are behind a toggle)."""
    return bool(row.get("fates"))


def layer_of(module: str) -> tuple[str, int, str] | None:
    """(container, index, path inside the layer) of a module path's first numbered part:
    ``layer_of("transformer.h.3.attn") == ("transformer.h", 3, "attn")``; None when it has none."""
    parts = module.split(".") if module else []
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:k]), int(part), ".".join(parts[k + 1:])
    return None


def index_ranges(indices: list[int], most: int = 6) -> str:
    """``[0, 1, 2, 5]`` → "0–2, 5"; an arithmetic run of steps over 1 → "1, 3, …, 47"."""
    indices = sorted(indices)
    if len(indices) >= 4:
        step = indices[1] - indices[0]
        if step > 1 and all(b - a == step for a, b in zip(indices, indices[1:])):
            return f"{indices[0]}, {indices[1]}, …, {indices[-1]}"
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    text = [f"{run[0]}–{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs]
    return ", ".join(text if len(text) <= most else text[:most - 1] + ["…", text[-1]])


@dataclass(frozen=True)
class Position:
    """One op of a folded layer: its rows in every layer and the decision most of them share."""

    inner: str                  # its module inside the layer ("" for the layer's own ops)
    kind: str                   # op kind (node name without FX's number)
    rows: tuple[Row, ...]       # one per layer, in the fold's order
    indices: tuple[int, ...]

    @cached_property
    def usual(self) -> Row:
        """The row of the first layer that has the commonest action (the first layer's on a tie)."""
        counts = Counter(row["action"] for row in self.rows)
        best = max(counts.values())
        return next(row for row in self.rows if counts[row["action"]] == best)

    def differences(self) -> dict[str, list[int]]:
        """Fate label → the layers whose action is not the usual one (the action itself where only its way
        differs: "rematerialize:chain")."""
        other: dict[str, list[int]] = defaultdict(list)
        usual = fate_label(self.usual)
        for index, row in zip(self.indices, self.rows):
            if row["action"] != self.usual["action"]:
                other[fate_label(row) if fate_label(row) != usual else row["action"]].append(index)
        return dict(other)

    def shows(self) -> bool:
        return any(shows(row) for row in self.rows)


@dataclass(frozen=True)
class Fold:
    """Layers ``indices`` of ``container``, alike op for op; ``layers`` their rows in graph order."""

    container: str
    indices: tuple[int, ...]
    layers: tuple[tuple[Row, ...], ...]

    @property
    def label(self) -> str:
        span = index_ranges(list(self.indices))
        return f"{self.container}.{span}" if self.container else span

    @cached_property
    def positions(self) -> list[Position]:
        first = self.layers[0]
        return [Position(layer_of(row["module"])[2], op_kind(row["name"]), tuple(layer[k] for layer in self.layers),
                         self.indices) for k, row in enumerate(first)]

    def differing(self) -> list[Position]:
        return [p for p in self.positions if p.differences()]

    def held_bytes(self) -> int:
        """Bytes one layer holds for backward (all alike)."""
        return sum(row["held_bytes"] for row in self.layers[0])

    def headline(self) -> str:
        """"12 layers alike, 67 ops each: the same decisions in every layer" (or where they differ)."""
        differ = self.differing()
        same = "the same decisions in every layer" if not differ else \
            f"decisions differ between layers in {len(differ)} of the {len(self.positions)} ops"
        return f"{len(self.indices)} layers alike, {len(self.positions)} ops each: {same}"


Item = Union[Row, Fold]


def _structure(rows: list[Row]) -> tuple:
    return tuple((layer_of(r["module"])[2], op_kind(r["name"]), tuple(r["shape"]), r["dtype"]) for r in rows)


def fold_layers(rows: list[Row]) -> list[Item]:
    """``rows`` in graph order, each run of alike layers (two or more, of two ops or more) replaced by one
    :class:`Fold` where its first layer begins."""
    layers: dict[tuple[str, int], list[Row]] = defaultdict(list)
    for row in rows:
        where = layer_of(row["module"])
        if where:
            layers[where[:2]].append(row)
    alike: dict[tuple, list[int]] = defaultdict(list)
    for (container, index), members in layers.items():
        alike[(container, _structure(members))].append(index)
    folds: dict[tuple[str, int], Fold] = {}
    for (container, _), indices in alike.items():
        if len(indices) >= 2 and len(layers[(container, indices[0])]) >= 2:
            fold = Fold(container, tuple(indices), tuple(tuple(layers[(container, i)]) for i in indices))
            folds.update({(container, i): fold for i in indices})
    items: list[Item] = []
    placed: set[int] = set()
    for row in rows:
        where = layer_of(row["module"])
        fold = folds.get(where[:2]) if where else None
        if fold is None:
            items.append(row)
        elif id(fold) not in placed:
            placed.add(id(fold))
            items.append(fold)
    return items
