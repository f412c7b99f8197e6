"""Every key autorecompute writes into ``node.meta`` and ``gm.meta``, with the functions that write and read it.

One place for the keys keeps a pass from reading a key under another name than the pass that writes it, and
lets a reader fail with the pass to run when that pass has not run, instead of a ``KeyError`` later.

=====================  ===============  ==========================================  ============================
key                    where            value                                       written by
=====================  ===============  ==========================================  ============================
``PROFILE``            ``node.meta``    :class:`~.profile_records.NodeInfo`         ``profile.profile_step``
``PROFILE``            ``gm.meta``      :class:`~.profile_records.StepProfile`      ``profile.profile_step``
``LEAN_OP``            ``node.meta``    :class:`LeanOp`: its two forms               ``capture.capture``
``REGION_MEMBERS``     ``node.meta``    names of the ops a region call runs         ``rewrite_recompute``
``SOURCE``             ``node.meta``    the op whose value a region output carries  ``rewrite_recompute``
=====================  ===============  ==========================================  ============================

``STASH_RUNTIME`` is no meta key but the attribute under which ``rewrite_stash`` adds its runtime to the
GraphModule; it is here so that the names a pass attaches to a graph are in one place too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx

from autorecompute.passes.profile_records import NodeInfo, StepProfile

PROFILE = "autorecompute"
LEAN_OP = "autorecompute_lean_op"
REGION_MEMBERS = "autorecompute_region"
SOURCE = "autorecompute_source"
STASH_RUNTIME = "stash_runtime"

_PROFILE_PASS = "autorecompute.passes.profile.profile_step(gm, args, kwargs)"
_CAPTURE_PASS = "autorecompute.passes.capture.capture(model, args, kwargs)"
_RECOMPUTE_PASS = "autorecompute.passes.rewrite_recompute.rewrite_recompute"
_STASH_PASS = "autorecompute.passes.rewrite_stash.rewrite_stash"


# -- PROFILE: the profile pass's records --------------------------------------------------------------------

def set_node_info(node: torch.fx.Node, info: NodeInfo) -> None:
    node.meta[PROFILE] = info


def set_step_profile(gm: torch.fx.GraphModule, profile: StepProfile) -> None:
    gm.meta[PROFILE] = profile


def node_info(node: torch.fx.Node) -> NodeInfo:
    """The profile of ``node``; fails with the pass to run when it is missing."""
    info = node.meta.get(PROFILE)
    if not isinstance(info, NodeInfo):
        raise RuntimeError(f"node {node.name!r} has no autorecompute profile: run {_PROFILE_PASS} first")
    return info


def node_info_if_profiled(node: torch.fx.Node) -> NodeInfo | None:
    """The profile of ``node``, or None for a node the profile did not run (one a rewrite added)."""
    info = node.meta.get(PROFILE)
    return info if isinstance(info, NodeInfo) else None


def step_profile(gm: torch.fx.GraphModule) -> StepProfile:
    """The graph-level profile; fails with the pass to run when it is missing."""
    info = gm.meta.get(PROFILE)
    if not isinstance(info, StepProfile):
        raise RuntimeError(f"graph has no autorecompute step profile: run {_PROFILE_PASS} first")
    return info


# -- LEAN_OP: the ops capture makes lean (same values, less memory), with autograd's form to switch back to -----

@dataclass(frozen=True)
class LeanOp:
    """The two forms of an op capture made lean: the node's first ``inputs`` arguments, then the lean form's
    constants (``lean(*inputs, *lean_constants)``) or autograd's (``autograd(*inputs, *autograd_constants,
    **dict(autograd_keywords))``). Constants only (no nodes), so the mark survives copies of the graph.
    ``lean_with`` names the lean op this one is lean only together with (an upcast its cross-entropy makes)."""
    kind: str                        # what it is, in a plan's words ("softmax in place", "cross-entropy in chunks")
    inputs: int
    lean: Callable
    lean_constants: tuple
    autograd: Callable
    autograd_constants: tuple
    autograd_keywords: tuple = ()    # (name, value) pairs
    lean_with: str = ""


def mark_lean_op(node: torch.fx.Node, lean_op: LeanOp) -> None:
    node.meta[LEAN_OP] = lean_op


def is_lean_op(node: torch.fx.Node) -> bool:
    """Whether capture made ``node`` lean (whichever form it has now). The mark alone is not enough: a region's
    outputs and inputs copy their op's meta."""
    forms = node.meta.get(LEAN_OP)
    return node.op == "call_function" and isinstance(forms, LeanOp) and node.target in (forms.lean, forms.autograd)


def lean_op(node: torch.fx.Node) -> LeanOp:
    """The two forms of an op capture made lean; fails with the pass to run when it is missing."""
    if not is_lean_op(node):
        raise RuntimeError(f"node {node.name!r} is no op that capture makes lean: run {_CAPTURE_PASS} first "
                           "(softmaxes whose gradient is their own and cross-entropies over class indices are)")
    return node.meta[LEAN_OP]


# -- REGION_MEMBERS, SOURCE: what the recompute rewrite's region calls and outputs stand for -----------------

def mark_region(call: torch.fx.Node, members: list[str]) -> None:
    call.meta[REGION_MEMBERS] = list(members)


def region_members(call: torch.fx.Node) -> list[str]:
    """The ops a region call runs; fails with the pass to run when ``call`` is no region call."""
    if REGION_MEMBERS not in call.meta:
        raise RuntimeError(f"node {call.name!r} is no recomputed region's call: {_RECOMPUTE_PASS} makes them")
    return call.meta[REGION_MEMBERS]


def mark_source(output: torch.fx.Node, op: str) -> None:
    output.meta[SOURCE] = op


def is_region_output(node: torch.fx.Node) -> bool:
    return SOURCE in node.meta


def source_op(node: torch.fx.Node) -> str:
    """The op whose value ``node`` carries: the op a region output stands for, else ``node`` itself."""
    return node.meta.get(SOURCE, node.name)


def ops_run_by(node: torch.fx.Node) -> list[str]:
    """The original ops ``node`` runs: a region call's members, else the op it carries the value of."""
    return node.meta.get(REGION_MEMBERS, [source_op(node)])


# -- STASH_RUNTIME: the stash rewrite's runtime, an attribute of the GraphModule ---------------------------

def stash_runtime(gm: torch.fx.GraphModule) -> Any:
    """The :class:`~autorecompute.runtime.stash.StashRuntime` ``rewrite_stash`` added; fails with the pass to
    run when there is none."""
    runtime = getattr(gm, STASH_RUNTIME, None)
    if runtime is None:
        raise RuntimeError(f"graph has no stash runtime: {_STASH_PASS} adds it when a plan stashes a tensor")
    return runtime
