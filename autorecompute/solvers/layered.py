"""Planning by layers: a menu of decisions for one block of a stack, then one menu entry per block.

A transformer's layers (a CNN stage's blocks) are alike: the same ops on the same shapes. Their plan is
made of per-block choices — keep everything, recompute the cheap ops, checkpoint the whole block — and the
least-cost mix of choices under a peak is a small problem over the blocks, not the ops (two-level planning,
as Rockmate and torchtitan's auto_perf_maxing do). So:

1. **The stack** (:func:`find_stack`): the most numerous blocks of ``problem.blocks`` that are alike (the same
   ops at the same costs) and run one after another (forward in order, backward in reverse).
2. **The menu** (:func:`menu`): block decisions (:class:`Template`) — keep-all, the block as one region,
   one region over each stretch of it (the MLP alone, all but the output...) or over all of it but one
   stretch, the block as two or three regions one after another (its backward then holds one part's tensors
   at a time), its ops cheapest per byte recomputed wherever they are, what it holds stashed, every block's
   decisions in the plans given — and runs of blocks recomputed as one region (√N's segments).
3. **Each entry measured** on the middle blocks in the memory model (:func:`measure`): what it saves
   while the blocks wait for their backward, the memory at their own forward and backward positions, its
   cost. Entries another beats at each of their own positions go; what is left of single blocks is tried
   again with its held tensors stashed, the cheapest per byte first. What a block saves depends on the plan
   outside the stack (a first region that begins with the embeddings', tables every layer reads held or
   made again), so what is left is measured again on each base plan; the DP of each base reads the entries
   no other beats at the peaks it reads (:func:`_own_peaks`).
4. **One entry per block** by dynamic programming over the blocks in forward order (:func:`choose`), the
   state being the bytes saved by the blocks before: the backward of block ``j`` happens while blocks
   ``0..j-1`` hold what they keep, so a block's peak is its own positions' memory less those savings.
5. **Checked in full**: the chosen plan's peak in the memory model; the DP runs again under a budget tighter by
   the overshoot where the blocks' interactions make it exceed the budget.

The result is a plan in the search's maps, which the search verifies and polishes like any other.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from autorecompute.decisions import Op
from autorecompute.memory_model import (TimelineChanges, effective_stashes, extra_cost, memory_timeline,
                                         predicted_peak)
from autorecompute.problem import Problem
from autorecompute.solvers.greedy import lowest_start as greedy_lowest_start, stash_all, stash_chains
from autorecompute.solvers.segment_plans import per_block_plan

SearchPlan = tuple[dict, dict]        # (op → Op or bool, activation → stash action), as greedy.SearchPlan
MIN_BLOCKS = 4                        # fewer alike blocks are planned whole
SAVING_STEPS = 16384                  # the DP's resolution in saved bytes over the whole stack
NEVER = np.iinfo(np.int64).max // 4   # the DP's cost of a state not reached
MAX_TIGHTENINGS = 4
# a template's stash variants: its first k ranked tensors stashed, for every k up to this many (k spread evenly
# over a block holding more): a block's share of the budget lands between counts, so coarse steps offload
# more than it needs or leave it to recomputation; each step is one entry more per template to measure
STASH_STEPS = 8
SELECTIVE_FRACTIONS = (0.25, 0.5, 0.75, 0.9, 1.0)
REGION_GRID = 14                      # a block's regions in the menu begin and end at one of this many points
MAX_WIDTH = 8                         # the most blocks one region of the menu spans
LOWEST_MARGINS = (0.0, 0.005, 0.01, 0.02, 0.05)   # above the DP's least peak, where the full check tries it


@dataclass(frozen=True)
class Stack:
    """Alike blocks, in chain order: their ops; the activations their ops own, by slot (the owner's position
    in the block, the activation's among the owner's), a slot of one block being the same tensor's in every
    other (where it is an activation: the last block's output may be the graph's); and each block's first and
    last forward position and first and last backward position."""

    blocks: tuple[tuple[str, ...], ...]
    activations: tuple[dict[tuple[int, int], str], ...]
    forward: tuple[tuple[int, int], ...]
    backward: tuple[tuple[int, int], ...]
    op_forward: tuple[tuple[int, ...], ...] = ()         # each block's ops' forward positions
    op_backward: tuple[tuple[int, ...], ...] = ()        # ... and backward positions (-1: none)

    @property
    def middle(self) -> int:
        return len(self.blocks) // 2

    def position_maps(self, j: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """For each forward and backward position of the segment of ``width`` blocks from block ``j``, the
        index of the position its entry was measured at: the same op's in the measured blocks plus the offset
        from it (a block may run an op of the model's own besides its ops: the rotary tables Llama makes in its
        first layer). Computed once per segment."""
        maps = self.__dict__.setdefault("_maps", {})
        if (j, width) not in maps:
            at = _measured_at(self, width)
            (fa, fb), (ba, bb) = _own_spans(self, j, width)
            (ma, mb), (na, nb) = _own_spans(self, at, width)
            forward = _aligned(range(fa, fb + 1), [(self.op_forward[j + k], self.op_forward[at + k])
                                                   for k in range(width)]) - ma
            backward = _aligned(range(ba, bb + 1), [(self.op_backward[j + k], self.op_backward[at + k])
                                                    for k in range(width)]) - na
            maps[(j, width)] = (np.clip(forward, 0, mb - ma), np.clip(backward, 0, nb - na))
        return maps[(j, width)]


@dataclass(frozen=True)
class Template:
    """A block's decisions by position: each op's :class:`Op`, and (slot, action) for the activations its ops
    own that are stashed (:attr:`Stack.activations`)."""

    ops: tuple[Op, ...]
    stash: tuple[tuple[tuple[int, int], str], ...] = ()


Segment = tuple  # the Templates of consecutive blocks (one region across them, when they recompute all)


@dataclass(frozen=True)
class Measured:
    """A menu entry as the DP sees it: the templates of the consecutive blocks it decides, the bytes they save
    while they wait for their backward, the change they make at each of their own positions (their forward,
    then their backward, each from its first position), and their extra cost."""

    segment: Segment
    saving: int
    forward_delta: tuple[int, ...]
    backward_delta: tuple[int, ...]
    cost: int

    @property
    def width(self) -> int:
        return len(self.segment)


def find_stack(problem: Problem) -> Stack | None:
    """The most numerous alike blocks of ``problem.blocks`` (at least :data:`MIN_BLOCKS`), None without.

    Example: four blocks of two ops, run forward in order and backward in reverse.

        >>> ops = tuple(f"{k}{j}" for j in range(4) for k in "ab")
        >>> problem = Problem(chain=ops, recomputable=frozenset(ops), cost=dict.fromkeys(ops, 1), flops={},
        ...                   activations=(), fixed=(0,) * 16, num_forward=8,
        ...                   backward_op={8 + i: op for i, op in enumerate(reversed(ops))},
        ...                   blocks=tuple(ops[i:i + 2] for i in range(0, 8, 2)),
        ...                   forward_position={op: i for i, op in enumerate(ops)})
        >>> find_stack(problem).forward, find_stack(problem).backward[0]
        (((0, 1), (2, 3), (4, 5), (6, 7)), (14, 15))
    """
    families: dict[tuple, list[tuple[str, ...]]] = {}
    for block in problem.blocks:
        key = tuple(problem.cost.get(op) for op in block)   # (the last block's output may not be recomputable)
        families.setdefault(key, []).append(block)
    if not families or not problem.forward_position:
        return None
    blocks = max(families.values(), key=lambda family: (len(family), len(family[0])))
    if len(blocks) < MIN_BLOCKS:
        return None
    backward = problem.backward_positions
    forward_spans, backward_spans = [], []
    for block in blocks:
        if any(op not in problem.forward_position for op in block) or not any(op in backward for op in block):
            return None
        forward_spans.append(_span(problem.forward_position[op] for op in block))
        backward_spans.append(_span(backward[op] for op in block if op in backward))
    if not _in_turn(forward_spans, backward_spans):
        return None
    owned: dict[str, list[str]] = {}
    for act in problem.activations:
        owned.setdefault(act.owner, []).append(act.name)
    activations = tuple({(q, k): name for q, op in enumerate(block) for k, name in enumerate(owned.get(op, ()))}
                        for block in blocks)
    op_forward = tuple(tuple(problem.forward_position[op] for op in block) for block in blocks)
    op_backward = tuple(tuple(backward.get(op, -1) for op in block) for block in blocks)
    return Stack(tuple(blocks), activations, tuple(forward_spans), tuple(backward_spans), op_forward, op_backward)


def _span(positions) -> tuple[int, int]:
    positions = list(positions)
    return min(positions), max(positions)


def _in_turn(forward: list[tuple[int, int]], backward: list[tuple[int, int]]) -> bool:
    """Whether the blocks run one after another: forward spans in order, backward spans in reverse order."""
    return all(a[1] < b[0] for a, b in zip(forward, forward[1:])) and \
        all(b[1] < a[0] for a, b in zip(backward, backward[1:]))


def template_of(stack: Stack, j: int, plan: SearchPlan) -> Template:
    """Block ``j``'s decisions in ``plan``, by position."""
    recompute, stash = plan
    ops = tuple(Op(int(recompute.get(op, False))) for op in stack.blocks[j])
    return Template(ops, tuple((slot, stash[a]) for slot, a in stack.activations[j].items() if a in stash))


def apply_template(problem: Problem, stack: Stack, j: int, plan: SearchPlan, template: Template) -> None:
    """Block ``j`` of ``plan`` takes ``template``'s decisions. In place."""
    recompute, stash = plan
    for op, decision in zip(stack.blocks[j], template.ops):
        if op in problem.recomputable:
            recompute[op] = decision
    for name in stack.activations[j].values():
        stash.pop(name, None)
    for slot, action in template.stash:
        if slot in stack.activations[j]:
            stash[stack.activations[j][slot]] = action


def _with_blocks(problem: Problem, stack: Stack, base: SearchPlan, templates: Mapping[int, Template]) -> SearchPlan:
    plan = (dict(base[0]), dict(base[1]))
    for j, template in templates.items():
        apply_template(problem, stack, j, plan, template)
    return plan


def menu(problem: Problem, stack: Stack, plans: list[SearchPlan]) -> list[Segment]:
    """Segments worth pricing: for one block, keep-all, the block as one region, the block with all it holds
    stashed (:func:`_stashed`), one region over each stretch of it (:func:`_regions`), its cheapest ops per
    byte recomputed wherever they are (:func:`_selective`) and every block's decisions in ``plans``; then runs
    of 2 to :data:`MAX_WIDTH` blocks recomputed as one region (√N's segments: one input held for all of them).
    Distinct, in that order."""
    block = stack.blocks[stack.middle]
    recomputable = [op in problem.recomputable for op in block]
    keep = Template(tuple(Op.KEEP for _ in block))
    first = recomputable.index(True) if any(recomputable) else 0
    whole = Template(tuple(Op.KEEP if not r else Op.NEW_REGION if k == first else Op.RECOMPUTE
                           for k, r in enumerate(recomputable)))
    onward = Template(tuple(Op.RECOMPUTE if r else Op.KEEP for r in recomputable))
    singles = [keep, whole, *_stashed(problem, stack, keep), *_regions(problem, block), *_selective(problem, block)]
    singles += [template_of(stack, j, plan) for plan in plans for j in range(len(stack.blocks))]
    runs = [(whole, *[onward] * (width - 1)) for width in range(2, min(MAX_WIDTH, len(stack.blocks)) + 1)]
    return list(dict.fromkeys([(t,) for t in singles] + runs))


def _stashed(problem: Problem, stack: Stack, template: Template) -> list[Template]:
    """``template`` with what its block holds stashed, the way leaving fewest bytes and the cheapest way
    (:func:`greedy.stash_all`); none without stash options."""
    if not problem.stash_options:
        return []
    m, stashed = stack.middle, []
    for prefer in ("memory", "cost"):
        recompute = {op: False for op in problem.recomputable}
        plan = (recompute, {})
        apply_template(problem, stack, m, plan, template)
        stashed.append(template_of(stack, m, (recompute, stash_all(problem, recompute, prefer))))
    return stashed


def _stash_variants(problem: Problem, stack: Stack, template: Template) -> list[Template]:
    """``template`` with the first k of its block's stashable tensors stashed (:data:`STASH_STEPS`), ranked by
    the cost per byte of their cheapest single-op option (a rematerialization of a cheap op first, an offload
    last); and with chains of cheap ops made again, each delivering the tensors on its way (a GELU's
    intermediates from its input), the rest stashed the least-memory way (:func:`greedy.stash_chains`)."""
    m = stack.middle
    recompute = {op: False for op in problem.recomputable}
    apply_template(problem, stack, m, (recompute, {}), template)
    by_name = problem.indexed.by_name
    ranked = []
    for name in stack.activations[m].values():
        act = problem.activations[by_name[name]]
        options = [o for o in problem.stash_options.get(name, ()) if not o.delivers]
        if options:
            option = min(options, key=lambda o: o.cost / max(1, act.nbytes - o.stored_bytes))
            ranked.append((option.cost / max(1, act.nbytes - option.stored_bytes), name, option.action))
    ranked.sort()
    counts = sorted({max(1, round(step * len(ranked) / STASH_STEPS)) for step in range(1, STASH_STEPS + 1)})
    chosen = [{name: action for _, name, action in ranked[:count]} for count in counts]
    variants = [template_of(stack, m, (recompute, stash)) for stash in effective_stashes(problem, recompute, chosen)]
    if ranked:      # (the block's choices among the whole model's: a chain may reach across its edges)
        chains = stash_chains(problem, recompute, only=stack.activations[m].values())
        variants.append(template_of(stack, m, (recompute, chains)))
    return list(dict.fromkeys(v for v in variants if v != template)) if ranked else []


def _selective(problem: Problem, block: tuple[str, ...]) -> list[Template]:
    """The block with its ops cheapest to run again per byte they hold recomputed, wherever they are (a
    selective-checkpointing policy: elementwise ops again, matmul outputs kept), until each fraction of
    :data:`SELECTIVE_FRACTIONS` of the bytes its ops hold for backward is recomputed."""
    held: dict[str, int] = {}
    for act in problem.activations:
        if act.savers and act.owner in block:
            held[act.owner] = held.get(act.owner, 0) + act.nbytes
    ranked = sorted((op for op in block if op in problem.recomputable and held.get(op)),
                    key=lambda op: problem.cost.get(op, 0) / held[op])
    total, templates = sum(held[op] for op in ranked), []
    for fraction in SELECTIVE_FRACTIONS:
        chosen, covered = set(), 0
        for op in ranked:
            if covered >= fraction * total:
                break
            chosen.add(op)
            covered += held[op]
        templates.append(Template(tuple(Op.RECOMPUTE if op in chosen else Op.KEEP for op in block)))
    return templates


def _grid(problem: Problem, block: tuple[str, ...]) -> tuple[int, list[bool]]:
    """(the ops between two of the block's :data:`REGION_GRID` points, whether each of its ops is
    recomputable)."""
    return max(1, math.ceil(len(block) / REGION_GRID)), [op in problem.recomputable for op in block]


def _regions(problem: Problem, block: tuple[str, ...]) -> list[Template]:
    """One region over each stretch of the block (both ends on a grid of at most :data:`REGION_GRID` points):
    the MLP alone, the attention alone, all but the output...; the block split into regions
    (:func:`_splits`), and recomputed but for one stretch (:func:`_complements`)."""
    step, recomputable = _grid(problem, block)
    templates = []
    for a in range(0, len(block), step):
        for b in range(a + step, len(block) + step, step):
            templates.append(Template(tuple((Op.NEW_REGION if k == a else Op.RECOMPUTE) if a <= k < b and r else Op.KEEP
                                            for k, r in enumerate(recomputable))))
    return templates + _splits(problem, block) + _complements(problem, block)


def _complements(problem: Problem, block: tuple[str, ...]) -> list[Template]:
    """The block recomputed but for one stretch of one to three grid steps kept (an MLP's matmuls), the parts
    before and after it a region each: where the budget leaves room for one stretch's tensors and the rest of
    the block must be made again."""
    step, recomputable = _grid(problem, block)
    templates = []
    for a in range(step, len(block), step):
        for b in range(a + step, min(len(block), a + 3 * step) + 1, step):
            ops, in_region = [], False
            for k, r in enumerate(recomputable):
                kept = a <= k < b or not r
                ops.append(Op.KEEP if kept else Op.RECOMPUTE if in_region else Op.NEW_REGION)
                in_region = not kept
            templates.append(Template(tuple(ops)))
    return templates


def _splits(problem: Problem, block: tuple[str, ...]) -> list[Template]:
    """The whole block recomputed as two or three regions one after another, cut at grid points: backward
    then holds one part's tensors at a time (the MLP's, then the attention's) where one region holds all."""
    step, recomputable = _grid(problem, block)
    first = recomputable.index(True) if any(recomputable) else 0
    cuts = sorted({next((k for k in range(c, len(block)) if recomputable[k]), first)
                   for c in range(step, len(block), step)} - {first})
    coarse = cuts[1::2]
    templates = []
    for chosen in [(c,) for c in cuts] + [(c, d) for c in coarse for d in coarse if c < d]:
        starts = {first, *chosen}
        templates.append(Template(tuple((Op.NEW_REGION if k in starts else Op.RECOMPUTE) if r else Op.KEEP
                                        for k, r in enumerate(recomputable))))
    return templates


def measure(problem: Problem, stack: Stack, changes: TimelineChanges, segment: Segment) -> Measured:
    """``segment`` on the middle blocks of ``changes.base`` (whose blocks keep everything), against it."""
    first = _measured_at(stack, len(segment))
    plan = _with_blocks(problem, stack, changes.base, {first + k: template for k, template in enumerate(segment)})
    delta, cost = changes.change(plan)
    (fa, fb), (ba, bb) = _own_spans(stack, first, len(segment))
    waiting = delta[fb + 1:ba]
    return Measured(segment, saving=-int(waiting.max()) if len(waiting) else 0,
                    forward_delta=tuple(delta[fa:fb + 1].tolist()), backward_delta=tuple(delta[ba:bb + 1].tolist()),
                    cost=cost)


def _own_spans(stack: Stack, first: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The forward and the backward positions of blocks ``first .. first + width - 1``."""
    last = first + width - 1
    return (stack.forward[first][0], stack.forward[last][1]), (stack.backward[last][0], stack.backward[first][1])


def _measured_at(stack: Stack, width: int) -> int:
    """The first of the middle blocks a segment of ``width`` blocks is measured on."""
    return max(0, min(stack.middle - width // 2, len(stack.blocks) - width))


def _own_peaks(stack: Stack, timeline: np.ndarray, entries: list[Measured]) -> list[np.ndarray]:
    """For each entry, for each first block, the highest memory of its segment's own positions with the entry,
    the blocks before it keeping all (none where the segment runs past the last block)."""
    positions = {width: _OwnPositions.made(stack, timeline, width) for width in {e.width for e in entries}}
    return [positions[e.width].peaks(e) for e in entries]


@dataclass(frozen=True)
class _OwnPositions:
    """The own positions of a segment of one width from each first block that fits (rows): the timeline's
    memory there and the index of the measured position each stands for (:meth:`Stack.position_maps`),
    forward then backward, each row padded with its last position (a repeat leaves its maximum as it is)."""

    memory: np.ndarray          # [first block, k]: the timeline at the k-th own position
    at: np.ndarray              # [first block, k]: its index into an entry's forward then backward deltas
    blocks: int

    @classmethod
    def made(cls, stack: Stack, timeline: np.ndarray, width: int) -> "_OwnPositions":
        measured = _measured_at(stack, width)
        forward_length = stack.forward[measured + width - 1][1] - stack.forward[measured][0] + 1
        rows = []
        for j in range(len(stack.blocks) - width + 1):
            (fa, fb), (ba, bb) = _own_spans(stack, j, width)
            to_forward, to_backward = stack.position_maps(j, width)
            rows.append((np.r_[fa:fb + 1, ba:bb + 1], np.concatenate([to_forward, to_backward + forward_length])))
        length = max(len(positions) for positions, _ in rows)
        positions = np.stack([np.pad(p, (0, length - len(p)), mode="edge") for p, _ in rows])
        at = np.stack([np.pad(a, (0, length - len(a)), mode="edge") for _, a in rows])
        return cls(timeline[positions], at, len(stack.blocks))

    def peaks(self, entry: Measured) -> np.ndarray:
        delta = np.asarray(entry.forward_delta + entry.backward_delta, dtype=np.int64)
        peaks = np.full(self.blocks, 2 ** 60, dtype=np.int64)
        peaks[:len(self.memory)] = (self.memory + delta[self.at]).max(axis=1)
        return peaks


def _aligned(positions, pairs: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> np.ndarray:
    """Each of ``positions`` moved from its blocks to the measured ones: by the op at or before it (in
    position order) and the offset from that op; ``pairs`` gives each block's ops' positions and the measured
    block's (-1: none)."""
    anchors = sorted((src, dst) for ours, theirs in pairs for src, dst in zip(ours, theirs) if src >= 0 and dst >= 0)
    sources = [src for src, _ in anchors]
    moved = []
    for p in positions:
        src, dst = anchors[max(bisect.bisect_right(sources, p) - 1, 0)]
        moved.append(dst + (p - src))
    return np.asarray(moved, dtype=np.int64)


def _outside_peaks(problem: Problem, stack: Stack, timeline: np.ndarray) -> np.ndarray:
    """``[k]``: the highest memory, all blocks keeping all, at the positions no block owns while blocks
    ``0..k-1`` wait for their backward (forward: those whose forward ended; backward: those not yet begun)."""
    own = np.zeros(len(timeline), dtype=bool)
    for (fa, fb), (ba, bb) in zip(stack.forward, stack.backward):
        own[fa:fb + 1] = True
        own[ba:bb + 1] = True
    ends = np.array([fb for _, fb in stack.forward])
    starts = np.array([ba for ba, _ in stack.backward])
    peaks = np.full(len(stack.blocks) + 1, -(2 ** 60), dtype=np.int64)
    for p in np.nonzero(~own)[0]:
        waiting = int((ends < p).sum()) if p < problem.num_forward else int((starts > p).sum())
        peaks[waiting] = max(peaks[waiting], timeline[p])
    return peaks


def choose(entries: list[Measured], own: list[np.ndarray], outside: np.ndarray, budget: int) -> list[int] | None:
    """The least-cost entries covering the blocks in order (indices into ``entries``) whose memory stays under
    ``budget``, by the blocks' savings (:class:`Measured`): ``own[t][j]``, entry ``t``'s peak from block ``j``
    (:func:`_own_peaks`), and ``outside[k]`` (:func:`_outside_peaks`), less what the blocks before save; None
    when no choice fits.

    The state after ``j`` blocks is the bytes they save, in buckets of about 1/:data:`SAVING_STEPS` of the
    most the stack can save; each bucket keeps its cheapest path (the one saving most among equals) with its
    exact saving, which every memory check reads.
    """
    blocks = len(outside) - 1
    unit = max(1, max(max(e.saving for e in entries), 1) * blocks // SAVING_STEPS)
    steps = [round(e.saving / unit) for e in entries]
    low, high = min(0, *steps), max(0, *steps)
    # row j holds the bucket sums j blocks can reach, j * low to j * high, at index sum - j * low
    table = _Table([j * (high - low) + 1 for j in range(blocks + 1)])
    moves = [(t, e.width, step - e.width * low, e.cost, e.saving) for t, (e, step) in enumerate(zip(entries, steps))]
    own_by_block = np.stack(own, axis=1).tolist()       # [j][t]: Python ints, compared thousands of times
    table.cost[0][0] = 0
    for j in range(blocks + 1):
        table.cost[j][outside[j] - table.saved[j] > budget] = NEVER
        if j == blocks:
            break
        table.advance(j, budget, [move for move in moves if j + move[1] <= blocks], own_by_block[j])
    return _path(entries, table.cost[blocks], table.pick, table.came)


class _Table:
    """:func:`choose`'s states: per number of blocks covered and bucket, the cheapest path's cost, its exact
    saving, its last entry and the bucket it came from."""

    def __init__(self, sizes: list[int]):
        self.cost = [np.full(size, NEVER, dtype=np.int64) for size in sizes]
        self.saved = [np.zeros(size, dtype=np.int64) for size in sizes]
        self.pick = [np.full(size, -1, dtype=np.int32) for size in sizes]
        self.came = [np.full(size, -1, dtype=np.int32) for size in sizes]

    def advance(self, j: int, budget: int, moves: list[tuple], peaks: list[int]) -> None:
        """Every move (entry, width, bucket shift, cost, saving) from the states after ``j`` blocks whose
        entry's peak there (``peaks[t]``) fits their room: a state it reaches keeps it where it is cheaper,
        or as cheap and saving more (the earlier entry on a tie)."""
        live = np.nonzero(self.cost[j] < NEVER)[0]       # (the states reached: far fewer than the buckets early on)
        room, live_cost, live_saved = budget + self.saved[j][live], self.cost[j][live], self.saved[j][live]
        least_room, most_room = room.min(initial=NEVER), room.max(initial=-NEVER)
        for t, width, shift, cost, saving in moves:
            if peaks[t] > most_room:
                continue
            if peaks[t] <= least_room:      # (every state: no mask)
                origin, total, after = live, live_cost + cost, live_saved + saving
            else:
                fits = room >= peaks[t]
                origin, total, after = live[fits], live_cost[fits] + cost, live_saved[fits] + saving
            to, target = j + width, origin + shift
            current = self.cost[to][target]
            better = (total < current) | ((total == current) & (after > self.saved[to][target]))
            target = target[better]
            self.cost[to][target], self.saved[to][target] = total[better], after[better]
            self.pick[to][target], self.came[to][target] = t, origin[better]


def _path(entries: list[Measured], final: np.ndarray, pick: list, came: list) -> list[int] | None:
    """The entries of the cheapest final state, first block first."""
    state = int(np.argmin(final))
    if final[state] >= NEVER:
        return None
    j, picks = len(pick) - 1, []
    while j > 0:
        t = int(pick[j][state])
        picks.append(t)
        state, j = int(came[j][state]), j - entries[t].width
    return picks[::-1]


@dataclass
class _Base:
    """A plan whose blocks keep all (its decisions outside the stack are used), the menu measured on it, and
    the peaks :func:`choose` reads."""

    plan: SearchPlan
    timeline: np.ndarray
    entries: list[Measured]
    own: list[np.ndarray]
    outside: np.ndarray

    @classmethod
    def measured(cls, problem: Problem, stack: Stack, plan: SearchPlan, segments: list[Segment],
                 stash_variants: bool = False) -> tuple["_Base", list[Segment]]:
        """``segments`` measured on ``plan``, those another beats dropped (:func:`_undominated`); with
        ``stash_variants``, what is left of one block is tried again with its held tensors stashed. Also the
        segments lower than any other somewhere at their own positions: the candidates of other bases."""
        timeline = np.asarray(memory_timeline(problem, *plan), dtype=np.int64)
        changes = TimelineChanges(problem, plan)
        entries = [measure(problem, stack, changes, segment) for segment in segments]
        candidates = [entries[i] for i in _undominated(entries, _profiles(entries))]
        if stash_variants:
            entries = candidates + [measure(problem, stack, changes, (stashed,)) for e in candidates if e.width == 1
                                    for stashed in _stash_variants(problem, stack, e.segment[0])]
            candidates = [entries[i] for i in _undominated(entries, _profiles(entries))]
        own = _own_peaks(stack, timeline, entries)
        kept = _undominated(entries, own)
        base = cls(plan, timeline, [entries[i] for i in kept], [own[i] for i in kept],
                   _outside_peaks(problem, stack, timeline))
        return base, [e.segment for e in candidates]

    def choose(self, budget: int) -> list[int] | None:
        return choose(self.entries, self.own, self.outside, budget)


class ByLayers:
    """The layered planner of one problem with a stack: the menu measured once per base, then
    :meth:`cheapest` under any budget and :meth:`lowest` (the least peak the menu reaches) in milliseconds.

    ``plans`` give the decisions outside the stack (embeddings, the head, the loss) and menu entries.
    """

    def __init__(self, problem: Problem, stack: Stack, plans: list[SearchPlan]):
        self.problem, self.stack, self.plans = problem, stack, plans
        segments = menu(problem, stack, plans)
        keep = dict.fromkeys(range(len(stack.blocks)), segments[0][0])
        bases = {_decisions_key(base): base for base in (_with_blocks(problem, stack, plan, keep) for plan in plans)}
        first, *others = bases.values()
        measured, candidates = _Base.measured(problem, stack, first, segments, stash_variants=True)
        # a block's savings depend on what the plan does outside the stack (a region that begins with the
        # embeddings', tables every layer reads held or made again): the first base's candidates measured
        # again on each other one
        self.bases = [measured] + [_Base.measured(problem, stack, base, candidates)[0] for base in others]

    def cheapest(self, budget: int) -> SearchPlan | None:
        """The cheapest plan over the bases whose peak in the memory model is under ``budget``; None if none."""
        found = [plan for plan in (self._from(base, budget) for base in self.bases) if plan is not None]
        return min(found, key=lambda plan: extra_cost(self.problem, *plan), default=None)

    def lowest(self) -> SearchPlan:
        """The plan of least peak in the memory model that :meth:`cheapest` finds: the DP bisected on the
        budget to 1/500 of the range, then checked in full (a little higher where the blocks' interactions
        make the DP's pick exceed it); or the lowest of the plans given."""
        fallback = min(self.plans, key=lambda plan: predicted_peak(self.problem, *plan))
        ceiling = predicted_peak(self.problem, *fallback)
        low, high = max(self.problem.fixed), ceiling
        while high - low > max(1, high // 500):
            middle = (low + high) // 2
            if any(base.choose(middle) is not None for base in self.bases):
                high = middle
            else:
                low = middle
        for margin in LOWEST_MARGINS:
            found = self.cheapest(int(high * (1 + margin)))
            if found is not None and predicted_peak(self.problem, *found) < ceiling:
                return found
        return fallback

    def _from(self, base: _Base, budget: int) -> SearchPlan | None:
        """:func:`choose` over ``base``, tightened while the whole plan is over ``budget``."""
        internal = budget
        for _ in range(MAX_TIGHTENINGS):
            picks = base.choose(internal)
            if picks is None:
                return None
            plan = _with_blocks(self.problem, self.stack, base.plan, _blocks_of(base.entries, picks))
            peak = predicted_peak(self.problem, *plan)
            if peak <= budget:
                return plan
            internal -= peak - budget
        return None


def _undominated(entries: list[Measured], profiles: list[np.ndarray]) -> list[int]:
    """Indices of the entries no other of their width beats — saving as much or more, costing as little or
    less, as low at every point of its profile (:func:`_own_peaks`, what :func:`choose` reads, or
    :func:`_profiles`: a block split into regions, as high as one region where backward begins and lower
    after, stays) — nor equals earlier in the list (keep-all, first, stays)."""
    width = np.array([e.width for e in entries])
    saving = np.array([e.saving for e in entries])
    cost = np.array([e.cost for e in entries])
    peaks = np.stack(profiles)
    # rival[i, j]: entry j as wide as i, saving as much, costing as little; the profiles are compared only
    # there (a few rivals of the thousand or so entries)
    rival = (width[None, :] == width[:, None]) & (saving[None, :] >= saving[:, None]) \
        & (cost[None, :] <= cost[:, None])
    np.fill_diagonal(rival, False)
    kept = [0]
    for i in range(1, len(entries)):
        rivals = np.flatnonzero(rival[i])
        below = (peaks[rivals] <= peaks[i]).all(axis=1)
        same = (saving[rivals] == saving[i]) & (cost[rivals] == cost[i]) & (peaks[rivals] == peaks[i]).all(axis=1)
        if not (below & (~same | (rivals < i))).any():
            kept.append(i)
    return kept


def _profiles(entries: list[Measured]) -> list[np.ndarray]:
    """Each entry's change at its own positions, forward then backward, padded to one length."""
    deltas = [np.asarray(e.forward_delta + e.backward_delta, dtype=np.int64) for e in entries]
    length = max(len(d) for d in deltas)
    return [np.pad(d, (0, length - len(d))) for d in deltas]


def _decisions_key(plan: SearchPlan) -> tuple:
    recompute, stash = plan
    return tuple(sorted((op, int(v)) for op, v in recompute.items())), tuple(sorted(stash.items()))


def _blocks_of(entries: list[Measured], picks: list[int]) -> dict[int, Template]:
    """Block index → template, for the entries ``picks`` laid end to end from the first block."""
    templates, j = {}, 0
    for t in picks:
        for template in entries[t].segment:
            templates[j] = template
            j += 1
    return templates


def planner_of(problem: Problem) -> ByLayers | None:
    """The problem's :class:`ByLayers` (made once, from keep-all and per-block checkpointing, each also with
    the ops outside the blocks recomputed and with every tensor stashed), None without a stack."""

    def make() -> ByLayers | None:
        stack = find_stack(problem)
        if stack is None:
            return None
        in_blocks = {op for block in stack.blocks for op in block}
        keep = {op: False for op in problem.recomputable}
        per_block = per_block_plan(problem) or keep
        # the ops outside the blocks recomputed too: the embeddings, the rotary and mask tables every layer
        # reads (held through backward, else), the head
        outside = {op: op not in in_blocks for op in problem.recomputable}
        both = {**per_block, **{op: True for op in problem.recomputable if op not in in_blocks}}
        bases = [(keep, {}), (per_block, {}), (outside, {}), (both, {})]
        if problem.stash_options:      # the head and embeddings' tensors stashed: the lowest peaks
            bases += [(plan, stash_all(problem, plan, "memory")) for plan in (keep, per_block)]
        return ByLayers(problem, stack, bases)
    return problem.derived("layered.ByLayers", make)


def lowest_start(problem: Problem) -> SearchPlan:
    """The layered minimum-peak start (:meth:`ByLayers.lowest`); for a problem without a stack, greedy's."""
    planner = planner_of(problem)
    if planner is None:
        return greedy_lowest_start(problem)
    return planner.lowest()


def cheapest_under(problem: Problem, budget: int) -> SearchPlan | None:
    """The layered plan under ``budget`` (:meth:`ByLayers.cheapest`); None without a stack or a fit."""
    planner = planner_of(problem)
    return None if planner is None else planner.cheapest(budget)
