import os

import pytest
import torch

from tests.helpers.pool import SharedPool

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


# One pool of gloo ranks of each size for the whole session and every test folder
# (tests/helpers/pool.py), started at the first case that needs it: 4 ranks (world sizes 2 and 3
# on its subgroups) and 2 ranks for cases that build process groups of their own (dist.new_group
# needs every rank of the pool).
@pytest.fixture(scope="session")
def pool():
    p = SharedPool(4)
    yield p
    p.close()


@pytest.fixture(scope="session")
def pool2():
    p = SharedPool(2)
    yield p
    p.close()
