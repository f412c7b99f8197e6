"""The words every view of a plan uses (summary, table, HTML page, graph, timeline) for what happens to a
tensor autograd holds for backward, and what each means."""
from __future__ import annotations

from autorecompute.decisions import Action

ACTIONS = ("keep", "recompute", "rematerialize", "offload", "compress")

# What happens to a tensor autograd holds for backward, in the words every view of a plan uses (summary,
# table, HTML page, graph, timeline), and what each means; an action's variant ("offload:late",
# "compress:bfloat16", "rematerialize:chain") is the way it is done.
FATES = {
    "kept": "stays on the device from forward to its backward",
    "recomputed": "dropped after forward; its checkpointed region of ops runs again in backward",
    "rematerialized": "dropped after forward; made again alone, by its own op or a short chain, when backward "
                      "needs it",
    "offloaded": "copied off the device (host memory or disk) after forward and back for backward",
    "compressed": "held in a smaller dtype until backward decodes it",
}
NOTHING_HELD = "nothing held"       # an op none of whose tensors autograd keeps (views, temporaries)
_FATE_OF_ACTION = {"keep": "kept", "recompute": "recomputed", "rematerialize": "rematerialized",
                   "offload": "offloaded", "compress": "compressed"}


def fate(action: str) -> str:
    """The word for an action: ``fate("offload:late") == "offloaded"``, ``fate("compress:bfloat16") ==
    "compressed"``."""
    return _FATE_OF_ACTION[action if action in ("keep", "recompute") else Action.parse(action).kind.value]


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def is_action(name: str) -> bool:
    """Whether ``name`` is an action a plan takes: keep, recompute or a stash action with its variant."""
    if name in ("keep", "recompute"):
        return True
    try:
        Action.parse(name)
    except ValueError:
        return False
    return True
