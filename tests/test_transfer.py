"""measure(): the machine's transfer and compute speeds, cached for what they were measured for."""
import json

from autorecompute.transfer import TransferModel, measure


def test_measures_once_then_reads_the_cache(tmp_path):
    cache = tmp_path / "transfer.json"
    first = measure(str(tmp_path), nbytes=1 << 20, cache=str(cache))
    assert isinstance(first, TransferModel) and first.flops_per_second > 0 and first.write_bytes_per_second > 0
    assert measure(str(tmp_path), nbytes=1 << 20, cache=str(cache)) == first      # read back, not measured


def test_a_cache_for_another_directory_or_format_is_measured_again(tmp_path):
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
