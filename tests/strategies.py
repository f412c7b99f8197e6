"""Hypothesis strategies shared by the solver tests."""
from hypothesis import strategies as st


@st.composite
def early_stop_saves(draw, chain: tuple[str, ...]):
    """``Problem.saves``: unknown (None), or for some ops whether they keep a tensor they make."""
    if draw(st.booleans()):
        return None
    return draw(st.dictionaries(st.sampled_from(chain), st.booleans()))
