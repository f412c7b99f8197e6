"""Rewrite: GraphModule → the same GraphModule calling each aten op through eager PyTorch's Python binding.

A captured graph calls ``torch.ops.aten.transpose.int(x, 1, 2)``: an ``OpOverload``, whose generic,
schema-driven argument conversion costs about a microsecond more per call than the binding eager code calls,
``torch.transpose`` (2.8 against 1.4 µs here). On a model of many small ops that is several percent of the
step: the GPT benchmark's forward ran 1.05× eager's with overloads, 1.00× with bindings.

A binding picks its overload from the Python types of its arguments, so one is used only where it provably
reaches the same kernels: called once on meta tensors shaped like the node's inputs, beside the overload, under
a dispatch mode that records every op dispatched; the two records and the kinds of the results must be equal
(for a composite op: the same decomposition). Anything else keeps its ``OpOverload``: ops outside ``aten``, a
binding that resolves to another overload (``aten.add.Scalar``: ``torch.add`` dispatches ``add.Tensor``), a
binding FX would print under another object's name (``torch.split`` is a Python wrapper of the binding), inputs
without recorded shapes. Decides nothing about the plan: run last, on the module that will execute it.

Example:
    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: x.transpose(0, 1) + 1, tracing_mode="fake")(torch.randn(2, 3))
    >>> print(rewrite_calls(gm).code.strip().splitlines()[1].split("=")[1].split("(")[0].strip())
    torch.transpose
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
import torch.fx
from torch.fx.node import _get_qualified_name
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# where eager PyTorch's bindings of aten ops live, in the order tried (methods last: ``Tensor.view``)
BINDING_NAMESPACES = (torch._C._VariableFunctions, torch._C._nn, torch._C._linalg, torch._C._special,
                      torch._C._fft, torch._C.TensorBase)

_checked: dict[tuple, Callable | None] = {}      # (overload, argument kinds) → binding, or None: keep it


class _NoExample(Exception):
    """A node's input has no recorded value to make a meta tensor from."""


class _RecordDispatch(TorchDispatchMode):
    """Records each op dispatched, with its inputs' shapes and dtypes and its other arguments."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, _described((args, kwargs))))
        return func(*args, **kwargs)


def _described(tree) -> Any:
    return tree_map(lambda v: ("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v, tree)


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
    def example(node: torch.fx.Node) -> Any:
        if "val" not in node.meta:
            raise _NoExample(node.name)
        return _example(node.meta["val"])
    return torch.fx.node.map_arg((args, kwargs), example)


def _printed_as_itself(binding: Callable) -> bool:
    """Whether the generated code names ``binding`` itself (FX prints torch objects by qualified name)."""
    try:
        module, *path = _get_qualified_name(binding).split(".")
        found = importlib.import_module(module)
        for part in path:
            found = getattr(found, part)
    except Exception:
        return False
    return found is binding


def _candidates(overload: torch._ops.OpOverload) -> list[Callable]:
    namespace, _, name = overload._schema.name.partition("::")
    if namespace != "aten":
        return []
    found = (getattr(space, name, None) for space in BINDING_NAMESPACES)
    return [binding for binding in found if callable(binding) and _printed_as_itself(binding)]


def _same_dispatch(overload: torch._ops.OpOverload, binding: Callable, args: tuple, kwargs: dict) -> bool:
    records, results = [], []
    for call in (overload, binding):
        with _RecordDispatch() as record:
            results.append(call(*args, **kwargs))
        records.append(record.calls)
    kinds = [tuple(type(v) for v in tree_flatten(r)[0]) + (type(r),) for r in results]
    return records[0] == records[1] and kinds[0] == kinds[1]


def binding_for(overload: Any, args: tuple, kwargs: dict) -> Callable | None:
    """The Python binding that dispatches exactly as ``overload(*args, **kwargs)`` (fx nodes with recorded
    values as arguments), or None."""
    if not isinstance(overload, torch._ops.OpOverload):
        return None
    key = (overload, _kinds(args), _kinds(kwargs))
    if key not in _checked:
        _checked[key] = None
        try:
            meta_args, meta_kwargs = _meta_arguments(args, kwargs)
        except _NoExample:
            del _checked[key]        # another node with the same kinds may have recorded values
            return None
        for binding in _candidates(overload):
            try:
                if _same_dispatch(overload, binding, meta_args, meta_kwargs):
                    _checked[key] = binding
                    break
            except Exception:        # the binding rejects these arguments: try the next, else keep the overload
                continue
    return _checked[key]


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
            binding = binding_for(node.target, node.args, node.kwargs)
            if binding is not None:
                node.target = binding
                changed = True
        if changed:
            module.recompile()
    return gm
