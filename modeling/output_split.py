"""Per-token hidden states and attentions from multi-token verify forwards, in plain decoding's shapes.

transformers' `_split_model_outputs` assumes `[B, S, D]` states and attention keys that are the whole sequence so
far. Neither holds for an mHC target: it cut the stream axis of a `[B, S, hc, D]` residual (`(1, k, 1, D)` per step
instead of `(1, 1, hc, D)`), and DeepSeek-V4's keys are a sliding window followed by compressed entries, so cutting
the key axis at the sequence length dropped the compressed columns. It also reads the first forward's generated
rows from row 0, which holds the prompt when that forward carries a draft (prompt lookup does). For the duration of
a speculative call, and for that call only, it is replaced by `split_per_token`: each step takes the rows plain
decoding's forward would have had (the prompt's, then one per token) on axis 1 of hidden states, and for attentions
exactly the key columns that forward has, in its order, as the target adapter lays them out.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import transformers.generation.utils as generation_utils

from . import call_scope

# (layer index, cache length before the forward, queries in the forward, query row) -> key columns
KeyColumns = Callable[[int, int, int, int], torch.Tensor]


def _step(new_outputs: tuple, rows: slice, columns: Callable | None) -> tuple:
    """Rows `rows` of every layer; for attentions (`columns` given) only the key columns `columns(layer_idx, S)`."""
    if columns is None:
        return tuple(layer[:, rows] for layer in new_outputs)
    return tuple(
        layer[..., rows, :].index_select(-1, columns(layer_idx, layer.shape[-2]).to(layer.device))
        for layer_idx, layer in enumerate(new_outputs)
    )


def split_per_token(
    outputs: tuple,
    new_outputs: tuple[torch.Tensor, ...],
    cur_len: int,
    added_len: int,
    is_decoder_attention: bool = False,
    *,
    one_token_columns: KeyColumns,
    prompt_columns: KeyColumns,
    prompt_cache_length: int,
) -> tuple:
    """One entry per generated token; the first entry is the prompt's forward, as in plain decoding."""
    first_row = 0
    cache_length = cur_len - 1  # a verify forward starts at the last accepted token, not yet in the cache
    if len(outputs) == 0:  # the first forward: the prompt tokens not yet cached, then perhaps a draft
        cache_length = prompt_cache_length
        first_row = cur_len - cache_length
        columns = (lambda i, s: prompt_columns(i, cache_length, s, first_row)) if is_decoder_attention else None
        outputs += (_step(new_outputs, slice(0, first_row), columns),)
        added_len -= cur_len + 1
    for row in range(first_row, first_row + added_len):
        columns = (lambda i, s, r=row: one_token_columns(i, cache_length, s, r)) if is_decoder_attention else None
        outputs += (_step(new_outputs, slice(row, row + 1), columns),)
    return outputs


def outputs_split_per_token(
    one_token_columns: KeyColumns, prompt_columns: KeyColumns, prompt_cache_length: int
) -> AbstractContextManager[None]:
    """Use `split_per_token` inside `_assisted_decoding`, for this call only."""

    def split(_original, *args, input_shape: tuple | None = None, **kwargs):
        # 5.25 passes the forward's input shape to find the sequence axis: it is axis 1 in every family here
        return split_per_token(
            *args,
            **kwargs,
            one_token_columns=one_token_columns,
            prompt_columns=prompt_columns,
            prompt_cache_length=prompt_cache_length,
        )

    return call_scope.functions(generation_utils, _split_model_outputs=split)
