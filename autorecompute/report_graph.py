"""The graph of a plan by module, as nested HTML boxes: no Graphviz, no script, as wide as the page.

Each module is a ``<details>`` box in forward order: a bar splits what it holds for backward by fate, and it
opens to its sub-modules and its ops; an arrow between two boxes carries the bytes one passes the next,
other inputs are named in the box. Alike layers are one box (:class:`~autorecompute.report_fold.Fold`), its
bar the bytes of all of them. Boxes open, breadth first, as far as a screen holds.
"""
from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autorecompute.budget import format_bytes
from autorecompute.fates import NOTHING_HELD, fate, is_action, plural
from autorecompute.report import FATE_COLORS
from autorecompute.report_fold import Fold, Position, fate_label, index_ranges, shows

if TYPE_CHECKING:
    from autorecompute.plan import Plan

OPEN_BUDGET = 22        # boxes and lines of ops shown before a reader opens anything


def chip(label: str, word: str, title: str = "", extra: str = "") -> str:
    """A label on its fate's colour (``word``: one of FATES, NOTHING_HELD or an action; a mix takes its first
    word)."""
    first = word.split(" + ")[0]
    if first not in FATE_COLORS:
        first = fate(first) if is_action(first) else NOTHING_HELD
    return (f"<span class='chip {extra}' style='background:{FATE_COLORS[first]}'"
            + (f" title='{html.escape(title, quote=True)}'" if title else "") + f">{html.escape(label)}</span>")


def fate_bar(held_by: dict[str, int]) -> str:
    """Bytes by fate as a bar of proportional, coloured parts."""
    total = sum(held_by.values())
    if not total:
        return "<span class='bar' title='holds nothing for backward'></span>"
    parts = "".join(f"<span style='width:{100 * n / total:.2f}%;background:{FATE_COLORS[word]}' "
                    f"title='{word} {format_bytes(n)}'></span>" for word, n in held_by.items() if n)
    return f"<span class='bar'>{parts}</span>"


@dataclass
class Box:
    name: str
    path: tuple[str, ...]
    held_by: Counter = field(default_factory=Counter)
    entries: list = field(default_factory=list)        # ("box", Box) or ("op", row, Position | None)
    ops: int = 0              # in a fold: ops of one layer
    shown: int = 0            # ops in it that hold something or are recomputed
    layers: int = 1           # the folded layers it stands for
    fold: Fold | None = None

    def child(self, part: str) -> "Box":
        for entry in self.entries:
            if entry[0] == "box" and entry[1].path[len(self.path)] == part:
                return entry[1]
        box = Box(part, self.path + (part,))
        self.entries.append(("box", box))
        return box

    def boxes(self) -> list["Box"]:
        return [entry[1] for entry in self.entries if entry[0] == "box"]

    def shown_ops(self) -> int:
        return sum(1 for entry in self.entries if entry[0] == "op" and _shows(entry))


def _shows(entry: tuple) -> bool:
    return entry[2].shows() if entry[2] is not None else shows(entry[1])


def _parts(path: str) -> tuple[str, ...]:
    return tuple(part for part in path.split(".") if part)


def build_tree(items: list) -> tuple[Box, dict[str, tuple[str, ...]]]:
    """The module tree of a folded table (:func:`~autorecompute.report_fold.fold_layers`), and each op's box
    path (every layer of a fold's ops in the fold's box)."""
    root, where = Box("", ()), {}
    for item in items:
        if not isinstance(item, Fold):
            where[item["name"]] = _add(root, _parts(item["module"]), item, None, item["held_by"])
            continue
        base = tuple(item.label.split("."))
        _walk(root, base).fold = item
        for position in item.positions:
            held = Counter()
            for row in position.rows:
                held.update(row["held_by"])
            path = _add(root, base + _parts(position.inner), position.usual, position, held, len(base))
            where.update({row["name"]: path for row in position.rows})
    return _merge_chains(root), where


def _walk(root: Box, path: tuple[str, ...]) -> Box:
    box = root
    for part in path:
        box = box.child(part)
    return box


def _add(root: Box, path: tuple[str, ...], row: dict, position: Position | None, held: dict,
         fold_depth: int = 0) -> tuple[str, ...]:
    """Adds an op (a folded one: ``position``, its box ``fold_depth`` parts down the path) under ``path``."""
    box, visible = root, position.shows() if position else shows(row)
    for depth in range(len(path) + 1):
        box.held_by.update(held)
        folded = position is not None and depth >= fold_depth
        box.ops += 1 if folded or position is None else len(position.rows)
        box.shown += visible
        box.layers = len(position.rows) if folded else 1
        if depth < len(path):
            box = box.child(path[depth])
    box.entries.append(("op", row, position))
    return path


def _merge_chains(box: Box) -> Box:
    """A box holding one box and no op is that box, named by both (``transformer.h``)."""
    for k, entry in enumerate(box.entries):
        if entry[0] == "box":
            box.entries[k] = ("box", _merge_chains(entry[1]))
    inner = box.boxes()
    if box.path and len(box.entries) == 1 and inner and box.fold is None:
        child = inner[0]
        child.name = f"{box.name}.{child.name}"
        return child
    return box


def _edges(plan: "Plan", where: dict[str, tuple[str, ...]]) -> dict[tuple, int]:
    """(parent path, from child, to child) → bytes, for edges between sibling boxes."""
    edges: Counter = Counter()
    for src, dst, nbytes in plan.edges:
        a, b = where.get(src), where.get(dst)
        if a is None or b is None:
            continue
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        if k < len(a) and k < len(b):
            edges[(a[:k], a[k], b[k])] += nbytes
    return edges


def _opened(root: Box) -> set[int]:
    """Boxes open at first, breadth first while the page shows at most OPEN_BUDGET boxes and lines of ops."""
    shown, opened, queue = len(root.boxes()) + 1, set(), list(root.boxes())
    while queue:
        box = queue.pop(0)
        if not box.shown:
            continue
        cost = len(box.boxes()) + (box.shown_ops() + 5) // 6
        if shown + cost <= OPEN_BUDGET:
            opened.add(id(box))
            shown += cost
            queue += box.boxes()
    return opened


def module_graph(plan: "Plan", items: list) -> str:
    """The HTML of the graph by module (see the module's docstring)."""
    root, where = build_tree(items)
    return _entries(root, _edges(plan, where), _opened(root))


def _entries(box: Box, edges: dict, opened: set[int]) -> str:
    out, ops, previous = [], [], None
    for entry in box.entries + [("end",)]:
        if entry[0] == "op":
            ops.append(entry)
            continue
        if ops:
            out.append("<div class='ops'>" + "".join(_op_chip(op) for op in ops) + "</div>")
            ops = []
        if entry[0] == "box":
            child = entry[1]
            key = child.path[len(box.path)]
            passed = edges.get((box.path, previous, key)) if previous else None
            if passed:
                out.append(f"<div class='arrow'>↓ {format_bytes(passed / box.layers)}"
                           + (" a layer" if box.layers > 1 else "") + "</div>")
            others = [(src, n / box.layers) for (parent, src, dst), n in edges.items()
                      if parent == box.path and dst == key and src != previous]
            out.append(_box(child, others, edges, opened))
            previous = key
    return "".join(out)


def _box(box: Box, others: list, edges: dict, opened: set[int]) -> str:
    held = format_bytes(sum(box.held_by.values()))
    meta = [plural(box.ops, "op") + (" a layer" if box.layers > 1 else ""),
            f"{held} held for backward" + (f" by the {box.layers} layers" if box.layers > 1 else "")]
    if box.fold is not None:
        meta = [box.fold.headline(), meta[1]]
    inputs = ", ".join(f"{src} ({format_bytes(n)})" for src, n in others)
    order = {"recomputed": 0, "rematerialized": 1, "offloaded": 2, "compressed": 3, "kept": 4}
    bar = dict(sorted(box.held_by.items(), key=lambda item: order.get(item[0], 5)))
    return (f"<details class='box'{' open' if id(box) in opened else ''}><summary><b>{html.escape(box.name)}</b>"
            f"{fate_bar(bar)}<span class='meta'>{html.escape(' · '.join(meta))}"
            + (f" · also reads {html.escape(inputs)}" if inputs else "") + "</span></summary>"
            f"<div class='kids'>{_entries(box, edges, opened)}</div></details>")


def _op_chip(entry: tuple) -> str:
    row, position = entry[1], entry[2]
    name = position.kind if position else row["name"]
    title = f"{row['name']}: {row['why']}"
    mark = ""
    if position is not None and position.differences():
        mark = " *"
        title += "; " + "; ".join(f"{word} in layers {index_ranges(indices)}"
                                  for word, indices in position.differences().items())
    held = f" {format_bytes(row['held_bytes'])}" if row["held_bytes"] else ""
    idle = "" if _shows(entry) else " idle"
    return chip(f"{name}{held}{mark}", fate_label(row), title, extra=f"op{idle}")
