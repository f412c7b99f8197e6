"""The offload, compress and rematerialize choices in the memory model and CP-SAT: brute force on tiny problems, and the
cheapest mix on hand-built cases (offload free when compute hides the copy, recompute cheaper otherwise)."""
import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autorecompute.memory_model import effective_stash, extra_cost, memory_timeline, predicted_peak, rerun_ops
from autorecompute.passes.build_problem import stash_options
from autorecompute.passes.profile_records import TensorInfo
from autorecompute.problem import Activation, Problem, StashOption
from autorecompute.solvers import cpsat, greedy
from strategies import activations, early_stop_saves
from autorecompute.transfer import CPU_DISK, CUDA_HOST, TransferModel

KIB = 1024


def all_decisions(problem):
    ops = sorted(problem.recomputable)
    names = sorted(problem.stash_options)
    for bits in itertools.product([False, True], repeat=len(ops)):
        recompute = dict(zip(ops, bits))
        choices = [[None] + [o.action for o in problem.stash_options[n]] for n in names]
        for picked in itertools.product(*choices):
            yield recompute, {n: a for n, a in zip(names, picked) if a is not None}


def two_layer(offload_cost: int, recompute_cost: int) -> Problem:
    """op0 → op1 → op2; op0's output (100 KiB) is saved by op1 and held from position 2 to op1's backward.
    Offloading it keeps nothing on the device until its prefetch at position 4."""
    chain = ("op0", "op1", "op2")
    act = Activation("t0", owner="op0", nbytes=100 * KIB, hold_start=2, savers=("op1",), readers=("op1",),
                     save_end=4, read_end=4)
    out = Activation("t1", owner="op1", nbytes=100 * KIB, hold_start=3, savers=("op2",), readers=("op2",),
                     save_end=3, read_end=3)
    return Problem(chain=chain, recomputable=frozenset({"op0", "op1"}),
                   cost={"op0": recompute_cost, "op1": recompute_cost, "op2": 1}, flops={"op0": 10, "op1": 10},
                   activations=(act, out), fixed=(0, 0, 0, 0, 0, 0), num_forward=3,
                   backward_op={3: "op2", 4: "op1", 5: "op0"},
                   stash_options={"t0": (StashOption("offload", 0, 2, 4, offload_cost),)})


def test_stashing_replaces_the_held_interval():
    p = two_layer(offload_cost=5, recompute_cost=100)
    assert memory_timeline(p, {}) == [0, 0, 100 * KIB, 200 * KIB, 100 * KIB, 0]
    # offloaded: off the device at 2-3, back (prefetched) at 4
    assert memory_timeline(p, {}, {"t0": "offload"}) == [0, 0, 0, 100 * KIB, 100 * KIB, 0]


def test_a_stash_needs_a_kept_saver():
    p = two_layer(offload_cost=5, recompute_cost=100)
    # op1 recomputed alone: t0 is its region's input, held by the checkpoint — offloading it does nothing
    assert effective_stash(p, {"op1": True}, {"t0": "offload"}) == {}
    assert extra_cost(p, {"op1": True}, {"t0": "offload"}) == extra_cost(p, {"op1": True})


def test_rematerialize_needs_its_op_and_inputs_on_the_device():
    p = two_layer(offload_cost=5, recompute_cost=100)
    remat = StashOption("rematerialize", 0, 2, 4, 7, needs_kept=("op0", "op1"), needs_unstashed=("t1",))
    p = dataclasses.replace(p, **{"stash_options": {"t0": (remat,), "t1": (StashOption("offload", 0, 3, 3, 5),)}})
    assert effective_stash(p, {}, {"t0": "rematerialize"}) == {"t0": "rematerialize"}
    assert memory_timeline(p, {}, {"t0": "rematerialize"}) == [0, 0, 0, 100 * KIB, 100 * KIB, 0]
    assert effective_stash(p, {"op0": True}, {"t0": "rematerialize"}) == {}           # its op recomputed
    assert effective_stash(p, {}, {"t0": "rematerialize", "t1": "offload"}) == {"t1": "offload"}  # input away
    result = cpsat.solve(p, budget=100 * KIB, minimize="cost", time_limit=5)
    assert result.status == "optimal" and result.stash == {"t0": "rematerialize"}
    assert extra_cost(p, result.recompute, result.stash) == 7


@pytest.mark.parametrize("packing", [50 * KIB, 250 * KIB])
def test_a_codecs_temporaries_count_where_it_encodes_and_decodes(packing):
    """Compressing t0 stores a quarter of it from its saver (position 1) and decodes it at 4: the codec's
    encoding temporaries at 1 and decoding ones at 4 are memory too — in the model and in CP-SAT, whose
    minimum-peak plan compresses only while they stay below keeping t0 (200 KiB at position 3)."""
    p = two_layer(offload_cost=5, recompute_cost=100)
    compress = StashOption("compress:int8", 25 * KIB, 1, 4, 3, transient_bytes=10 * KIB, packing_bytes=packing)
    p = dataclasses.replace(p, **{"recomputable": frozenset(), "stash_options": {"t0": (compress,)}})
    assert memory_timeline(p, {}, {"t0": "compress:int8"}) == [0, 25 * KIB + packing, 25 * KIB, 125 * KIB,
                                                             135 * KIB, 0]
    lowest = cpsat.solve(p, minimize="peak", time_limit=5)
    assert lowest.status == "optimal"
    assert lowest.stash == ({"t0": "compress:int8"} if 25 * KIB + packing < 200 * KIB else {})
    assert lowest.objective == min(predicted_peak(p, r, s) for r, s in all_decisions(p))


def test_offload_chosen_when_the_copy_is_hidden():
    p = two_layer(offload_cost=5, recompute_cost=100)
    budget = 100 * KIB
    result = cpsat.solve(p, budget=budget, minimize="cost", time_limit=5)
    assert result.status == "optimal"
    assert result.stash == {"t0": "offload"} and not any(result.recompute.values())
    best = min(extra_cost(p, r, s) for r, s in all_decisions(p) if predicted_peak(p, r, s) <= budget)
    assert extra_cost(p, result.recompute, result.stash) == best == 5


def test_recompute_chosen_when_it_is_cheaper():
    p = two_layer(offload_cost=10_000, recompute_cost=3)
    budget = 100 * KIB
    result = cpsat.solve(p, budget=budget, minimize="cost", time_limit=5)
    assert result.status == "optimal" and result.stash == {}
    assert any(result.recompute.values())
    best = min(extra_cost(p, r, s) for r, s in all_decisions(p) if predicted_peak(p, r, s) <= budget)
    assert extra_cost(p, result.recompute, result.stash) == best


def test_offload_cost_is_the_transfer_compute_cannot_hide():
    """A long matmul between the save and the last forward use, and before the first backward use, hides
    the whole copy: only the fixed per-transfer overhead is left. Without compute the copy is exposed."""
    transfer = TransferModel(flops_per_second=1e9, write_bytes_per_second=1e9, read_bytes_per_second=1e9,
                             per_transfer_seconds=0.0)
    tensor = TensorInfo("t", "op0", 1_000_000, (250_000,), "float32", birth=0, last_forward_use=2)
    act = Activation("t", "op0", 1_000_000, hold_start=3, savers=("op1",), readers=("op1",), save_end=6, read_end=6)
    busy = [0, 0, 10**7, 0, 0, 10**7, 0]      # 10 ms of compute inside both windows: the 1 ms copies hide
    idle = [0] * 7
    hidden = stash_options(tensor, act, busy, num_forward=4, saver_positions=[1], saver_backward=[6], last=6,
                           offload=transfer, compress_dtypes=())
    exposed = stash_options(tensor, act, idle, num_forward=4, saver_positions=[1], saver_backward=[6], last=6,
                            offload=transfer, compress_dtypes=())
    assert hidden[0].action == "offload" and hidden[0].cost == 1
    assert exposed[0].cost == 1 + 2_000_000      # 1 ms out + 1 ms back at 1 GFLOP/s
    compress = stash_options(tensor, act, idle, 4, [1], [6], 6, None, ("bfloat16", "int8"))
    assert [o.action for o in compress] == ["compress:bfloat16", "compress:int8"]
    assert compress[0].stored_bytes == 500_000 and compress[1].stored_bytes == 250_000 + 4



def test_where_copies_take_the_computes_cores_nothing_hides_them_and_nothing_is_prefetched():
    """The CPU's disk tier copies on the training thread (``overlaps_compute=False``): the same busy windows
    hide nothing, and the one option is ``offload:late`` (a prefetch would hold the memory earlier for no
    time saved). Before, the CPU model hid the copies: 12-layer GPT-2's default plan measured +129 ms over
    eager where it was priced +54 ms."""
    cpu = TransferModel(flops_per_second=1e9, write_bytes_per_second=1e9, read_bytes_per_second=1e9,
                        per_transfer_seconds=1e-6, overlaps_compute=False)
    tensor = TensorInfo("t", "op0", 1_000_000, (250_000,), "float32", birth=0, last_forward_use=2)
    act = Activation("t", "op0", 1_000_000, hold_start=3, savers=("op1",), readers=("op1",), save_end=6, read_end=6)
    busy = [0, 0, 10**7, 0, 0, 10**7, 0]
    (only,) = stash_options(tensor, act, busy, num_forward=4, saver_positions=[1], saver_backward=[6], last=6,
                            offload=cpu, compress_dtypes=())
    assert only.action == "offload:late" and only.restored_from == 6
    assert only.cost == 1 + 2_000_000 + 2_000        # 1 ms out + 1 ms back + 2 × 1 µs, all exposed
    assert not CPU_DISK.overlaps_compute and CUDA_HOST.overlaps_compute

@st.composite
def random_problems(draw):
    n = draw(st.integers(3, 4))
    chain = tuple(f"op{i}" for i in range(n))
    order = list(range(n))[::-1]
    bpos = {f"op{j}": n + k for k, j in enumerate(order)}
    acts, options = [], {}
    for i in range(n):
        for k in range(draw(st.integers(0, 2))):
            act = draw(activations(chain, i, k, bpos))
            acts.append(act)
            name, nbytes, savers, save_end = act.name, act.nbytes, act.savers, act.save_end
            last_use = act.hold_start - 1
            if savers and save_end >= last_use + 1 and draw(st.booleans()):
                first_use = min(bpos[s] for s in savers)
                opts = [StashOption("offload", 0, last_use + 1, draw(st.integers(max(n, first_use - 2), first_use)),
                                    draw(st.integers(1, 9)))]
                if draw(st.booleans()):
                    opts.append(StashOption("compress:int8", nbytes // 4, min(int(s[2:]) for s in savers),
                                            first_use, draw(st.integers(1, 9)),
                                            # the codec's temporaries while it decodes and encodes
                                            transient_bytes=draw(st.sampled_from([0, 800])),
                                            packing_bytes=draw(st.sampled_from([0, 2500, 6000]))))
                if draw(st.booleans()):     # made again by its op, which (and an input's saver) must be kept
                    earlier = [a.name for a in acts if a.name != name]
                    opts.append(StashOption(
                        "rematerialize", 0, last_use + 1, first_use, draw(st.integers(1, 9)),
                        needs_kept=(f"op{i}", *draw(st.sets(st.sampled_from(chain), max_size=1))),
                        needs_unstashed=tuple(draw(st.sets(st.sampled_from(earlier), max_size=1))) if earlier else (),
                        transient_bytes=draw(st.sampled_from([0, 0, 1500]))))   # a recipe's temporaries
                earlier = [a.name for a in acts if a.name != name and a.savers and a.save_end >= a.hold_start]
                if earlier and draw(st.booleans()):   # made again with tensors it delivers on its way
                    opts.append(StashOption(
                        "rematerialize:chain", 0, last_use + 1, first_use, draw(st.integers(1, 9)),
                        needs_kept=(f"op{i}",), delivers=tuple(draw(st.sets(st.sampled_from(earlier), min_size=1,
                                                                            max_size=2))),
                        transient_bytes=draw(st.sampled_from([0, 0, 1500]))))
                options[name] = tuple(opts)
    recomputable = frozenset(draw(st.sets(st.sampled_from(chain), min_size=1)))
    positions = 2 * n
    fixed = tuple(draw(st.lists(st.integers(0, 5000), min_size=positions, max_size=positions)))
    return Problem(chain=chain, recomputable=recomputable, cost={op: draw(st.integers(1, 9)) for op in chain},
                   flops={op: 1 for op in chain}, activations=tuple(acts), fixed=fixed, num_forward=n,
                   backward_op={p: op for op, p in bpos.items()}, region_cost=draw(st.sampled_from([0, 3])),
                   stash_options=options, saves=draw(early_stop_saves(chain)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems())
def test_cpsat_agrees_with_brute_force_over_all_actions(problem):
    """Keep / recompute / rematerialize (one op or a chain that delivers others, with or without
    temporaries while the recipe runs) / offload / compress:
    CP-SAT's optimum equals brute force over the memory model."""
    decisions = list(all_decisions(problem))
    peaks = [predicted_peak(problem, r, s) for r, s in decisions]
    lowest = cpsat.solve(problem, minimize="peak", time_limit=5)
    assert lowest.status == "optimal"
    assert predicted_peak(problem, lowest.recompute, lowest.stash) == min(peaks)
    budget = sorted(peaks)[len(peaks) // 3]
    cheapest = cpsat.solve(problem, budget=budget, minimize="cost", time_limit=5)
    best = min(extra_cost(problem, r, s) for (r, s), p in zip(decisions, peaks) if p <= budget)
    assert cheapest.status == "optimal"
    assert predicted_peak(problem, cheapest.recompute, cheapest.stash) <= budget
    assert extra_cost(problem, cheapest.recompute, cheapest.stash) == best
    # in stages (easier models first, each from the best plan so far) the optimum is the same, in the full
    # model's terms
    staged = cpsat.solve_in_stages(problem, budget=budget, minimize="cost", time_limit=4)
    assert staged.status == "optimal" and staged.gap == 0.0
    assert predicted_peak(problem, staged.recompute, staged.stash) <= budget
    assert extra_cost(problem, staged.recompute, staged.stash) == staged.objective == best
    # the heuristic's plans are real plans: what they claim is what the memory model says
    hint = greedy.best_under(problem, budget)
    if hint is not None:
        assert predicted_peak(problem, *hint) <= budget


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems(), st.data())
def test_local_search_never_raises_the_peak_and_returns_effective_choices(problem, data):
    """``greedy.lower_peak`` over every action: no higher than its start, and its stash choices are the
    ones that take effect (what the rewriter would be handed)."""
    start = data.draw(st.sampled_from(list(all_decisions(problem))))
    recompute, stash = greedy.lower_peak(problem, start)
    assert predicted_peak(problem, recompute, stash) <= predicted_peak(problem, *start)
    assert stash == effective_stash(problem, recompute, stash)


def test_the_cost_local_search_drops_an_offload_the_budget_has_room_for():
    """op0's output offloaded where the budget holds it on the device: the copy is all the plan pays for, and
    the local search drops it (a layer menu's plan can offload more than its budget needs)."""
    problem = two_layer(offload_cost=5, recompute_cost=3)
    start = ({"op0": False, "op1": False}, {"t0": "offload"})
    budget = predicted_peak(problem, start[0], {})
    assert extra_cost(problem, *start) == 5
    found = greedy.lower_cost(problem, budget, start)
    assert found == ({"op0": False, "op1": False}, {})
    assert extra_cost(problem, *found) == 0


def test_the_cost_local_search_drops_a_choice_that_shuts_out_a_dearer_one():
    """t1 offloaded shuts out t0's rematerialization (which needs t1 on the device): dropping t1 alone brings
    that in at a higher cost; over the choices that take effect, dropping t1 saves all there is."""
    problem = two_layer(offload_cost=5, recompute_cost=3)
    problem = dataclasses.replace(problem, stash_options={
        "t0": (StashOption("rematerialize", 0, 2, 4, 9, needs_unstashed=("t1",)),),
        "t1": (StashOption("offload", 0, 3, 3, 5),)})
    start = ({"op0": False, "op1": False}, {"t0": "rematerialize", "t1": "offload"})
    assert effective_stash(problem, *start) == {"t1": "offload"}
    assert extra_cost(problem, start[0], {"t0": "rematerialize"}) == 9
    found = greedy.lower_cost(problem, predicted_peak(problem, start[0], {}), start)
    assert found == ({"op0": False, "op1": False}, {})


def test_the_cost_local_search_undoes_single_choices_before_pairs():
    """t0's offload (the dearer) cannot go alone and no change makes room for it at a lower cost; t1's
    can go alone. With work for three evaluations the single undos reach t1 before the pairs spend them."""
    problem = two_layer(offload_cost=9, recompute_cost=50)
    problem = dataclasses.replace(problem, stash_options={**problem.stash_options,
                                                          "t1": (StashOption("offload", 0, 3, 3, 1),)})
    start = ({"op0": False, "op1": False}, {"t0": "offload", "t1": "offload"})
    budget = predicted_peak(problem, start[0], {"t0": "offload"})
    assert predicted_peak(problem, start[0], {"t1": "offload"}) > budget
    tries = 3 * (problem.num_positions + len(problem.activations))
    found = greedy.lower_cost(problem, budget, start, work=tries)
    assert found == ({"op0": False, "op1": False}, {"t0": "offload"})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems(), st.data())
def test_the_cost_local_search_over_every_action_keeps_the_budget_and_never_costs_more(problem, data):
    """From any plan over every action that fits, ``greedy.lower_cost`` returns one that fits and costs no
    more, with the choices that take effect; keeping an op it runs again, or dropping a stash choice, alone
    no longer fits or saves nothing (its stopping rule, for the single changes)."""
    decisions = list(all_decisions(problem))
    peaks = [predicted_peak(problem, r, s) for r, s in decisions]
    budget = sorted(peaks)[len(peaks) // 2]
    start = data.draw(st.sampled_from([d for d, p in zip(decisions, peaks) if p <= budget]))
    recompute, stash = greedy.lower_cost(problem, budget, start)
    cost = extra_cost(problem, recompute, stash)
    assert predicted_peak(problem, recompute, stash) <= budget
    assert cost <= extra_cost(problem, *start)
    assert stash == effective_stash(problem, recompute, stash)
    singles = [({**recompute, op: False}, stash) for op in rerun_ops(problem, recompute)]
    singles += [(recompute, {n: a for n, a in stash.items() if n != name}) for name in stash]
    for single in singles:
        assert predicted_peak(problem, *single) > budget or extra_cost(problem, *single) >= cost


def test_windows_decide_the_gradients_their_ops_make():
    """From a start that offloads every activation and every parameter gradient (a minimum-peak plan's kind),
    under a budget with room, the windows take the gradients' offloads back too: each belongs to the window
    of the op whose backward makes it. Fixed to the start's choice, all 10 stayed offloaded (cost 98.7 M
    against 14.6 M; 12-layer BERT: 191 gradients, twice the plan's time)."""
    import torch

    from autorecompute.passes.build_problem import build_problem
    from autorecompute.passes.capture import capture
    from autorecompute.passes.profile import profile_step
    from autorecompute.problem import GRADIENT

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6)])
    x = torch.randn(512, 64)
    gm = capture(model, (x,), {})
    profile_step(gm, (x,), {})
    problem = build_problem(gm, offload=CPU_DISK, device=CPU_DISK)
    gradients = {a.name for a in problem.activations if a.name.startswith(GRADIENT)}
    keep = {op: False for op in problem.recomputable}
    start = (keep, effective_stash(problem, keep, {n: o[0].action for n, o in problem.stash_options.items()}))
    assert gradients and gradients <= set(start[1])
    budget = (predicted_peak(problem, *start) + predicted_peak(problem, keep, {})) // 2
    found = cpsat.solve_in_windows(problem, start, budget=budget, width=6, time_limit=2)
    assert predicted_peak(problem, *found) <= budget
    assert not gradients & set(found[1])
    assert extra_cost(problem, *found) < extra_cost(problem, *start) / 4
