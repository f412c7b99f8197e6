"""Each constraint family of the CP-SAT encoding (``solvers/cpsat.Encoding``) on a hand-built problem of two or
three activations: what the family makes true, checked against a hand computation or the memory model."""
import itertools
from dataclasses import replace

import pytest
from ortools.sat.python import cp_model

from autorecompute.memory_model import NEW_REGION, effective_stash, extra_cost, memory_timeline, predicted_peak, \
    rerun_ops
from autorecompute.problem import GRADIENT, Activation, Problem, StashOption
from autorecompute.solvers import cpsat
from autorecompute.solvers.cpsat import Encoding

# the order solve adds them in
FAMILIES = ("add_recompute_decisions", "add_region_prefix", "add_reruns", "add_stash_decisions", "add_activations",
            "add_unheld_deliveries", "add_rng_states", "add_rematerialized_bytes", "add_memory_levels", "add_budget",
            "add_region_starts")


def encode(problem: Problem, upto: str = FAMILIES[-1], **kwargs) -> Encoding:
    """The encoding with the families up to ``upto`` added."""
    encoding = Encoding(problem, **kwargs)
    for family in FAMILIES[:FAMILIES.index(upto) + 1]:
        getattr(encoding, family)()
    return encoding


def fixed(problem: Problem, plan: dict, stash: dict | None = None, upto: str = FAMILIES[-1], **kwargs) -> Encoding:
    """The encoding with every decision fixed to ``plan`` and ``stash`` (an empty window)."""
    return encode(problem, upto, hint=plan, hint_stash=stash or {}, window=frozenset(), **kwargs)


def solved(encoding: Encoding, minimize=None) -> cp_model.CpSolver | None:
    """A solver holding a solution of the encoding's model (least ``minimize`` when given), None if infeasible."""
    if minimize is not None:
        encoding.model.minimize(minimize)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    status = solver.solve(encoding.model)
    return solver if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None


def value(solver: cp_model.CpSolver, literal) -> int:
    return literal if isinstance(literal, int) else solver.value(literal)


def named(encoding: Encoding, solver: cp_model.CpSolver, name: str) -> int:
    """The value of the model's variable called ``name``."""
    for i, var in enumerate(encoding.model.proto.variables):
        if var.name == name:
            return solver.value(encoding.model.get_int_var_from_proto_index(i))
    raise KeyError(name)


def on_device(encoding: Encoding, solver: cp_model.CpSolver) -> list[int]:
    """The units the memory pieces put on the device at each position."""
    levels, running = [], 0
    for p in range(encoding.problem.num_positions):
        running += sum(value(solver, piece) for piece in encoding.starts.get(p, []))
        running -= sum(value(solver, piece) for piece in encoding.ends.get(p - 1, [])) if p else 0
        levels.append(running)
    return levels


def chain_problem(n: int, nbytes: int | tuple[int, ...] = 100, **fields) -> Problem:
    """n ops; op i's output (``nbytes``, or ``nbytes[i]``) is saved and read by op i+1; forward positions
    0..n-1, backward n..2n-1 (op n-1's first); the last op cannot be recomputed."""
    chain = tuple(f"op{i}" for i in range(n))
    backward = {op: 2 * n - 1 - i for i, op in enumerate(chain)}
    sizes = nbytes if isinstance(nbytes, tuple) else (nbytes,) * (n - 1)
    acts = tuple(Activation(f"t{i}", owner=chain[i], nbytes=sizes[i], hold_start=i + 2, savers=(chain[i + 1],),
                            readers=(chain[i + 1],), save_end=backward[chain[i + 1]],
                            read_end=backward[chain[i + 1]]) for i in range(n - 1))
    problem = Problem(chain=chain, recomputable=frozenset(chain[:-1]), cost={op: 1 + i for i, op in enumerate(chain)},
                      flops={}, activations=acts, fixed=(0,) * (2 * n), num_forward=n,
                      backward_op={p: op for op, p in backward.items()})
    return replace(problem, **fields)


def plans(problem: Problem, decisions=(False, True, NEW_REGION)):
    ops = sorted(problem.recomputable, key=problem.chain.index)
    for picked in itertools.product(decisions, repeat=len(ops)):
        yield dict(zip(ops, picked))


# -- decisions and regions --

def test_recompute_variables_exist_only_for_the_decisions_the_model_makes():
    """op3 cannot be recomputed; outside the window op0 is recomputed as the hint has it, op1 kept: op0's
    variable is fixed to 1, op1 and op3 have none, op2 (in the window) is free."""
    problem = chain_problem(4)
    encoding = encode(problem, "add_recompute_decisions", hint={"op0": True, "op1": False},
                      window=frozenset({"op2"}))
    assert set(encoding.r) == {"op0", "op2"}
    encoding.model.add(encoding.r["op0"] == 0)
    assert solved(encoding) is None
    free = encode(problem, "add_recompute_decisions")
    assert set(free.r) == {"op0", "op1", "op2"}


def test_same_is_true_iff_every_op_between_is_recomputed_in_one_region():
    """``same(a, b)`` ⇔ every op in a..b recomputed; 0 across an op that cannot be recomputed or a region cut."""
    problem = chain_problem(4)
    for bits in itertools.product((0, 1), repeat=3):
        encoding = encode(problem, "add_region_prefix")
        for op, bit in zip(("op0", "op1", "op2"), bits):
            encoding.model.add(encoding.r[op] == bit)
        together = encoding.same("op0", "op2")
        solver = solved(encoding)
        assert value(solver, together) == all(bits)
        assert value(solver, encoding.same("op1", "op1")) == bits[1]
    assert encode(problem, "add_region_prefix").same("op2", "op3") == 0        # op3 is never recomputed
    cut = fixed(problem, {"op0": True, "op1": NEW_REGION, "op2": True}, upto="add_region_prefix")
    assert cut.same("op0", "op1") == 0 and cut.same("op0", "op0") is cut.r["op0"]
    later = cut.same("op1", "op2")      # (made before the solve: the model makes it on first use)
    assert value(solved(cut), later) == 1


@pytest.mark.parametrize("saves", [{"op0": True, "op1": False}, {"op1": True}, {"op0": False, "op2": True}, None])
def test_reruns_are_the_ops_checkpoint_runs_again_up_to_a_regions_last_save(saves):
    """``runs[op]`` is 1 for exactly the ops :func:`memory_model.rerun_ops` runs again (its early stop), on
    every plan of keep / recompute / new region."""
    problem = chain_problem(4, saves=saves)
    for plan in plans(problem):
        encoding = fixed(problem, plan, upto="add_reruns")
        solver = solved(encoding)
        assert {op for op, literal in encoding.runs.items() if value(solver, literal)} == set(rerun_ops(problem, plan))


def two_held(**fields) -> Problem:
    """op0 → op1 → op2: t0 (op0's, 100 B) saved by op1 and t1 (op1's, 100 B) by op2, each with an offload option;
    u (op2's) is not held after forward; ``grad:w``, a gradient op1's backward (position 4) makes, offloadable."""
    chain = ("op0", "op1", "op2")
    t0 = Activation("t0", owner="op0", nbytes=100, hold_start=2, savers=("op1",), readers=("op1",), save_end=4,
                    read_end=4)
    t1 = Activation("t1", owner="op1", nbytes=100, hold_start=3, savers=("op2",), readers=("op2",), save_end=3,
                    read_end=3)
    u = Activation("u", owner="op2", nbytes=50, hold_start=3, savers=(), readers=(), save_end=-1, read_end=-1)
    grad = Activation(f"{GRADIENT}w", owner="op2", nbytes=10, hold_start=5, savers=("op0",), readers=(), save_end=5,
                      read_end=5)
    options = {"t0": (StashOption("offload", 0, 2, 4, 5), StashOption("compress:int8", 25, 1, 4, 3)),
               "t1": (StashOption("offload", 0, 3, 3, 5),), "u": (StashOption("offload", 0, 3, 3, 5),),
               f"{GRADIENT}w": (StashOption("offload", 0, 5, 5, 2),)}
    problem = Problem(chain=chain, recomputable=frozenset({"op0", "op1"}), cost={"op0": 2, "op1": 3, "op2": 1},
                      flops={}, activations=(t0, t1, u, grad), fixed=(0,) * 6, num_forward=3,
                      backward_op={3: "op2", 4: "op1", 5: "op0"}, stash_options=options)
    return replace(problem, **fields)


def test_stash_variables_exist_for_held_activations_and_keep_the_hint_outside_the_window():
    """u is not held after forward: no variable. With the window {op1}, t0 (op0's) keeps the hint's offload;
    t1 (op1's) is free, and so is the gradient op1's backward makes."""
    problem = two_held()
    assert set(encode(problem, "add_stash_decisions").x) == {("t0", "offload"), ("t0", "compress:int8"),
                                                             ("t1", "offload"), (f"{GRADIENT}w", "offload")}
    hint_stash = {"t0": "offload", "t1": "offload", f"{GRADIENT}w": "offload"}
    for name, action, pinned in [("t0", "offload", True), ("t0", "compress:int8", True), ("t1", "offload", False),
                                 (f"{GRADIENT}w", "offload", False)]:
        for other in (0, 1):
            encoding = encode(problem, "add_stash_decisions", hint={}, hint_stash=hint_stash,
                              window=frozenset({"op1"}))
            encoding.model.add(encoding.x[(name, action)] == other)
            feasible = solved(encoding) is not None
            assert feasible == (not pinned or other == (hint_stash.get(name) == action)), (name, action, other)


# -- activations --

def test_an_activation_is_held_as_a_region_input_by_a_recomputed_reader_outside_its_owners_region():
    """t0 (op0's) is read by op1: held as an input iff op1 is recomputed and not in op0's region."""
    problem = chain_problem(3)
    expected = [({}, 0), ({"op0": True}, 0), ({"op1": True}, 1), ({"op0": True, "op1": True}, 0),
                ({"op0": True, "op1": NEW_REGION}, 1)]
    for plan, held in expected:
        encoding = fixed(problem, plan, upto="add_activations")
        assert named(encoding, solved(encoding), "held_as_input[t0]") == held, plan


@pytest.mark.parametrize("saves, held_until", [
    ({"op1": True, "op2": True}, (3, 4, 3, 4)),
    ({"op2": True}, (3, 3, 3, 3)),
    ({"op1": True}, (3, 4, None, 4)),
    (None, (3, 4, 4, 4)),
])
def test_an_activation_is_on_the_device_until_the_last_end_of_what_holds_it(saves, held_until):
    """t (op0's, kept) is read by op1 and op2 and saved by op2, whose backward is at 3 (op1's at 4). A kept op2
    holds it to 3; a region that reads it holds it as an input to its last saver's backward — none when the
    region saves nothing — or, when what regions save is not known, to ``read_end`` (4). Held until, for
    keeping everything, recomputing op1, op2, both: by hand, and as the memory model has it."""
    chain = ("op0", "op1", "op2")
    t = Activation("t", owner="op0", nbytes=100, hold_start=3, savers=("op2",), readers=("op1", "op2"), save_end=3,
                   read_end=4)
    problem = Problem(chain=chain, recomputable=frozenset({"op1", "op2"}), cost=dict.fromkeys(chain, 1), flops={},
                      activations=(t,), fixed=(0,) * 6, num_forward=3, backward_op={3: "op2", 4: "op1", 5: "op0"},
                      saves=saves)
    for plan, until in zip(({}, {"op1": True}, {"op2": True}, {"op1": True, "op2": True}), held_until):
        encoding = fixed(problem, plan, upto="add_activations")
        device = on_device(encoding, solved(encoding))
        assert device == [100 if until is not None and 3 <= p <= until else 0 for p in range(6)], plan
        assert device == memory_timeline(problem, plan)


def test_a_stash_choice_is_allowed_exactly_where_the_memory_model_lets_it_take_effect():
    """Stash rules: at most one taker, a kept saver, no region holding the tensor as an input; a
    rematerialization needs its ops kept and its inputs unstashed; a chain one delivers ``a`` too. On every plan
    and choice, the model is feasible iff every choice takes effect (``memory_model.effective_stash``).

    ``a`` (op0's) is read by op1 and saved by op3, which is always kept: a recomputed op1 holds it as an input;
    ``b`` (op1's) is read and saved by op2."""
    chain = ("op0", "op1", "op2", "op3")
    a = Activation("a", owner="op0", nbytes=100, hold_start=2, savers=("op3",), readers=("op1",), save_end=4,
                   read_end=6)
    b = Activation("b", owner="op1", nbytes=100, hold_start=3, savers=("op2",), readers=("op2",), save_end=5,
                   read_end=5)
    options = {"a": (StashOption("offload", 0, 2, 4, 5),
                     StashOption("rematerialize", 0, 2, 4, 7, needs_kept=("op0",), needs_unstashed=("b",))),
               "b": (StashOption("offload", 0, 3, 5, 5),
                     StashOption("rematerialize:chain", 0, 3, 5, 4, needs_kept=("op1",), delivers=("a",)))}
    problem = Problem(chain=chain, recomputable=frozenset(chain[:3]), cost=dict.fromkeys(chain, 1), flops={},
                      activations=(a, b), fixed=(0,) * 8, num_forward=4,
                      backward_op={4: "op3", 5: "op2", 6: "op1", 7: "op0"}, stash_options=options)
    outcomes = set()
    for plan in plans(problem, (False, True)):
        for for_a, for_b in itertools.product((None, "offload", "rematerialize"),
                                              (None, "offload", "rematerialize:chain")):
            stash = {name: action for name, action in (("a", for_a), ("b", for_b)) if action}
            feasible = solved(fixed(problem, plan, stash, upto="add_unheld_deliveries")) is not None
            assert feasible == (effective_stash(problem, plan, stash) == stash), (plan, stash)
            outcomes.add(feasible)
    assert outcomes == {True, False}


def test_a_stashed_activation_is_its_stored_copy_then_whole_again_with_its_codecs_temporaries():
    """t0 compressed: 25 B from its saver's forward (1) with 60 B of encoding temporaries there, whole again
    from 4 with 10 B of decoding temporaries; offloaded: nothing until its prefetch at 4."""
    problem = two_held(recomputable=frozenset(), stash_options={"t0": (
        StashOption("offload", 0, 2, 4, 5),
        StashOption("compress:int8", 25, 1, 4, 3, transient_bytes=10, packing_bytes=60))})
    problem = replace(problem, activations=problem.activations[:2])     # t0 and t1
    for action, device in [("compress:int8", [0, 85, 25, 125, 135, 0]), ("offload", [0, 0, 0, 100, 100, 0])]:
        encoding = fixed(problem, {}, {"t0": action}, upto="add_activations")
        assert on_device(encoding, solved(encoding)) == device
        assert device == memory_timeline(problem, {}, {"t0": action})


def test_a_chain_rematerialization_cannot_deliver_a_tensor_autograd_does_not_hold():
    """t1's chain rematerialization delivers u, which nothing holds after forward: never chosen; delivering
    t0 instead is allowed."""
    problem = two_held(recomputable=frozenset())
    for delivers, allowed in [(("u",), False), (("t0",), True)]:
        chain = StashOption("rematerialize:chain", 0, 3, 3, 4, needs_kept=("op1",), delivers=delivers)
        problem = replace(problem, stash_options={"t1": (chain,)})
        encoding = fixed(problem, {}, {"t1": "rematerialize:chain"}, upto="add_unheld_deliveries")
        assert (solved(encoding) is not None) == allowed


# -- memory --

def test_a_region_holds_what_it_makes_again_from_its_recomputation_to_each_tensors_earliest_saver():
    """op0..op2 recomputed: at op2's backward t0 and t1 (100 B each) are made again, at op1's t0 is left, at
    op0's nothing; with op1 starting a region of its own, only t1 (op1's, in op2's region)."""
    problem = chain_problem(4)
    for plan, expected in [({"op0": True, "op1": True, "op2": True}, {"op0": 0, "op1": 100, "op2": 200}),
                           ({"op0": True, "op1": NEW_REGION, "op2": True}, {"op0": 0, "op1": 0, "op2": 100}),
                           ({"op0": True, "op2": True}, {"op0": 0, "op2": 0})]:
        encoding = fixed(problem, plan, upto="add_rematerialized_bytes")
        solver = solved(encoding, sum(encoding.remat.values()))
        assert {op: solver.value(var) for op, var in encoding.remat.items()} == expected, plan


@pytest.mark.parametrize("random", [False, True], ids=["", "random ops"])
def test_the_peak_is_the_memory_models_on_every_plan(random):
    """Pieces, fixed bytes and what regions make again, at every position: the least peak of a fixed plan is
    :func:`memory_model.predicted_peak`, on every plan of keep / recompute / new region; with random ops,
    the generator state each region through them keeps, once a region (fixed, a run of decisions is a
    region, so CP-SAT's span for it is the region's own)."""
    problem = chain_problem(4, (100, 30, 70), fixed=(0, 30, 0, 0, 0, 50, 0, 40),
                            saves={"op1": True, "op2": False, "op3": True})
    if random:
        problem = replace(problem, random_ops=frozenset({"op1", "op2"}), rng_state_bytes=20,
                          forward_position={op: i for i, op in enumerate(problem.chain)})
    peaks = set()
    for plan in plans(problem):
        encoding = fixed(problem, plan)
        solver = solved(encoding, encoding.peak)
        assert solver.value(encoding.peak) == predicted_peak(problem, plan), plan
        peaks.add(solver.value(encoding.peak))
    assert len(peaks) > 2


def test_the_budget_is_rounded_down_to_whole_units_so_a_plan_that_fits_the_model_fits_in_bytes():
    """40 MiB of fixed bytes make the byte unit 10 B: a budget of exactly the peak fits, one byte less does not
    (the model never rounds a budget up)."""
    peak = 40 << 20
    problem = Problem(chain=("op0",), recomputable=frozenset(), cost={"op0": 1}, flops={}, activations=(),
                      fixed=(0, peak), num_forward=1, backward_op={1: "op0"})
    assert cpsat.byte_unit(problem) == 10
    assert solved(encode(problem, budget=peak)) is not None
    assert solved(encode(problem, budget=peak - 1)) is None
    assert solved(encode(problem)) is not None


# -- cost and objective --

def test_each_region_starts_once_a_cut_included():
    """A region start per recomputed run, and one where a cut starts a region right after another; none without
    a region cost."""
    problem = chain_problem(5, region_cost=3)
    for plan, regions in [({"op0": True, "op1": True, "op3": True}, 2), ({"op0": True, "op1": NEW_REGION}, 2),
                          ({"op0": True, "op1": True, "op2": True}, 1), ({}, 0)]:
        encoding = fixed(problem, plan)
        solver = solved(encoding, sum(encoding.region_starts.values()))
        assert sum(solver.value(s) for s in encoding.region_starts.values()) == regions, plan
    assert not encode(chain_problem(5)).region_starts


def test_the_objectives_are_the_memory_models_cost_and_the_least_peak_then_cost():
    """Least cost under a budget: brute force's cheapest plan and its cost; least peak: the lowest peak, and the
    cheapest plan among those at it (the cost breaks ties)."""
    problem = chain_problem(5, cost={"op0": 5, "op1": 1, "op2": 4, "op3": 2, "op4": 1}, saves={"op1": True,
                                                                                              "op3": True})
    every = [(plan, predicted_peak(problem, plan), extra_cost(problem, plan)) for plan in plans(problem)]
    budget = sorted(peak for _, peak, _ in every)[len(every) // 2]
    cheapest = cpsat.solve(problem, budget=budget, time_limit=1)
    assert cheapest.status == "optimal" and predicted_peak(problem, cheapest.recompute) <= budget
    assert cheapest.objective == pytest.approx(min(cost for _, peak, cost in every if peak <= budget))
    assert extra_cost(problem, cheapest.recompute) == pytest.approx(cheapest.objective)
    lowest = cpsat.solve(problem, minimize="peak", time_limit=1)
    least = min(peak for _, peak, _ in every)
    assert lowest.objective == predicted_peak(problem, lowest.recompute) == least
    assert extra_cost(problem, lowest.recompute) == min(cost for _, peak, cost in every if peak == least)
    with pytest.raises(ValueError, match="needs a budget"):
        cpsat.solve(problem, minimize="cost")
    with pytest.raises(ValueError, match="expected 'cost' or 'peak'"):
        cpsat.solve(problem, minimize="flops", budget=budget)


# -- hint and result --

def test_a_hint_that_fits_is_completed_to_every_variable_and_one_that_does_not_is_dropped():
    """op0 and op1 recomputed fit 200 B: every variable is hinted, the decisions as the plan has them. Keeping
    everything (300 B) does not fit: no hint is left."""
    problem = chain_problem(4)
    fits = {"op0": True, "op1": True}
    budget = predicted_peak(problem, fits)
    assert predicted_peak(problem, {}) > budget
    for plan, complete in [(fits, True), ({"op0": False}, False)]:
        encoding = encode(problem, budget=budget, hint=plan)
        encoding.set_objective()
        encoding.complete_hint(0.5, seed=0)
        hint = dict(zip(encoding.model.proto.solution_hint.vars, encoding.model.proto.solution_hint.values))
        assert len(hint) == (len(encoding.model.proto.variables) if complete else 0)
        if complete:
            assert {op: hint[var.index] for op, var in encoding.r.items()} == {"op0": 1, "op1": 1, "op2": 0}


def test_the_result_keeps_the_decisions_outside_the_window_and_reports_the_peak_in_bytes():
    """Outside the window op0 and op1 keep the hint's decisions (op1's region cut included); the stash is the
    choices CP-SAT made; the least peak is in bytes, the memory model's."""
    problem = two_held(recomputable=frozenset({"op0", "op1", "op2"}))
    hint = {"op0": True, "op1": NEW_REGION}
    result = cpsat.solve(problem, minimize="peak", hint=hint, hint_stash={}, window=frozenset({"op2"}),
                         time_limit=1)
    assert result.status == "optimal"
    assert {op: result.recompute[op] for op in hint} == hint and result.recompute["op2"] in (False, True)
    assert result.objective == predicted_peak(problem, result.recompute, result.stash)
    assert set(result.stash) <= {"t1", f"{GRADIENT}w"}          # t0 is op0's: outside the window, not stashed
