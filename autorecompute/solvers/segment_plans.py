"""Segment checkpointing plans as recompute decisions on a :class:`~autorecompute.problem.Problem`: the chain cut
into segments, one checkpoint kept per segment, the rest recomputed. They are the minimum-peak search's
starts (``greedy.lowest_start``) and, for any captured model, the plans autorecompute is compared with.

``sqrt_n_plan``: Chen et al.'s √N checkpointing generalized to graphs — the chain is cut only at
articulation points of the data-flow graph (ops every path goes through, so a segment boundary holds one
tensor), round(√N) segments of about equal held bytes, one checkpoint kept per segment, everything else
recomputed.

``per_block_plan``: per-block checkpointing (Hugging Face's ``gradient_checkpointing_enable()``), each
repeated layer one region that keeps only its input.
"""
from __future__ import annotations

import math

import networkx as nx

from autorecompute.problem import Problem


def articulation_ops(problem: Problem) -> list[str]:
    """Chain ops that are articulation points of the (undirected) data-flow graph, in chain order."""
    graph = nx.Graph()
    graph.add_nodes_from(problem.chain)
    for act in problem.activations:
        for reader in act.readers:
            if act.owner != reader:
                graph.add_edge(act.owner, reader)
        for saver in act.savers:
            if act.owner != saver:
                graph.add_edge(act.owner, saver)
    cut = set(nx.articulation_points(graph))
    return [op for op in problem.chain if op in cut and op in problem.recomputable]


def sqrt_n_plan(problem: Problem, segments: int | None = None,
                boundaries: list[str] | None = None) -> dict[str, bool]:
    """Recompute everything except round(√N) checkpoints (``segments`` if given) at articulation points (N =
    their number; ``boundaries``: :func:`articulation_ops`, when already computed)."""
    boundaries = articulation_ops(problem) if boundaries is None else boundaries
    if not boundaries:
        return {op: False for op in problem.recomputable}
    segments = segments or max(1, round(math.sqrt(len(boundaries))))
    held: dict[str, int] = {}
    for act in problem.activations:
        if act.savers:
            held[act.owner] = held.get(act.owner, 0) + act.nbytes
    total = sum(held.values()) or 1
    keep, running, step = set(), 0, total / (segments + 1)
    boundary_set = set(boundaries)
    target = step
    for op in problem.chain:
        running += held.get(op, 0)
        if op in boundary_set and running >= target:
            keep.add(op)
            target += step
    return {op: op not in keep for op in problem.recomputable}


def per_block_plan(problem: Problem) -> dict[str, bool] | None:
    """Per-block checkpointing (what Hugging Face's ``gradient_checkpointing_enable()`` does): each repeated
    block (``Problem.blocks``: a transformer's layers) is one region that keeps only its input, the output of
    the op before it; the block's last op, whose output the next block reads, and every op outside the blocks
    are kept. None when the model has no repeated blocks."""
    if not problem.blocks:
        return None
    inside = {op for block in problem.blocks for op in block[:-1]}
    return {op: op in inside for op in problem.recomputable}
