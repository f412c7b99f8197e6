"""The lean cross-entropy: autograd's values bit for bit, a chunk of rows at a time; capture makes a model's
cross-entropy lean, plans keep it so where the budget needs it (and only there), measured."""
import json
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import autorecompute
from autorecompute.passes.capture import capture
from autorecompute.passes.cross_entropy_in_chunks import chunks_for
from autorecompute.passes.meta import is_lean_op
from autorecompute.plan import Plan
from autorecompute.passes.rewrite_lean_ops import lean_op_nodes, rewrite_lean_ops
from autorecompute.runtime.cross_entropy import REDUCTIONS, cross_entropy_in_chunks, upcast_by_cross_entropy
from autorecompute.runtime.memory import LiveStorageTracker
from harness import assert_bitwise_equal, measured_step


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunks", [1, 3, 8, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_the_loss_and_the_logits_gradient_are_autograds_bit_for_bit(reduction, chunks, dtype, ignore_index):
    torch.manual_seed(0)
    logits = torch.randn(37, 517, dtype=dtype, requires_grad=True)
    target = torch.randint(1, 517, (37,))
    target[::5] = ignore_index                                  # ignored rows: no loss, no gradient
    expected = F.cross_entropy(logits, target, reduction=reduction, ignore_index=ignore_index)
    loss = cross_entropy_in_chunks(logits, target, REDUCTIONS[reduction], ignore_index, chunks)
    upstream = torch.randn_like(expected)
    assert torch.equal(loss, expected)
    assert torch.equal(torch.autograd.grad(loss, logits, upstream)[0],
                       torch.autograd.grad(expected, logits, upstream)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_upcast_made_a_chunk_at_a_time_gives_autograds_loss_and_gradient(dtype):
    torch.manual_seed(0)
    logits = torch.randn(64, 300, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 300, (64,))
    expected = F.cross_entropy(logits.float(), target)
    loss = cross_entropy_in_chunks(upcast_by_cross_entropy(logits), target, upcast=torch.float32, chunks=5)
    assert loss.dtype == torch.float32 and torch.equal(loss, expected)
    gradient, = torch.autograd.grad(loss, logits)
    assert gradient.dtype == dtype and torch.equal(gradient, torch.autograd.grad(expected, logits)[0])


def test_transposed_logits_autocast_and_a_gradient_of_the_gradient_are_autograds():
    torch.manual_seed(0)
    target = torch.randint(0, 40, (24,))
    weights = torch.randn(40, 24, requires_grad=True)              # logits = weights.T: not contiguous
    expected = F.cross_entropy(weights.t(), target)
    loss = cross_entropy_in_chunks(weights.t(), target, chunks=5)
    assert torch.equal(loss, expected)
    assert torch.equal(torch.autograd.grad(loss, weights)[0], torch.autograd.grad(expected, weights)[0])

    low = torch.randn(24, 40, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):              # autocast's cross-entropy is float32's
        expected, loss = F.cross_entropy(low, target), cross_entropy_in_chunks(low, target, chunks=5)
    assert loss.dtype == expected.dtype == torch.float32 and torch.equal(loss, expected)
    assert torch.equal(torch.autograd.grad(loss, low)[0], torch.autograd.grad(expected, low)[0])

    logits = torch.randn(24, 40, dtype=torch.float64, requires_grad=True)
    gradients = [torch.autograd.grad(f(logits, target), logits, create_graph=True)[0]
                 for f in (F.cross_entropy, lambda x, t: cross_entropy_in_chunks(x, t, chunks=5))]
    assert torch.equal(*gradients)
    assert torch.equal(*[torch.autograd.grad(g.square().sum(), logits)[0] for g in gradients])


class _LogSoftmaxes(TorchDispatchMode):
    """Counts the log-softmaxes run."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._log_softmax.default
        return func(*args, **(kwargs or {}))


def _played(logits: torch.Tensor, target: torch.Tensor, chunks: int) -> tuple[int, int, int]:
    """(the peak of the loss and its backward, the bytes left, the log-softmaxes run)."""
    with LiveStorageTracker() as tracker, _LogSoftmaxes() as counted:
        loss = cross_entropy_in_chunks(logits, target, chunks=chunks)
        loss.backward()
        del loss
    return tracker.peak, tracker.current, counted.count


@pytest.mark.parametrize("rows", [37, 40])      # a shorter last chunk; chunks of one size
def test_a_fake_step_plays_two_chunks_for_the_memory_of_all_and_a_traced_graph_takes_every_chunk(rows):
    torch.manual_seed(0)
    logits, target = torch.randn(rows, 517, requires_grad=True), torch.randint(0, 517, (rows,))
    peak, left, log_softmaxes = _played(logits, target, chunks=8)
    assert log_softmaxes == 16                  # each chunk's in forward and again in backward
    with FakeTensorMode() as mode:
        fake_logits = mode.from_tensor(logits).detach().requires_grad_(True)
        assert _played(fake_logits, mode.from_tensor(target), chunks=8) == (peak, left, 4)
    traced = make_fx(lambda x, t: cross_entropy_in_chunks(x, t, chunks=8), tracing_mode="fake")(logits, target)
    assert sum(node.target is torch.ops.aten._log_softmax.default for node in traced.graph.nodes) == 8


class Head(torch.nn.Module):
    """A language-model head over a wide vocabulary, its loss inside: the logits and the cross-entropy's
    vocabulary-sized tensors are most of the step."""

    def __init__(self, vocabulary: int = 4096, width: int = 32, **loss_options):
        super().__init__()
        self.embed = torch.nn.Embedding(vocabulary, width)
        self.mix = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, vocabulary)
        self.loss_options = loss_options

    def forward(self, ids, labels):
        logits = self.out(torch.tanh(self.mix(self.embed(ids))))
        logits = logits.float() if logits.dtype != torch.float32 else logits      # as HF's causal-LM loss
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), **self.loss_options)


def _batch(vocabulary: int = 4096):
    torch.manual_seed(0)
    ids = torch.randint(0, vocabulary, (4, 64))
    return ids, torch.roll(ids, -1, 1)


def _listing(gm: torch.fx.GraphModule) -> list[str]:
    return [f"{n.name} = {getattr(n.target, '__name__', n.target)}{tuple(a.name if isinstance(a, torch.fx.Node) else a for a in n.args)}"
            for n in gm.graph.nodes if n.op == "call_function" and n.name.startswith(("view", "cross_entropy"))]


def test_capture_makes_an_unweighted_cross_entropy_over_class_indices_lean():
    model, (ids, labels) = Head(), _batch()
    gm = capture(model, (ids, labels), {})
    chunks = chunks_for(torch.empty(256, 4096))
    assert _listing(gm) == ["view = view.default('linear_1', [-1, 4096])", "view_1 = view.default('labels', [-1])",
                            f"cross_entropy_loss = cross_entropy_in_chunks('view', 'view_1', 1, -100, {chunks}, None)"]
    assert chunks == 8                                            # at least eight chunks, each ≤ 32 MiB
    assert chunks_for(torch.empty(8 * 1024, 50257)) == 50          # GPT-2's logits: 50 chunks of ≤ 32 MiB


@pytest.mark.parametrize("options", [{"weight": torch.ones(4096)}, {"label_smoothing": 0.1}],
                         ids=["class weights", "label smoothing"])
def test_a_cross_entropy_the_chunks_do_not_compute_stays_autograds(options):
    gm = capture(Head(**options), _batch(), {})
    loss = next(n for n in gm.graph.nodes if n.name == "cross_entropy_loss")
    assert loss.target is torch.ops.aten.cross_entropy_loss.default and not is_lean_op(loss)


def test_a_plan_keeps_the_cross_entropy_lean_only_where_its_budget_needs_it():
    """At the model's minimum the lean cross-entropy is what fits: below eager's peak by a logits tensor less
    a chunk's log-softmax; at eager's own peak autograd's is back. Each plan measured within budget, bitwise
    eager's."""
    model, args = Head(), _batch()
    logits_bytes = 4 * 64 * 4096 * 4
    eager = measured_step(model, model, args, {})
    model.zero_grad(set_to_none=True)                              # the step measured starts without gradients
    minimum = autorecompute.minimum_peak(model, *args, actions=("recompute",), solver_time_limit=2)
    assert minimum <= eager.peak - logits_bytes * 7 // 8
    for budget, lean in ((1.0, ()), (minimum, ("cross_entropy_loss",))):
        compiled = autorecompute.compile(model, budget=budget, actions=("recompute",), solver_time_limit=2)
        ours = measured_step(compiled, model, args, {})
        assert compiled.plan.lean_ops == lean
        assert compiled.plan.baseline_peak == eager.peak           # fractions are of eager's step
        assert ours.peak <= compiled.plan.budget and ours.peak == compiled.plan.predicted_peak
        assert_bitwise_equal(eager, ours)
    assert "cross_entropy_loss: the same values for less memory" in compiled.plan.summary()
    # a GraphModule rebuilt from its code (pickle) keeps the lean loss one node, with the memory planned
    rebuilt = pickle.loads(pickle.dumps(compiled.graph_module))
    assert any(n.target is cross_entropy_in_chunks for n in rebuilt.graph.nodes)


def test_plan_files_carry_the_lean_ops_and_older_files_their_softmaxes():
    plan = autorecompute.plan(Head(), *_batch(), budget=0.8, actions=("recompute",), solver_time_limit=2)
    assert Plan.from_json(plan.to_json()).lean_ops == plan.lean_ops == ("cross_entropy_loss",)
    older = json.loads(plan.to_json())
    older["schema_version"], older["softmax_in_place"] = 12, older.pop("lean_ops")
    assert Plan.from_json(json.dumps(older)).lean_ops == ("cross_entropy_loss",)


def test_an_upcast_of_a_slice_stays_a_cast():
    """``logits[:, :-1].float()`` is a contiguous copy of a strided slice: handed on as it is, the slice's
    strides would not take the ``view`` after it."""
    class Shifted(Head):
        def forward(self, ids, labels):
            logits = self.out(torch.tanh(self.mix(self.embed(ids))))[:, :-1].float()
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    model, args = Shifted().to(torch.bfloat16), _batch()
    gm = capture(model, args, {})
    assert not any(n.target is upcast_by_cross_entropy for n in gm.graph.nodes)
    assert lean_op_nodes(gm) == ["cross_entropy_loss"]
    eager = measured_step(model, model, args, {})
    assert_bitwise_equal(eager, measured_step(gm, model, args, {}))


def test_a_low_precision_models_upcast_for_the_loss_is_made_by_the_lean_cross_entropy():
    """bfloat16 logits cast to float32 for the loss alone: the cast hands them on, the lean cross-entropy casts
    a chunk at a time — lean together only; at the minimum the float32 logits are never whole: below eager's
    peak by their bytes and a bfloat16 logits tensor, bit for bit eager's."""
    model, args = Head().to(torch.bfloat16), _batch()
    gm = capture(model, args, {})
    assert _listing(gm)[-1].startswith("cross_entropy_loss = cross_entropy_in_chunks('view', 'view_1', 1, -100, 8, "
                                       "torch.float32)")
    cast = next(n for n in gm.graph.nodes if n.target is upcast_by_cross_entropy)
    assert [str(a) for a in cast.args] == ["linear_1"]
    assert lean_op_nodes(gm) == ["cross_entropy_loss", cast.name]
    with pytest.raises(ValueError, match="lean only together with 'cross_entropy_loss'"):
        rewrite_lean_ops(gm, [cast.name])
    assert rewrite_lean_ops(gm, ()) and cast.target is torch.ops.aten.to.dtype

    eager = measured_step(model, model, args, {})
    model.zero_grad(set_to_none=True)
    minimum = autorecompute.minimum_peak(model, *args, actions=("recompute",), solver_time_limit=2)
    logits = 4 * 64 * 4096
    assert minimum <= eager.peak - logits * (4 + 2)
    compiled = autorecompute.compile(model, budget=minimum, actions=("recompute",), solver_time_limit=2)
    ours = measured_step(compiled, model, args, {})
    assert set(compiled.plan.lean_ops) == {"cross_entropy_loss", cast.name}
    assert ours.peak <= minimum and ours.peak == compiled.plan.predicted_peak
    assert_bitwise_equal(eager, ours)
