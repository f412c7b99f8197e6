"""The command line: demo and plan."""
import subprocess
import sys
import textwrap

import pytest

from autorecompute.cli import budget_arg, main


def test_budget_argument_forms():
    assert budget_arg("0.5") == 0.5
    assert budget_arg("12000000") == 12_000_000
    assert budget_arg("12GB") == "12GB"


USER_MODELS = textwrap.dedent("""
    import torch
    def make():
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
                                      for _ in range(6)])
        return model, (torch.randn(1024, 64),)
""")


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    """A module ``user_models`` with a factory ``make``, importable from the current directory."""
    (tmp_path / "user_models.py").write_text(USER_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_plan_command_writes_html(user_models, capsys):
    tmp_path = user_models
    out = tmp_path / "plan.html"
    assert main(["plan", "user_models:make", "--budget", "0.8", "--out", str(out), "--solver-time-limit", "1"]) == 0
    assert out.read_text().startswith("<!doctype html>")
    assert "predicted peak" in capsys.readouterr().out


def test_demo_runs_and_fits():
    done = subprocess.run([sys.executable, "-m", "autorecompute.cli", "demo", "--steps", "2",
                           "--solver-time-limit", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: measured peak <= budget" in done.stdout
    assert "sqrt(N) checkpointing" in done.stdout


def test_help_for_each_command():
    for args in (["--help"], ["demo", "--help"], ["plan", "--help"]):
        done = subprocess.run([sys.executable, "-m", "autorecompute.cli", *args], capture_output=True, text=True)
        assert done.returncode == 0 and "usage: autorecompute" in done.stdout


def test_plan_command_actions_and_bad_dtype(user_models, capsys):
    assert main(["plan", "user_models:make", "--budget", "0.9", "--actions", "compress",
                 "--solver-time-limit", "1"]) == 0
    assert "compress:bfloat16" in capsys.readouterr().out
    assert main(["plan", "user_models:make", "--budget", "0.9", "--actions", "compress",
                 "--compress-dtypes", "float4"]) == 1
    assert "accepted compress dtypes" in capsys.readouterr().err
