"""What autorecompute is compared with: Chen et al.'s √N checkpointing, as users write it."""
from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint_sequential


class SqrtNCheckpointed(torch.nn.Module):
    """Runs ``model`` with its ``nn.Sequential`` attribute ``blocks`` under ``checkpoint_sequential`` with
    ``round(√N)`` segments (non-reentrant), the rest of the forward unchanged.

    Example:
        >>> body = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(9)])
        >>> model = torch.nn.Module(); model.layers = body; model.forward = lambda x: model.layers(x)
        >>> SqrtNCheckpointed(model, "layers").segments
        3
    """

    def __init__(self, model: torch.nn.Module, blocks: str):
        super().__init__()
        self.model = model
        self.blocks_name = blocks
        self.blocks = model.get_submodule(blocks)
        self.segments = max(1, round(math.sqrt(len(self.blocks))))

    def forward(self, *args, **kwargs):
        blocks, segments = self.blocks, self.segments

        def checkpointed(x):
            return checkpoint_sequential(blocks, segments, x, use_reentrant=False)

        owner_path, _, attr = self.blocks_name.rpartition(".")
        owner = self.model.get_submodule(owner_path) if owner_path else self.model
        original = owner._modules[attr]
        owner._modules[attr] = _Call(checkpointed)
        try:
            return self.model(*args, **kwargs)
        finally:
            owner._modules[attr] = original


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)
