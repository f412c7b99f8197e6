"""measure(): the machine's transfer and compute speeds, cached for what they were measured for."""
import json

import pytest

from autorecompute import probes
from autorecompute.transfer import CPU_DISK, TransferModel, measure


@pytest.fixture
def quick_probes(monkeypatch):
    """The cache's tests need measuring, not the seconds of planning the stash runtime's probe takes."""
    monkeypatch.setattr(probes, "transfer_seconds", lambda *args: 5e-5)


def test_measures_once_then_reads_the_cache(quick_probes, tmp_path):
    cache = tmp_path / "transfer.json"
    first = measure(str(tmp_path), nbytes=1 << 20, cache=str(cache))
    assert isinstance(first, TransferModel) and first.flops_per_second > 0 and first.write_bytes_per_second > 0
    assert measure(str(tmp_path), nbytes=1 << 20, cache=str(cache)) == first      # read back, not measured


def test_a_cache_for_another_directory_or_format_is_measured_again(quick_probes, tmp_path):
    cache = tmp_path / "transfer.json"
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    measure(str(tmp_path / "a"), nbytes=1 << 20, cache=str(cache))
    saved = json.loads(cache.read_text())
    saved["model"]["flops_per_second"] = 1.0                    # marks the saved numbers
    cache.write_text(json.dumps(saved))
    assert measure(str(tmp_path / "a"), nbytes=1 << 20, cache=str(cache)).flops_per_second == 1.0
    assert measure(str(tmp_path / "b"), nbytes=1 << 20, cache=str(cache)).flops_per_second > 1.0
    cache.write_text(json.dumps({**saved["model"], "a_field_gone_since": 0}))      # an older layout
    assert measure(str(tmp_path / "b"), nbytes=1 << 20, cache=str(cache)).flops_per_second > 1.0


def test_the_offload_path_is_timed_and_recomputation_keeps_the_defaults(tmp_path):
    """The disk tier and a transfer's fixed cost are this machine's; recomputation's figures are the CPU
    defaults (fitted on whole steps; probes/scaling priced worse), not scaled by anything."""
    import torch

    before = torch.random.get_rng_state()
    model = measure(str(tmp_path), nbytes=1 << 20, cache=str(tmp_path / "transfer.json"))
    assert torch.equal(torch.random.get_rng_state(), before)       # the caller's random stream untouched
    assert model.write_bytes_per_second > 0 and model.read_bytes_per_second > 0
    assert model.per_transfer_seconds > 1e-6 and model.per_transfer_seconds != CPU_DISK.per_transfer_seconds
    recompute = ("flops_per_second", "memory_bytes_per_second", "random_bytes_per_second", "op_seconds",
                 "region_seconds", "stash_seconds", "overlaps_compute")
    assert all(getattr(model, name) == getattr(CPU_DISK, name) for name in recompute)


def test_the_transfer_probe_offloads_through_the_stash_runtime(tmp_path):
    """The per-transfer cost comes from a plan that offloads (not a fallback to the default)."""
    seconds = probes.transfer_seconds(str(tmp_path), 4e9, 4e9)
    assert seconds is not None and seconds > 0


def test_an_unwritable_cache_returns_the_figures_with_a_warning(quick_probes, tmp_path):
    """A cache path that cannot be written (here under a regular file) does not throw the seconds of
    measuring away: the figures come back, and a warning names the path and the fix."""
    (tmp_path / "a_file").write_text("")
    cache = tmp_path / "a_file" / "transfer.json"
    with pytest.warns(UserWarning, match=r"cannot be written.*Fix: pass cache="):
        model = measure(str(tmp_path), nbytes=1 << 20, cache=str(cache))
    assert isinstance(model, TransferModel) and model.write_bytes_per_second > 0


def test_a_probe_too_small_to_time_the_disk_is_refused_and_the_size_keys_the_cache(quick_probes, tmp_path):
    """``nbytes=3`` timed the call, not the disk (256 KB/s), and was cached for every later size."""
    cache = tmp_path / "transfer.json"
    for nbytes in (3, 0, -1, 1.5e6, "64MB"):
        with pytest.raises(ValueError, match="nbytes=.* must be an int of at least"):
            measure(str(tmp_path), nbytes=nbytes, cache=str(cache))
    measure(str(tmp_path), nbytes=1 << 20, cache=str(cache))
    saved = json.loads(cache.read_text())
    saved["model"]["flops_per_second"] = 1.0                    # marks the saved numbers
    cache.write_text(json.dumps(saved))
    assert measure(str(tmp_path), nbytes=1 << 20, cache=str(cache)).flops_per_second == 1.0
    assert measure(str(tmp_path), nbytes=2 << 20, cache=str(cache)).flops_per_second > 1.0
