"""Build the solver's :class:`~autorecompute.problem.Problem` from a profiled graph.

Decides what *may* be recomputed (a graph fact, not a plan decision): ops that mutate state, produce graph
outputs, or have no tensor output are never recomputed; in-place buffer updates that read no activation
(BatchNorm's ``num_batches_tracked += 1``) do not split regions, since the rewrite hoists them.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from autorecompute.passes.capture import is_mutating
from autorecompute.passes.profile import node_info, step_profile
from autorecompute.problem import Activation, Problem

BYTES_COST_WEIGHT = 8   # cost of recomputing an op: FLOPs + this many per byte it writes (memory-bound ops)
REGION_COST = 2**22     # cost of one recomputed region: a checkpoint call's overhead, in FLOP-equivalents


def is_transparent(node: torch.fx.Node) -> bool:
    """Nodes that neither are recomputed nor split a region: the rewrite moves them ahead of it."""
    info = node_info(node)
    return (node.target is operator.getitem) or (is_mutating(node) and not info.reads)


def is_recomputable(node: torch.fx.Node, output_tensors: set[str]) -> bool:
    info = node_info(node)
    if is_mutating(node) or node.target is operator.getitem:
        return False
    if any(name in output_tensors for name in info.creates):
        return False
    if not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
        return False
    return True


def build_problem(gm: torch.fx.GraphModule) -> Problem:
    """The planning problem of a graph that :func:`~autorecompute.passes.profile.profile_step` annotated."""
    profile = step_profile(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    outputs = {name for name, t in profile.tensors.items() if t.is_output}
    chain = tuple(op for op in profile.order if not is_transparent(nodes[op]))
    recomputable = frozenset(op for op in chain if is_recomputable(nodes[op], outputs))
    num_forward = len(profile.order)
    num_positions = num_forward + len(profile.backward_events)
    last = num_positions - 1

    def backward_position(op: str) -> int | None:
        event = node_info(nodes[op]).backward_event
        return None if event is None else num_forward + event

    activations = []
    in_chain = set(chain)
    for t in profile.tensors.values():
        if t.is_output or t.nbytes == 0:
            continue
        saver_positions = [backward_position(s) for s in t.savers]
        save_end = -1
        if t.savers:
            save_end = last if None in saver_positions else max(saver_positions)
        readers = tuple(c for c in t.readers if c in recomputable and c != t.owner)
        reader_positions = [backward_position(c) for c in readers]
        read_end = max([save_end, *[last if p is None else p for p in reader_positions]])
        activations.append(Activation(
            name=t.name, owner=t.owner if t.owner in in_chain else f"<{t.owner}>", nbytes=t.nbytes,
            hold_start=t.last_forward_use + 1, savers=tuple(t.savers), readers=readers,
            save_end=save_end, read_end=read_end))

    measured = [profile.resident_bytes + p for p in profile.forward_peaks]
    measured += [profile.resident_bytes + p for p in profile.backward_peaks]
    problem = Problem(
        chain=chain, recomputable=recomputable,
        cost={op: 1 + node_info(nodes[op]).flops + BYTES_COST_WEIGHT * _written_bytes(profile, nodes[op])
              for op in chain},
        flops={op: node_info(nodes[op]).flops for op in chain},
        activations=tuple(activations), fixed=tuple([0] * num_positions), num_forward=num_forward,
        backward_op={num_forward + i: op for i, op in enumerate(profile.backward_events) if op in in_chain},
        bytes_at_rest=dict(profile.resident), region_cost=REGION_COST)
    return calibrate(problem, measured)


def _written_bytes(profile, node: torch.fx.Node) -> int:
    return sum(profile.tensors[name].nbytes for name in node_info(node).creates)


def calibrate(problem: Problem, measured: list[int]) -> Problem:
    """Sets ``fixed`` so that the all-keep plan predicts exactly ``measured`` at every position."""
    from dataclasses import replace

    from autorecompute.memory_model import memory_timeline

    modelled = memory_timeline(problem, {})
    fixed = tuple(m - v for m, v in zip(measured, modelled))
    return replace(problem, fixed=fixed)
