"""Host work per batched verify step does not grow with the batch: the loop moves data between host and device (or
waits on the device) a fixed number of times a step, whatever the number of rows. On a GPU each such call stalls
the pipeline; on this CPU it costs nothing measurable, so it is counted instead of timed."""

import pytest
from test_batched import PAD, built_targets, drafter_for, left_padded_batch  # noqa: F401
from torch.overrides import TorchFunctionMode

import hf_hyperdflash  # noqa: F401  (installs the generate() integration)

pytestmark = pytest.mark.compat  # counts what generate()'s internals do per step too

# Tensor calls that read a device tensor on the host or make one from host data
HOST_TRANSFERS = {"tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__", "tensor"}
ROW_LENGTHS = (5, 40, 13, 22)


class HostTransferCount(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HOST_TRANSFERS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def transfers_per_step(target, drafter, rows: int) -> list[int]:
    """Host transfers between consecutive target forwards of a batched call of `rows` rows (the prefill's left out)."""
    lengths = tuple(ROW_LENGTHS[row % len(ROW_LENGTHS)] for row in range(rows))
    inputs = left_padded_batch(target.config.vocab_size, lengths=lengths)
    counter, marks = HostTransferCount(), []
    hook = target.register_forward_pre_hook(lambda *_: marks.append(counter.count))
    try:
        with counter:
            target.generate(**inputs, assistant_model=drafter, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    finally:
        hook.remove()
    assert len(marks) > 3, "the call made too few verify steps to count"
    return [after - before for before, after in zip(marks[1:], marks[2:], strict=False)]


def test_host_transfers_per_step_do_not_grow_with_the_batch(targets):
    """A block drafter's verify steps at batch 2 and batch 8: the most host transfers any step makes is the same."""
    target = targets("deepseek_v4")
    drafter = drafter_for(target, "hyperdflash")
    at_two, at_eight = transfers_per_step(target, drafter, 2), transfers_per_step(target, drafter, 8)
    assert max(at_eight) == max(at_two), (at_two, at_eight)
