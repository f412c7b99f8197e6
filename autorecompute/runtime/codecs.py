"""Codecs of the ``compress`` action: how a saved activation is stored smaller until backward.

The forward uses the full-precision tensor; only the copy autograd keeps for backward is encoded, and it
is decoded back to the original dtype when backward first needs it. Every codec works on fake tensors
too (no ``.item()``), so verification measures the same allocations as a real step.

========== ======================== ============================ =========================================
dtype      stored as                scale                        expected error (per element)
========== ======================== ============================ =========================================
bfloat16   bfloat16                 none                         relative ≤ 2⁻⁸ (0.39 %)
float16    float16                  none (|x| ≤ 65504 assumed)   relative ≤ 2⁻¹¹ (0.05 %) for |x| ≥ 2⁻¹⁴ (6.1e-5);
                                                                 absolute ≤ 2⁻²⁵ (3e-8) below (subnormals)
float8     float8_e4m3fn            one per tensor (amax / 448)  relative ≤ 2⁻⁴ (6.25 %) for |x| ≥ amax / 28672;
                                                                 absolute ≤ amax / 458752 below
int8       int8                     one per channel (amax / 127) absolute ≤ amax_channel / 254
========== ======================== ============================ =========================================

The int8 channel is dim 1 of an image (N, C, H, W), else the last dimension (features); tensors below 2-D
get one scale. Scales come from the finite values; an inf or NaN comes back as NaN (int8 stores it as -128,
outside the ±127 of finite values; e4m3fn has a NaN), not saturated to a finite value.
"""
from __future__ import annotations

import math
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
    encode: Callable[..., tuple[torch.Tensor, ...]]       # (tensor, channel=None for the cast codecs' none)
    decode: Callable[[tuple[torch.Tensor, ...], torch.dtype], torch.Tensor]

    def stored_bytes(self, shape: tuple[int, ...]) -> int:
        numel = 1
        for size in shape:
            numel *= size
        return numel * self.itemsize + 4 * _scale_count(self.name, shape)

    def accepts(self, dtype: torch.dtype) -> bool:
        """Only floating tensors wider than the stored type are worth compressing."""
        return dtype.is_floating_point and dtype.itemsize > self.itemsize

    def transient_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
        """Device bytes the codec's temporaries add while it (encodes, decodes) a ``dtype`` tensor of ``shape``,
        beside the tensors it reads and writes: none for a cast; for a scaled codec, float32 chunks of
        :func:`chunk_elements` elements — encode: a float32 copy (unless already float32) and the scaled
        values, or the scaled values and their stored cast; decode: the float32 values, scaled in place (and for
        int8 a one-byte mask of the non-finite ones). Measured by ``tests/test_codecs.py``."""
        scales = _scale_count(self.name, shape)
        if scales == 0:
            return 0, 0
        n = chunk_elements(self.name, shape)
        encode = 8 * n if dtype != torch.float32 else (4 + self.itemsize) * n
        if scales > 1:       # the per-channel maxima beside them: an upper bound, equal from a few rows on
            encode += 4 * scales
        # decoding chunks by channel only where there is more than one scale (as _scaled_decode reads them):
        # the float32 values (scaled in place), and int8's mask of the values that were not finite
        m = n if scales > 1 else chunk_elements("float8", shape)
        return encode, (5 if self.name == "int8" else 4) * m


def channel_dim(shape: tuple[int, ...]) -> int:
    """The channel dimension of an activation: 1 for images (N, C, H, W), else the last (features)."""
    return 1 if len(shape) == 4 else len(shape) - 1


def _channel(name: str, shape: tuple[int, ...]) -> int | None:
    """The dimension a scaled codec keeps one scale per entry of (None: one scale for the tensor)."""
    return channel_dim(shape) if name == "int8" and len(shape) >= 2 else None


def chunk_elements(name: str, shape: tuple[int, ...]) -> int:
    """Elements a scaled codec converts at a time for a tensor of ``shape`` (what its temporaries hold)."""
    outer, channels, inner = _rows_shape(shape, _channel(name, shape))
    per_row = max(1, channels * inner)
    return min(outer, max(1, _CHUNK // per_row)) * per_row


def _scale_count(name: str, shape: tuple[int, ...]) -> int:
    if name == "float8":
        return 1
    if name == "int8":
        return shape[channel_dim(shape)] if len(shape) >= 2 else 1
    return 0


def _cast(dtype: torch.dtype):
    def encode(x: torch.Tensor, channel: int | None = None) -> tuple[torch.Tensor, ...]:
        return (x.to(dtype),)

    def decode(stored: tuple[torch.Tensor, ...], original: torch.dtype) -> torch.Tensor:
        return stored[0].to(original)
    return encode, decode


def _rows_shape(shape: tuple[int, ...], channel: int | None) -> tuple[int, int, int]:
    """(outer, C, inner): C the channel dimension's size; without one, every element a row of its own (so
    that a per-tensor scale's conversion is chunked too)."""
    numel = 1
    for size in shape:
        numel *= size
    if channel is None:
        return numel, 1, 1
    outer = 1
    for size in shape[:channel]:
        outer *= size
    return outer, shape[channel], numel // max(1, outer * shape[channel])


def _rows(x: torch.Tensor, channel: int | None) -> torch.Tensor:
    """``x`` as (outer, C, inner) (:func:`_rows_shape`), a view when ``x`` is contiguous."""
    return x.reshape(_rows_shape(tuple(x.shape), channel))


def _chunks(rows: torch.Tensor):
    """Slices of the outer dimension holding about ``_CHUNK`` elements (one outer row at least)."""
    per_row = max(1, rows.shape[1] * rows.shape[2])
    step = max(1, _CHUNK // per_row)
    for start in range(0, rows.shape[0], step):
        yield slice(start, start + step)


def _finite_amax(rows: torch.Tensor) -> torch.Tensor:
    """max |x| per channel over finite values, shape (1, C, 1), float32, chunk by chunk (no full temporary):
    one inf or NaN must not turn every other value into NaN."""
    amax = torch.zeros((1, rows.shape[1], 1), dtype=torch.float32, device=rows.device)
    for part in _chunks(rows):
        chunk = torch.nan_to_num(rows[part].float(), nan=0.0, posinf=0.0, neginf=0.0).abs_()
        amax = torch.maximum(amax, chunk.amax(dim=(0, 2), keepdim=True))
        del chunk       # before the next chunk is made: one chunk's temporaries at a time
    return amax


def _scaled_encode(x: torch.Tensor, channel: int | None, limit: float, dtype: torch.dtype,
                   rounding: bool) -> tuple[torch.Tensor, ...]:
    if x.numel() == 0:       # nothing to scale (an amax over an empty dimension raises)
        scales = x.shape[channel] if channel is not None else 1
        return torch.empty(x.shape, dtype=dtype, device=x.device), torch.ones(scales, device=x.device)
    rows = _rows(x, channel)
    scale = _finite_amax(rows) / limit
    # a channel of zeros keeps scale 1 (a floor such as 1e-30 would break the error bound of tiny values)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    out = torch.empty(rows.shape, dtype=dtype, device=x.device)
    for part in _chunks(rows):
        scaled = rows[part].float() / scale
        # an inf or NaN comes back as NaN, not as a finite value (saturated, it would hide a divergence from
        # NaN checks and GradScaler): int8 marks it with -128, outside the ±127 of finite values; e4m3fn has NaN
        scaled.nan_to_num_(nan=math.nan, posinf=math.nan, neginf=math.nan)
        if rounding:     # (clamped first: a subnormal scale can put a finite value past ±127.5)
            scaled.round_().clamp_(-limit, limit).nan_to_num_(nan=-limit - 1)
        out[part] = scaled.to(dtype)
        del scaled
    # the scale keeps the channel's place, so decoding finds it whatever the layout the stash encoded
    where = [size if d == channel else 1 for d, size in enumerate(x.shape)] if channel is not None else [-1]
    return out.view(x.shape), scale.reshape(where)


def _float8_encode(x: torch.Tensor, channel: int | None = None) -> tuple[torch.Tensor, ...]:
    return _scaled_encode(x, None, 448.0, torch.float8_e4m3fn, rounding=False)     # one scale per tensor


def _int8_encode(x: torch.Tensor, channel: int | None = None) -> tuple[torch.Tensor, ...]:
    """``channel``: the dimension of ``x`` that is the activation's channel (the stash encodes a channels-last
    tensor in its memory order, where it is not :func:`channel_dim`'s); no channels below 2-D."""
    return _scaled_encode(x, channel if channel is not None else _channel("int8", tuple(x.shape)), 127.0,
                          torch.int8, rounding=True)


def _scaled_decode(stored: tuple[torch.Tensor, ...], original: torch.dtype) -> torch.Tensor:
    """Back to ``original``, multiplying in float32 (a bf16/fp16 scale would round away small values)."""
    values, scale = stored
    if values.numel() == 0:
        return torch.empty(values.shape, dtype=original, device=values.device)
    channel = next((d for d, size in enumerate(scale.shape) if size > 1), None) \
        if scale.dim() == values.dim() and scale.numel() > 1 else None
    rows = _rows(values, channel)
    scale = scale.reshape(1, -1, 1)
    out = torch.empty(rows.shape, dtype=original, device=values.device)
    for part in _chunks(rows):
        chunk = rows[part].float()
        if values.dtype == torch.int8:
            chunk.masked_fill_(chunk == -128, math.nan)        # a value that was not finite
        out[part] = chunk.mul_(scale)          # (the copy casts: no temporary of the original dtype)
        del chunk
    return out.view(values.shape)


CODECS: dict[str, Codec] = {
    "bfloat16": Codec("bfloat16", 2, "relative ≤ 2^-8 (0.39%) per element", *_cast(torch.bfloat16)),
    "float16": Codec("float16", 2, "relative ≤ 2^-11 (0.05%) per element for 6.1e-5 ≤ |x| ≤ 65504, absolute ≤ "
                     "3e-8 below (subnormals: small values such as attention probabilities lose precision)",
                     *_cast(torch.float16)),
    "float8": Codec("float8", 1, "relative ≤ 2^-4 (6.25%) per element for |x| ≥ amax/28672, absolute ≤ "
                    "amax/458752 below (e4m3fn, per-tensor scale)", _float8_encode, _scaled_decode),
    "int8": Codec("int8", 1, "absolute ≤ amax/254 per element (per-channel scale)", _int8_encode, _scaled_decode),
}


def codec(name: str) -> Codec:
    """The codec called ``name``; ``ValueError`` naming the accepted ones otherwise."""
    if name not in CODECS:
        raise ValueError(f"compress dtype {name!r} is not supported; accepted compress_dtypes are "
                         f"{tuple(CODECS)}")
    return CODECS[name]
