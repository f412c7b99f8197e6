"""Codecs of the ``compress`` action: how a saved activation is stored smaller until backward.

The forward uses the full-precision tensor; only the copy autograd keeps for backward is encoded, and it
is decoded back to the original dtype when backward first needs it. Every codec works on fake tensors
too (no ``.item()``), so verification measures the same allocations as a real step.

========== ======================== ============================ =========================================
dtype      stored as                scale                        expected error (per element)
========== ======================== ============================ =========================================
bfloat16   bfloat16                 none                         relative ≤ 2⁻⁸ (0.39 %)
float16    float16                  none (|x| ≤ 65504 assumed)   relative ≤ 2⁻¹¹ (0.05 %)
float8     float8_e4m3fn            one per tensor (amax / 448)  relative ≤ 2⁻⁴ (6.25 %) above amax·2⁻¹⁵
int8       int8                     one per channel (amax / 127) absolute ≤ amax_channel / 254
========== ======================== ============================ =========================================

The int8 channel is dim 1 of an image (N, C, H, W), else the last dimension (features); tensors below 2-D
get one scale.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

_CHUNK = 1 << 20     # elements encoded at a time: bounds the temporaries of scaled casts


@dataclass(frozen=True)
class Codec:
    """A way to store a floating-point tensor smaller.

    Attributes:
        name: the name users pass in ``compress_dtypes``.
        itemsize: bytes per stored element.
        expected_error: what the table above says, for the plan and the docs.
    """

    name: str
    itemsize: int
    expected_error: str
    encode: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    decode: Callable[[tuple[torch.Tensor, ...], torch.dtype], torch.Tensor]

    def stored_bytes(self, shape: tuple[int, ...]) -> int:
        numel = 1
        for size in shape:
            numel *= size
        return numel * self.itemsize + 4 * _scale_count(self.name, shape)

    def accepts(self, dtype: torch.dtype) -> bool:
        """Only floating tensors wider than the stored type are worth compressing."""
        return dtype.is_floating_point and dtype.itemsize > self.itemsize


def channel_dim(shape: tuple[int, ...]) -> int:
    """The channel dimension of an activation: 1 for images (N, C, H, W), else the last (features)."""
    return 1 if len(shape) == 4 else len(shape) - 1


def _scale_count(name: str, shape: tuple[int, ...]) -> int:
    if name == "float8":
        return 1
    if name == "int8":
        return shape[channel_dim(shape)] if len(shape) >= 2 else 1
    return 0


def _cast(dtype: torch.dtype):
    def encode(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.to(dtype),)

    def decode(stored: tuple[torch.Tensor, ...], original: torch.dtype) -> torch.Tensor:
        return stored[0].to(original)
    return encode, decode


def _amax(x: torch.Tensor, dims=None) -> torch.Tensor:
    """max |x| without a full-size temporary (two reductions instead of ``abs``)."""
    if dims is None:
        low, high = torch.aminmax(x)
    else:
        low, high = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    return torch.maximum(-low, high).float()


def _scaled_encode(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rounding: bool) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    flat_x, flat_out = x.reshape(-1), out.view(-1)
    flat_scale = scale.expand(x.shape).reshape(-1) if scale.numel() > 1 else scale.reshape(())
    for start in range(0, flat_x.numel(), _CHUNK):
        part = slice(start, start + _CHUNK)
        scaled = flat_x[part].float() / (flat_scale[part] if flat_scale.dim() else flat_scale)
        if rounding:
            scaled = scaled.round_().clamp_(-127, 127)
        flat_out[part] = scaled.to(dtype)
    return out


def _float8_encode(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    scale = (_amax(x) / 448.0).clamp_min(1e-30)
    return _scaled_encode(x, scale, torch.float8_e4m3fn, rounding=False), scale


def _int8_encode(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if x.dim() < 2:     # no channels: one scale for the tensor
        scale = (_amax(x) / 127.0).clamp_min(1e-30)
    else:
        channel = channel_dim(tuple(x.shape))
        scale = (_amax(x, [d for d in range(x.dim()) if d != channel]) / 127.0).clamp_min(1e-30)
    return _scaled_encode(x, scale, torch.int8, rounding=True), scale


def _scaled_decode(stored: tuple[torch.Tensor, ...], original: torch.dtype) -> torch.Tensor:
    values, scale = stored
    out = values.to(original)
    return out.mul_(scale.to(original))


CODECS: dict[str, Codec] = {
    "bfloat16": Codec("bfloat16", 2, "relative ≤ 2^-8 (0.39%) per element", *_cast(torch.bfloat16)),
    "float16": Codec("float16", 2, "relative ≤ 2^-11 (0.05%) per element; |x| ≤ 65504", *_cast(torch.float16)),
    "float8": Codec("float8", 1, "relative ≤ 2^-4 (6.25%) per element above amax·2^-15 (e4m3fn, "
                    "per-tensor scale)", _float8_encode, _scaled_decode),
    "int8": Codec("int8", 1, "absolute ≤ amax/254 per element (per-channel scale)", _int8_encode, _scaled_decode),
}


def codec(name: str) -> Codec:
    """The codec called ``name``; ``ValueError`` naming the accepted ones otherwise."""
    if name not in CODECS:
        raise ValueError(f"compress dtype {name!r} is not supported; accepted compress_dtypes are "
                         f"{tuple(CODECS)}")
    return CODECS[name]
