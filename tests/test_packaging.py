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


def test_importing_the_package_loads_neither_torch_nor_the_planner():
    """The planner's parts load on first use; ``autorecompute.plan`` is the function, though a submodule of
    that name exists (and is imported by the package itself)."""
    script = ("import sys, autorecompute\n"
              "assert not {'torch', 'ortools'} & set(sys.modules), 'imported at import time'\n"
              "from autorecompute.plan import Plan\n"
              "assert callable(autorecompute.plan) and autorecompute.plan.__module__ == 'autorecompute.api'\n"
              "assert autorecompute.Plan is Plan and callable(autorecompute.compile)\n"
              "assert set(autorecompute.__all__) <= set(dir(autorecompute))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
