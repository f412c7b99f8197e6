"""One plan for N ranks: ranks that plan the same step share the first one's plan.

Under an initialized ``torch.distributed`` every rank captures and profiles its step (a second or two) and keys
it as the plan cache does (graph, signature, budget, options, device, versions). The first rank to ask for a
key plans; the others wait for its plan on the process group's store and apply it to their own capture. Ranks
whose steps differ (other shapes, another budget) have other keys and plan on their own, and a rank whose
planning fails leaves the others to plan (and meet the error) themselves, so no rank waits on another's
different step. The store is not a collective: no rank that plans nothing takes part.
"""
from __future__ import annotations

import datetime
import hashlib
import logging

import torch

from autorecompute.plan import Plan

log = logging.getLogger("autorecompute")
WAIT = datetime.timedelta(hours=1)    # the longest another rank's planning is waited for


class RankShare:
    """The sharing of one step's plan among the ranks (nothing without ``torch.distributed``, or ``key`` None).

    Example:
        >>> share = RankShare("a step's key")       # not distributed here: this process plans
        >>> share.plan_of_another_rank() is None
        True
        >>> share.publish(None)                     # (nothing to tell)
    """

    def __init__(self, key: str | None, resident: dict | None = None):
        """``resident``: what the rank holds besides the step (a plan is applied only where it is the same, so
        ranks that differ there — other tensors on their devices — plan on their own instead of waiting)."""
        self.store = _store() if key else None
        held = hashlib.sha256(repr(sorted((resident or {}).items())).encode()).hexdigest()[:16]
        self.prefix = f"autorecompute/plan/{key}/{held}"
        self.owner = False

    def plan_of_another_rank(self) -> Plan | None:
        """The plan the first rank made for this key, waited for; None where this rank plans (the first)."""
        if self.store is None:
            return None
        if self.store.add(f"{self.prefix}/claims", 1) == 1:
            self.owner = True
            return None
        log.info("waiting for the plan another rank makes for this step")
        try:
            self.store.wait([f"{self.prefix}/plan"], WAIT)
            text = self.store.get(f"{self.prefix}/plan").decode()
            return Plan.from_json(text) if text else None
        except (RuntimeError, ValueError) as error:     # (the store's time-out; a plan that does not read)
            log.info("no plan from the rank that planned this step (%s): planning it here", error)
            return None

    def publish(self, plan: Plan | None) -> None:
        """The first rank's plan (None: it made none) for the ranks waiting on this key."""
        if self.store is not None and self.owner:
            self.store.set(f"{self.prefix}/plan", plan.to_json() if plan is not None else "")
            self.owner = False


def _store():
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store()
