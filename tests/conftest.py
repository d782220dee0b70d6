import os
import tempfile

# Each pytest-xdist worker keeps the remote code of the drafters it loads apart, so two workers never write the same
# module files at once (transformers reads this when it is imported).
if "PYTEST_XDIST_WORKER" in os.environ and "HF_MODULES_CACHE" not in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix=f"hf-modules-{os.environ['PYTEST_XDIST_WORKER']}-")

import pytest  # noqa: E402
import torch  # noqa: E402

from hf_hyperdflash.testing import tiny_deepseek_v4  # noqa: E402

# The test models are tiny: one thread is faster than two, and the suite stays steady on a busy 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    """The tiny DeepSeek-V4 target most tests decode with, one per test module (tests may change its settings)."""
    return tiny_deepseek_v4(seed=0)
