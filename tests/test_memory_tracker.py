"""The tracker against hand-derived numbers (512x512 fp32 tensors are exactly 1 MiB)."""
import pytest
import torch
import torch.nn.functional as F

import autorecompute
from autorecompute.runtime.memory import LiveStorageTracker, measure_step
from conftest import SOLVER_TIME

MIB = 2**20


def test_counts_new_storages_and_frees():
    tracker = LiveStorageTracker()
    with tracker:
        a = torch.ones(512, 512)
        b = a * 2
        c = b.view(-1)          # alias: no new bytes
        del a
        d = b + 1
        del b, c, d
    assert tracker.peak == 2 * MIB          # never more than two of a, b, d alive at once
    assert tracker.current == 0


def test_existing_storages_are_not_counted():
    x = torch.ones(512, 512)
    tracker = LiveStorageTracker()
    with tracker:
        x.mul_(2)               # in place on an existing storage
        y = x.t()               # view of an existing storage
    assert tracker.peak == 0
    del y


def test_linear_relu_step_matches_hand_count():
    # forward: y = relu(x @ W^T) kept for backward (1 MiB); h = x @ W^T freed after relu... relu saves
    # its output, linear saves x (an input, resident). Backward: ones seed (1 MiB), grad of h (1 MiB),
    # grad of W (1 MiB, stays).
    model = torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False), torch.nn.ReLU())
    x = torch.randn(512, 512)
    mem = measure_step(model, (x,))
    assert mem.resident == 2 * MIB            # weight + input
    assert mem.tracked_peak == 4 * MIB        # h/out, seed, grad_h, grad_W at the end of backward


def test_a_cuda_kernels_measured_workspace_is_live_during_its_call(monkeypatch):
    """Scratch a CUDA kernel takes inside one call (cuDNN convolutions, reductions) is no tensor; measured
    once per op signature on the device, the tracker adds it at every call — here on fake CUDA tensors, the
    probe replaced by a fixed measurement (this machine may have no GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autorecompute.runtime import workspaces

    monkeypatch.setattr(workspaces, "_measured", {})
    monkeypatch.setattr(workspaces, "_pending", {})
    with FakeTensorMode():
        a = torch.empty(512, 512, device="cuda")
        first = LiveStorageTracker()
        with first:
            b = torch.mm(a, a)
            del b
        assert first.peak == MIB                 # not measured yet: queued, counted 0
        assert workspaces.has_pending()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(workspaces, "_probe", lambda func, spec, described: 3 * MIB)
        assert workspaces.probe_pending() == 1 and not workspaces.has_pending()
        half = torch.empty(256, 512, device="cuda")    # (not a slice: a CPU build cannot view a CUDA tensor)
        again = LiveStorageTracker()
        with again:
            b = torch.mm(a, a)               # same signature: its workspace on top of its output
            c = torch.mm(half, a)            # another signature: queued, counted 0
            del b, c
        assert again.peak == MIB + 3 * MIB
        assert workspaces.has_pending()
        cpu = LiveStorageTracker()
        with cpu:
            torch.mm(torch.ones(512, 512), torch.ones(512, 512))
        assert cpu.peak == 3 * MIB               # two inputs and the output; CPU ops are never probed


def test_other_device_memory_is_counted_in_whole_mib_so_a_reported_minimum_stays_valid(monkeypatch):
    """What else is allocated on a CUDA device (cuBLAS workspaces, optimizer state) is resident for a plan.
    Planning itself may leave a 512-B block behind, so the next plan sees a little more: rounded up to whole
    MiB (plus the allocator's slack), the two counts agree and a minimum one plan reports is one the next
    accepts. Fake CUDA tensors and a stubbed allocator stand in for a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autorecompute.runtime import memory

    with FakeTensorMode():
        weight = torch.empty(512, 512, device="cuda")          # 1 MiB of the model's own
    monkeypatch.setattr(memory, "is_fake", lambda t: False)
    monkeypatch.setattr(memory, "warm_up_blas", lambda device: None)
    counts = []
    for allocated in (MIB + 64 * MIB + 3 * 512, MIB + 64 * MIB + 4 * 512, MIB + 65 * MIB):
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None, a=allocated: a)
        counts.append(memory.device_bytes_outside([weight]))
    assert counts[0] == counts[1] == 65 * MIB + memory.ALLOCATOR_SLACK     # 64 MiB and a few blocks
    assert counts[2] == 65 * MIB + memory.ALLOCATOR_SLACK                  # exactly 65 MiB: not rounded further


class Recurrent(torch.nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(64, 128, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_a_fake_recurrent_step_measures_what_the_real_one_allocates(cell):
    """The CPU LSTM kernel (oneDNN) saves a reserve for backward that its fake kernel makes empty (1.9 MiB
    per layer here), and its backward returns two bias gradients that are one tensor fake: the tracker
    takes the reserve's size from one real call on made-up inputs and counts both gradients, so the fake
    step's peak — what plans are verified with — is the real one's, to the byte."""
    from autorecompute.passes.verify import fake_step_memory

    torch.manual_seed(0)
    model, x = Recurrent(cell), torch.randn(8, 32, 64)
    fake = fake_step_memory(model, (x,), {}).peak
    real = measure_step(model, (x,), {}).peak
    assert fake == real



def test_cpu_convolution_scratch_is_counted_as_the_allocator_sees_it(monkeypatch):
    """oneDNN's convolutions take scratch no tensor shows (reordered inputs and weights): measured once per
    signature from the allocator's events and added at each call, the fake step (what plans are verified
    with), the real step under the tracker and the allocator's own walk give one peak, to the byte."""
    from autorecompute.passes.verify import fake_step_memory
    from autorecompute.runtime import memory
    from autorecompute.runtime.memory import allocated_peak, resident_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 16, 3, padding=1))
    x = torch.randn(8, 16, 32, 32)
    fake = fake_step_memory(model, (x,), {}).peak
    tracked = measure_step(model, (x,), {}).peak
    model.zero_grad(set_to_none=True)
    walked = resident_bytes(model, (x,), {}) + allocated_peak(lambda: model(x).backward(torch.ones(8, 16, 32, 32)))
    assert fake == tracked == walked, (fake, tracked, walked)
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(memory, "has_scratch", lambda func, inputs: False)
    assert measure_step(model, (x,), {}).peak < tracked          # the storages alone reach less


class LossInside(torch.nn.Module):
    """An MLP whose forward returns its own loss: a pointwise loss, reduced."""

    def __init__(self, loss):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
        self.loss = loss

    def forward(self, x, target):
        return {"loss": self.loss(torch.sigmoid(self.mlp(x)), target)}


class Folding(torch.nn.Module):
    """Patches mixed by a linear layer and folded back (F.unfold, F.fold), three times."""

    def __init__(self):
        super().__init__()
        self.mix = torch.nn.ModuleList([torch.nn.Linear(72, 72) for _ in range(3)])
        self.scale = torch.nn.Parameter(torch.ones(3))       # (its gradient keeps each fold's output)

    def forward(self, x):
        for mix, scale in zip(self.mix, self.scale):
            patches = mix(F.unfold(x, 3, padding=1).transpose(1, 2)).transpose(1, 2)
            y = F.fold(patches, x.shape[-2:], 3, padding=1)
            x = x + F.gelu(y * scale)
        return x


@pytest.mark.parametrize("name", ["mse_loss", "smooth_l1_loss", "binary_cross_entropy", "soft_margin_loss", "fold"])
def test_plans_at_their_minimum_hold_where_kernels_return_larger_storages(name):
    """Plans are verified on fake tensors, whose kernels size a tensor's storage as the tensor; some CPU
    kernels return it in a larger one: a reduced pointwise loss keeps its unreduced buffer under the 0-d
    loss (the reviewer's smooth-L1 model measured 1 MiB over its minimum), F.fold's col2im a buffer k² its
    output (2 MiB over). The tracker sizes their outputs by one real call on made-up inputs (as an RNN's
    reserve), and a step at the minimum measures within it."""
    from harness import measured_step

    torch.manual_seed(0)
    if name == "fold":
        model, args = Folding(), (torch.randn(4, 8, 32, 32),)
    else:
        model, args = LossInside(getattr(F, name)), (torch.randn(2048, 128), torch.rand(2048, 128))
    eager = measured_step(model, model, args, {}, seed=1)
    model.zero_grad(set_to_none=True)
    actions = ("recompute",)        # (with offload too the plans' fold outputs go off the device)
    lowest = autorecompute.minimum_peak(model, *args, actions=actions, solver_time_limit=SOLVER_TIME)
    compiled = autorecompute.compile(model, budget=lowest, actions=actions, solver_time_limit=SOLVER_TIME)
    result = measured_step(compiled, model, args, {}, seed=1)
    assert result.peak <= lowest < eager.peak
    assert all(torch.equal(eager.grads[n], result.grads[n]) for n in eager.grads)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_measure_peak_is_the_number_the_tests_hold_against_budgets(name):
    """``autorecompute.measure_peak`` around a user's own step equals the harness's measured peak, for an eager
    step and a planned one (what users call to check the promise is what the tests check it with)."""
    from harness import measured_step

    import models

    case = models.make(name)
    compiled = autorecompute.compile(case.model, budget=0.6, solver_time_limit=SOLVER_TIME)
    for module in (case.model, compiled):
        expected = measured_step(module, case.model, case.args, case.kwargs).peak
        case.model.zero_grad(set_to_none=True)

        def step():
            out = module(*case.args, **case.kwargs)
            out.backward(torch.ones_like(out))
        memory = autorecompute.measure_peak(step, case.model, case.args, case.kwargs)
        assert memory.peak == expected and memory.resident > 0
