import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# the cores shared among pytest-xdist's workers (README's test command runs one per core)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

# Plans in tests use a short solver time: the tests check guarantees (budget, gradients), not optimality.
SOLVER_TIME = 1.0


@pytest.fixture(autouse=True)
def _fresh_grads():
    yield
