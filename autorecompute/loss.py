"""The model and its loss as one module: what ``compile(model, budget, loss_fn=...)`` captures and plans.

A loss computed outside the compiled module is beyond the plan's reach: the plan can only reserve what it
holds (``loss_reserve``). Captured with the model, the loss is ops of the graph like any other: its tensors
are counted exactly, can be recomputed or offloaded, and a cross-entropy is made lean (its log-softmax a chunk
of rows at a time, :mod:`autorecompute.runtime.cross_entropy`) — for a large vocabulary the difference between
fitting and not.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

TARGET = "target"       # the keyword the compiled module takes the loss's target by


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


class LossOfModel(torch.nn.Module):
    """``loss_fn(model(*args, **kwargs), target)`` as one module, sharing ``model``'s parameters and buffers
    (a module compiled with it pickles only where ``loss_fn`` does: a module-level function or a loss module,
    not a lambda).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(8, 3)
        >>> step = LossOfModel(model, torch.nn.CrossEntropyLoss())
        >>> x, y = torch.randn(4, 8), torch.tensor([0, 2, 1, 0])
        >>> torch.equal(step(x, target=y), torch.nn.functional.cross_entropy(model(x), y))
        True
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn          # a Module (CrossEntropyLoss()) becomes a submodule; a function stays one

    @property
    def plan_name(self) -> str:
        """What plans call the model: the model's class, with its loss."""
        return f"{type(self.model).__name__} with its loss"

    def forward(self, *args, target=_MISSING, **kwargs):
        if target is _MISSING:
            raise TypeError(f"{type(self.model).__name__} was compiled with loss_fn=: call it with the loss's target "
                            f"as a keyword, loss = compiled(*inputs, {TARGET}=labels); it returns "
                            "loss_fn(model(*inputs), labels)")
        return self.loss_fn(self.model(*args, **kwargs), target)


def with_loss(model: torch.nn.Module, loss_fn: Callable | None) -> torch.nn.Module:
    """``model`` itself without a ``loss_fn``; else the model and its loss as one :class:`LossOfModel`.

    Raises:
        TypeError: ``loss_fn`` is not callable.
        ValueError: ``model.forward`` takes a ``target`` of its own, which the loss's would hide.
    """
    if loss_fn is None:
        return model
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(outputs, target) -> scalar loss (a function or a "
                        f"loss module such as torch.nn.CrossEntropyLoss()); got a {type(loss_fn).__name__}")
    if TARGET in inspect.signature(model.forward).parameters:
        raise ValueError(f"{type(model).__name__}.forward takes a {TARGET!r} argument of its own, and with loss_fn= "
                         f"the compiled module takes the loss's target by that name. Fix: compute the loss in the "
                         "model's forward (it is captured with the model then), or wrap the model in a module "
                         "whose forward has no 'target'.")
    return LossOfModel(model, loss_fn)


def users_model(module: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside ``module``: its ``model`` for a :class:`LossOfModel`, else ``module`` itself."""
    return module.model if isinstance(module, LossOfModel) else module


def plan_name(model: torch.nn.Module) -> str:
    """The name plans give ``model``."""
    return getattr(model, "plan_name", None) or type(model).__name__
