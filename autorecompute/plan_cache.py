"""Plans that survive the process: a disk cache of solved plans, so a training script's second run does not plan.

A plan is stored as its JSON (:meth:`Plan.to_json`) under a key of everything that decides it: the captured graph
(its code, and the names, shapes, dtypes and ``requires_grad`` of its parameters and buffers), the step's
signature (inputs, existing gradients, modes), the budget as given, the options that shape the search, the
device, and the versions of autorecompute and torch. A hit still captures and profiles the model (the plan is
applied to that graph: :func:`~autorecompute.passes.apply_plan.apply_plan`) but solves and verifies nothing.
Planning is deterministic, so a hit gives the plan a miss would have made.

The cache lives in ``$AUTORECOMPUTE_CACHE_DIR``, else ``$XDG_CACHE_HOME/autorecompute`` (``~/.cache/autorecompute``);
``AUTORECOMPUTE_CACHE=off`` turns it off. Entries are written whole (a temporary file renamed), so processes
that plan the same step at once (ranks) each read a complete plan.

"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

import torch

from autorecompute._version import __version__
from autorecompute.plan import Plan

log = logging.getLogger("autorecompute")
OFF = ("0", "off", "false", "no")


def cache_dir() -> Path | None:
    """The cache's folder (made if missing), or None when the cache is off or cannot be written."""
    if os.environ.get("AUTORECOMPUTE_CACHE", "").strip().lower() in OFF:
        return None
    base = os.environ.get("AUTORECOMPUTE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "autorecompute")
    try:
        Path(base).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        log.info("plan cache off: %s cannot be made (%s)", base, error)
        return None
    return Path(base)


def plan_key(gm: torch.fx.GraphModule, signature: str, budget, options: dict, device: str) -> str:
    """The key of the plan for a captured graph, step signature, budget and search options."""
    state = [(name, tuple(t.shape), str(t.dtype), bool(t.requires_grad))
             for name, t in [*gm.named_parameters(), *gm.named_buffers()]]
    # (one device's index or another's: ranks of one job, each on its own GPU, share plans)
    what = {"autorecompute": __version__, "torch": torch.__version__, "graph": _without_device_index(gm.code),
            "state": state, "signature": _without_device_index(signature), "budget": repr(budget),
            "options": options, "device": device}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()


def _without_device_index(text: str) -> str:
    """``cuda:1`` → ``cuda``, ``device(type='cuda', index=1)`` → ``device(type='cuda')``."""
    return re.sub(r", index=\d+\)", ")", re.sub(r"\b(cuda|xpu|hpu|mps|mtia):\d+", r"\1", text))


def load(key: str) -> Plan | None:
    """The plan stored under ``key``, or None (none stored, the cache off, or an entry that does not read)."""
    folder = cache_dir()
    path = folder / f"{key}.json" if folder else None
    if path is None or not path.is_file():
        return None
    try:
        return Plan.from_json(path.read_text())
    except (OSError, ValueError) as error:
        log.info("plan cache: %s does not read (%s); planning again", path, error)
        return None


def store(key: str, plan: Plan) -> None:
    """Stores ``plan`` under ``key`` (nothing when the cache is off or its folder cannot be written)."""
    folder = cache_dir()
    if folder is None:
        return
    try:
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as file:
            file.write(plan.to_json())
        os.replace(file.name, folder / f"{key}.json")
    except OSError as error:
        log.info("plan cache: cannot write to %s (%s)", folder, error)
