"""Rewrite: GraphModule → the same GraphModule calling each aten op through eager PyTorch's Python binding.

A captured graph calls ``torch.ops.aten.transpose.int(x, 1, 2)``: an ``OpOverload``, whose generic,
schema-driven argument conversion makes each call slower than through the binding eager code calls,
``torch.transpose``. On a model of many small ops that is several percent of the step; through the binding,
a call costs what it costs in eager code.

A binding picks its overload from the Python types of its arguments, so one is used only where it provably
calls the same one: traced once before any decomposition (``make_fx(pre_dispatch=True)``) on meta tensors
shaped like the node's inputs, it must reach exactly the node's overload, and return results of the same
structure and layout. Anything else keeps its ``OpOverload``: ops outside ``aten``, a binding that resolves
to another overload (``aten.add.Scalar``: ``torch.add`` calls ``add.Tensor``), a binding FX would print under
another object's name (``torch.split`` is a Python wrapper of the binding), inputs without recorded shapes.
Decides nothing about the plan: run last, on the module that will execute it.

Example:
    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: x.transpose(0, 1) + 1, tracing_mode="fake")(torch.randn(2, 3))
    >>> print(rewrite_calls(gm).code.strip().splitlines()[1].split("=")[1].split("(")[0].strip())
    torch.transpose
"""
from __future__ import annotations

import operator
import pydoc
from typing import Any, Callable

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.graph import _is_from_torch
from torch.fx.node import _get_qualified_name
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from autorecompute.runtime.tensor_methods import method

# where eager PyTorch's bindings of aten ops live, in the order tried; then the tensor methods
BINDING_NAMESPACES = (torch._C._VariableFunctions, torch._C._nn, torch._C._linalg, torch._C._special,
                      torch._C._fft)

_checked: dict[tuple, Callable | None] = {}      # (overload, argument kinds) → binding, or None: keep it


class _NoExample(Exception):
    """A node's input has no recorded value to make a meta tensor from."""


def _described(tree) -> Any:
    """``tree`` with each tensor replaced by its layout: what two calls' results must agree on."""
    return tree_map(lambda v: ("tensor", tuple(v.shape), tuple(v.stride()), v.dtype) if isinstance(v, torch.Tensor)
                    else v, tree)


def _kinds(tree) -> Any:
    """The Python types a binding's argument parser resolves an overload from (lists kept as lists)."""
    if isinstance(tree, (list, tuple)):
        return type(tree).__name__, tuple(_kinds(v) for v in tree)
    if isinstance(tree, dict):
        return tuple((k, _kinds(v)) for k, v in sorted(tree.items()))
    if isinstance(tree, (torch.fx.Node, torch.Tensor)):
        return "tensor"
    return type(tree).__name__


def _example(value: Any) -> Any:
    """A meta-tensor stand-in for a node's recorded value (a FakeTensor, or a list of them)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_example(v) for v in value)
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    raise _NoExample(type(value).__name__)


def _meta_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with meta tensors for its inputs and the meta device for any device: the check
    allocates nothing and draws no random numbers on the real device (a factory op names its device)."""
    def example(node: torch.fx.Node) -> Any:
        if "val" not in node.meta:
            raise _NoExample(node.name)
        return _example(node.meta["val"])
    arguments = torch.fx.node.map_arg((args, kwargs), example)
    return tree_map(lambda v: torch.device("meta") if isinstance(v, torch.device) else v, arguments)


def _printed_as_itself(binding: Callable) -> bool:
    """Whether the generated code names ``binding`` itself: FX prints a torch object by its qualified name
    (``torch.split`` would be the Python wrapper, not the binding); anything else becomes a global that a
    pickled module imports by module and name, which a method of the C tensor type does not have."""
    try:
        printed = _get_qualified_name(binding)
    except Exception:
        return False
    return _is_from_torch(binding) and pydoc.locate(printed) is binding


def _candidates(overload: torch._ops.OpOverload) -> list[Callable]:
    namespace, _, name = overload._schema.name.partition("::")
    if namespace != "aten":
        return []
    found = [getattr(space, name, None) for space in BINDING_NAMESPACES]
    bindings = [binding for binding in found if callable(binding) and _printed_as_itself(binding)]
    # a method-only op (view, expand) through a function that calls the method: importable by name
    calling_method = method(name)
    return bindings + ([calling_method] if calling_method is not None else [])


def _overloads_called(call: Callable, args: tuple, kwargs: dict) -> list:
    """The ops ``call(*args, **kwargs)`` reaches first, traced before any decomposition (pre-dispatch: a
    composite op such as ``linear`` is recorded as itself, not as the matmul it runs)."""
    flat, spec = tree_flatten((args, kwargs))
    tensor_at = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]

    def with_tensors(*tensors):
        values = list(flat)
        for i, t in zip(tensor_at, tensors):
            values[i] = t
        call_args, call_kwargs = tree_unflatten(values, spec)
        return call(*call_args, **call_kwargs)

    traced = make_fx(with_tensors, pre_dispatch=True)(*[flat[i] for i in tensor_at])
    return [n.target for n in traced.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def _same_call(overload: torch._ops.OpOverload, binding: Callable, args: tuple, kwargs: dict) -> bool:
    """``binding`` reaches exactly ``overload`` on these arguments and returns the same structure."""
    if _overloads_called(binding, args, kwargs) != [overload]:
        return False
    results = [call(*args, **kwargs) for call in (overload, binding)]
    described = [(type(r), _described(r)) for r in results]
    return described[0] == described[1]


def binding_for(overload: Any, args: tuple, kwargs: dict) -> Callable | None:
    """The Python binding that calls exactly ``overload`` with these arguments (fx nodes with recorded
    values), or None. Checked once per overload and argument kinds: the kinds are what a binding's argument
    parser resolves an overload from."""
    if not isinstance(overload, torch._ops.OpOverload):
        return None
    key = (overload, _kinds(args), _kinds(kwargs))
    if key in _checked:
        return _checked[key]
    try:
        meta_args, meta_kwargs = _meta_arguments(args, kwargs)
    except _NoExample:
        return None              # unknown, not cached: another node with the same kinds may have recorded values
    found = None
    for binding in _candidates(overload):
        try:
            if _same_call(overload, binding, meta_args, meta_kwargs):
                found = binding
                break
        except Exception:        # the binding rejects these arguments: try the next, else keep the overload
            continue
    _checked[key] = found        # one assignment: threads planning at once write the same answer
    return found


def rewrite_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Calls through bindings in ``gm`` and in every GraphModule inside it (region bodies, recipes); returns
    ``gm``, rewritten in place. (A single-op rematerialization's op stays an ``OpOverload``: it is an argument
    of the generated code, which can name an overload but not a builtin.)"""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            try:
                binding = binding_for(node.target, node.args, node.kwargs)
            except Exception:        # an unforeseen value in the node's record: the overload it has runs fine
                binding = None
            if binding is not None:
                node.target = binding
                changed = True
        if changed:
            module.recompile()
    return gm
