"""The Plan: the only thing the solver hands to the rewriter, and what users read.

A frozen, JSON-serializable record keyed by node name. ``decisions`` maps every op the solver could act on
to ``"keep"`` or ``"recompute"``; ``stash`` maps every activation taken off the device (``"offload"``),
stored smaller (``"compress:<dtype>"``) or dropped and made again by its own op when backward needs it
(``"rematerialize"``; ``"rematerialize:chain"``: by a chain of ops that makes other saved tensors again too;
``"rematerialize:through"``: from the model's inputs, the saved tensors on the way made again as
temporaries) to a :class:`StashRecord`; ``nodes`` carries what a person needs to read it (shape, dtype,
bytes, module path, FLOPs).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from autorecompute.budget import format_bytes
from autorecompute.decisions import Action, ActionKind, Op, Rewrite, Stashed
from autorecompute.fates import FATES, NOTHING_HELD, fate, plural

__all__ = ["Plan", "StashRecord", "NodeRecord", "SCHEMA_VERSION", "FATES", "NOTHING_HELD", "fate", "tensor_bytes"]
from autorecompute.problem import GRADIENT

# 13: ``lean_ops`` (``softmax_in_place`` before, softmaxes only); 12: ``engine``; 11: ``outputs``;
# 10: ``loss_reserve``; 9: ``softmax_in_place``; 8: ``extra_seconds``; 7: ``region_remakes``;
# 6: ``region_starts``; 5: the ``rematerialize:through`` action; 4: the ``rematerialize:chain`` action,
# ``delivers`` / ``delivered_by``; 3: adds ``objective``, the ``rematerialize`` action and its ``recipe``;
# 2: ``stash``
SCHEMA_VERSION = 13
_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2,
             "float32": 4, "float64": 8, "complex64": 8, "complex128": 16}


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes a dense tensor of ``shape`` and ``dtype`` holds (0 for an op that makes no tensor)."""
    if not dtype:
        return 0
    size = _ITEMSIZE.get(dtype) or (1 if dtype.startswith("float8") else 0)
    if not size:
        try:
            import torch
            size = getattr(torch, dtype).itemsize
        except (ImportError, AttributeError):
            return 0
    count = 1
    for extent in shape:
        count *= extent
    return count * size


@dataclass(frozen=True)
class StashRecord:
    """One activation the plan offloads, compresses or rematerializes.

    Attributes:
        action: ``"offload"`` (prefetched before backward needs it), ``"offload:late"`` (copied back when
            backward needs it: less memory, the copy not hidden), ``"compress:<dtype>"`` or
            ``"rematerialize"`` (dropped after forward, its op run again on held inputs at first use;
            ``"rematerialize:chain"``: with the ops back past other saved tensors, which it hands over;
            ``"rematerialize:through"``: from the model's inputs, those made again as temporaries).
        owner: the op that makes it.
        nbytes: its size; ``stored_bytes`` what stays on the device meanwhile (0 when offloaded).
        shape, dtype: of the tensor.
        expected_error: ``"exact"`` for offload and rematerialize, the codec's error bound for compress.
        prefetch_event: backward event from which it may be back on the device.
        recipe: for rematerialize, the ops run again to make it (its own op last).
        delivers: for ``"rematerialize:chain"``, the saved tensors its recipe makes again on the way (each
            has its own record, with ``delivered_by`` naming this one).
        delivered_by: the chain-rematerialized tensor whose recipe makes this one again.
    """

    action: str
    owner: str
    nbytes: int
    stored_bytes: int
    shape: tuple[int, ...]
    dtype: str
    expected_error: str
    prefetch_event: int
    recipe: tuple[str, ...] = ()
    delivers: tuple[str, ...] = ()
    delivered_by: str = ""

    @property
    def kind(self) -> ActionKind:
        """Offload, compress or rematerialize (:class:`~autorecompute.decisions.Action` of ``action``)."""
        return Action.parse(self.action).kind

    @property
    def saved_bytes(self) -> int:
        return self.nbytes - self.stored_bytes


@dataclass(frozen=True)
class NodeRecord:
    """One op of the plan, for people: what it makes and where it comes from.

    ``shape`` and ``dtype`` are its (first) output's; ``nbytes`` is every storage the op allocates in forward:
    its outputs and the tensors it makes inside and keeps for backward (a dropout's mask, a norm's statistics,
    a loss's log-softmax), so a scalar loss allocates far more than the 4 bytes its output holds
    (:func:`tensor_bytes` of the shape is those); 0 for a view. ``held_bytes`` is what of it autograd keeps
    for backward when everything is kept: what a plan acts on.
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    held_bytes: int
    flops: int
    module: str


# the kinds of Plan.to_json's top-level fields, checked on reading (a damaged file fails there rather than in
# str(plan); what is inside a field is not checked)
_JSON_KINDS = {**{name: int for name in ("budget", "predicted_peak", "baseline_peak", "minimum_peak", "model_peak",
                                          "loss_reserve", "extra_flops", "baseline_flops", "num_forward")},
               **{name: (int, float) for name in ("solver_time", "solver_gap", "plan_time", "extra_seconds")},
               **{name: str for name in ("solver_status", "objective", "model_name", "signature", "outputs",
                                          "engine")},
               **{name: dict for name in ("decisions", "resident", "nodes", "timeline", "stash")},
               **{name: list for name in ("actions", "edges", "at_peak", "region_starts", "region_remakes",
                                                "lean_ops")}}
_KIND_NAMES = {int: "an int", (int, float): "a number", str: "a string", dict: "an object", list: "a list"}


@dataclass(frozen=True)
class Plan:
    """A memory plan for one input signature of one model.

    Attributes:
        budget: bytes the step must fit in.
        predicted_peak: peak of the rewritten module's step, measured on fake tensors (exact up to kernel
            scratch memory).
        baseline_peak: peak with nothing recomputed (same measurement).
        minimum_peak: lowest peak the solver reached with the allowed actions: verified like
            ``predicted_peak`` when planning needed the minimum-peak plan, else the memory model's estimate
            (``InfeasibleBudgetError.minimum`` is always verified).
        model_peak: the solver's own memory-model estimate of this plan's peak.
        decisions: node name → "keep" / "recompute".
        stash: tensor name → :class:`StashRecord`, for the activations offloaded or compressed.
        extra_flops: FLOPs recomputed in backward; ``baseline_flops`` the FLOPs of the forward.
        extra_seconds: the time the plan adds to a step as the cost model prices it (the ``TransferModel``'s
            speeds: FLOPs, memory-bound bytes, random numbers, calls and regions run again, transfers not
            hidden), whatever the objective: what to hold a measured step against (0.0 in files before 8).
        solver_status / solver_time / solver_gap: CP-SAT's status, seconds and relative optimality gap of
            the cost solve ("trivial" when nothing had to be recomputed, "fallback" when the minimum-peak
            plan was used).
        plan_time: seconds from capture to verified plan.
        resident: bytes live at the start of the step (parameters, buffers, inputs, gradients).
        signature: the input signature this plan is for.
        edges: (producer, consumer, bytes) between decided ops, for graph dumps.
        timeline: predicted bytes per position of the step (forward ops, then backward events) for this
            plan — ``resident``, ``fixed`` (everything no decision changes), ``held`` (activations kept
            for backward), ``recomputed`` — and ``baseline`` (the total with nothing recomputed).
        num_forward: number of forward positions in ``timeline`` (the rest are backward events).
        at_peak: kept ops whose activations are held at the plan's peak: what the peak is made of.
        region_starts: recomputed ops that begin a checkpointed region of their own although the op
            before them is recomputed too (elsewhere a region is a maximal run of recomputed ops).
        region_remakes: those of ``region_starts`` whose region, when it is recomputed, makes the inputs
            the region before it made again (from that region's inputs) instead of holding them.
        lean_ops: ops kept in the lean form capture gave them (the same values for less memory, a little more
            time): softmaxes whose backward writes into their incoming gradient (one attention-sized tensor less
            at their backward), cross-entropies whose log-softmax lives a chunk of rows at a time (one
            vocabulary-sized tensor less); those the budget needs, the others in autograd's form
            (``softmax_in_place``, softmaxes only, in files 9 to 12).
        loss_reserve: bytes held beside the outputs' gradients as backward starts, for a loss the caller
            computes over the outputs (``compile(..., loss_reserve=)``; 0 in files before 10).
        outputs: whether the step keeps the outputs backward does not start from (the logits beside a loss the
            model returns) through backward, ``"kept"``, or drops them before it, ``"dropped"`` (``"kept"`` in
            files before 11).
        engine: what runs the step: ``"eager"`` (the module autorecompute rewrites, run by autograd) or
            ``"torch.compile"`` (its regions compiled by ``torch.compile``, whose partitioner recomputes them;
            the predicted peak is that of the compiled step) (``"eager"`` in files before 12).
    """

    budget: int
    predicted_peak: int
    baseline_peak: int
    minimum_peak: int
    model_peak: int
    decisions: dict[str, str]
    extra_flops: int
    baseline_flops: int
    solver_status: str
    solver_time: float
    solver_gap: float
    plan_time: float
    actions: tuple[str, ...] = ("recompute",)
    objective: str = "time"
    resident: dict[str, int] = field(default_factory=dict)
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    model_name: str = ""
    signature: str = ""
    edges: tuple[tuple[str, str, int], ...] = ()
    timeline: dict[str, list[int]] = field(default_factory=dict)
    num_forward: int = 0
    at_peak: tuple[str, ...] = ()
    stash: dict[str, StashRecord] = field(default_factory=dict)
    region_starts: tuple[str, ...] = ()
    region_remakes: tuple[str, ...] = ()
    lean_ops: tuple[str, ...] = ()
    extra_seconds: float = 0.0
    loss_reserve: int = 0
    outputs: str = "kept"
    engine: str = "eager"

    # ---- queries -------------------------------------------------------------------------------------
    def count(self, action: str) -> int:
        """Number of ops with ``action`` ("keep", "recompute"), or of tensors stashed with it ("offload",
        "compress", "compress:bfloat16", ...)."""
        if action in ("keep", "recompute"):
            return sum(1 for a in self.decisions.values() if a == action)
        return sum(1 for r in self.stash.values() if r.action == action or r.kind.value == action)

    def action_of(self, op: str) -> str:
        """What happens to ``op``'s held outputs: "recompute", "keep", or their stash actions."""
        action = self.decisions.get(op, "keep")
        stashed = sorted({r.action for r in self.stash.values() if r.owner == op})
        if not stashed:
            return action
        # a recomputed op's region output that a kept op saves can still be stashed: "recompute+offload"
        return "+".join((["recompute"] if action == "recompute" else []) + stashed)

    @property
    def extra_flops_ratio(self) -> float:
        """Recomputed FLOPs over forward FLOPs."""
        return self.extra_flops / self.baseline_flops if self.baseline_flops else 0.0

    def _ops(self) -> list[str]:
        """The ops the plan decides, and those whose activations it could stash (all the ops it acts on
        where only offload or compress is allowed), in graph order where recorded."""
        stashed = {r.owner for name, r in self.stash.items() if not name.startswith(GRADIENT)}
        return [*self.nodes, *(name for name in self.decisions if name not in self.nodes),
                *sorted(stashed - set(self.nodes) - set(self.decisions))]

    def table(self) -> list[dict[str, Any]]:
        """One row per op the plan decides or holds activations of, in graph order.

        Keys: ``name``, ``module``, ``shape``, ``dtype``; ``tensor_bytes`` (what its output tensor holds: 4 for
        a float32 scalar), ``bytes`` (every storage the op allocates, see :class:`NodeRecord`; 0 for a view),
        ``held_bytes`` (what autograd keeps of it for backward when nothing is recomputed); ``action`` (the
        plan's: "keep", "recompute", its tensors' stash actions joined by "+"); ``fates`` (the words of
        :data:`FATES` for what happens to what it holds, empty when it holds nothing and is not recomputed)
        and ``held_by`` (fate → bytes: the split of ``held_bytes`` that :meth:`fates` totals); ``flops``;
        ``why``."""
        return [self._row(name) for name in self._ops()]

    def _row(self, name: str) -> dict[str, Any]:
        action = self.action_of(name)
        node = self.nodes.get(name) or NodeRecord((), "", 0, 0, 0, "")
        held_by = self._held_by_fate(name)
        why = (_why(action, node, name in self.at_peak, self._stashed_of(name), held_by.get("kept", 0))
               + ("; begins a region of its own" if name in self.region_starts else "")
               + (" that makes its inputs from the region before again" if name in self.region_remakes else ""))
        return {"name": name, "action": action, "module": node.module, "shape": tuple(node.shape),
                "dtype": node.dtype, "tensor_bytes": tensor_bytes(tuple(node.shape), node.dtype),
                "bytes": node.nbytes, "held_bytes": node.held_bytes, "fates": tuple(held_by), "held_by": held_by,
                "flops": node.flops, "why": why}

    def _held_by_fate(self, op: str) -> dict[str, int]:
        """The bytes ``op`` holds for backward by what happens to them: each stashed tensor's bytes under its
        fate (a compressed one's whole size: its smaller copy is what is left of it), the rest recomputed or
        kept as the op is decided. A recomputed op is listed first (holding nothing, with 0), kept last."""
        held = self.nodes[op].held_bytes if op in self.nodes else 0
        recomputed = self.decisions.get(op) == "recompute"
        split = {"recomputed": 0} if recomputed else {}
        for record in self._stashed_of(op):
            word = fate(record.action)
            split[word] = split.get(word, 0) + record.nbytes
            held -= record.nbytes
        if held > 0 or recomputed:
            rest = "recomputed" if recomputed else "kept"
            split[rest] = split.get(rest, 0) + max(0, held)
        return split

    def _stashed_of(self, op: str) -> list[StashRecord]:
        return [r for r in self.stash.values() if r.owner == op]

    def _held_split(self, op: str) -> dict[str, int]:
        """The bytes ``op`` holds for backward by the action that takes them: each stash action the bytes it
        takes off the device, the rest "recompute" or "keep" as the op is decided (a compressed copy's bytes
        stay on the device: kept)."""
        split: dict[str, int] = {}
        held = self.nodes[op].held_bytes if op in self.nodes else 0
        for record in self._stashed_of(op):
            split[record.action] = split.get(record.action, 0) + record.saved_bytes
            held -= record.saved_bytes
        rest = "recompute" if self.decisions.get(op) == "recompute" else "keep"
        split[rest] = split.get(rest, 0) + max(0, held)
        return split

    def bytes_by_action(self) -> dict[str, int]:
        """Bytes of activations each action takes off the device between forward and backward: recomputed,
        offloaded, saved by each compression dtype; ``keep``: what stays held on the device."""
        totals: dict[str, int] = {}
        for name in self._ops():
            for action, nbytes in self._held_split(name).items():
                totals[action] = totals.get(action, 0) + nbytes
        return totals

    def fates(self) -> dict[str, dict[str, int]]:
        """For each word of :data:`FATES`: ``bytes`` held for backward that it happens to (compressed: the
        tensors' whole size), ``ops`` (rows of :meth:`table` it names) and ``tensors`` (stashed tensors; 0 for
        kept and recomputed, decided per op). What the summary's lines say; the bytes add up to what autograd
        holds with nothing recomputed."""
        stats = {word: {"bytes": 0, "ops": 0, "tensors": 0} for word in FATES}
        for row in self.table():
            for word, nbytes in row["held_by"].items():
                stats[word]["bytes"] += nbytes
                stats[word]["ops"] += 1
        for name, record in self.stash.items():
            if not name.startswith(GRADIENT):
                stats[fate(record.action)]["tensors"] += 1
        return stats

    def rematerialize_flops(self) -> int:
        """Of :attr:`extra_flops`, those the rematerialized tensors' recipes run (the rest: recomputed regions)."""
        return sum(self.nodes[op].flops for record in self.stash.values()
                   if record.kind is ActionKind.REMATERIALIZE for op in record.recipe if op in self.nodes)

    # ---- serialization -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema_version"] = SCHEMA_VERSION
        return data

    def to_json(self, indent: int | None = 1) -> str:
        """JSON text; :meth:`from_json` reads it back into an equal Plan."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"plan JSON must be an object (what Plan.to_json writes), got a {type(data).__name__}")
        version = data.pop("schema_version", None)
        if isinstance(version, bool) or version not in range(1, SCHEMA_VERSION + 1):
            raise ValueError(f"plan JSON has schema_version {version!r}; this autorecompute reads "
                             f"1 to {SCHEMA_VERSION}")
        if version < 13 and "softmax_in_place" in data:
            data["lean_ops"] = data.pop("softmax_in_place")
        known = {f.name for f in fields(cls)}
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING
                         and f.default_factory is MISSING)
        if missing:
            raise ValueError(f"plan JSON lacks {missing}: not a file Plan.to_json / plan.save wrote")
        data = {k: v for k, v in data.items() if k in known}
        for name, kind in _JSON_KINDS.items():
            if name in data and (not isinstance(data[name], kind) or isinstance(data[name], bool)):
                raise ValueError(f"plan JSON's {name!r} is {data[name]!r}, where Plan.to_json writes "
                                 f"{_KIND_NAMES.get(kind, kind)}: the file is damaged")
        try:
            return cls._from_fields(data)
        except (KeyError, TypeError, AttributeError, ValueError) as error:
            raise ValueError(f"plan JSON is damaged ({type(error).__name__}: {error}): not as Plan.to_json writes "
                             "it; save the plan again") from error

    @classmethod
    def _from_fields(cls, data: dict) -> "Plan":
        data["actions"] = tuple(data.get("actions", ()))
        data["nodes"] = {k: NodeRecord(**{**v, "shape": tuple(v["shape"])}) for k, v in data.get("nodes", {}).items()}
        data["edges"] = tuple(tuple(e) for e in data.get("edges", ()))
        data["at_peak"] = tuple(data.get("at_peak", ()))
        data["region_starts"] = tuple(data.get("region_starts", ()))
        data["region_remakes"] = tuple(data.get("region_remakes", ()))
        data["lean_ops"] = tuple(data.get("lean_ops", ()))
        data["stash"] = {k: StashRecord(**{**v, "shape": tuple(v["shape"]), "recipe": tuple(v.get("recipe", ())),
                                           "delivers": tuple(v.get("delivers", ()))})
                         for k, v in data.get("stash", {}).items()}
        return cls(**data)

    @property
    def rewrite(self) -> Rewrite:
        """What the rewrite passes need to carry this plan out (:func:`autorecompute.passes.apply_plan.apply_plan`):
        a plan loaded from JSON applies to a freshly captured model without solving."""
        remakes, starts = set(self.region_remakes), set(self.region_starts)
        ops = {op: Op.REMAKE if op in remakes else Op.NEW_REGION if op in starts else
               Op.RECOMPUTE if decision == "recompute" else Op.KEEP for op, decision in self.decisions.items()}
        stash = {name: Stashed(Action.parse(record.action), record.prefetch_event, record.recipe, record.delivers)
                 for name, record in self.stash.items() if not record.delivered_by}
        return Rewrite(ops, stash, tuple(self.lean_ops))

    # ---- reading ---------------------------------------------------------------------------------------
    def summary(self) -> str:
        """What the plan does, in the words of :data:`FATES`: the lines' counts and bytes are
        :meth:`fates`, the totals of :meth:`table`'s rows."""
        fits = "fits" if self.predicted_peak <= self.budget else "OVER BUDGET"
        return "\n".join([
            f"autorecompute plan for {self.model_name or 'model'} {self.signature}",
            f"  budget          {format_bytes(self.budget):>12}   predicted peak {format_bytes(self.predicted_peak)}"
            f" ({fits})",
            f"  baseline peak   {format_bytes(self.baseline_peak):>12}   minimum peak   "
            f"{format_bytes(self.minimum_peak)}",
            "  resident        " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.resident.items() if v),
            *self._reserve_lines(),
            *self._fate_lines(),
            *self._gradient_lines(),
            *self._lean_lines(),
            *self._cost_lines(),
            f"  solver          {self.solver_status} (least extra {self.objective}), {self.solver_time:.2f} s, "
            # a gap of 1: no lower bound above 0 was proven (a plan of the local search or of windows), not a bad plan
            + (f"gap {100 * self.solver_gap:.1f}%" if self.solver_gap < 1 else "gap unknown (no lower bound proven)")
            + f"; plan made in {self.plan_time:.2f} s",
        ])

    def _reserve_lines(self) -> list[str]:
        lines = [] if self.engine == "eager" else [
            f"  engine          {self.engine}: checkpointed regions its partitioner recomputes; the peak predicted "
            "is the compiled step's"]
        lines += [] if self.outputs == "kept" else [
            "  outputs         dropped before backward: only those backward starts from (the loss) live on, as "
            "in model(x).loss.backward()"]
        if not self.loss_reserve:
            return lines
        return lines + [f"  loss reserve    {format_bytes(self.loss_reserve)} at the start of backward, for a loss "
                        "computed outside the model over its outputs (loss_reserve=0 when the model returns its loss)"]

    def _lean_lines(self) -> list[str]:
        if not self.lean_ops:
            return []
        shown = ", ".join(self.lean_ops[:4]) + (f" and {len(self.lean_ops) - 4} more" if len(self.lean_ops) > 4 else "")
        return [f"  lean ops        {shown}: the same values for less memory (a softmax backward written into its "
                "gradient, a cross-entropy a chunk of rows at a time)"]

    def _fate_lines(self) -> list[str]:
        """One line per fate the plan uses (kept always, recomputed when recomputing is allowed)."""
        rows = self.table()
        holding = sum(1 for row in rows if row["held_bytes"])
        off = sum(n for action, n in self.bytes_by_action().items() if action != "keep")
        lines = [f"  activations     {format_bytes(sum(row['held_bytes'] for row in rows))} held for backward by "
                 f"{holding} of {len(rows)} ops ({len(rows) - holding} hold nothing); {format_bytes(off)} of it off "
                 "the device by action:"]
        for word, stat in self.fates().items():
            if not stat["ops"] and not stat["tensors"] and word != "kept" \
                    and not (word == "recomputed" and "recompute" in self.actions):
                continue
            ops = plural(stat["ops"], "op")
            count = (f"{stat['ops']} of {plural(len(self.decisions), 'op')}" if word == "recomputed"
                     else ops if word == "kept" else f"{plural(stat['tensors'], 'tensor')} of {ops}")
            lines.append(f"    {word:<14} {format_bytes(stat['bytes']):>11}  {count:<24} {self._fate_detail(word)}")
        return lines

    def _fate_detail(self, word: str) -> str:
        """What ``word`` means in this plan, in short, with each stash action's variant and its tensors."""
        records = [r for name, r in self.stash.items() if not name.startswith(GRADIENT) and fate(r.action) == word]
        variants = Counter(r.action for r in records)
        if word == "kept":
            return "on the device from forward to backward"
        if word == "recomputed":
            return "run again in backward by checkpointed regions"
        how = {"offload": "prefetched before backward needs them", "offload:late": "copied back when backward "
               "needs them", "rematerialize": "each by its own op", "rematerialize:chain": "by a chain of ops",
               "rematerialize:through": "from the model's inputs"}
        parts = [f"{n} {how.get(action, 'as ' + action.split(':')[-1])} ({action})"
                 for action, n in sorted(variants.items())]
        if word == "offloaded":
            return "to host memory or disk: " + ", ".join(parts)
        if word == "compressed":
            return (", ".join(parts) + f", held in {format_bytes(sum(r.stored_bytes for r in records))}; expected "
                    f"error {', '.join(sorted({r.expected_error for r in records}))}")
        return "made again alone when backward needs them: " + ", ".join(parts)

    def _cost_lines(self) -> list[str]:
        """The FLOPs and the time the plan adds, side by side, each saying what it counts."""
        rematerialized = self.rematerialize_flops()
        parts = [f"{max(0, self.extra_flops - rematerialized):.3g} recomputing"]
        if self.count("rematerialize"):
            parts.append(f"{rematerialized:.3g} rematerializing")
        stats = self.fates()
        priced = ["ops run again (elementwise ones too)"]
        copies = [plural(stats["offloaded"]["tensors"], "offloaded tensor")] if stats["offloaded"]["tensors"] else []
        if self._gradient_records():
            copies.append(plural(len(self._gradient_records()), "offloaded gradient"))
        if copies:
            priced.append(f"the copies of {' and '.join(copies)} that compute does not hide")
        if stats["compressed"]["tensors"]:
            priced.append(f"encoding and decoding {plural(stats['compressed']['tensors'], 'compressed tensor')}")
        return [f"  extra FLOPs     {self.extra_flops:.3g} ({100 * self.extra_flops_ratio:.1f}% of the forward's "
                f"{self.baseline_flops:.3g}): {', '.join(parts)}; FLOPs of matmuls, convolutions, attention",
                f"  extra time      {1e3 * self.extra_seconds:.3g} ms a step as the cost model prices it: "
                + ", ".join(priced)]

    def gradients_offloaded(self) -> list[str]:
        """Parameters whose gradient goes to the offload tier from its accumulation to the end of backward."""
        return list(self._gradient_records())

    def _gradient_records(self) -> dict[str, StashRecord]:
        """The offloaded parameter gradients' records, by parameter name."""
        return {name[len(GRADIENT):]: record for name, record in self.stash.items() if name.startswith(GRADIENT)}

    def _gradient_lines(self) -> list[str]:
        gradients = self._gradient_records()
        if not gradients:
            return []
        return [f"  gradients       {len(gradients)} parameter gradients offloaded from their accumulation to the end "
                f"of backward, {format_bytes(sum(r.nbytes for r in gradients.values()))}: "
                + ", ".join(list(gradients)[:4]) + (" …" if len(gradients) > 4 else "")]

    def __str__(self) -> str:
        from autorecompute.report import format_table

        return self.summary() + "\n" + format_table(self)

    def __repr__(self) -> str:
        # one line: the generated repr would spell out every node record and the timeline, and printing
        # ``compiled.plans`` would flood a terminal; ``str`` and ``summary()`` say the rest
        stats = self.fates()
        moved = "".join(f", {plural(stats[word]['tensors'], 'tensor')} {word}" for word in (
            "rematerialized", "offloaded", "compressed") if stats[word]["tensors"])
        return (f"<Plan for {self.model_name or 'model'} {self.signature}: budget {format_bytes(self.budget)}, "
                f"predicted peak {format_bytes(self.predicted_peak)}, {self.count('recompute')} of "
                f"{len(self.decisions)} ops recomputed{moved}"
                + (f", {len(self._gradient_records())} gradients offloaded" if self._gradient_records() else "") + ">")

    def to_dot(self) -> str:
        """Graphviz DOT of the decided ops: clusters per module, filled by fate, bytes on edges, a legend."""
        from autorecompute.report import plan_to_dot

        return plan_to_dot(self)

    def save(self, path: str) -> str:
        """Writes the plan as ``.dot``, ``.svg`` (Graphviz), ``.json``, ``.html`` (one self-contained page:
        summary, table, graph, timeline) or ``.png`` (the memory timeline); returns ``path``."""
        from autorecompute.report_html import save_plan

        return save_plan(self, path)

    def plot_memory(self, path: str | None = None, ax=None):
        """Memory over the step, stacked by kind, with the budget and the peak; needs matplotlib.

        Saves a PNG to ``path`` when given; returns the matplotlib Axes.
        """
        from autorecompute.report import plot_memory

        return plot_memory(self, path, ax)


def _why(action: str, node: NodeRecord, held_at_peak: bool, stashed: list[StashRecord] = (), kept: int = 0) -> str:
    """Why the op's held bytes go where they go, in the words of :data:`FATES`."""
    if stashed:
        return _why_stashed(node, stashed) + (f"; {format_bytes(kept)} more kept" if kept else "")
    if action == "recompute":
        if node.held_bytes == 0:
            return "recomputed: holds nothing itself, run again in its region to rebuild a later op's input"
        if node.flops == 0:
            return f"recomputed: frees {format_bytes(node.held_bytes)}, no FLOPs (memory-bound op)"
        return f"recomputed: frees {format_bytes(node.held_bytes)}, {node.held_bytes / node.flops:.3g} B per extra FLOP"
    if node.held_bytes == 0:
        return "nothing held for backward"
    if held_at_peak:
        return f"kept: needed at peak, {format_bytes(node.held_bytes)} held, cheaper to keep than to recompute"
    return f"kept: {format_bytes(node.held_bytes)} not held at the peak"


def _why_stashed(node: NodeRecord, stashed: list[StashRecord]) -> str:
    moved = sum(r.saved_bytes for r in stashed)
    if all(r.kind is ActionKind.OFFLOAD for r in stashed):
        when = "prefetched before backward" if all(r.action == "offload" for r in stashed) \
            else "copied back when backward needs it"
        cheaper = f"; cheaper than recomputing {node.flops:.3g} FLOPs" if node.flops else ""
        return f"offloaded: {format_bytes(moved)} off the device, {when}{cheaper}"
    if all(r.kind is ActionKind.REMATERIALIZE for r in stashed):
        if all(r.delivered_by for r in stashed):
            return (f"rematerialized: {format_bytes(moved)} dropped after forward, made again by the recipe "
                    f"of {', '.join(sorted({r.delivered_by for r in stashed}))} when backward needs it")
        ops = max(len(r.recipe) for r in stashed)
        how = "its op" if ops <= 1 else f"{ops} ops"
        also = sorted({d for r in stashed for d in r.delivers})
        inputs = "the model's inputs" if any(r.action == "rematerialize:through" for r in stashed) \
            else "held inputs"
        return (f"rematerialized: {format_bytes(moved)} dropped after forward, {how} run again on {inputs} "
                f"when backward needs it" + (f" (making {', '.join(also)} again too)" if also else ""))
    if all(r.kind is ActionKind.COMPRESS for r in stashed):
        return f"compressed: {format_bytes(moved)} off the device until backward ({stashed[0].expected_error})"
    return "; ".join(_why_stashed(node, [r]) for r in stashed)
