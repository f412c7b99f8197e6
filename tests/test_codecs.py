"""The compress codecs: stored size as the cost model says, error within the documented bound, robust to
non-finite values and tiny scales."""
import pytest
import torch

from autorecompute.runtime.codecs import CODECS, codec

BOUNDS = {"bfloat16": 2**-8, "float16": 2**-11}


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("shape", [(7,), (33, 65), (2, 3, 8, 8), (4, 300, 33)])
def test_round_trip_error_and_stored_bytes(name, shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    stored = CODECS[name].encode(x)
    assert sum(t.numel() * t.element_size() for t in stored) == CODECS[name].stored_bytes(shape)
    y = CODECS[name].decode(stored, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype
    error = (y - x).abs()
    if name in BOUNDS:
        assert (error <= BOUNDS[name] * x.abs()).all()
    elif name == "float8":
        assert (error <= 2**-4 * x.abs() + x.abs().max() * 2**-9).all()
    else:   # int8: per channel, half a quantization step
        channel = 1 if len(shape) == 4 else len(shape) - 1
        dims = [d for d in range(x.dim()) if d != channel] if x.dim() >= 2 else list(range(x.dim()))
        amax = x.abs().amax(dim=dims, keepdim=True)
        assert (error <= amax / 254 * 1.0001).all()


@pytest.mark.parametrize("name", ["float8", "int8"])
def test_one_infinite_value_does_not_poison_the_rest(name):
    x = torch.randn(16, 32)
    x[0, 0] = float("inf")
    y = CODECS[name].decode(CODECS[name].encode(x), x.dtype)
    finite = torch.isfinite(x)
    assert not torch.isnan(y[finite]).any()
    assert (y - x)[finite].abs().max() < 0.2


@pytest.mark.parametrize("name", ["float8", "int8"])
def test_small_half_precision_values_survive(name):
    x = (torch.randn(8, 16) * 1e-5).half()
    y = CODECS[name].decode(CODECS[name].encode(x), x.dtype)
    assert ((y.float() - x.float()).abs().max() / x.float().abs().max()) < 0.05


def test_unknown_codec_names_the_accepted_ones():
    with pytest.raises(ValueError, match="accepted compress_dtypes are"):
        codec("float4")
