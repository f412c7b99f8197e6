import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Plans in tests use a short solver time: the tests check guarantees (budget, gradients), not optimality.
SOLVER_TIME = 1.0


@pytest.fixture(autouse=True)
def _fresh_grads():
    yield
