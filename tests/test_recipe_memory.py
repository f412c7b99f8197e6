"""What a rematerialization recipe adds to the step's memory: its temporaries and the headroom it shares."""
import torch
import torch.nn as nn

from autorecompute.passes.build_problem import _recipe_temporaries, _transient
from autorecompute.passes.capture import capture
from autorecompute.passes.profile import profile_step
from autorecompute.passes.profile_records import StepProfile

ROWS, WIDTH = 32, 16
TENSOR = ROWS * WIDTH * 4      # bytes of each activation below


class ViewThenGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.nn.functional.gelu(h.view(ROWS, WIDTH)) * 2)


def profiled():
    x = torch.randn(ROWS, WIDTH)
    gm = capture(ViewThenGelu(), (x,), {})
    profile = profile_step(gm, (x,), {})
    return {n.name: n for n in gm.graph.nodes}, profile


def test_a_single_op_has_no_temporaries():
    nodes, profile = profiled()
    assert _recipe_temporaries(profile, [nodes["gelu"]]) == 0


def test_an_input_read_by_a_later_op_is_a_temporary():
    nodes, profile = profiled()
    # linear → view → gelu: the linear's output is alive (through its view) while gelu makes the result
    assert _recipe_temporaries(profile, [nodes["linear"], nodes["view"], nodes["gelu"]]) == TENSOR
    # ... → mul: gelu's output is read by mul; the linear's was last read by gelu
    assert _recipe_temporaries(profile, [nodes["linear"], nodes["view"], nodes["gelu"], nodes["mul"]]) == TENSOR


def test_temporaries_beyond_the_events_headroom_count():
    nodes, profile = profiled()
    ops = [nodes["linear"], nodes["view"], nodes["gelu"]]
    for event in range(len(profile.backward_events)):
        room = profile.headroom(event)
        assert room == max(0, profile.backward_peaks[event] - profile.backward_starts[event])
        assert _transient(profile, ops, event) == max(0, TENSOR - room)
    assert profile.headroom(len(profile.backward_events)) == 0          # past the last event: nothing known
    assert profile.headroom(-1) == 0


def test_headroom_is_what_the_event_allocates_above_its_start():
    profile = StepProfile(resident={}, tensors={}, order=[], forward_peaks=[], backward_events=["a", "b"],
                          backward_peaks=[700, 300], parameter_grad_bytes=0, tracked_peak=700,
                          backward_starts=[500, 400])
    assert [profile.headroom(0), profile.headroom(1)] == [200, 0]     # an event that frees more than it makes
