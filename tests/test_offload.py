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
from autorecompute.decisions import Action, Stashed
from autorecompute.passes.build_problem import build_problem
from autorecompute.passes.capture import capture
from autorecompute.passes.profile import profile_step
from autorecompute.passes.rewrite_stash import rewrite_stash
from autorecompute.passes.apply_plan import clone_graph_module
from autorecompute.throughputs import CUDA_HOST
from autorecompute.runtime import tiers
from autorecompute.runtime.stash import StashedModule, StashRuntime
from conftest import SOLVER_TIME
from harness import assert_bitwise_equal, measured_step


def minimum(case, **options) -> int:
    return autorecompute.minimum_peak(case.model, *case.args, solver_time_limit=SOLVER_TIME, **options, **case.kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(models.ACTIVATION_HEAVY))
def test_offload_goes_below_07_of_the_recompute_only_minimum(name, tmp_path, monkeypatch):
    """Issue 3, acceptance 1: with offload the measured peak reaches ≤ 0.7× the recompute-only minimum,
    stays under every tested budget, and the gradients are bitwise those of eager. In tensor storages, as the
    issue measured: the CPU convolutions' scratch is left out (on the activation-heavy ResNet it sets the
    offload minimum's floor: 13.7 MB against 17.5 MB recompute-only, 0.78×, where the tensors reach 0.58×)."""
    from autorecompute.runtime import memory

    monkeypatch.setattr(memory, "has_scratch", lambda func, inputs: False)
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
        disk = compiled.graph_module.stash_runtime.disk
        assert disk is None or disk.in_use == 0, "extents freed after backward"
        assert disk is not None or budget >= recompute_only


def test_prefetched_offloads_are_nodes_of_the_graph_and_come_back_exact():
    """Where copies overlap the compute (a GPU's tier, priced by ``CUDA_HOST``) an offloaded tensor is
    prefetched from a backward event before its first use: a ``stash_prefetch`` node (on the CPU it reads at
    that point on the training thread), and the gradients are eager's. The planner prices CPU tensors
    without overlap, even with a TransferModel that says otherwise: no prefetch there (next test)."""
    case = models.make("gpt")
    eager = measured_step(case.model, case.model, case.args, case.kwargs)
    case.model.zero_grad(set_to_none=True)
    gm = capture(case.model, case.args, case.kwargs)
    profile_step(gm, case.args, case.kwargs)
    problem = build_problem(gm, offload=CUDA_HOST)
    prefetched = {name: options[0] for name, options in problem.stash_options.items()
                  if options[0].action == "offload" and not name.startswith("grad:")}
    first_uses = {name: next(o for o in problem.stash_options[name] if o.action == "offload:late").restored_from
                  for name in prefetched if len(problem.stash_options[name]) > 1}
    assert first_uses and any(prefetched[n].restored_from < first_uses[n] for n in first_uses)
    stash = {name: Stashed(Action.parse("offload"), prefetched[name].restored_from - problem.num_forward)
             for name in first_uses}
    rewritten = StashedModule(rewrite_stash(clone_graph_module(gm), stash, StashRuntime()))
    code = rewritten.graph_module.code
    assert "stash_offload(" in code and "stash_release(" in code and code.count("stash_prefetch(") == len(stash)
    assert f"'{next(iter(stash))}'" in code          # the node names the tensor it offloads
    assert_bitwise_equal(eager, measured_step(rewritten, case.model, case.args, case.kwargs))


@pytest.mark.slow
def test_graph_code_shows_offload_and_cast_nodes():
    """On the CPU the copy takes the compute's own cores: each offloaded tensor comes back at its first use
    (``offload:late``, no prefetch node), whatever ``transfer`` says about overlap."""
    case = models.make("gpt")
    offloading = autorecompute.compile(case.model, budget=0.5, actions=("offload",), solver_time_limit=SOLVER_TIME,
                                       transfer=CUDA_HOST)
    offloading.prepare(*case.args)
    code, plan = offloading.graph_module.code, offloading.plan
    assert plan.count("offload") > 0 and {r.action for r in plan.stash.values()} == {"offload:late"}
    assert "stash_offload(" in code and "stash_release(" in code and "stash_prefetch(" not in code
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
@pytest.mark.slow
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
    disk = compiled.graph_module.stash_runtime.disk
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
    assert compiled.graph_module.stash_runtime.disk.in_use == 0     # every extent free
    # the hooks on the user's parameters go with the compiled module
    hooked = [p for p in model.parameters() if p._post_accumulate_grad_hooks]
    assert hooked
    del compiled, plan
    gc.collect()
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


@pytest.mark.skipif(os.name == "nt", reason="on Windows a temporary file has a name until it closes")
def test_the_offload_file_has_no_name_so_nothing_can_remove_it(tmp_path):
    """The disk tier's file is anonymous: while a step's activations are offloaded nothing is visible in
    offload_dir (so a killed process leaves nothing behind), and a cleaner removing offload_dir itself
    between steps changes nothing. The file stays the size of one step's offloads; a plan for another input
    shape offloads to the same file (a file per plan grew with every shape: 7 files, 107 MiB, at 7 batch sizes)."""
    import shutil

    case = models.make("mlp")
    root = tmp_path / "offload"
    root.mkdir()
    eager = measured_step(case.model, case.model, case.args, case.kwargs)
    case.model.zero_grad(set_to_none=True)
    compiled = autorecompute.compile(case.model, budget=0.5, actions=("offload",), offload_dir=str(root),
                                     solver_time_limit=SOLVER_TIME)
    out = compiled(*case.args)
    disk = compiled.graph_module.stash_runtime.disk
    assert disk.in_use > 0 and os.listdir(root) == []
    out.sum().backward()
    size = disk.file_bytes
    assert disk.in_use == 0 and size > 0
    shutil.rmtree(root)
    case.model.zero_grad(set_to_none=True)
    assert_bitwise_equal(eager, measured_step(compiled, case.model, case.args, case.kwargs))
    half = tuple(a[: a.shape[0] // 2] for a in case.args)
    compiled(*half).sum().backward()
    assert compiled.graph_module.stash_runtime.disk is disk and compiled.plan.count("offload") > 0
    assert disk.file_bytes == size and disk.in_use == 0


_FORKED_CHILD = """
import os, sys, torch
torch.set_num_threads(1)     # the child runs on one thread (OpenMP's do not survive a fork): eager's too, like for like
sys.path.insert(0, {tests!r})
import autorecompute, models
from harness import measured_step
case = models.make("mlp")
eager = measured_step(case.model, case.model, case.args, case.kwargs)
case.model.zero_grad(set_to_none=True)
compiled = autorecompute.compile(case.model, budget=0.5, actions=("offload",), offload_dir={tmp!r},
                                 solver_time_limit=1)
compiled(*case.args).sum().backward()
disk = compiled.graph_module.stash_runtime.disk
parent_file = os.fstat(disk._resources[0].fileno()).st_ino
def steps_exact():
    ok = True
    for _ in range(3):
        case.model.zero_grad(set_to_none=True)
        step = measured_step(compiled, case.model, case.args, case.kwargs)
        ok = ok and all(torch.equal(step.grads[n], g) for n, g in eager.grads.items())
    return ok
pid = os.fork()
if pid == 0:
    try:
        own = os.fstat(disk._resources[0].fileno()).st_ino != parent_file
        os._exit(0 if own and steps_exact() else 3)
    finally:
        os._exit(4)
parent_ok = steps_exact()
_, status = os.waitpid(pid, 0)
sys.exit(0 if parent_ok and os.waitstatus_to_exitcode(status) == 0 else 5)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_offloads_to_a_file_of_its_own(tmp_path):
    """A child forked after the tier opened shared the parent's file and its position: the two laid their
    tensors out over each other (1 step in 80 with other gradients, or a short read). The child opens its
    own file at the fork and trains with eager's gradients while the parent trains too. (In a fresh process:
    autograd's worker threads, started by earlier tests, make a fork here unusable.)"""
    import subprocess
    import sys

    script = _FORKED_CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)), tmp=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_release_inside_the_tiers_bookkeeping_is_queued_not_waited_for(monkeypatch, tmp_path):
    """Garbage collection can run a stash's finalizer, which releases its extent, while the same thread is in
    the tier's bookkeeping (under its lock): that release was a deadlock. It is queued and settled by the
    bookkeeping it interrupted; an extent released twice is an error, not two tensors in one extent."""
    import threading

    disk = tiers.DiskTier(str(tmp_path))
    first, _ = disk.store(torch.ones(16), "a")
    second, _ = disk.store(torch.ones(16), "b")
    settle, pending = disk._settle, [second]

    def settle_then_collect():             # what a collection during the bookkeeping does
        settle()
        if pending:
            disk.release(pending.pop())
    monkeypatch.setattr(disk, "_settle", settle_then_collect)
    worker = threading.Thread(target=disk.release, args=(first,), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and disk.in_use == 0
    with pytest.raises(RuntimeError, match="released twice"):
        disk.release(first)
    disk.close()


def _gradient_offloading_mlp(tmp_path):
    """An 8-layer MLP and a plan that offloads the last layers' gradients (at 0.4 of its peak)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU()) for _ in range(8)])
    eager, x = copy.deepcopy(model), torch.randn(512, 128)
    compiled = autorecompute.compile(model, budget=0.4, offload_dir=str(tmp_path), solver_time_limit=SOLVER_TIME)
    assert compiled.prepare(x).gradients_offloaded()
    return model, compiled, eager, x


def _two_steps_beside_eager(model, compiled, eager, x) -> None:
    """Two steps of ``compiled`` and of ``eager``: bitwise the same gradients, every extent free after each."""
    for _ in range(2):
        for net, module in ((model, compiled), (eager, eager)):
            net.zero_grad(set_to_none=True)
            module(x).sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))
        assert compiled.graph_module.stash_runtime.disk.in_use == 0


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
    _two_steps_beside_eager(model, compiled, eager, x)


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


def test_the_background_thread_path_keeps_order_and_frees_every_extent(monkeypatch, tmp_path):
    """Copies of non-CPU tensors run on the tier's one background thread (CUDA falling through to disk): forced
    here for CPU tensors, writes, reads and releases interleave with the step as they would there, and the
    gradients are eager's bit for bit, the offloaded gradients included, with every extent free after each
    backward."""
    run = tiers.DiskTier._run
    monkeypatch.setattr(tiers.DiskTier, "_run", lambda self, job, here, name, then=None: run(self, job, False, name, then))
    model, compiled, eager, x = _gradient_offloading_mlp(tmp_path)
    _two_steps_beside_eager(model, compiled, eager, x)
    assert compiled.plan.count("offload") > 0 and compiled.plan.gradients_offloaded()
