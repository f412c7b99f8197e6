"""Facts about a captured graph's in-place writes and views, read off the ops' schemas.

The capture transforms use them to tell what they may rewrite; :mod:`~autorecompute.passes.build_problem` uses
them to tell which ops may run again: an op whose result a later op writes in place, or that reads a tensor a
later op writes, would not compute the same values a second time. Which ops draw random numbers (a region that
runs one replays the RNG state) and the device a graph runs on, for both.
"""
from __future__ import annotations

import operator

import torch
import torch.fx


def is_mutating(node: torch.fx.Node) -> bool:
    """Whether ``node`` writes into one of its arguments (``add_``, ``relu_``, ``copy_``...)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def is_view(node: torch.fx.Node) -> bool:
    """Whether ``node``'s (first) result shares storage with an argument (``view``, ``transpose``, ``add_``)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def written_operands(node: torch.fx.Node) -> list:
    """The values ``node`` writes in place, read off its schema (``self`` of ``add_``, ``out`` of an out= op)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    return [node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            for i, argument in enumerate(schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write]


def storage_root(value):
    """The node whose storage ``value`` is: through views and in-place writes (which return what they wrote)
    to the op that allocated it, or the input / attribute."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function" and value.args \
            and (is_mutating(value) or is_view(value)):
        written = written_operands(value)
        value = written[0] if written else value.args[0]
    return value


def written_in_place(graph: torch.fx.Graph) -> set[str]:
    """Ops whose result a later op writes in place (``empty_like`` that ``bernoulli_`` fills, a tensor other ops
    also read and ``add_`` updates): running such an op again would not run the writes."""
    written = set()
    for node in graph.nodes:
        if node.op == "call_function" and is_mutating(node):
            for value in written_operands(node):
                root = storage_root(value)
                if isinstance(root, torch.fx.Node) and root.op == "call_function":
                    written.add(root.name)
    return written


def _subgraphs(node: torch.fx.Node) -> list[tuple[int, torch.fx.GraphModule]]:
    """A higher-order op's subgraphs, with their positions among its arguments."""
    owner = node.graph.owning_module
    found = [(i, getattr(owner, arg.target, None)) for i, arg in enumerate(node.args)
             if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and owner is not None]
    return [(i, sub) for i, sub in found if isinstance(sub, torch.fx.GraphModule)]


def subgraphs_mutate(node: torch.fx.Node) -> bool:
    """Whether a higher-order op's subgraphs write a tensor in place (``wrap_with_set_grad_enabled`` around
    spectral norm's power iteration, which updates its ``_u``/``_v`` buffers with ``out=``)."""
    return any(is_mutating(n) or (isinstance(n.target, torch._ops.HigherOrderOperator) and subgraphs_mutate(n))
               for _, sub in _subgraphs(node) for n in sub.graph.nodes if n.op == "call_function")


def read_before_written(graph: torch.fx.Graph) -> set[str]:
    """Ops that read a tensor (or a view of it) which a later op writes in place — an activation's slice
    assigned (``a[:, :4] = tanh(a[:, :4])``), a buffer the forward updates (spectral norm's power iteration,
    statistics updated under ``torch.no_grad()`` inside a higher-order op's subgraph): run again in backward,
    they would read the written values (and autograd's version check fails)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    sharing: dict[torch.fx.Node, list[torch.fx.Node]] = {}    # storage root → it, its views and in-place results
    found: set[str] = set()

    def readers_before(node: torch.fx.Node, value) -> None:
        root = storage_root(value)
        for alias in sharing.get(root, [root] if isinstance(root, torch.fx.Node) else []):
            found.update(reader.name for reader in alias.users
                         if reader is not node and reader.op == "call_function" and order[reader] < order[node])

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            written, returned = _subgraph_writes(node)
            for user in node.users:       # a result that is a written operand (the buffer's new value) aliases it
                if user.target is operator.getitem and user.args[1] in returned:
                    root = storage_root(returned[user.args[1]])
                    sharing.setdefault(root, [root]).append(user)
            for value in written:
                readers_before(node, value)
            continue
        if not (is_view(node) or is_mutating(node)):
            continue
        root = storage_root(node)
        if isinstance(root, torch.fx.Node):
            sharing.setdefault(root, [root]).append(node)
        if is_mutating(node):
            for value in written_operands(node):
                readers_before(node, value)
    return found


def _subgraph_writes(node: torch.fx.Node) -> tuple[list, dict]:
    """For a higher-order op (``wrap_with_set_grad_enabled(False, submod, *operands)``): the operands its
    subgraph writes in place, and {result index: the written operand that result is}."""
    subgraphs = _subgraphs(node)
    if not subgraphs:
        return [], {}
    position, sub = subgraphs[0]
    operands = node.args[position + 1:]
    placeholders = {n: i for i, n in enumerate(n for n in sub.graph.nodes if n.op == "placeholder")}
    written: set[int] = set()
    for inner in sub.graph.nodes:
        if inner.op != "call_function":
            continue
        values = written_operands(inner) if is_mutating(inner) else \
            _subgraph_writes(inner)[0] if isinstance(inner.target, torch._ops.HigherOrderOperator) else []
        written.update(placeholders[root] for root in map(storage_root, values) if root in placeholders)
    results = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    results = results if isinstance(results, (tuple, list)) else [results]
    returned = {k: operands[placeholders[root]] for k, root in enumerate(map(storage_root, results))
                if root in placeholders and placeholders[root] in written and placeholders[root] < len(operands)}
    return [operands[i] for i in sorted(written) if i < len(operands)], returned


_DROPOUTS = {torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default,
             torch.ops.aten.alpha_dropout.default, torch.ops.aten.feature_alpha_dropout.default,
             torch.ops.aten.native_dropout.default}


def draws_random_numbers(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers: a region running it replays the RNG state for it. A dropout of
    probability 0 or out of training (Llama's attention dropout) returns its input and draws none."""
    target = node.target
    if target in _DROPOUTS and len(node.args) >= 3 and (node.args[1] == 0 or node.args[2] is False):
        return False
    tags = getattr(target, "tags", ())
    name = str(target)
    return torch.Tag.nondeterministic_seeded in tags or any(
        word in name for word in ("dropout", "rand", "bernoulli", "normal", "multinomial"))


def device_of(nodes: list[torch.fx.Node]) -> str | None:
    """The device type of the first of ``nodes`` that makes a tensor (None: none does)."""
    for node in nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device.type
    return None
