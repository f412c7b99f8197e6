"""Tensor methods as module-level functions, for generated code: ``view(x, [4, 16])`` calls ``x.view``.

``passes/rewrite_calls.py`` calls an aten op through eager's binding where it can; for ops that are only
methods (``view``, ``expand``, ``contiguous``) the binding is ``torch.Tensor.<name>``, which FX's generated
code can call but a pickled GraphModule cannot import by name (``from torch._C import TensorBase.view`` is
not Python). Each function here is importable as ``autorecompute.runtime.tensor_methods.<name>`` and calls
the method (a Python frame: a fraction of the extra time a call through the aten overload takes).

Example:
    >>> import torch
    >>> method("view")(torch.arange(6), [2, 3]).shape
    torch.Size([2, 3])
"""
from __future__ import annotations

from typing import Callable

import torch


def _calling(name: str) -> Callable:
    def call(self, *args, **kwargs):
        # looked up on the value, as eager code does: an fx Proxy (re-tracing a pickled module) records it
        return getattr(self, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__module__ = __name__
    call.__doc__ = f"``self.{name}(*args, **kwargs)``"
    return call


# one function per public method of the C tensor type, bound at import so that pickling finds each by name
METHODS: dict[str, Callable] = {name: _calling(name) for name in dir(torch._C.TensorBase)
                                if not name.startswith("__") and callable(getattr(torch._C.TensorBase, name))
                                and name.isidentifier() and name not in globals()}
globals().update(METHODS)


def method(name: str) -> Callable | None:
    """The function here that calls ``Tensor.<name>``, or None."""
    return METHODS.get(name)
