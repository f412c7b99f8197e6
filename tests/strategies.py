"""Hypothesis strategies shared by the solver tests."""
from hypothesis import strategies as st

from autorecompute.problem import Activation


@st.composite
def early_stop_saves(draw, chain: tuple[str, ...]):
    """``Problem.saves``: unknown (None), or for some ops whether they keep a tensor they make."""
    if draw(st.booleans()):
        return None
    return draw(st.dictionaries(st.sampled_from(chain), st.booleans()))


@st.composite
def activations(draw, chain: tuple[str, ...], i: int, k: int, backward_position: dict[str, int]):
    """The ``k``-th activation ``t{i}_{k}`` of op ``chain[i]`` (named ``op{i}``): read and saved by ops at or
    after it, 1-8 KB, its intervals as build_problem derives them from the readers' and savers' backward."""
    owner = f"op{i}"
    readers = tuple(sorted(draw(st.sets(st.sampled_from(chain[i:]), max_size=2))))
    savers = tuple(sorted(draw(st.sets(st.sampled_from(chain[i:]), max_size=2))))
    last_use = max([i] + [int(r[2:]) for r in readers])
    save_end = max([backward_position[s] for s in savers], default=-1)
    read_end = max([save_end] + [backward_position[r] for r in readers if r != owner])
    return Activation(name=f"t{i}_{k}", owner=owner, nbytes=draw(st.integers(1, 8)) * 1000,
                      hold_start=last_use + 1, savers=savers, readers=tuple(r for r in readers if r != owner),
                      save_end=save_end, read_end=read_end, saver_ends=tuple(backward_position[s] for s in savers))
