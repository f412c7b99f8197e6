"""Offload (disk tier on CPU) and compress, measured on real tensors: peak against budget, gradients against
eager, the nodes in the rewritten graph, the offload file, and the errors users get."""
import copy
import errno
import gc
import os
import warnings

import pytest
import torch

import autorecompute
import models
from autorecompute.runtime import tiers
from conftest import SOLVER_TIME
from harness import assert_bitwise_equal, measured_step


def minimum(case, **options) -> int:
    with pytest.raises(autorecompute.InfeasibleBudgetError) as info:
        autorecompute.plan(case.model, *case.args, budget=1, solver_time_limit=SOLVER_TIME, **options, **case.kwargs)
    return info.value.minimum


@pytest.mark.parametrize("name", list(models.ACTIVATION_HEAVY))
def test_offload_goes_below_07_of_the_recompute_only_minimum(name, tmp_path):
    """Issue 3, acceptance 1: with offload the measured peak reaches ≤ 0.7× the recompute-only minimum,
    stays under every tested budget, and the gradients are bitwise those of eager."""
    torch.manual_seed(0)
    case = models.ACTIVATION_HEAVY[name]()
    model = case.model
    eager = measured_step(model, model, case.args, case.kwargs, seed=1)
    model.zero_grad(set_to_none=True)
    recompute_only = minimum(case, actions=("recompute",))
    with_offload = minimum(case, actions=("recompute", "offload"))
    assert with_offload <= 0.7 * recompute_only, (with_offload, recompute_only)
    for budget in (with_offload, (with_offload + recompute_only) // 2, recompute_only):
        compiled = autorecompute.compile(model, budget=budget, solver_time_limit=SOLVER_TIME, offload_dir=str(tmp_path))
        result = measured_step(compiled, model, case.args, case.kwargs, seed=1)
        assert result.peak <= budget, (name, budget, result.peak)
        assert_bitwise_equal(eager, result)
        if budget < recompute_only:      # below what recomputation alone reaches, offload must be used
            assert compiled.plan.count("offload") > 0
        assert compiled.graph_module.stash_runtime.tier(case.args[0]).in_use == 0, "extents freed after backward"


def test_graph_code_shows_offload_prefetch_and_cast_nodes():
    """Where copies overlap the compute (a GPU's tier) offloaded tensors are prefetched before backward needs
    them; on the CPU the copy takes the compute's own cores, so each comes back at its first use."""
    case = models.make("gpt")
    on_cpu = autorecompute.plan(case.model, *case.args, budget=0.5, actions=("offload",), solver_time_limit=SOLVER_TIME)
    assert on_cpu.count("offload") > 0 and {r.action for r in on_cpu.stash.values()} == {"offload:late"}
    offloading = autorecompute.compile(case.model, budget=0.5, actions=("offload",), solver_time_limit=SOLVER_TIME,
                                       transfer=autorecompute.transfer.CUDA_HOST)
    offloading.prepare(*case.args)
    code, plan = offloading.graph_module.code, offloading.plan
    assert plan.count("offload") > 0 and "offload" in {r.action for r in plan.stash.values()}
    assert "stash_offload(" in code and "stash_release(" in code and "stash_prefetch(" in code
    assert f"'{next(iter(plan.stash))}'" in code          # the node names the tensor it offloads
    text = str(plan)
    assert "off the device by action" in text and "offload" in text
    compressing = autorecompute.compile(case.model, budget=0.75, actions=("compress",), solver_time_limit=SOLVER_TIME)
    compressing.prepare(*case.args)
    code, plan = compressing.graph_module.code, compressing.plan
    assert plan.count("compress:bfloat16") > 0
    assert "stash_compress(" in code and "'bfloat16'" in code
    assert "compress:bfloat16" in str(plan) and "expected error" in str(plan)


def _cosine(a: dict, b: dict) -> float:
    x = torch.cat([a[k].flatten() for k in sorted(a)])
    y = torch.cat([b[k].flatten() for k in sorted(b)])
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0))


@pytest.mark.parametrize("dtype,min_cosine", [("bfloat16", 0.999), ("float16", 0.999), ("float8", 0.99),
                                              ("int8", 0.99)])
def test_compress_fits_the_budget_and_reports_its_error(dtype, min_cosine):
    """Issue 3, acceptance 2: measured peak ≤ budget; gradient cosine similarity against eager."""
    case = models.make("gpt")
    model = case.model
    eager = measured_step(model, model, case.args, case.kwargs, seed=1)
    model.zero_grad(set_to_none=True)
    compiled = autorecompute.compile(model, budget=0.75, actions=("compress",), compress_dtypes=(dtype,),
                                     solver_time_limit=SOLVER_TIME)
    result = measured_step(compiled, model, case.args, case.kwargs, seed=1)
    plan = compiled.plan
    assert plan.count("compress") > 0 and plan.count("recompute") == 0
    assert result.peak <= plan.budget
    cosine = _cosine(eager.grads, result.grads)
    print(f"{dtype}: gradient cosine similarity {cosine:.6f}, peak {result.peak} ≤ {plan.budget}")
    assert cosine >= min_cosine
    assert all(r.expected_error != "exact" for r in plan.stash.values())
    assert not torch.equal(torch.cat([g.flatten() for g in eager.grads.values()]),
                           torch.cat([g.flatten() for g in result.grads.values()])), "compression is lossy"


def test_bad_actions_and_dtypes_name_the_accepted_ones(tmp_path):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"accepted actions are \('recompute', 'offload', 'compress'\)"):
        autorecompute.compile(model, budget="1GB", actions=("recompute", "swap"))
    with pytest.raises(ValueError, match=r"accepted compress dtypes are \('bfloat16', 'float16', 'float8', 'int8'\)"):
        autorecompute.compile(model, budget="1GB", actions=("compress",), compress_dtypes=("float4",))
    with pytest.raises(ValueError, match="'compress' is not in"):
        autorecompute.compile(model, budget="1GB", compress_dtypes=("bfloat16",))
    with pytest.raises(ValueError, match="must be a tuple"):
        autorecompute.compile(model, budget="1GB", actions="offload")


def test_unwritable_offload_dir_fails_before_training(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(autorecompute.OffloadError, match="cannot be written.*Fix: pass offload_dir="):
        autorecompute.compile(torch.nn.Linear(4, 4), budget="1GB", offload_dir=str(blocked / "sub"))


def test_a_full_disk_stops_the_step_with_an_error(monkeypatch, tmp_path):
    """A write that fails mid-step (ENOSPC, after two tensors were written) raises OffloadError naming the
    tensor; nothing is lost silently, the failed step's extents are free at once (the next step needs the
    space: it lays its tensors out at the same offsets) and the next step is eager's."""
    case = models.make("mlp")
    eager = measured_step(case.model, case.model, case.args, case.kwargs)
    case.model.zero_grad(set_to_none=True)
    compiled = autorecompute.compile(case.model, budget=0.5, actions=("offload",), offload_dir=str(tmp_path),
                                     solver_time_limit=SOLVER_TIME)
    compiled.prepare(*case.args)
    assert compiled.plan.count("offload") > 2
    written, write_at = [], tiers._write_at

    def full_disk(file, view, offset):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(offset)
        write_at(file, view, offset)

    monkeypatch.setattr(tiers, "_write_at", full_disk)
    with pytest.raises(autorecompute.OffloadError, match="activation '.*' .*No space left on device.*Fix: free space"):
        compiled(*case.args).sum().backward()
    assert len(written) == 2
    monkeypatch.setattr(tiers, "_write_at", write_at)
    case.model.zero_grad(set_to_none=True)
    disk = compiled.graph_module.stash_runtime.tier(case.args[0])
    assert disk.in_use == 0         # nothing of the failed step holds space
    assert_bitwise_equal(eager, measured_step(compiled, case.model, case.args, case.kwargs))


def test_saved_views_restore_and_a_retained_graph_backwards_twice(tmp_path):
    """Ops that save views of an offloaded tensor get the same views back; backward can run twice."""
    torch.manual_seed(0)

    class ViewSaver(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 512)
            self.b = torch.nn.Linear(128, 64)
            self.tail = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(),
                                                                  torch.nn.Linear(512, 64)) for _ in range(4)])

        def forward(self, x):
            h = torch.tanh(self.a(x))                    # tanh saves its output h
            parts = h.view(x.shape[0], 4, 128)           # b saves views of h
            y = self.b(parts[:, 1]) + self.b(parts.transpose(1, 2)[:, :, 3].contiguous().sin())
            return self.tail(y)

    model, x = ViewSaver(), torch.randn(512, 64)
    model(x).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with pytest.raises(autorecompute.InfeasibleBudgetError) as info:
        autorecompute.plan(model, x, budget=1, actions=("offload",), solver_time_limit=SOLVER_TIME)
    compiled = autorecompute.compile(model, budget=info.value.minimum, actions=("offload",),
                                     offload_dir=str(tmp_path), solver_time_limit=SOLVER_TIME)
    out = compiled(x)
    assert compiled.plan.count("offload") > 0
    with pytest.warns(UserWarning, match="keeps its graph"):     # (over the budget: not measured here)
        out.sum().backward(retain_graph=True)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, expected[n]), n
    out.sum().backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, 2 * expected[n]), n


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_step(module, args) -> int:
    """``torch.cuda.max_memory_allocated`` over one step (same dropout masks every time)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    module(*args).float().sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


@cuda
# VGG's cuDNN backward workspaces (140 MiB at batch 128 on an H200) can leave little for a plan to win
@pytest.mark.parametrize("name, actions, must_act", [("gpt", ("offload",), True), ("vgg", ("recompute",), False)])
def test_the_allocator_peak_on_cuda_stays_under_the_budget(name, actions, must_act, monkeypatch):
    """On CUDA the budget holds on ``torch.cuda.max_memory_allocated``: cuBLAS workspaces and other
    allocations on the device are counted as resident, cuDNN's convolution workspaces (VGG) are measured
    per op, offload copies run on a side stream into pinned memory. The budget is halfway between the
    minimum and the unoptimized peak, so the plan has to act."""
    # cuDNN's default convolution-backward algorithms add with atomics: two eager steps differ by ~1e-3
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    torch.manual_seed(0)
    case = models.ACTIVATION_HEAVY[name]() if name in models.ACTIVATION_HEAVY else models.make(name)
    model = case.model.cuda()
    args = tuple(a.cuda() for a in case.args)
    _cuda_step(model, args)
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with pytest.raises(autorecompute.InfeasibleBudgetError) as info:
        autorecompute.plan(model, *args, budget=1, actions=actions, solver_time_limit=SOLVER_TIME)
    probe = autorecompute.plan(model, *args, budget=1.0, actions=actions, solver_time_limit=SOLVER_TIME)
    budget = (info.value.minimum + probe.baseline_peak) // 2
    compiled = autorecompute.compile(model, budget=budget, actions=actions, solver_time_limit=SOLVER_TIME)
    compiled.prepare(*args)
    assert compiled.plan.resident["other on device"] > 0       # the cuBLAS workspaces at least
    peak = _cuda_step(compiled, args)
    assert compiled.plan.count(actions[0]) > 0 or not must_act
    assert peak <= budget, (peak, budget)
    for n, p in model.named_parameters():
        # lossless actions; the tolerance only absorbs CUDA's other nondeterministic kernels (atomics)
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-6)


def test_parameter_gradients_leave_the_device_until_backward_ends(tmp_path):
    """A VGG-style net peaks late in backward, at its first, largest layers, while the gradients of the deep
    layers sit unread until the optimizer: offloading those from their accumulation to the end of backward
    reaches budgets below any activation plan's minimum. Every gradient is back (bitwise eager's) when
    backward returns, the measured peak is the predicted one, and nothing stays stored."""
    torch.manual_seed(0)
    case = models.make("vgg")
    model = case.model
    eager = measured_step(model, model, case.args, case.kwargs, seed=1)
    model.zero_grad(set_to_none=True)
    budget = 5_000_000     # the lowest peak without gradient offload is ~5.5 MB here (docs/benchmarks.md)
    compiled = autorecompute.compile(model, budget=budget, actions=("recompute", "offload"),
                                     solver_time_limit=SOLVER_TIME, offload_dir=str(tmp_path))
    plan = compiled.prepare(*case.args)
    offloaded = [name for name in plan.stash if name.startswith("grad:")]
    assert offloaded and "stash_gradient(" in compiled.graph_module.code
    result = measured_step(compiled, model, case.args, case.kwargs, seed=1)
    assert result.peak == plan.predicted_peak <= budget
    assert_bitwise_equal(eager, result)
    assert all(p.grad is not None for p in model.parameters())
    assert compiled.graph_module.stash_runtime.tier(case.args[0]).in_use == 0     # every extent free
    # the hooks on the user's parameters go with the compiled module
    hooked = [p for p in model.parameters() if p._post_accumulate_grad_hooks]
    assert hooked
    del compiled, plan
    gc.collect()
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_the_offload_file_has_no_name_so_nothing_can_remove_it(tmp_path):
    """The disk tier's file is anonymous: while a step's activations are offloaded nothing is visible in
    offload_dir (so a killed process leaves nothing behind), and a cleaner removing offload_dir itself
    between steps changes nothing; the file's size stays one step's offloads."""
    import shutil

    case = models.make("mlp")
    root = tmp_path / "offload"
    root.mkdir()
    eager = measured_step(case.model, case.model, case.args, case.kwargs)
    case.model.zero_grad(set_to_none=True)
    compiled = autorecompute.compile(case.model, budget=0.5, actions=("offload",), offload_dir=str(root),
                                     solver_time_limit=SOLVER_TIME)
    out = compiled(*case.args)
    disk = compiled.graph_module.stash_runtime.tier(case.args[0])
    assert disk.in_use > 0 and os.listdir(root) == []
    out.sum().backward()
    size = os.fstat(disk._file.fileno()).st_size
    assert disk.in_use == 0 and size > 0
    shutil.rmtree(root)
    case.model.zero_grad(set_to_none=True)
    assert_bitwise_equal(eager, measured_step(compiled, case.model, case.args, case.kwargs))
    assert os.fstat(disk._file.fileno()).st_size == size


def _gradient_offloading_mlp(tmp_path):
    """An 8-layer MLP and a plan that offloads the last layers' gradients (at 0.4 of its peak)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU()) for _ in range(8)])
    eager, x = copy.deepcopy(model), torch.randn(512, 128)
    compiled = autorecompute.compile(model, budget=0.4, offload_dir=str(tmp_path), solver_time_limit=SOLVER_TIME)
    assert compiled.prepare(x).gradients_offloaded()
    return model, compiled, eager, x


def test_a_failed_backward_leaves_eagers_gradients_and_no_files(tmp_path):
    """A backward that raises after some gradients were offloaded (here a hook on the first layer, reached
    last; Ctrl-C does the same) drops autograd's end-of-backward callback: the gradients come back anyway
    when that backward is released, as eager's partial ones, and later steps get every gradient. Before,
    those parameters had no gradient at any later step and each step left three stored gradients behind."""
    model, compiled, eager, x = _gradient_offloading_mlp(tmp_path)
    fail = [True]

    def hook(grad):
        if fail[0]:
            raise RuntimeError("a failing hook")
    for net, module in ((model, compiled), (eager, eager)):
        net[0][0].weight.register_hook(hook)
        with pytest.raises(RuntimeError, match="a failing hook"):
            module(x).sum().backward()
    for a, b in zip(eager.parameters(), model.parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad))
    fail[0] = False
    for _ in range(2):
        for net, module in ((model, compiled), (eager, eager)):
            net.zero_grad(set_to_none=True)
            module(x).sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))
        assert compiled.graph_module.stash_runtime.tier(x).in_use == 0


def test_create_graph_keeps_the_gradients_graph_with_a_warning(tmp_path):
    """``backward(create_graph=True)`` (a gradient penalty): the gradients the plan offloads carry the graph
    of the backward, so they stay on the device, with a warning that the budget does not cover that step;
    the penalty's gradients are eager's bit for bit (a stored copy had dropped the graph: 3 of 16 gradients
    without it, every penalty gradient off)."""
    model, compiled, eager, x = _gradient_offloading_mlp(tmp_path)
    penalties = []
    for net, module in ((model, compiled), (eager, eager)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module(x).pow(2).sum().backward(create_graph=True)
        params = list(net.parameters())
        assert all(p.grad.grad_fn is not None for p in params)
        penalties.append(torch.autograd.grad(sum(p.grad.pow(2).sum() for p in params), params))
        if net is model:
            assert any("create_graph=True" in str(w.message) for w in caught)
        for p in params:
            p.grad = None           # (breaks the parameter ↔ gradient cycle create_graph makes)
    assert all(torch.equal(a, b) for a, b in zip(*penalties))
