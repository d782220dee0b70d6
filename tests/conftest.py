import torch

# The test models are tiny: one thread is faster than two, and the suite stays steady on a busy 2-core machine.
torch.set_num_threads(1)
