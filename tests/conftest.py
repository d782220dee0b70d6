import pytest
import torch

from hf_hyperdflash.testing import tiny_deepseek_v4

# The test models are tiny: one thread is faster than two, and the suite stays steady on a busy 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    """The tiny DeepSeek-V4 target most tests decode with, one per test module (tests may change its settings)."""
    return tiny_deepseek_v4(seed=0)
