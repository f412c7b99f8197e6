"""Running a module on fake tensors: same shapes, dtypes, devices and autograd graph, no real memory."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_map


@contextlib.contextmanager
def fake_step(module: torch.nn.Module, args: tuple, kwargs: dict) -> Iterator[tuple[tuple, dict]]:
    """Inside the block, ``module``'s parameters, buffers and existing gradients are fake copies and the
    yielded ``(args, kwargs)`` are fake versions of the inputs. Real state is untouched afterwards."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}

    def fake(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in memo:
            converted = fake_mode.from_tensor(value)
            if value.requires_grad:
                # a leaf of the step, as the real input is to the compiled module (an activation of an eager
                # model around a compiled submodule too: backward through the copy must stop there)
                converted = converted.detach().requires_grad_(True)
            if value.is_leaf and value.grad is not None:     # (.grad of a non-leaf warns)
                converted.grad = fake_mode.from_tensor(value.grad)
            memo[id(value)] = converted
        return memo[id(value)]

    state = {name: fake(t) for name, t in module.named_parameters(remove_duplicate=False)}
    state.update({name: fake(t) for name, t in module.named_buffers(remove_duplicate=False)})
    fake_args, fake_kwargs = tree_map(fake, (tuple(args), dict(kwargs)))
    with fake_mode, _reparametrize_module(module, state, tie_weights=True):
        yield fake_args, fake_kwargs
