"""The command line: demo and plan."""
import argparse
import subprocess
import sys
import textwrap

import pytest

from autorecompute.cli import budget_arg, main


def test_budget_argument_forms():
    """As the API reads strings: a unitless decimal is a fraction, whole numbers bytes; others refused."""
    assert budget_arg("0.5") == 0.5 and budget_arg("1.0") == 1.0
    assert budget_arg("12000000") == 12_000_000 and budget_arg("1") == 1
    assert budget_arg("12GB") == 12_000_000_000
    for bad in ("1.5", "inf", "12 parsecs"):
        with pytest.raises(argparse.ArgumentTypeError, match="accepted budgets"):
            budget_arg(bad)


@pytest.mark.parametrize("argv, says", [
    (["demo", "--steps", "0"], "at least 1 step"),
    (["demo", "--steps", "-2"], "at least 1 step"),
    (["demo", "--steps", "two"], "not a whole number"),
    (["demo", "--solver-time-limit", "0"], "positive, finite"),
    (["plan", "m:f", "--budget", "0.5", "--solver-time-limit", "nan"], "positive, finite"),
])
def test_counts_and_time_limits_are_checked_before_anything_runs(capsys, argv, says):
    """``demo --steps 0`` printed a peak of 0 B and "OK" without training; a time limit of 0 reached the solver."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


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


@pytest.mark.slow
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


@pytest.mark.parametrize("argv, says", [
    (["plan", "user_models:nope", "--budget", "0.8"], "cannot load 'user_models:nope'"),
    (["plan", "no_such_module:make", "--budget", "0.8"], "cannot load 'no_such_module:make'"),
    (["plan", "user_models_broken:broken", "--budget", "0.8"], "user_models_broken:broken() raised RuntimeError: boom"),
    (["plan", "user_models:make", "--budget", "0.8", "--input-shape", "512x256"], "comma-separated positive sizes"),
    (["plan", "user_models:make", "--budget", "0.8", "--input-shape", "8,16:int64"], "int64 inputs need HIGH"),
    (["plan", "user_models:make", "--budget", "0.8", "--input-shape", "8,16:float32:9"], "HIGH is for integer"),
    (["plan", "user_models:make", "--budget", "0.8", "--input-shape", "8,16:complex64"], "unknown dtype"),
    (["plan", "user_models:make", "--budget", "0.8", "--input-shape", "8,16:int64:0"], "positive whole number"),
    (["plan", "user_models:make", "--budget", "0.8", "--input-shape", "not a name=8"], "[NAME=]SIZES"),
    (["plan", "user_models:make", "--budget", "0.8", "--input-shape=-1,64"], "positive sizes"),
    (["plan", "user_models:make", "--budget", "0.8", "--input-shape", ""], "positive sizes"),   # not ignored
    (["plan", ":make", "--budget", "0.8"], "expected MODULE:FACTORY"),
    (["plan", "user_models:make", "--budget", "0.8", "--out", "plan.pdf"], "a plan is saved as"),
    (["plan", "user_models:make", "--budget", "0.8", "--out", "no/such/dir/plan.json"], "does not exist"),
    (["plan", "user_models_odd:three", "--budget", "0.8"], "returned a tuple of 3"),
    (["plan", "user_models_odd:number", "--budget", "0.8"], "returned int where a torch.nn.Module was expected"),
])
def test_plan_command_errors_are_one_line(user_models, capsys, argv, says):
    """Mistakes on the command line give one ``error:`` line and exit 2 (before any planning), no traceback."""
    (user_models / "user_models_broken.py").write_text("def broken():\n    raise RuntimeError('boom')\n")
    (user_models / "user_models_odd.py").write_text(USER_MODELS + "def three():\n    return (*make(), 1)\n"
                                                    "def number():\n    return 42\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and "Traceback" not in err


def test_an_out_path_that_cannot_be_written_is_an_error_line_after_the_plan(user_models, capsys):
    (user_models / "taken.json").mkdir()         # a directory where the file would go
    assert main(["plan", "user_models:make", "--budget", "1.0", "--solver-time-limit", "0.5",
                 "--out", "taken.json", "--actions", "recompute, offload"]) == 1
    captured = capsys.readouterr()
    assert "autorecompute plan for" in captured.out
    assert captured.err.startswith("error: --out 'taken.json' cannot be written") and "Traceback" not in captured.err


def test_an_uncapturable_model_is_an_error_line_not_a_traceback(user_models, capsys):
    (user_models / "user_models_branchy.py").write_text(USER_MODELS + textwrap.dedent("""
        class Branchy(torch.nn.Module):
            def forward(self, x):
                return x if x.sum() > 0 else -x
        def branchy():
            return Branchy(), (torch.randn(4, 4, requires_grad=True),)
    """))
    assert main(["plan", "user_models_branchy:branchy", "--budget", "0.8"]) == 1
    assert "could not capture Branchy" in capsys.readouterr().err


def test_python_dash_m_autorecompute_runs_the_command_line():
    result = subprocess.run([sys.executable, "-m", "autorecompute", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "demo" in result.stdout and "plan" in result.stdout


TOKEN_MODELS = textwrap.dedent("""
    import torch
    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(100, 32)
            self.body = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 100))
        def forward(self, input_ids, features, labels=None):
            logits = self.body(self.embed(input_ids) + features)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    def make():
        return Tagger()
""")


def test_input_shapes_make_token_ids_several_inputs_and_keywords(user_models, capsys):
    """Token ids below a vocabulary, a second positional input and a keyword input, made for a factory that
    returns a model alone."""
    (user_models / "token_models.py").write_text(TOKEN_MODELS)
    assert main(["plan", "token_models:make", "--budget", "0.9", "--solver-time-limit", "1",
                 "--input-shape", "4,16:int64:100", "--input-shape", "4,16,32",
                 "--input-shape", "labels=4,16:int64:100"]) == 0
    assert "(int64[4, 16]@cpu, float32[4, 16, 32]@cpu, labels=int64[4, 16]@cpu)" in capsys.readouterr().out


def test_version_and_usage_errors_answer_without_loading_torch():
    """``--version``, ``--help`` and a usage error import neither torch nor the planner (they answer at once)."""
    script = ("import sys; from autorecompute.cli import main\n"
              "for argv in (['--version'], ['plan', '--help'], ['plan', 'm:f', '--budget', 'x']):\n"
              "    try: main(argv)\n"
              "    except SystemExit: pass\n"
              "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("autorecompute ") and "accepted budgets" in done.stderr


def test_the_loss_reserve_is_auto_zero_or_bytes(user_models, capsys):
    """``--loss-reserve`` reaches the plan: 'auto' sizes it from the outputs, 0 and sizes are taken as given;
    a fraction is refused (a reserve is bytes)."""
    from autorecompute.cli import reserve_arg

    assert reserve_arg("auto") == "auto" and reserve_arg("0") == 0 and reserve_arg("64MB") == 64_000_000
    with pytest.raises(argparse.ArgumentTypeError, match="'auto', or bytes"):
        reserve_arg("0.5")
    assert main(["plan", "user_models:make", "--budget", "0.9", "--solver-time-limit", "1",
                 "--loss-reserve", "1MiB", "--out", "plan.json"]) == 0
    import autorecompute
    assert autorecompute.Plan.from_json((user_models / "plan.json").read_text()).loss_reserve == 2**20
