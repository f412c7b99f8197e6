"""The profile pass: backward events are the autograd nodes that really run, so the memory model built on
them books each backward's memory where it happens."""
import itertools

import torch
import torch.nn as nn

from autorecompute.memory_model import predicted_peak
from autorecompute.passes.build_problem import build_problem
from autorecompute.passes.capture import capture
from autorecompute.passes.meta import node_info
from autorecompute.passes.profile import profile_step
from autorecompute.passes.rewrite_recompute import rewrite_recompute
from autorecompute.passes.verify import fake_step_memory
from autorecompute.memory_model import rewrite_of
from autorecompute.passes.apply_plan import clone_graph_module


class Attention(nn.Module):
    """Attention as Hugging Face writes it: the probabilities cast to their own dtype, then a dropout with
    p=0 — two ops that return their input and add no autograd node."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        probs = torch.softmax(q @ k.transpose(-1, -2), dim=-1).to(q.dtype)
        probs = nn.functional.dropout(probs, p=0.0, training=True)
        return self.out(torch.tanh(probs @ v))


def profiled():
    torch.manual_seed(0)
    x = torch.randn(2, 48, 32)
    gm = capture(Attention(), (x,), {})
    return gm, (x,), profile_step(gm, (x,), {})


def test_an_op_that_returns_its_input_shares_its_makers_backward_event():
    gm, _, profile = profiled()
    nodes = {n.name: n for n in gm.graph.nodes}
    softmax = next(n for n in nodes if n.startswith("softmax"))
    aliases = [n for n in nodes if n.startswith(("to", "dropout")) and n in profile.order]
    assert aliases, "the graph keeps the cast and the dropout"
    for name in aliases:
        assert node_info(nodes[name]).backward_event == node_info(nodes[softmax]).backward_event
        assert name not in profile.backward_events          # no empty event opened before softmax's


def test_the_model_never_books_a_tensor_twice_on_any_single_region_plan():
    # Booked at an empty event before the softmax's, the softmax's backward would count the probabilities as
    # fixed and again as recomputed (or as held by a saver whose region made its own copy). The model is
    # within less than one tensor of the probabilities' size of the measured peak on every one. It can be under: a region recomputed at softmax's backward makes its
    # unsaved temporaries (the scores) there, which the model does not count — autograd's softmax backward
    # allocates a gradient of their size after them, the in-place one allocates none (the verification
    # measures every plan).
    gm, args, profile = profiled()
    probabilities = next(t.nbytes for t in profile.tensors.values() if t.owner.startswith("softmax"))
    problem = build_problem(gm)
    ops = [op for op in problem.chain if op in problem.recomputable]
    assert len(ops) >= 6
    for i, j in itertools.combinations(range(len(ops) + 1), 2):
        recompute = {op: True for op in ops[i:j]}
        candidate = rewrite_recompute(clone_graph_module(gm), rewrite_of(problem, recompute).words)
        measured = fake_step_memory(candidate, args, {}).peak
        assert abs(predicted_peak(problem, recompute) - measured) < probabilities, ops[i:j]


class SliceUpdated(nn.Module):
    """An in-place add on a slice of each layer's activation, then a scan over it."""

    def __init__(self, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(128, 128) for _ in range(layers)])

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = torch.sigmoid(layer(h)) * 1.0
            h[:, :16] += 1.0
            h = h.cumsum(-1) / 128
        return h


def test_the_profile_measures_what_the_graph_module_allocates_when_a_value_has_no_reader():
    """``h[:, :16] += 1`` is captured as ``copy_(slice, add_)``, whose result — a view of ``h`` — nothing reads.
    The GraphModule's code drops it at once; the profile must too (holding it, and ``h``'s storage, to the
    end of the step would raise the baseline peak over eager's, and fractional budgets with it)."""
    from harness import measured_step

    torch.manual_seed(0)
    model, x = SliceUpdated(), torch.randn(512, 128)
    eager = measured_step(model, model, (x,), {}).peak
    model.zero_grad(set_to_none=True)
    gm = capture(model, (x,), {})
    assert any(n.target is torch.ops.aten.copy_.default and not n.users for n in gm.graph.nodes)
    assert profile_step(gm, (x,), {}).peak == eager == fake_step_memory(gm, (x,), {}).peak
