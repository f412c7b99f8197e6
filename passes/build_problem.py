"""Build the solver's :class:`~autorecompute.problem.Problem` from a profiled graph.

Decides what *may* be recomputed (a graph fact, not a plan decision): ops that mutate state, produce graph
outputs, or have no tensor output are never recomputed; in-place buffer updates that read no activation
(BatchNorm's ``num_batches_tracked += 1``) do not split regions, since the rewrite hoists them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx

from autorecompute.memory_model import memory_timeline
from autorecompute.passes.graph_facts import (device_of, draws_random_numbers, is_mutating, read_before_written,
                                              subgraphs_mutate, written_in_place)
from autorecompute.passes.meta import node_info, node_info_if_profiled, step_profile
from autorecompute.passes.profile import module_path
from autorecompute.passes.profile_records import NodeInfo, StepProfile, TensorInfo
from autorecompute.passes.sharded_units import is_sharded_call
from autorecompute.throughputs import CPU_DISK, TransferModel
from autorecompute.problem import GRADIENT, Activation, Problem, StashOption
from autorecompute.runtime.codecs import codec
from autorecompute.runtime.regions import BATCH_NORM, cpu_rng_state_bytes

LOSSY_COST = {"bfloat16": 1, "float16": 1, "float8": 2, "int8": 2}   # per byte compressed: prefer exact dtypes
MAX_PREFETCH_LEAD = 8   # backward positions a prefetch may start before the first use
MAX_RECIPE_OPS = 8      # ops one rematerialization may run again (an elementwise chain back to held inputs)
MAX_CHAIN_HEAVY_OPS = 1  # ops with FLOPs a chain rematerialization may run (one matmul per tensors it frees)
MAX_THROUGH_HEAVY_OPS = 2  # ops with FLOPs a rematerialization from the model's inputs may run (two convolutions)


def is_transparent(node: torch.fx.Node) -> bool:
    """Nodes that neither are recomputed nor split a region: the rewrite moves them ahead of it."""
    info = node_info(node)
    return (node.target is operator.getitem) or (is_mutating(node) and not info.reads)


def is_recomputable(node: torch.fx.Node, output_tensors: set[str]) -> bool:
    info = node_info(node)
    if is_mutating(node) or node.target is operator.getitem:
        return False
    if unreplayable(node):     # a region's recomputation would update its state again (InstanceNorm's statistics)
        return False
    if any(name in output_tensors for name in info.creates):
        return False
    if not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
        return False
    return True


def is_random(node: torch.fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


# composite ops whose schema does not say they update their running statistics in training mode
_UPDATES_STATE = {torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default}
# of those, the ones a recipe runs again without the update (``runtime.regions.batch_norm_once``: in training
# mode the output depends on the batch statistics alone)
REPLAYABLE = {BATCH_NORM}


def updates_state(node: torch.fx.Node) -> bool:
    """Whether running ``node`` again would update state (BatchNorm's running statistics, a write alias)."""
    if node.target in _UPDATES_STATE:
        # (input, weight, bias, running_mean, running_var, training / use_input_stats, ...): only with running
        # statistics, and in training mode
        arguments = node.target._schema.arguments
        bound = {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
                 for i, a in enumerate(arguments)}
        return bound["running_mean"] is not None and bool(bound[arguments[5].name])
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return subgraphs_mutate(node)
    if is_sharded_call(node):   # FSDP2's gathers and hooks: once per forward
        return True
    return is_mutating(node)


def recompute_cost(node: torch.fx.Node, written: int, device: TransferModel) -> int:
    """Running ``node`` again, in FLOP-equivalents: its FLOPs, the bytes it writes at the device's
    memory-bound speed, the random numbers it draws (a random op: one per element of its result) and one
    call."""
    seconds = device.op_seconds + written / device.memory_bytes_per_second
    if is_random(node) and written:     # (dropout with p=0, or in eval mode, returns its input: no numbers drawn)
        # one number per element of the result, not per byte written: dropout also writes its mask, which
        # draws no numbers of its own
        seconds += _result_bytes(node) / device.random_bytes_per_second
    return 1 + node_info(node).flops + device.seconds_to_cost(seconds)


def _result_bytes(node: torch.fx.Node) -> int:
    """Bytes of ``node``'s (first) result tensor."""
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        value = next((v for v in value if isinstance(v, torch.Tensor)), None)
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


@dataclass(frozen=True)
class StepFacts:
    """What :func:`build_problem` reads of a profiled graph once and its steps share: the ops of the chain, which
    may run again, and what running each again costs."""

    profile: StepProfile
    nodes: dict[str, torch.fx.Node]
    chain: tuple[str, ...]             # ops in forward order, less the transparent ones
    recomputable: frozenset[str]
    cost: dict[str, int]               # op → running it again, in FLOP-equivalents
    device: TransferModel              # the speeds ``cost`` is priced at

    @property
    def num_forward(self) -> int:
        return len(self.profile.order)

    @property
    def num_positions(self) -> int:
        return self.num_forward + len(self.profile.backward_events)

    @property
    def last(self) -> int:
        return self.num_positions - 1

    def backward_position(self, op: str) -> int | None:
        """The position of ``op``'s backward, None when it has none."""
        event = node_info(self.nodes[op]).backward_event
        return None if event is None else self.num_forward + event

    def position(self, op: str) -> int:
        """The position of ``op``'s backward, the last when it has none (what it saves is kept to the end)."""
        p = self.backward_position(op)
        return self.last if p is None else p

    def backward_ops(self) -> dict[int, str]:
        """Backward position → the chain op whose backward runs there."""
        in_chain = set(self.chain)
        return {self.num_forward + i: op for i, op in enumerate(self.profile.backward_events) if op in in_chain}


def build_problem(gm: torch.fx.GraphModule, *, recompute: bool = True, offload: TransferModel | None = None,
                  compress_dtypes: tuple[str, ...] = (), device: TransferModel | None = None,
                  offload_gradients: bool = True, regions_only: bool = False) -> Problem:
    """The planning problem of a graph that :func:`~autorecompute.passes.profile.profile_step` annotated.

    Args:
        recompute: whether ops may be recomputed (in regions, or one at a time: ``rematerialize``).
        offload: the transfer model when activations may be offloaded (None: they may not).
        compress_dtypes: the dtypes activations may be compressed to (see ``runtime/codecs.py``).
        device: the speeds recompute costs are computed with (None: ``offload``'s, else the CPU's).
        offload_gradients: whether parameter gradients may be offloaded too (with ``offload``).
        regions_only: recomputation in plain checkpointed regions only, what torch.compile's partitioner is
            told: no op rematerialized on its own, no region making its inputs again.
    """
    facts = step_facts(gm, recompute, device or offload or CPU_DISK)
    activations = _activations(facts)
    options: dict[str, tuple[StashOption, ...]] = {}
    if recompute and not regions_only:
        options.update(_rematerialize_options(facts, activations))
    if offload is not None or compress_dtypes:
        for name, found in _stash_options(facts, activations, offload, compress_dtypes).items():
            options[name] = options.get(name, ()) + found
    if offload is not None and offload_gradients:
        for act, option in gradient_offloads(gm, facts.backward_position, facts.last, offload):
            activations.append(act)
            options[act.name] = (option,)
    nodes, chain = facts.nodes, facts.chain
    chain_nodes = [nodes[op] for op in chain]
    random_ops = frozenset(node.name for node in chain_nodes if draws_random_numbers(node))
    problem = Problem(
        chain=chain, recomputable=facts.recomputable, cost=facts.cost,
        flops={op: node_info(nodes[op]).flops for op in chain}, activations=tuple(activations),
        fixed=tuple([0] * facts.num_positions), num_forward=facts.num_forward, backward_op=facts.backward_ops(),
        bytes_at_rest=dict(facts.profile.resident),
        region_cost=facts.device.seconds_to_cost(facts.device.region_seconds), stash_options=options,
        saves=_saves(facts),
        # random ops (ops that update state are not recomputable at all)
        unremakeable=frozenset(chain) if regions_only else random_ops,
        random_ops=random_ops, rng_state_bytes=_rng_state_bytes(chain_nodes),
        repeats=repeated_ops(chain_nodes, facts.recomputable), blocks=repeated_blocks(chain_nodes),
        forward_position={op: node_info(nodes[op]).position for op in chain})
    return calibrate(problem, _measured(facts.profile))


def _rng_state_bytes(chain: list[torch.fx.Node]) -> int:
    """What a checkpointed region that draws random numbers keeps on the step's device to replay them: the
    CPU generator's state on a CPU step (:func:`~autorecompute.runtime.regions.rng_state_stand_in`); none on
    CUDA (host memory) or when planning on ``meta`` for a GPU."""
    return cpu_rng_state_bytes() if device_of(chain) == "cpu" else 0


def step_facts(gm: torch.fx.GraphModule, recompute: bool, device: TransferModel) -> StepFacts:
    """The chain of a profiled ``gm``, which of its ops may run again (none unless ``recompute``), and their costs
    at ``device``'s speeds."""
    profile = step_profile(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    outputs = {name for name, t in profile.tensors.items() if t.is_output}
    chain = tuple(op for op in profile.order if not is_transparent(nodes[op]))
    written = written_in_place(gm.graph)    # re-running their op would not re-run the writes
    written |= read_before_written(gm.graph)    # re-run, they would read what the writes made
    recomputable = frozenset(op for op in chain if recompute and op not in written
                             and is_recomputable(nodes[op], outputs))
    cost = {op: recompute_cost(nodes[op], _written_bytes(profile, nodes[op]), device) for op in chain}
    return StepFacts(profile, nodes, chain, recomputable, cost, device)


def _activations(facts: StepFacts) -> list[Activation]:
    """The tensors forward makes that a decision can drop (not graph outputs, not empty), with the positions
    they are needed until: their savers' backwards and their recomputable readers'."""
    in_chain = set(facts.chain)
    activations = []
    for t in facts.profile.tensors.values():
        if t.is_output or t.nbytes == 0:
            continue
        saver_ends = tuple(facts.position(s) for s in t.savers)
        save_end = max(saver_ends, default=-1)
        readers = tuple(c for c in t.readers if c in facts.recomputable and c != t.owner)
        activations.append(Activation(
            name=t.name, owner=t.owner if t.owner in in_chain else f"<{t.owner}>", nbytes=t.nbytes,
            hold_start=t.last_forward_use + 1, savers=tuple(t.savers), readers=readers,
            save_end=save_end, read_end=max([save_end, *[facts.position(c) for c in readers]]),
            saver_ends=saver_ends))
    return activations


def _rematerialize_options(facts: StepFacts, activations: list[Activation]) -> dict[str, tuple[StashOption, ...]]:
    """Each activation's rematerializations, of every kind that makes it."""
    by_name = {act.name: act for act in activations}
    options = {}
    for act in activations:
        found = tuple(option for kind in REMATERIALIZE_KINDS
                      if (option := rematerialize_option(facts.nodes.get(act.name), act, facts, by_name, kind))
                      is not None)
        if found:
            options[act.name] = found
    return options


def _stash_options(facts: StepFacts, activations: list[Activation], offload: TransferModel | None,
                   compress_dtypes: tuple[str, ...]) -> dict[str, tuple[StashOption, ...]]:
    """Each stashable activation's offloads and compressions (:func:`stash_options`)."""
    cost, backward_op = facts.cost, facts.backward_ops()
    work = [cost.get(op, 0) for op in facts.profile.order]
    work += [2 * cost.get(backward_op.get(p, ""), 0) for p in range(facts.num_forward, facts.num_positions)]
    in_chain = set(facts.chain)
    options = {}
    for act in activations:
        # graph values, and tensors an op saves without returning them (stashed around that op)
        stashable = (act.savers and act.save_end >= act.hold_start and act.owner in in_chain
                     and (act.name in facts.nodes or act.savers == (act.owner,)))
        if stashable:
            found = stash_options(facts.profile.tensors[act.name], act, work, facts.num_forward,
                                  [node_info(facts.nodes[s]).position for s in act.savers if s in facts.nodes],
                                  [facts.backward_position(s) for s in act.savers], facts.last, offload,
                                  compress_dtypes, facts.device)
            if found:
                options[act.name] = found
    return options


def _saves(facts: StepFacts) -> dict[str, bool]:
    """For each chain op that saves a tensor: whether checkpoint's early stop runs it again when it ends a
    region (True: it keeps a tensor it makes once it has run; False: it saves before it does its work — only
    tensors made before it, or, for an op with FLOPs, its last save comes before any of them: a 4-D matmul's
    copy before its bmm)."""
    saves = {}
    for op in facts.chain:
        info = node_info(facts.nodes[op])
        if info.saves or info.saves_static_bytes:
            if info.flops:
                saves[op] = info.flops_before_last_save > 0
            else:
                saves[op] = bool(set(info.saves) & set(info.creates))
    return saves


def _measured(profile: StepProfile) -> list[int]:
    """The measured bytes at every position: each forward op's peak, then each backward event's."""
    return [profile.resident_bytes + p for p in [*profile.forward_peaks, *profile.backward_peaks]]


def repeated_ops(nodes: list[torch.fx.Node], among: frozenset[str] | None = None) -> tuple[tuple[str, ...], ...]:
    """Groups of ``nodes`` (those in ``among``; None: all) that play one part in repeated blocks.

    A block is a module at an index of its parent (``blocks.3``, ``layers.0.mlp.2``). Blocks of one parent
    that call the same ops, in the same order, with results of the same shapes and dtypes, repeat each
    other: their i-th ops form a group. Blocks that differ (an MLP's two linear layers, at ``mlp.0`` and
    ``mlp.2``; a layer that calls an op once more than the others) do not.

    Example: two blocks of ``relu`` then ``mul``.

        >>> import torch
        >>> class Block(torch.nn.Module):
        ...     def forward(self, x):
        ...         return torch.relu(x) * 2
        >>> blocks = torch.nn.Sequential(Block(), Block())
        >>> nodes = list(torch.fx.symbolic_trace(blocks).graph.nodes)   # records each node's module path
        >>> repeated_ops(nodes)
        (('relu', 'relu_1'), ('mul', 'mul_1'))
    """
    groups: dict[tuple[str, ...], None] = {}
    for family in _alike_blocks(nodes).values():
        for ith in zip(*family.values()):
            group = tuple(node.name for node in ith if among is None or node.name in among)
            if len(group) > 1:
                groups[group] = None
    return tuple(groups)


def repeated_blocks(nodes: list[torch.fx.Node]) -> tuple[tuple[str, ...], ...]:
    """The ops of each repeated block (in ``nodes``' order) of the outermost stacks: the blocks of one parent
    that repeat each other (:func:`repeated_ops`), leaving out those inside another such block (a layer's
    heads). An encoder's and a decoder's layers are two stacks; each block is one entry.

        >>> import torch
        >>> class Block(torch.nn.Module):
        ...     def forward(self, x):
        ...         return torch.relu(x) * 2
        >>> nodes = list(torch.fx.symbolic_trace(torch.nn.Sequential(Block(), Block())).graph.nodes)
        >>> repeated_blocks(nodes)
        (('relu', 'mul'), ('relu_1', 'mul_1'))
    """
    families = [family for family in _alike_blocks(nodes).values() if len(family) > 1]
    paths = {path for family in families for path in family}
    outermost = [family for family in families
                 if not any(path.startswith(other + ".") for path in family for other in paths)]
    return tuple(tuple(node.name for node in called) for family in outermost for called in family.values())


def _alike_blocks(nodes: list[torch.fx.Node]) -> dict[tuple, dict[str, list[torch.fx.Node]]]:
    """Blocks (modules at an index of their parent: ``blocks.3``, ``layers.0.mlp.2``) that repeat each other,
    by (parent, what they call): block path → the nodes it (or a module inside it) calls, in order."""
    calls: dict[str, list[torch.fx.Node]] = {}
    for node in nodes:
        parts = module_path(node).split(".")
        for end, part in enumerate(parts):
            if part.isdigit():
                calls.setdefault(".".join(parts[:end + 1]), []).append(node)
    alike: dict[tuple, dict[str, list[torch.fx.Node]]] = {}
    for block, called in calls.items():
        parent = block.rpartition(".")[0]
        alike.setdefault((parent, tuple(_signature(node) for node in called)), {})[block] = called
    return alike


def _signature(node: torch.fx.Node) -> tuple:
    """What a node calls and the shapes and dtypes of its results."""
    val = node.meta.get("val")
    results = val if isinstance(val, (tuple, list)) else (val,)
    return str(node.target), tuple((tuple(v.shape), v.dtype) for v in results if isinstance(v, torch.Tensor))


def stash_options(tensor: TensorInfo, act: Activation, work: list[int], num_forward: int, saver_positions: list[int],
                  saver_backward: list[int | None], last: int, offload: TransferModel | None,
                  compress_dtypes: tuple[str, ...], device: TransferModel = CPU_DISK) -> tuple[StashOption, ...]:
    """The ways ``act`` may be stashed, with their cost.

    Offload: the copy out runs from the first save to the last forward use and the copy back from the
    prefetch point to the first backward use; only the transfer time that the compute in those windows
    (``work``, cost units per position) cannot hide is cost, plus a fixed overhead per transfer. The
    prefetch point is the latest that hides the copy back (at most ``MAX_PREFETCH_LEAD`` positions ahead).
    ``offload:late`` skips the prefetch: the copy back starts at the first use (less memory, more time).
    Where transfers do not overlap the compute (``offload.overlaps_compute`` False: a CPU's disk tier) nothing
    is hidden and a prefetch would only hold memory earlier: ``offload:late`` alone.
    Compress: the casts' bytes, plus a small penalty per byte for the loss of precision.
    """
    pack = min(saver_positions, default=act.hold_start - 1)
    first_use = first_backward_use(saver_backward or [act.save_end], last, num_forward)
    options = []
    if offload is not None:
        write = act.nbytes / offload.write_bytes_per_second
        read = act.nbytes / offload.read_bytes_per_second
        overhead = 2 * offload.per_transfer_seconds
        restored_from, hidden_read = first_use, 0.0
        if offload.overlaps_compute:
            hidden_write = offload.compute_seconds(sum(work[pack + 1:act.hold_start]))
            while restored_from > max(num_forward, first_use - MAX_PREFETCH_LEAD) and hidden_read < read:
                restored_from -= 1
                hidden_read += offload.compute_seconds(work[restored_from])
            exposed_write = max(0.0, write - hidden_write) + overhead
            options.append(StashOption("offload", stored_bytes=0, stored_from=act.hold_start,
                                       restored_from=restored_from,
                                       cost=1 + offload.seconds_to_cost(exposed_write + max(0.0, read - hidden_read))))
        else:
            exposed_write = write + overhead     # nothing hides a copy, and a prefetch would only hold memory
        if restored_from < first_use or not offload.overlaps_compute:
            # without prefetch: less memory in backward, the whole copy back exposed
            options.append(StashOption("offload:late", stored_bytes=0, stored_from=act.hold_start,
                                       restored_from=first_use,
                                       cost=1 + offload.seconds_to_cost(exposed_write + read)))
    return _with_compress(options, tensor, act, pack, first_use, compress_dtypes, device)


def _with_compress(options: list[StashOption], tensor: TensorInfo, act: Activation, pack: int, first_use: int,
                   compress_dtypes: tuple[str, ...], device: TransferModel) -> tuple[StashOption, ...]:
    """``options`` and one compress option per dtype in ``compress_dtypes`` that takes ``tensor``."""
    dtype = getattr(torch, tensor.dtype, None)
    numel = 1
    for size in tensor.shape:
        numel *= size
    whole = dtype is not None and numel * dtype.itemsize == act.nbytes
    for name in compress_dtypes:
        chosen = codec(name)
        if whole and chosen.accepts(dtype):
            stored = chosen.stored_bytes(tensor.shape)
            cast_cost = (device.seconds_to_cost(device.stash_seconds + 2 * device.op_seconds
                                                + (stored + act.nbytes) / device.memory_bytes_per_second)
                         + LOSSY_COST[name] * act.nbytes)
            packing, unpacking = chosen.transient_bytes(tuple(tensor.shape), dtype)
            options.append(StashOption(f"compress:{name}", stored_bytes=stored, stored_from=pack,
                                       restored_from=first_use, cost=1 + cast_cost, transient_bytes=unpacking,
                                       packing_bytes=packing))
    return tuple(options)


def gradient_offloads(gm: torch.fx.GraphModule, backward_position, last: int,
                      offload: TransferModel) -> list[tuple[Activation, StashOption]]:
    """Parameter gradients that may go to the offload tier from their accumulation to the end of backward.

    A gradient made at the backward of the parameter's one user sits on the device, unread, until the
    optimizer needs it after backward: offloaded, it leaves as soon as it is accumulated and comes back
    when backward ends (``runtime/stash.py``). Offered for parameters with one user op whose backward
    runs (a second use would accumulate into a gradient already gone); the copy out and back are exposed.
    """
    found = []
    for node in gm.graph.find_nodes(op="get_attr"):
        try:
            param = gm.get_parameter(node.target)
        except AttributeError:
            continue                                   # a buffer or constant: no gradient
        users = list(node.users)
        if not param.requires_grad or len(users) != 1 or users[0].op != "call_function":
            continue
        made_at = backward_position(users[0].name) if node_info_if_profiled(users[0]) is not None else None
        if made_at is None or made_at >= last:
            continue
        nbytes = param.numel() * param.element_size()
        name = f"{GRADIENT}{node.target}"
        act = Activation(name=name, owner=f"<{name}>", nbytes=nbytes, hold_start=made_at + 1, savers=(f"<{name}>",),
                         readers=(), save_end=last, read_end=last)
        seconds = nbytes / offload.write_bytes_per_second + nbytes / offload.read_bytes_per_second
        found.append((act, StashOption("offload", stored_bytes=0, stored_from=made_at + 1, restored_from=last,
                                       cost=1 + offload.seconds_to_cost(seconds + 2 * offload.per_transfer_seconds))))
    return found


def first_backward_use(saver_backward: list[int | None], last: int, num_forward: int) -> int:
    """The first backward position that needs a tensor its savers (at ``saver_backward``; None: a saver
    whose backward did not run, so the last position) keep: where it must be back on the device (the last
    position when the step ran no backward event at all)."""
    return min(last, max(num_forward, min(last if p is None else p for p in saver_backward)))


REMATERIALIZE_KINDS = ("plain", "chain", "through")
_REMATERIALIZE_ACTION = {"plain": "rematerialize", "chain": "rematerialize:chain",
                         "through": "rematerialize:through"}


def rematerialize_option(node: torch.fx.Node | None, act: Activation, facts: StepFacts,
                         activations: dict[str, Activation], kind: str = "plain") -> StashOption | None:
    """Dropping ``act`` after forward and running its op again — with the ops that made its inputs, back to
    inputs that stay on the device anyway — when backward first needs it. A checkpointed region cannot do
    this without recomputing the op that saved ``act`` too. ``activations``: every activation, by name.

    The recipe walks back from ``act``'s op through inputs that are not held long enough (at most
    ``MAX_RECIPE_OPS`` ops, an elementwise chain such as a tanh-GELU) to *base* inputs that are: a saver
    of the base whose backward comes no earlier than ``act``'s last use is kept (``needs_kept``) and the
    base is not stashed (``needs_unstashed``); parameters and inputs are always bases. The recipe's ops
    stay in the outer graph (``needs_kept``). The runtime holds references to the bases only, so they live
    no longer than autograd keeps them anyway. Only ``act``'s own op may be random (its RNG state is
    replayed). Offered for one contiguous tensor output.

    With ``kind="chain"`` (action ``"rematerialize:chain"``) the walk also goes through held inputs that are
    saved activations the recipe can hand over (``delivers``: dropped after forward as well, back from
    ``act``'s first use), while the recipe runs at most ``MAX_CHAIN_HEAVY_OPS`` ops with FLOPs: a GELU output
    made from the linear output before the previous GELU frees that linear output and the GELU output it
    reads for one matmul, where two single-op recipes cannot (each would need the other's tensor held).
    Offered only when it delivers something.

    With ``kind="through"`` (action ``"rematerialize:through"``) the walk goes through every input back to
    the model's inputs and parameters, held or not, running at most ``MAX_THROUGH_HEAVY_OPS`` ops with FLOPs:
    the saved tensors it passes are made again as temporaries, not handed over, so each keeps its own choice
    — often its own rematerialization, later: a tensor recomputed twice, which neither a region (recomputed
    once, held to its last use) nor a chain can do. Near a CNN's input, where the largest tensors are, each
    tensor of the first block can then be made from the image just before its own backward (Checkmate's
    optimum recomputes there too). Offered only when it passes a held saved tensor. Its temporaries
    (``transient_bytes``) count at its first use.

    BatchNorm in training mode runs again without updating its running statistics
    (``runtime.regions.batch_norm_once``), in recipes as in regions.
    """
    if kind not in _REMATERIALIZE_ACTION:
        raise ValueError(f"kind={kind!r} must be one of {REMATERIALIZE_KINDS}")
    if not _may_rematerialize(node, act, facts):
        return None
    walk = _RecipeWalk(node, act, facts, activations, kind)
    return walk.option() if walk.run() else None


def _may_rematerialize(node: torch.fx.Node | None, act: Activation, facts: StepFacts) -> bool:
    """Whether ``act`` is the whole tensor of a recomputable op that saves it for backward."""
    if node is None or node.op != "call_function" or act.owner != node.name or node.name not in facts.recomputable:
        return False
    if not act.savers or act.save_end < act.hold_start or not _whole_tensor(node, act.nbytes):
        return False
    # the RNG state is replayed for the CPU and CUDA generators only
    return not (is_random(node) and node.meta["val"].device.type not in ("cpu", "cuda"))


class _RecipeWalk:
    """One walk back from ``act``'s op (see :func:`rematerialize_option`): the ops the recipe runs, the bases it
    reads and what it hands over, gathered as it goes."""

    def __init__(self, node: torch.fx.Node, act: Activation, facts: StepFacts, activations: dict[str, Activation],
                 kind: str):
        self.node, self.act, self.facts, self.activations, self.kind = node, act, facts, activations, kind
        self.first_use = self._first_use(act)
        self.recipe: dict[str, torch.fx.Node] = {}
        self.needs_kept: list[str] = []
        self.needs_unstashed: list[str] = []
        self.delivers: list[str] = []
        self.heavy = int(node_info(node).flops > 0)     # ops with FLOPs in the recipe, counted as they join it
        self.passes_held = False                        # (through) it makes a held saved tensor again on its way
        self.visiting = [node]

    def _first_use(self, act: Activation) -> int:
        return first_backward_use([self.facts.backward_position(s) for s in act.savers], self.facts.last,
                                  self.facts.num_forward)

    def run(self) -> bool:
        """Walks the recipe; whether it makes ``act`` as its kind must."""
        while self.visiting:
            n = self.visiting.pop()
            if n.name in self.recipe:
                continue
            if not self._may_join(n):
                return False
            self.recipe[n.name] = n
            if not all(self._take(arg) for arg in n.all_input_nodes):
                return False
        if self.kind == "chain" and not self.delivers:
            return False
        return self.kind != "through" or self.passes_held

    def _may_join(self, n: torch.fx.Node) -> bool:
        """Whether the recipe may run ``n``: a plannable op with one output (an op's internal saves, a dropout
        mask, are temporaries), not random unless it is ``act``'s own, and room left in the recipe."""
        info = node_info(n) if n.op == "call_function" else None
        if info is None or n.name not in self.facts.recomputable or (n is not self.node and is_random(n)):
            return False
        if any(".saved" not in c for c in info.creates[1:]) or len(self.recipe) == MAX_RECIPE_OPS:
            return False
        return n is not self.node or info.creates[:1] == [self.act.name]

    def _take(self, arg: torch.fx.Node) -> bool:
        """Takes input ``arg`` of a recipe op as a base the recipe reads, or as an op it runs again too; False
        when it can be neither."""
        if arg.op in ("placeholder", "get_attr"):
            return True                       # parameters, buffers, inputs: always on the device
        arg_info = node_info(arg) if arg.op == "call_function" else None
        if arg_info is None:
            return False
        storage = arg_info.creates[0] if arg_info.creates else (
            arg_info.reads[0] if len(arg_info.reads) == 1 else None)
        if storage is None:
            return False
        source = self.activations.get(storage)
        if source is None:
            tensor = self.facts.profile.tensors.get(storage)
            if tensor is None or tensor.is_output or not tensor.nbytes:
                return True                   # graph outputs live to the end
        guards = [s for s in source.savers if self.facts.position(s) >= self.act.save_end] \
            if source is not None else []
        if guards and self.kind != "through" and storage not in self.delivers and not (
                self._deliverable(arg, storage) and self.heavy + (arg_info.flops > 0) <= MAX_CHAIN_HEAVY_OPS):
            self._read_base(arg, storage, guards)
            return True
        return self._run_again(arg, arg_info, storage, bool(guards))

    def _read_base(self, arg: torch.fx.Node, storage: str, guards: list[str]) -> None:
        """A base: held by a kept saver until ``act``'s last use."""
        if not any(s not in self.facts.recomputable for s in guards):
            self.needs_kept.append(max(guards, key=self.facts.position))
        if arg.name in self.facts.recomputable:
            self.needs_kept.append(arg.name)   # its value is read from the outer graph
        self.needs_unstashed.append(storage)

    def _run_again(self, arg: torch.fx.Node, arg_info: NodeInfo, storage: str, held: bool) -> bool:
        """``arg`` made again too; False when that takes the recipe over its ops with FLOPs."""
        if held and self.kind == "through":
            self.passes_held = True           # held, but made again here as a temporary of the recipe
        elif held and storage not in self.delivers:
            self.delivers.append(storage)     # held, but made again here and handed over
        if arg.name not in self.recipe and arg not in self.visiting:
            self.heavy += arg_info.flops > 0
            if self.kind == "through" and self.heavy > MAX_THROUGH_HEAVY_OPS:
                return False
        self.visiting.append(arg)
        return True

    def _deliverable(self, arg: torch.fx.Node, storage: str) -> bool:
        """A held input the chain may make again and hand over: a whole saved tensor of a plain op, needed
        in backward no earlier than ``act``."""
        source = self.activations.get(storage)
        if self.kind != "chain" or source is None or arg.name != storage or arg.name not in self.facts.recomputable:
            return False
        if is_random(arg) or not _whole_tensor(arg, source.nbytes):
            return False
        if not source.savers or source.save_end < source.hold_start:
            return False
        return self._first_use(source) >= self.first_use

    def option(self) -> StashOption:
        """The walked recipe as a stash option."""
        facts, recipe = self.facts, self.recipe
        order = sorted(recipe, key=lambda name: node_info(recipe[name]).position)
        overhead = facts.device.seconds_to_cost(facts.device.stash_seconds) * (1 + len(self.delivers))
        # (plain and chain recipes make little besides their result: their temporaries are left to verification)
        transient = _transient(facts.profile, [recipe[n] for n in order], self.first_use - facts.num_forward) \
            if self.kind == "through" else 0
        return StashOption(_REMATERIALIZE_ACTION[self.kind], stored_bytes=0, stored_from=self.act.hold_start,
                           restored_from=self.first_use, cost=overhead + sum(facts.cost[op] for op in order),
                           needs_kept=tuple(dict.fromkeys([*order, *self.needs_kept])),
                           needs_unstashed=tuple(dict.fromkeys(self.needs_unstashed)), recipe=tuple(order),
                           delivers=tuple(self.delivers), transient_bytes=transient)


def unreplayable(node: torch.fx.Node) -> bool:
    """An op a recipe cannot run again: it would update state a second time (BatchNorm is replayed without)."""
    return updates_state(node) and node.target not in REPLAYABLE


def _transient(profile, ops: list[torch.fx.Node], event: int) -> int:
    """What a recipe run at the start of backward event ``event`` adds to that event's peak: its
    temporaries (:func:`_recipe_temporaries`) beyond what the event itself allocates after them."""
    headroom = profile.headroom(event) if event >= 0 else 0    # (no backward event: none to share with)
    return max(0, _recipe_temporaries(profile, ops) - headroom)


def _recipe_temporaries(profile, ops: list[torch.fx.Node]) -> int:
    """Peak bytes of a recipe's temporaries besides its result: running ``ops`` in order, the tensors made
    by earlier ops that a later op still reads, and what the op allocates, less the final result."""
    made = {n.name: sum(profile.tensors[t].nbytes for t in node_info(n).creates) for n in ops}
    by_name = {n.name: n for n in ops}

    def storage(name: str) -> str:
        """The recipe op whose allocation ``name`` shares (a view keeps its base alive)."""
        while made.get(name) == 0 and by_name[name].all_input_nodes \
                and by_name[name].all_input_nodes[0].name in made:
            name = by_name[name].all_input_nodes[0].name
        return name

    last_read = {}
    for i, n in enumerate(ops):
        for arg in n.all_input_nodes:
            if arg.name in made:
                last_read[storage(arg.name)] = i
    peak = 0
    for i, n in enumerate(ops):
        live = sum(made[o.name] for o in ops[:i] if last_read.get(o.name, -1) >= i)
        peak = max(peak, live + made[n.name])
    result = profile.tensors[node_info(ops[-1]).creates[0]].nbytes
    return max(0, peak - result)


def _whole_tensor(node: torch.fx.Node, nbytes: int) -> bool:
    """``node`` makes one contiguous tensor of ``nbytes`` (a rematerialization makes it whole again)."""
    value = node.meta.get("val")
    return (isinstance(value, torch.Tensor) and value.is_contiguous()
            and value.numel() * value.element_size() == nbytes)


def _written_bytes(profile, node: torch.fx.Node) -> int:
    return sum(profile.tensors[name].nbytes for name in node_info(node).creates)


def calibrate(problem: Problem, measured: list[int]) -> Problem:
    """Sets ``fixed`` so that the all-keep plan predicts exactly ``measured`` at every position."""
    modelled = memory_timeline(problem, {})
    fixed = tuple(m - v for m, v in zip(measured, modelled))
    return replace(problem, fixed=fixed)
