"""`passes/` ships as `autorecompute.passes` in the wheel."""
import subprocess
import sys
import zipfile
from pathlib import Path


def test_wheel_contains_autorecompute_passes(tmp_path):
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(root)], check=True)
    wheel = next(tmp_path.glob("autorecompute-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "autorecompute/passes/capture.py" in names
    assert "autorecompute/passes/profile.py" in names
    assert not any(n.startswith("passes/") for n in names)
