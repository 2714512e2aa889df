import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pool():
    from tests.pool import RankPool

    p = RankPool(4)
    yield p
    p.close()
