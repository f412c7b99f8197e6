"""Capture: what the planner sees of attention, and of ops whose results are written in place later."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import autorecompute
import models
from autorecompute.passes.build_problem import build_problem
from autorecompute.passes.capture import capture
from autorecompute.passes.profile import profile_step
from autorecompute.runtime.softmax import softmax_backward_in_place
from harness import assert_bitwise_equal, measured_step

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Attention(torch.nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.dropout = dropout

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        mask = torch.ones(16, 16, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout).sum(1)


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_attention_with_dropout_becomes_the_math_ops_pytorch_runs():
    """On a CPU, SDPA with dropout runs its math composite: the captured graph holds those ops (two bmm, the
    softmax, the mask drawn by bernoulli.p, the masked probabilities as their own tensor), and computes the
    same outputs and gradients as eager, bit for bit (the same random numbers), at no higher a peak (the graph
    drops each temporary at its last use, where the C++ composite holds some to its end)."""
    x = torch.randn(2, 16, 32)
    model = Attention(0.1)
    gm = capture(model, (x,), {})
    ops = targets(gm)
    aten = torch.ops.aten
    assert SDPA not in ops
    assert ops.count(aten.bmm.default) == 2
    assert softmax_backward_in_place in ops and aten.bernoulli.p in ops and aten.div.Scalar in ops
    assert not any(getattr(t, "_schema", None) and t._schema.name.endswith("_") for t in ops), "in-place op left"
    eager = measured_step(model, model, (x,), {}, seed=5)
    captured = measured_step(gm, model, (x,), {}, seed=5)
    assert_bitwise_equal(eager, captured)
    assert captured.peak <= eager.peak


def test_attention_without_dropout_stays_one_fused_op():
    """Without dropout a CPU runs flash attention: one kernel, kept as one node."""
    x = torch.randn(2, 16, 32)
    assert targets(capture(Attention(0.0), (x,), {})).count(SDPA) == 1


def test_attention_under_autocast_stays_one_op_and_trains_as_eager():
    """Under CPU autocast eager runs SDPA's math composite below autocast (its casts chosen once by the
    autocast kernel); inlined, each of its ops would be cast again when the graph runs (gradients off by
    up to 0.25 on this block). Captured under autocast the call stays one node, and the compiled step, its
    dropout included, is eager's bit for bit."""
    x = torch.randn(2, 16, 32)
    model = Attention(0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert targets(capture(model, (x,), {})).count(SDPA) == 1
    compiled = autorecompute.compile(model, budget=1.0, solver_time_limit=1)
    results = []
    for module in (model, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if module is compiled:
                compiled.prepare(x)
            results.append(measured_step(module, model, (x,), {}, seed=5))
    assert_bitwise_equal(*results)


def test_masked_probabilities_can_be_rematerialized_without_flops():
    """The probabilities after dropout (softmax output × mask) are an elementwise product of two tensors
    autograd keeps anyway: a rematerialization that runs no FLOPs — what SDPA as one op could not offer."""
    x = torch.randn(2, 16, 32)
    gm = capture(Attention(0.1), (x,), {})
    profile_step(gm, (x,), {})
    problem = build_problem(gm)
    masked = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    options = [o for name in masked for o in problem.stash_options.get(name, ()) if o.action == "rematerialize"]
    assert options and all(problem.flops[op] == 0 for o in options for op in o.recipe)


class WrittenLater(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x).exp()
        y = h * 3             # reads h before the write below, so the write cannot be made out-of-place
        h.add_(1.0)
        return (y * h).sum()


def test_an_op_whose_result_is_written_in_place_later_is_not_recomputable():
    """Running ``exp`` again would give its value before ``add_``: neither a region nor a rematerialization
    may remake it."""
    x = torch.randn(4, 8)
    gm = capture(WrittenLater(), (x,), {})
    exp = next(n.name for n in gm.graph.nodes if n.target is torch.ops.aten.exp.default)
    assert any(n.target is torch.ops.aten.add_.Tensor for n in gm.graph.nodes)
    profile_step(gm, (x,), {})
    problem = build_problem(gm)
    assert exp not in problem.recomputable
    assert exp not in problem.stash_options


@pytest.mark.slow
def test_least_flops_plan_at_torch_compiles_point_runs_no_flops_again():
    """GPT-2 with dropout at 69.6% of eager's peak: torch.compile's ``activation_memory_budget=0.7`` point,
    where its partitioner recomputes only elementwise ops. With attention split into its math ops, a plan
    that runs no FLOPs again fits there, and the least-FLOPs search finds it (goal 3 of the benchmarks)."""
    case = models.make("gpt2")
    model = case.model
    eager = measured_step(model, model, case.args, case.kwargs, seed=2)
    with FlopCounterMode(display=False) as counter:
        measured_step(model, model, case.args, case.kwargs, seed=2)
    eager_flops = counter.get_total_flops()
    model.zero_grad(set_to_none=True)
    budget = int(0.696 * eager.peak)
    compiled = autorecompute.compile(model, budget=budget, solver_time_limit=6.0, actions=("recompute",),
                                     objective="flops")
    result = measured_step(compiled, model, case.args, case.kwargs, seed=2)
    with FlopCounterMode(display=False) as counter:
        measured_step(compiled, model, case.args, case.kwargs, seed=2)
    assert result.peak <= budget
    assert compiled.plan.extra_flops == 0
    assert counter.get_total_flops() == eager_flops
    assert_bitwise_equal(eager, result)


class _SharedMask(torch.nn.Module):
    """Two attention-like layers adding one float causal mask, made once from a boolean (HF's way)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        mask = torch.where(causal, 0.0, float("-inf"))          # 4 bytes per entry where the boolean has 1
        h = torch.softmax(self.first(x) @ x.transpose(1, 2) + mask, -1) @ x
        return torch.softmax(self.second(h) @ h.transpose(1, 2) + mask, -1) @ h


def test_a_widened_mask_is_made_again_at_each_reader():
    """The float mask (widened from a boolean, no gradient through it) is made again before its second
    reader: the boolean, a quarter of its bytes, is what lives from the first layer to the second (and what
    a recomputed layer holds as its input). Same values and gradients as eager, bitwise."""
    torch.manual_seed(0)
    model, x = _SharedMask(), torch.randn(2, 8, 16)
    gm = capture(model, (x,), {})
    masks = [n for n in gm.graph.nodes if n.op == "call_function" and "where" in str(n.target)]
    assert len(masks) == 2 and all(len(n.users) == 1 for n in masks)
    assert masks[0].args == masks[1].args
    expected = model(x)
    expected.sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    got = gm(x)
    got.sum().backward()
    assert torch.equal(expected, got)
    assert all(torch.equal(grads[k], p.grad) for k, p in model.named_parameters())


def test_an_op_that_does_not_widen_or_carries_gradient_is_not_duplicated():
    """Only widening ops off the gradient path are made again: a same-size cast of a float mask, or a
    mask computed from a parameter, stays one node."""

    class Learned(_SharedMask):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(8, 8))

        def forward(self, x):
            mask = self.bias * 2.0                               # a gradient flows through it
            h = torch.softmax(self.first(x) @ x.transpose(1, 2) + mask, -1) @ x
            return torch.softmax(self.second(h) @ h.transpose(1, 2) + mask, -1) @ h

    gm = capture(Learned(), (torch.randn(2, 8, 16),), {})
    scaled = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mul.Tensor]
    assert len(scaled) == 1 and len(scaled[0].users) == 2


def _llama(**config):
    t = models._quiet_transformers()
    torch.manual_seed(0)
    cfg = t.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=192, vocab_size=256, max_position_embeddings=128, use_cache=False,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0, **config)
    return t.LlamaForCausalLM(cfg)


def test_a_hugging_face_decoder_with_default_attention_is_captured_as_eager_runs_it():
    """Llama's default attention (SDPA, grouped-query): eager skips the causal mask and runs the fused kernel
    with ``is_causal`` and ``enable_gqa``; ``torch.export`` alone builds the mask, repeats the keys and
    takes the masked kernel (gradients ~1e-4 off). Captured with eager's decisions (no mask, no packed
    sequences passed), the graph has one SDPA call per layer on the unrepeated keys, and a plan's
    gradients are eager's bit for bit."""
    ids = torch.randint(0, 256, (4, 64))
    gm = capture(_llama(), (ids,), {})
    calls = [n for n in gm.graph.nodes if n.target is SDPA]
    assert len(calls) == 2 and all(n.kwargs.get("enable_gqa") and n.args[3] is None for n in calls)
    eager_model, planned_model = _llama(), _llama()
    eager = measured_step(eager_model, eager_model, (ids,), {})
    compiled = autorecompute.compile(planned_model, budget=0.6, solver_time_limit=1)
    planned = measured_step(compiled, planned_model, (ids,), {})
    assert planned.peak <= compiled.plan.budget
    assert_bitwise_equal(planned, eager)


def test_a_sparse_gradient_is_refused_with_the_fix():
    """Sparse gradients' size depends on the indices' values: a typed error naming the module and the fix,
    not an internal fake-tensor exception."""
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16, sparse=True), torch.nn.Linear(16, 4))
    with pytest.raises(autorecompute.CaptureError, match=r"(?s)Embedding '0'.*sparse=False"):
        capture(model, (torch.randint(0, 100, (2, 8)),), {})


def test_a_model_returning_a_key_value_cache_is_told_to_turn_it_off():
    """HF decoders return a DynamicCache by default (``use_cache=True``), which export cannot flatten."""
    t = models._quiet_transformers()
    model = t.GPT2LMHeadModel(t.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(autorecompute.CaptureError, match="use_cache=False"):
        capture(model, (torch.randint(0, 64, (2, 16)),), {})


class StraightThroughRound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_custom_autograd_function_is_refused_not_differentiated_otherwise():
    """torch.export traces a custom Function's forward and drops its backward: the graph's gradient of a
    straight-through round would be 0. Refused with a CaptureError naming it. PyTorch's reentrant checkpoint
    is refused too (its function runs under no_grad: the graph would give its parameters no gradients), with
    its own fix."""
    class Quantized(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.b(StraightThroughRound.apply(self.a(x) * 4))

    with pytest.raises(autorecompute.CaptureError, match="StraightThroughRound.*drops its backward"):
        capture(Quantized(), (torch.randn(4, 16),), {})

    class Reentrant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=True)

    with pytest.raises(autorecompute.CaptureError, match="use_reentrant=False"):
        capture(Reentrant(), (torch.randn(2, 8, requires_grad=True),), {})
    assert type(torch.autograd.Function.__dict__["apply"]).__name__ != "function"   # the original, restored


class AutocastInside(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.b(torch.tanh(self.a(x)))
        return y.float()


def test_autocast_entered_inside_forward_is_named_with_the_fix():
    """``torch.export`` keeps an autocast region inside forward as one op, whose activations the planner can
    neither recompute nor offload: the warning says so and how to enter autocast instead, at the user's line."""
    compiled = autorecompute.compile(AutocastInside(), budget=1.0, solver_time_limit=0.5)
    with pytest.warns(UserWarning, match=r"enters torch.autocast inside forward.*1 region, 3 ops inside.*Fix: "
                                         r"enter torch.autocast around the call") as caught:
        compiled(torch.randn(4, 16)).sum().backward()
    assert {w.filename for w in caught if "autocast" in str(w.message)} == {__file__}


class AutocastOffInside(AutocastInside):
    def forward(self, x):
        with torch.autocast("cpu", enabled=False):       # a part kept in float32 (HF models do): cannot move out
            return torch.softmax(self.b(torch.tanh(self.a(x))).float(), -1)


def test_autocast_switched_off_inside_forward_is_not_told_to_move():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture(AutocastOffInside(), (torch.randn(4, 16),), {})


class MaskIndexed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        f = self.lin(x)
        return self.head(f[f[:, 0] > 0])


def test_a_shape_that_depends_on_values_is_refused_at_the_users_line():
    """Boolean-mask indexing makes a tensor whose size is known only when the step runs: a CaptureError that
    names the op and the user's line, with the fix (planning raised an untyped fake-tensor exception)."""
    with pytest.raises(autorecompute.CaptureError, match=r"shape depends on its values .*test_capture.py.*"
                                                         r"f\[f\[:, 0\] > 0\][\s\S]*torch.where"):
        capture(MaskIndexed(), (torch.randn(16, 8),), {})


def test_cumulative_batch_norm_is_refused_with_the_fix():
    """BatchNorm(momentum=None) reads 1/num_batches_tracked from its buffer in training: named, with the fix
    (export's own error named neither the module nor anything a user could change); in eval mode it captures."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, momentum=None))
    with pytest.raises(autorecompute.CaptureError, match=r"BatchNorm2d '1' has momentum=None.*\n.*momentum=0.1"):
        capture(model, (torch.randn(2, 3, 8, 8),), {})
    capture(model.eval(), (torch.randn(2, 3, 8, 8),), {})


def test_functional_call_with_plain_tensors_is_told_to_pass_parameters():
    """``torch.func.functional_call`` with plain tensors puts them where export wants Parameters."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    compiled = autorecompute.compile(model, budget=0.9)
    tensors = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    with pytest.raises(autorecompute.CaptureError, match="pass nn.Parameter values"):
        torch.func.functional_call(compiled, tensors, (torch.randn(4, 8),))


def test_transformers_output_collecting_hooks_are_not_warned_of():
    """transformers 5 installs forward hooks on first ``output_hidden_states=True`` and keeps them; they only
    hand each layer's output to the model's return value, which the captured graph returns at every step.
    No "run once" warning for them (it said side effects would be lost where none are), the hidden states and
    gradients eager's bit for bit; a hook of the user's beside them is still named."""
    import warnings

    case = models.make("llama")
    compiled = autorecompute.compile(case.model, budget=1.0, solver_time_limit=1)
    kwargs = {"output_hidden_states": True}
    eager = measured_step(case.model, case.model, case.args, kwargs)
    assert any(case.model.model.layers[0]._forward_hooks.values())        # installed by transformers, kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = measured_step(compiled, case.model, case.args, kwargs)
    assert len(ours.outputs) == len(eager.outputs) == 1 + len(case.model.model.layers) + 1
    assert_bitwise_equal(eager, ours)
    case.model.model.layers[1].register_forward_hook(lambda module, inputs, output: None)
    with pytest.warns(UserWarning, match=r"forward hooks on \['model.layers.1'\]"):
        capture(case.model, case.args, kwargs)


def test_only_readers_of_what_a_no_grad_block_writes_are_kept_from_recomputation():
    """Writes inside a higher-order op's subgraph (a ``torch.no_grad()`` block updating buffers) make the ops
    that read those buffers before them unfit to run again — and only those: spectral norm's power
    iteration writes its own vectors, so a BatchNorm beside it stays recomputable (a rule taking every
    buffer would turn off all four here, and raise the recompute-only minimum)."""
    from torch.nn.utils.parametrizations import spectral_norm

    from autorecompute.passes.graph_facts import read_before_written

    class Statistics(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)
            self.register_buffer("shift", torch.zeros(16))
            self.register_buffer("ema", torch.zeros(16))

        def forward(self, x):
            h = self.linear(x)
            y = torch.tanh(h + self.shift) * torch.sigmoid(h)
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * h.mean(0))      # written, read by nothing before
                self.shift.add_(0.01)                          # written after the add read it
            return y

    gm = capture(Statistics(), (torch.randn(8, 16),), {})
    assert [n.target for n in gm.graph.nodes if n.name in read_before_written(gm.graph)] == [torch.ops.aten.add.Tensor]
    layers = []
    for _ in range(4):
        layers += [spectral_norm(torch.nn.Conv2d(8, 8, 3, padding=1)), torch.nn.BatchNorm2d(8), torch.nn.ReLU()]
    gm = capture(torch.nn.Sequential(*layers), (torch.randn(2, 8, 8, 8),), {})
    flagged = read_before_written(gm.graph)
    assert not [n for n in gm.graph.nodes if n.name in flagged and "batch_norm" in str(n.target)]


class _Probabilities(torch.nn.Module):
    """Attention's shape: probabilities ``softmax(q kᵀ)`` (64 KiB, the step's largest tensor), read as ``reads``."""

    def __init__(self, reads):
        super().__init__()
        self.query = torch.nn.Linear(8, 8)
        self.reads = reads

    def forward(self, x, v):
        return self.reads(torch.softmax(self.query(x) @ x.transpose(1, 2), -1), v)


# how each reads the probabilities, and the bytes the in-place backward takes off the peak (the mask's
# product holds a second 64-KiB tensor at the peak, set elsewhere then)
OWN_GRADIENT = {
    "a matmul": (lambda p, v: p @ v, 4 * 64 * 64 * 4),
    "a dropout at p=0, a view and a matmul": (lambda p, v: (F.dropout(p, 0.0).view(4, 1, 64, 64) @ v.unsqueeze(1)),
                                              4 * 64 * 64 * 4),
    "a cast to its own dtype and a mask's product": (lambda p, v: (p.to(torch.float32) * (v[:, :, :1] > 0)) @ v, 0),
}
SHARED_GRADIENT = {
    "a graph output (the caller's gradient)": lambda p, v: (p @ v, p),
    "two readers": lambda p, v: p @ v + (p * 2.0) @ v,
    "an add (one gradient for both operands)": lambda p, v: (p + v @ v.transpose(1, 2)) @ v,
    "a sum (a broadcast gradient)": lambda p, v: (p @ v).sum() + p.sum(),
}


@pytest.mark.parametrize("reads, saved", OWN_GRADIENT.values(), ids=OWN_GRADIENT.keys())
def test_a_softmax_whose_gradient_is_its_own_writes_its_backward_into_it(reads, saved):
    """A softmax read (through views, casts to its own dtype, dropout at p=0) by one op that makes it a new
    gradient becomes ``softmax_backward_in_place``: its backward overwrites that gradient instead of holding
    a third attention-sized tensor beside it and the probabilities. Same outputs and gradients as eager, bit
    for bit; the measured peak one 64-KiB tensor lower, as the profile predicts."""
    torch.manual_seed(0)
    model, args = _Probabilities(reads), (torch.randn(4, 64, 8), torch.randn(4, 64, 8))
    gm = capture(model, args, {})
    assert softmax_backward_in_place in targets(gm) and torch.ops.aten.softmax.int not in targets(gm)
    eager = measured_step(model, model, args, {})
    captured = measured_step(gm, model, args, {})
    assert_bitwise_equal(eager, captured)
    assert captured.peak <= eager.peak - saved
    model.zero_grad(set_to_none=True)
    assert profile_step(gm, args, {}).peak == captured.peak


@pytest.mark.parametrize("reads", SHARED_GRADIENT.values(), ids=SHARED_GRADIENT.keys())
def test_a_softmax_whose_gradient_others_read_keeps_autograds_backward(reads):
    """Where the gradient is also another's (the caller's, an add's other operand, a sum's broadcast, two
    readers' sum) the softmax stays autograd's — writing into it there gives other gradients than eager's."""
    torch.manual_seed(0)
    model, args = _Probabilities(reads), (torch.randn(4, 64, 8), torch.randn(4, 64, 8))
    gm = capture(model, args, {})
    assert softmax_backward_in_place not in targets(gm) and torch.ops.aten.softmax.int in targets(gm)
    assert_bitwise_equal(measured_step(model, model, args, {}), measured_step(gm, model, args, {}))


def test_writing_into_a_shared_gradient_would_change_it():
    """Why the capture pass proves the gradient is the softmax's own: run on a graph output, the op would
    overwrite the gradient the caller handed backward."""
    s = torch.randn(4, 16, requires_grad=True)
    caller_gradient = torch.randn(4, 16)
    kept = caller_gradient.clone()
    torch.softmax(s, -1).backward(caller_gradient)
    assert torch.equal(caller_gradient, kept)
    softmax_backward_in_place(s, -1).backward(caller_gradient)
    assert not torch.equal(caller_gradient, kept) and torch.equal(caller_gradient, s.grad / 2)


def test_a_softmax_backward_in_place_is_recorded_as_autograds_under_create_graph():
    """A backward that records its own graph (gradient penalties) gets a new tensor, differentiable again."""
    torch.manual_seed(0)
    s, w = torch.randn(4, 16, requires_grad=True), torch.randn(16, 16)
    expected, = torch.autograd.grad((torch.softmax(s, -1) @ w).pow(2).sum(), s, create_graph=True)
    got, = torch.autograd.grad((softmax_backward_in_place(s, -1) @ w).pow(2).sum(), s, create_graph=True)
    assert torch.equal(expected, got)
    assert torch.equal(*(torch.autograd.grad(g.pow(2).sum(), s)[0] for g in (expected, got)))


def test_a_plan_keeps_the_softmax_backward_in_place_only_where_its_budget_needs_it():
    """autograd's softmax backward is the faster (called from C++): a plan that fits without the in-place one
    puts it back — budget=1.0 is eager's own peak — and at the minimum, where the in-place
    backward is what fits, it stays. Each plan measured within its budget, with eager's gradients bit for bit."""
    torch.manual_seed(0)
    model, args = _Probabilities(OWN_GRADIENT["a matmul"][0]), (torch.randn(4, 64, 8), torch.randn(4, 64, 8))
    eager = measured_step(model, model, args, {})
    minimum = autorecompute.minimum_peak(model, *args, solver_time_limit=2)
    for budget, in_place in ((1.0, ()), (eager.peak, ()), (minimum, ("softmax",))):
        compiled = autorecompute.compile(model, budget=budget, solver_time_limit=2)
        ours = measured_step(compiled, model, args, {})
        assert compiled.plan.lean_ops == in_place
        assert compiled.plan.baseline_peak == eager.peak       # what fractions are of: eager's step
        assert ours.peak <= compiled.plan.budget and ours.peak == compiled.plan.predicted_peak
        assert_bitwise_equal(eager, ours)
        assert autorecompute.Plan.from_json(compiled.plan.to_json()) == compiled.plan


def test_a_failed_capture_prints_nothing_beside_its_error(capfd):
    """export prints the partial FX graph to stderr (twice) and symbolic shapes log a warning before raising;
    the CaptureError names the construct and the line, so those are held back."""
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(autorecompute.CaptureError, match="could not capture Branchy"):
        capture(Branchy(), (torch.randn(4, 4),), {})
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""
