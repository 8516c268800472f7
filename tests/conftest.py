import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread in a module (small tensors; the host is shared), restored after it: other modules
    compare in-process results bit for bit with subprocesses that run on torch's default. Use with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
