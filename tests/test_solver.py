"""CP-SAT against brute force on tiny problems, and the memory model's rules on hand-built cases."""
import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autorecompute.memory_model import extra_cost, extra_flops, memory_timeline, predicted_peak, rerun_ops
from autorecompute.problem import Activation, Problem
from autorecompute import search
from autorecompute.solvers import cpsat, greedy
from strategies import activations, early_stop_saves

MIB = 2**20


def chain_problem(n: int = 4, nbytes: int = MIB) -> Problem:
    """A chain of n ops; op i's output is saved by op i+1 (like linear → linear). Forward positions
    0..n-1, backward positions n..2n-1 (op n-1's backward first)."""
    chain = tuple(f"op{i}" for i in range(n))
    acts = []
    for i in range(n - 1):
        saver = f"op{i + 1}"
        bpos = n + (n - 1 - (i + 1))
        acts.append(Activation(name=f"t{i}", owner=f"op{i}", nbytes=nbytes, hold_start=i + 2, savers=(saver,),
                               readers=(saver,), save_end=bpos, read_end=bpos))
    return Problem(chain=chain, recomputable=frozenset(chain[:-1]), cost={op: 1 + i for i, op in enumerate(chain)},
                   flops={op: 100 for op in chain}, activations=tuple(acts), fixed=tuple([0] * (2 * n)),
                   num_forward=n, backward_op={n + (n - 1 - i): f"op{i}" for i in range(n)})


def all_assignments(problem):
    ops = sorted(problem.recomputable)
    for bits in itertools.product([False, True], repeat=len(ops)):
        yield dict(zip(ops, bits))


def test_keep_all_holds_every_saved_tensor():
    p = chain_problem(4)
    assert predicted_peak(p, {}) == 3 * MIB


def test_recomputing_a_lone_op_saves_nothing_when_its_saver_is_kept():
    p = chain_problem(4)
    # op1 recomputed alone: its output t1 is saved by op2 (kept) → still held; its input t0 is held as a
    # region input → nothing saved, cost paid.
    assert memory_timeline(p, {"op1": True}) == memory_timeline(p, {})


def test_recomputing_a_run_drops_its_interior():
    p = chain_problem(6)
    plan = {"op1": True, "op2": True, "op3": True}
    assert predicted_peak(p, plan) < predicted_peak(p, {})


def test_a_region_runs_again_up_to_its_last_save():
    """Checkpoint's early stop: op2 saves only what op0/op1 made (before it runs), op3 saves nothing."""
    p = chain_problem(5)
    p = dataclasses.replace(p, **{"recomputable": frozenset(p.chain), "saves": {"op0": False, "op1": True,
                                                                               "op2": False}})
    everything = {op: True for op in p.chain}
    assert rerun_ops(p, everything) == ["op0", "op1"]
    assert rerun_ops(p, {"op0": True, "op1": True}) == ["op0", "op1"]     # op1 keeps its own output
    assert rerun_ops(p, {"op2": True, "op3": True, "op4": True}) == []     # nothing op2..4 saves is theirs
    assert extra_flops(p, everything) == 200
    unknown = dataclasses.replace(p, **{"saves": None})
    assert rerun_ops(unknown, everything) == list(p.chain)


@pytest.mark.slow
@pytest.mark.parametrize("n", [3, 5, 6])
def test_min_peak_matches_brute_force(n):
    p = chain_problem(n)
    best = min(predicted_peak(p, r) for r in all_assignments(p))
    result = cpsat.solve(p, minimize="peak", time_limit=5)
    assert result.status == "optimal"
    assert predicted_peak(p, result.recompute) == best
    assert result.objective == best


@pytest.mark.parametrize("n", [4, 6])
def test_min_cost_matches_brute_force(n):
    p = chain_problem(n)
    peaks = sorted({predicted_peak(p, r) for r in all_assignments(p)})
    for budget in peaks:
        best = min(extra_cost(p, r) for r in all_assignments(p) if predicted_peak(p, r) <= budget)
        result = cpsat.solve(p, budget=budget, minimize="cost", time_limit=5)
        assert result.status == "optimal"
        assert predicted_peak(p, result.recompute) <= budget
        assert extra_cost(p, result.recompute) == best


@st.composite
def random_problems(draw):
    n = draw(st.integers(3, 6))
    chain = tuple(f"op{i}" for i in range(n))
    num_forward = n
    num_backward = n
    positions = num_forward + num_backward
    order = list(range(n))[::-1]
    if draw(st.booleans()):      # autograd may interleave branches: perturb the backward order a little
        i = draw(st.integers(0, n - 2))
        order[i], order[i + 1] = order[i + 1], order[i]
    bpos = {f"op{j}": num_forward + k for k, j in enumerate(order)}
    acts = []
    for i in range(n):
        for k in range(draw(st.integers(0, 2))):
            acts.append(draw(activations(chain, i, k, bpos)))
    recomputable = frozenset(draw(st.sets(st.sampled_from(chain), min_size=1)))
    fixed = tuple(draw(st.lists(st.integers(0, 5000), min_size=positions, max_size=positions)))
    return Problem(chain=chain, recomputable=recomputable, cost={op: draw(st.integers(1, 9)) for op in chain},
                   flops={op: 1 for op in chain}, activations=tuple(acts), fixed=fixed, num_forward=num_forward,
                   backward_op={p: op for op, p in bpos.items()}, region_cost=draw(st.sampled_from([0, 3])),
                   saves=draw(early_stop_saves(chain)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems())
def test_cpsat_agrees_with_the_memory_model_on_random_problems(problem):
    """CP-SAT's optimum equals brute force over the memory model, for both objectives."""
    assignments = list(all_assignments(problem))
    peaks = [predicted_peak(problem, r) for r in assignments]
    lowest = cpsat.solve(problem, minimize="peak", time_limit=5)
    assert lowest.status == "optimal"
    assert predicted_peak(problem, lowest.recompute) == min(peaks)
    budget = sorted(peaks)[len(peaks) // 2]
    cheapest = cpsat.solve(problem, budget=budget, minimize="cost", time_limit=5)
    best = min(extra_cost(problem, r) for r, p in zip(assignments, peaks) if p <= budget)
    assert cheapest.status == "optimal"
    assert predicted_peak(problem, cheapest.recompute) <= budget
    assert extra_cost(problem, cheapest.recompute) == best


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems(), st.data())
def test_cpsat_over_a_window_matches_brute_force_with_the_rest_fixed(problem, data):
    """With the ops outside a window fixed to the hint's decisions (region cuts among them), CP-SAT's optimum
    equals brute force over the window's assignments, for both objectives, and the rest is left as it was;
    the hint's cuts inside the window are decided anew (plain recomputation or not)."""
    from autorecompute.memory_model import NEW_REGION

    ops = sorted(problem.recomputable)
    window = frozenset(data.draw(st.sets(st.sampled_from(ops))))
    # (cuts matter between recomputed ops: drawn more often than a kept op)
    outside = {op: data.draw(st.sampled_from([False, True, NEW_REGION, NEW_REGION])) for op in ops if op not in window}
    cut_inside = data.draw(st.sets(st.sampled_from(sorted(window)))) if window else set()   # decided anew
    hint = {**outside, **dict.fromkeys(cut_inside, NEW_REGION)}
    plans = [{**outside, **dict(zip(sorted(window), bits))}
             for bits in itertools.product([False, True], repeat=len(window))]
    peaks = [predicted_peak(problem, r) for r in plans]
    lowest = cpsat.solve(problem, minimize="peak", time_limit=5, hint=hint, window=window)
    assert lowest.status == "optimal"
    assert {op: lowest.recompute[op] for op in outside} == outside
    assert all(lowest.recompute[op] in (False, True) for op in window)
    assert predicted_peak(problem, lowest.recompute) == min(peaks)
    budget = sorted(peaks)[len(peaks) // 2]
    cheapest = cpsat.solve(problem, budget=budget, minimize="cost", time_limit=5, hint=hint, window=window)
    assert cheapest.status == "optimal"
    assert {op: cheapest.recompute[op] for op in outside} == outside
    assert predicted_peak(problem, cheapest.recompute) <= budget
    assert extra_cost(problem, cheapest.recompute) == min(extra_cost(problem, r)
                                                           for r, peak in zip(plans, peaks) if peak <= budget)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems(), st.data())
def test_cpsat_scores_a_fixed_plan_with_region_cuts_as_the_memory_model_does(problem, data):
    """Every decision fixed (an empty window), region cuts among them: CP-SAT's peak and cost are the memory
    model's — the encoding of a cut itself, not only where it changes the optimum."""
    from autorecompute.memory_model import NEW_REGION

    plan = {op: data.draw(st.sampled_from([False, True, NEW_REGION])) for op in sorted(problem.recomputable)}
    peak, cost = predicted_peak(problem, plan), extra_cost(problem, plan)
    assert cpsat.solve(problem, minimize="peak", time_limit=5, hint=plan, window=frozenset()).objective == peak
    costed = cpsat.solve(problem, budget=peak, minimize="cost", time_limit=5, hint=plan, window=frozenset())
    assert costed.objective == pytest.approx(cost, abs=1e-6 * max(1, cost))


def test_a_fixed_cut_makes_the_tensor_between_two_regions_an_input_held_by_the_second():
    """a, then b starting a region of its own: a's output, saved by b, is the second region's input, held
    from forward to b's backward (150 B at position 2); as one region it would be made again (100 B)."""
    from autorecompute.memory_model import NEW_REGION

    h = Activation("h", owner="a", nbytes=100, hold_start=2, savers=("b",), readers=("b",), save_end=4, read_end=4)
    problem = Problem(chain=("a", "b", "c"), recomputable=frozenset("abc"), cost=dict.fromkeys("abc", 1),
                      flops={}, activations=(h,), fixed=(0, 0, 50, 0, 0, 0), num_forward=3,
                      backward_op={3: "c", 4: "b", 5: "a"})
    plan = {"a": True, "b": NEW_REGION, "c": False}
    assert predicted_peak(problem, plan) == 150 and predicted_peak(problem, {"a": True, "b": True}) == 100
    assert cpsat.solve(problem, minimize="peak", hint=plan, window=frozenset()).objective == 150


def test_a_fixed_cut_ends_the_region_before_it_for_checkpoints_early_stop():
    """a, then b starting a region of its own: a's region saves nothing, so it never runs again (cost 0),
    though b's region, right after it, saves (b keeps a tensor made before it)."""
    from autorecompute.memory_model import NEW_REGION

    act = Activation("t", owner="a", nbytes=100, hold_start=1, savers=("b",), readers=("b",), save_end=4,
                     read_end=4)
    problem = Problem(chain=("a", "b", "c"), recomputable=frozenset("abc"), cost={"a": 5, "b": 1, "c": 1},
                      flops={}, activations=(act,), fixed=(0,) * 6, num_forward=3,
                      backward_op={3: "c", 4: "b", 5: "a"}, saves={"b": False})
    plan = {"a": True, "b": NEW_REGION, "c": False}
    assert rerun_ops(problem, plan) == [] and extra_cost(problem, plan) == 0
    fixed = cpsat.solve(problem, budget=predicted_peak(problem, plan), hint=plan, window=frozenset())
    assert fixed.objective == pytest.approx(0, abs=1e-6)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems(), st.data())
def test_windows_keep_the_budget_never_cost_more_and_one_over_everything_is_the_optimum(problem, data):
    assignments = list(all_assignments(problem))
    peaks = [predicted_peak(problem, r) for r in assignments]
    budget = sorted(peaks)[len(peaks) // 2]
    fitting = [r for r, peak in zip(assignments, peaks) if peak <= budget]
    start = (data.draw(st.sampled_from(fitting)), {})
    found = cpsat.solve_in_windows(problem, start, budget=budget, width=data.draw(st.integers(1, 3)), time_limit=2)
    assert predicted_peak(problem, *found) <= budget
    assert extra_cost(problem, *found) <= extra_cost(problem, *start)
    whole = cpsat.solve_in_windows(problem, start, budget=budget, width=len(problem.chain))
    assert extra_cost(problem, *whole) == min(extra_cost(problem, r) for r in fitting)
    lowest = cpsat.solve_in_windows(problem, start, minimize="peak", width=len(problem.chain))
    assert predicted_peak(problem, *lowest) == min(peaks)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems(), st.data())
def test_a_window_of_ops_apart_is_solved_to_its_optimum(problem, data):
    """Windows across layers are not runs of the chain: for any set of ops, CP-SAT's plan is the cheapest of
    those that keep the start's decisions outside it and fit (brute force)."""
    assignments = list(all_assignments(problem))
    peaks = [predicted_peak(problem, r) for r in assignments]
    budget = sorted(peaks)[len(peaks) // 2]
    fitting = [r for r, peak in zip(assignments, peaks) if peak <= budget]
    start = data.draw(st.sampled_from(fitting))
    ops = sorted(problem.recomputable, key=problem.chain.index)
    window = frozenset(data.draw(st.lists(st.sampled_from(ops), unique=True, min_size=1)))
    result = cpsat.solve(problem, budget=budget, hint=start, window=window, time_limit=2)
    best = min(extra_cost(problem, r) for r in fitting if all(r[op] == start[op] for op in ops if op not in window))
    assert result.recompute is not None
    assert all(result.recompute[op] == start[op] for op in ops if op not in window)
    assert predicted_peak(problem, result.recompute) <= budget
    assert extra_cost(problem, result.recompute) == best


def test_hint_is_kept_as_a_solution():
    p = chain_problem(6)
    hint, _ = greedy.lowest_peak(p)
    result = cpsat.solve(p, budget=predicted_peak(p, hint), minimize="cost", time_limit=2, hint=hint)
    assert result.recompute is not None
    assert extra_cost(p, result.recompute) <= extra_cost(p, hint)


def test_infeasible_budget_reports_no_solution():
    p = chain_problem(4)
    result = cpsat.solve(p, budget=1, minimize="cost", time_limit=2)
    assert result.recompute is None and result.status == "infeasible"


def test_segment_heuristic_fits_what_it_claims():
    p = chain_problem(8)
    for budget in sorted({predicted_peak(p, *plan) for plan in greedy.candidates(p)}):
        plan = greedy.cheapest_under(p, budget)
        assert plan is not None and predicted_peak(p, *plan) <= budget
        assert predicted_peak(p, *greedy.descend(p, budget, plan)) <= budget


def test_the_iterated_local_search_leaves_a_minimum_no_single_change_can():
    """A tensor two ops save (it is not among what they read): recomputing either saver alone leaves the
    other holding it, so from keeping everything no single change lowers the peak; recomputing both does.
    The kicks (three consecutive ops toggled, then a descent near them) find the brute-force minimum."""
    chain = ("op0", "op1", "op2", "op3")
    act = Activation("t", owner="op1", nbytes=1000, hold_start=2, savers=("op2", "op3"), readers=(),
                     save_end=5, read_end=5, saver_ends=(5, 4))
    problem = Problem(chain=chain, recomputable=frozenset(chain), cost=dict.fromkeys(chain, 1),
                      flops=dict.fromkeys(chain, 1), activations=(act,), fixed=(0,) * 8, num_forward=4,
                      backward_op={4: "op3", 5: "op2", 6: "op1", 7: "op0"})
    assert predicted_peak(problem, {}) == 1000
    assert all(predicted_peak(problem, {op: True}) == 1000 for op in chain)
    found = greedy.lower_peak(problem, ({}, {}))
    assert predicted_peak(problem, *found) == min(predicted_peak(problem, r) for r in all_assignments(problem)) == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems(), st.data())
def test_local_search_ends_where_no_single_change_lowers_the_peak(problem, data):
    """From any plan, ``greedy.lower_peak`` returns one no higher, where toggling any one op does not
    lower the peak (its stopping rule; ties are broken by how many positions sit at the peak)."""
    assignments = list(all_assignments(problem))
    start = data.draw(st.sampled_from(assignments))
    found, _ = greedy.lower_peak(problem, (start, {}))
    peak = predicted_peak(problem, found)
    assert peak <= predicted_peak(problem, start)
    for op in problem.recomputable:
        toggled = {**found, op: not found.get(op, False)}
        assert predicted_peak(problem, toggled) >= peak


def _attention_then_mlp(saves: bool = True) -> Problem:
    """a1 → a2 → m1 → m2 → out: a1's output (100 B) is saved by a2, a2's (10 B) by m1, m1's (100 B) by m2,
    m2's (10 B) by out (kept); out's backward takes 50 B more. Backward runs out, m2, m1, a2, a1 at
    positions 5..9."""
    chain = ("a1", "a2", "m1", "m2", "out")
    backward = {"out": 5, "m2": 6, "m1": 7, "a2": 8, "a1": 9}

    def act(owner, nbytes, saver):
        position = chain.index(saver)
        return Activation(f"t_{owner}", owner=owner, nbytes=nbytes, hold_start=position + 1, savers=(saver,),
                          readers=(saver,), save_end=backward[saver], read_end=backward[saver],
                          saver_ends=(backward[saver],))

    return Problem(chain=chain, recomputable=frozenset(chain[:4]), cost=dict.fromkeys(chain, 1),
                   flops=dict.fromkeys(chain, 1),
                   activations=(act("a1", 100, "a2"), act("a2", 10, "m1"), act("m1", 100, "m2"), act("m2", 10, "out")),
                   fixed=(0,) * 5 + (50,) + (0,) * 4, num_forward=5, backward_op={p: op for op, p in backward.items()},
                   saves=dict.fromkeys(chain, False) if saves else None)


def test_a_region_start_reaches_below_every_plan_of_maximal_runs():
    """One region over a1..m2 makes a1's and m1's outputs again together at m2's backward (210 B); a kept
    m1 holds its 100-B output through out's backward (160 B and more). Two regions back to back, m1
    starting the second (``NEW_REGION``), hold only a2's 10-B output between them: 110 B, below every plan
    of maximal runs — and the local search finds it from keeping everything."""
    from autorecompute.memory_model import NEW_REGION

    p = _attention_then_mlp()
    runs_only = min(predicted_peak(p, r) for r in all_assignments(p))
    cut = {"a1": True, "a2": True, "m1": NEW_REGION, "m2": True}
    assert predicted_peak(p, dict.fromkeys(cut, True)) == 210
    assert predicted_peak(p, cut) == 110 < runs_only
    found, _ = greedy.lower_peak(p, ({}, {}))
    assert predicted_peak(p, found) == 110


def test_a_region_holds_its_inputs_until_the_last_backward_of_what_it_saves():
    """a2's output is an input of m1's region. Held until that region's last saver's backward (m1's, 7,
    not the reader m1's read_end alone): when m2 is in the region too, still 7 (m2's backward, 6, is
    earlier); a region that saves nothing (``saves`` without m1, m2) does not hold its inputs at all."""
    p = _attention_then_mlp()
    mlp = {"m1": True, "m2": True}
    # at 3..7 a1's output (held by a2) and a2's (held by the region); at 8 a1's alone
    assert memory_timeline(p, mlp)[3:9] == [110, 110, 170, 210, 110, 100]
    nothing_saved = dataclasses.replace(p, **{"saves": {"a1": False, "a2": False, "out": False}})
    assert memory_timeline(nothing_saved, mlp)[3:9] == [100, 100, 160, 200, 100, 100]


def test_the_local_search_moves_a_cut_by_one_op():
    """a1 → a2 → n → m1 → m2 → out, like Llama's attention, the MLP's norm scale ``n`` and the MLP. With
    the cut before n, a2's output is the MLP region's input and n's is made again with m1's at m2's
    backward (120 B); with the cut one op later, n's output is the input and is not made again (110 B, the
    brute-force minimum over keep / recompute / new region). Neither half of the move lowers the peak
    alone; the ``shift`` move makes both at once."""
    from autorecompute.memory_model import NEW_REGION

    chain = ("a1", "a2", "n", "m1", "m2", "out")
    backward = {"out": 6, "m2": 7, "m1": 8, "n": 9, "a2": 10, "a1": 11}

    def act(owner, nbytes, saver):
        return Activation(f"t_{owner}", owner=owner, nbytes=nbytes, hold_start=chain.index(saver) + 1,
                          savers=(saver,), readers=(saver,), save_end=backward[saver], read_end=backward[saver],
                          saver_ends=(backward[saver],))

    p = Problem(chain=chain, recomputable=frozenset(chain[:5]), cost=dict.fromkeys(chain, 1),
                flops=dict.fromkeys(chain, 1),
                activations=(act("a1", 100, "a2"), act("a2", 10, "n"), act("n", 10, "m1"), act("m1", 100, "m2"),
                             act("m2", 10, "out")),
                fixed=(0,) * 6 + (50,) + (0,) * 5, num_forward=6, backward_op={q: op for op, q in backward.items()},
                saves=dict.fromkeys(chain, True))
    before_n = {"a1": True, "a2": True, "n": NEW_REGION, "m1": True, "m2": True}
    before_m1 = {**before_n, "n": True, "m1": NEW_REGION}
    brute = min(predicted_peak(p, dict(zip(chain, v)))
                for v in itertools.product([False, True, NEW_REGION], repeat=5))
    assert predicted_peak(p, before_n) == 120
    assert predicted_peak(p, before_m1) == brute == 110
    single = [{**before_n, op: not before_n.get(op)} for op in chain[:5]]
    single += [{**before_n, op: True if before_n.get(op) == NEW_REGION else NEW_REGION} for op in chain[1:5]]
    assert min(predicted_peak(p, r) for r in single) >= 120
    found, _ = greedy.lower_peak(p, (before_n, {}))
    assert predicted_peak(p, found) == 110


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems(), st.data())
def test_the_cost_local_search_keeps_the_budget_and_never_costs_more(problem, data):
    """From any plan that fits, ``greedy.lower_cost`` returns one that fits and costs no more; keeping an
    op it runs again no longer fits or saves nothing (its stopping rule, for the single changes)."""
    from autorecompute.memory_model import rerun_ops

    assignments = list(all_assignments(problem))
    peaks = [predicted_peak(problem, r) for r in assignments]
    budget = sorted(peaks)[len(peaks) // 2]
    start = data.draw(st.sampled_from([r for r, p in zip(assignments, peaks) if p <= budget]))
    found, _ = greedy.lower_cost(problem, budget, (start, {}))
    cost = extra_cost(problem, found)
    assert predicted_peak(problem, found) <= budget
    assert cost <= extra_cost(problem, start)
    for op in rerun_ops(problem, found):
        kept = {**found, op: False}
        assert predicted_peak(problem, kept) > budget or extra_cost(problem, kept) >= cost


def test_the_cost_local_search_keeps_an_op_with_one_change_that_makes_room():
    """Four ops, each 100-B output saved by the next: under 200 B, recomputing op1 and op2 costs 6; keeping
    op2 goes over alone and fits with op0 recomputed instead — 3, the brute-force optimum."""
    p = chain_problem(4, nbytes=100)
    p = dataclasses.replace(p, **{"cost": {"op0": 2, "op1": 1, "op2": 5, "op3": 1}})
    start = {"op0": False, "op1": True, "op2": True}
    assert predicted_peak(p, start) <= 200 and extra_cost(p, start) == 6
    assert extra_cost(p, greedy.descend(p, 200, (start, {}))[0]) == 6      # no op can be kept alone
    found, _ = greedy.lower_cost(p, 200, (start, {}))
    brute = min(extra_cost(p, r) for r in all_assignments(p) if predicted_peak(p, r) <= 200)
    assert predicted_peak(p, found) <= 200 and extra_cost(p, found) == brute == 3


@pytest.mark.parametrize("while_solving", [True, False])
def test_without_a_solve_to_overlap_only_the_plan_returned_is_verified(while_solving):
    """A search whose start a refinement replaces (planning by layers: its DP's plan, then the local search)
    verifies the start meanwhile only where a solve runs beside it; else it verifies the refined plan alone,
    one fake step instead of two. The plan is the same either way."""
    p = chain_problem(4, nbytes=100)
    start = ({"op0": True, "op1": True, "op2": True}, {})
    cheaper = ({"op0": False, "op1": True, "op2": True}, {})
    verified = []

    def verify(decisions):
        verified.append(decisions)
        return object(), predicted_peak(p, *decisions)
    strategies = search.Strategies(
        solve=search.not_solved, segment_start=lambda problem, budget: start,
        refinements=(search.Refinement("refined", lambda round_: cheaper),),
        verify_start_while_solving=while_solving)
    found = search.Search(p, budget=200, baseline=300, unplanned=object(), verify=verify, time_limit=1.0,
                          strategies=strategies, progress=False).run()
    assert found.decisions == cheaper and found.status == "refined" and found.peak <= 200
    assert verified == ([start, cheaper] if while_solving else [cheaper])


def _finds_nothing(*args, **kwargs) -> cpsat.SolverResult:
    """CP-SAT's full model within its limit on a deep chain: no solution."""
    return cpsat.SolverResult(None, "unknown", float("inf"), 0.0, float("inf"), 0.0)


def _plan_with(strategies, case, budget, **options):
    """``autorecompute.plan`` with the search's strategies replaced."""
    from autorecompute.api import _plan
    from autorecompute.planner import PlannerOptions

    return _plan(case.model, case.args, case.kwargs, budget, PlannerOptions(**options, strategies=strategies))


@pytest.mark.slow
def test_when_cp_sat_finds_nothing_the_minimum_peak_start_is_tried_too():
    """On deep chains CP-SAT's presolve does not finish within the limit and the plan is a heuristic's.
    Under a budget near √N's peak the usual start (``best_under``) is √N-like; the minimum-peak plan with
    the dearest ops kept while they fit can be far cheaper: GPT at 0.9× √N's peak, CP-SAT made to find
    nothing, runs fewer extra FLOPs than the usual start polished by the same local search (56.6 → 21.0 M)."""
    import models
    from autorecompute.passes.build_problem import build_problem
    from autorecompute.passes.capture import capture
    from autorecompute.passes.profile import profile_step
    from autorecompute.transfer import counting_flops, default_for

    case = models.make("gpt")
    budget = 8_029_670
    local_only = search.Strategies(solve=_finds_nothing, refinements=search.Strategies.refinements[:1])
    plan = _plan_with(local_only, case, budget, objective="flops", actions=("recompute",), solver_time_limit=2)
    gm = capture(case.model, case.args, {})
    profile_step(gm, case.args, {})
    problem = build_problem(gm, device=counting_flops(default_for("cpu")))
    usual = greedy.lower_cost(problem, budget, greedy.best_under(problem, budget),
                              work=int(search.COST_SEARCH_WORK * 2))
    assert plan.predicted_peak <= budget
    assert plan.extra_flops < extra_flops(problem, *usual)


@pytest.mark.slow
def test_when_cp_sat_finds_nothing_it_solves_windows_of_the_chain():
    """The full model found nothing (deep chains): CP-SAT over windows of 80 ops, the rest of the local
    search's plan fixed. GPT-2 at half its peak, least FLOPs: 33.6 → 18.9 MFLOP run again, within budget."""
    import autorecompute
    import models

    case = models.make("gpt2")
    budget = autorecompute.plan(case.model, *case.args, budget=1.0).baseline_peak // 2

    def plan(refinements):
        strategies = search.Strategies(solve=_finds_nothing, refinements=refinements)
        return _plan_with(strategies, case, budget, objective="flops", actions=("recompute",), solver_time_limit=2)

    windowed = plan(search.Strategies.refinements[:2])      # (across layers: the test below)
    local = plan(search.Strategies.refinements[:1])
    assert windowed.solver_status == "feasible (cp-sat windows)"
    assert windowed.predicted_peak <= budget
    assert windowed.extra_flops < local.extra_flops


@pytest.mark.slow
def test_windows_across_layers_trade_between_layers_far_apart():
    """At √N's peak (checkpoint_sequential's, measured) the 6-layer GPT's least-FLOPs plan ran 35.7 MFLOP
    again: CP-SAT's whole model does not finish and a chain window holds a layer or two. CP-SAT over the same
    stretch of every layer at once finds a plan that runs no matmul again; measured within the budget, with
    eager's gradients bit for bit."""
    import autorecompute
    import models
    from autorecompute.baselines import SqrtNCheckpointed
    from harness import assert_bitwise_equal, measured_step

    case = models.make("gpt")
    budget = measured_step(SqrtNCheckpointed(case.model, "blocks"), case.model, case.args, {}).peak

    def plan():
        case.model.zero_grad(set_to_none=True)
        compiled = autorecompute.compile(case.model, budget=budget, objective="flops", actions=("recompute",),
                                         solver_time_limit=2)
        compiled.prepare(*case.args)
        return compiled

    across = plan()
    case.model.zero_grad(set_to_none=True)
    within = _plan_with(search.Strategies(refinements=search.Strategies.refinements[:2]), case, budget,
                        objective="flops", actions=("recompute",), solver_time_limit=2)
    assert across.plan.solver_status == "feasible (cp-sat across layers)"
    assert across.plan.extra_flops < within.extra_flops / 4
    eager = measured_step(case.model, case.model, case.args, {})
    ours = measured_step(across, case.model, case.args, {})
    assert ours.peak <= budget
    assert_bitwise_equal(eager, ours)


def test_block_windows_take_the_same_stretch_of_every_layer():
    import models
    from autorecompute.passes.build_problem import build_problem
    from autorecompute.passes.capture import capture
    from autorecompute.passes.profile import profile_step

    case = models.make("gpt")
    gm = capture(case.model, case.args, {})
    profile_step(gm, case.args, {})
    problem = build_problem(gm)
    layers = problem.blocks
    assert len(layers) == 6
    windows = cpsat.block_windows(problem, width=cpsat.WINDOW_OPS)
    position = {op: (i, layer.index(op)) for i, layer in enumerate(layers) for op in layer}
    covered = set()
    for window in windows:
        assert window <= problem.recomputable
        assert len(window) <= cpsat.WINDOW_OPS
        # the same positions in every layer
        assert {i for i, _ in map(position.__getitem__, window)} == set(range(6))
        assert len({k for _, k in map(position.__getitem__, window)}) * 6 == len(window)
        covered |= window
    assert covered == {op for layer in layers for op in layer} & problem.recomputable


def test_block_windows_of_a_hundred_layers_keep_to_the_width():
    """More blocks than a window has ops: a window takes one op of each of ``width`` blocks at a time."""
    layers = tuple(tuple(f"op{i}_{k}" for k in range(30)) for i in range(100))
    ops = tuple(op for layer in layers for op in layer)
    problem = Problem(chain=ops, recomputable=frozenset(ops), cost={}, flops={}, activations=(), fixed=(0, 0),
                      num_forward=1, blocks=layers)
    windows = cpsat.block_windows(problem, width=80)
    assert max(map(len, windows)) <= 80
    assert set().union(*windows) == set(ops)
