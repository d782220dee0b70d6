"""Per-token hidden states from a multi-token verify forward, in plain decoding's shapes.

transformers' `_split_model_outputs` cuts the second-to-last axis: the sequence axis of `[B, S, D]` states, but the
stream axis of an mHC residual `[B, S, hc, D]`, which came back as `(1, k, 1, D)` per step instead of `(1, 1, hc, D)`.
During a speculative call it is replaced by `split_per_token`, which cuts axis 1 of every hidden state (the
sequence axis for every model); attentions still go to the original (they are refused with a drafter, see
`integration._validate_request`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import transformers.generation.utils as generation_utils


def split_per_token(
    outputs: tuple, new_outputs: tuple[torch.Tensor, ...], cur_len: int, added_len: int, is_decoder_attention=False
) -> tuple:
    """One entry per generated token; the first entry also covers the prompt, as in plain decoding."""
    if is_decoder_attention:
        return _ORIGINAL_SPLIT(outputs, new_outputs, cur_len, added_len, is_decoder_attention)
    if len(outputs) == 0:  # the prefill: the prompt and the first generated token
        outputs += (tuple(layer[:, :cur_len] for layer in new_outputs),)
        cur_len += 1
        added_len -= cur_len
    for i in range(added_len):
        outputs += (tuple(layer[:, i : i + 1] for layer in new_outputs),)
    return outputs


_ORIGINAL_SPLIT = generation_utils._split_model_outputs


@contextmanager
def hidden_states_split_per_token() -> Iterator[None]:
    """Use `split_per_token` inside `_assisted_decoding` for the duration of one call."""
    previous = generation_utils._split_model_outputs
    generation_utils._split_model_outputs = split_per_token
    try:
        yield
    finally:
        generation_utils._split_model_outputs = previous
