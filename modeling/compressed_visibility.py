"""Which HCA compressed entries a verify forward's queries see: the ones one-token decoding would have seen.

A one-token V4 forward lets its query see every compressed entry the cache holds, `(c + 1) // compress_rate` after
token `c` (cache index) is folded in. A multi-token forward masks entries by the queries' *position ids* instead.
The two agree while position ids equal cache indices, but a prompt whose `attention_mask` has zeros makes generate()
derive position ids from the mask, so they lag the cache, and a verify forward then hides entries that token-by-token
decoding shows (measured on the tiny test target: a different token within 24). During a speculative call, the
HCA compressors' block bias is rebuilt for the rows of generated tokens from their cache indices; rows of prompt
tokens keep the position-based mask, since plain decoding's prefill is a multi-token forward too. CSA layers need
nothing: their indexer masks by position ids in one-token forwards as well.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HCACompressor

from .call_scope import CallHooks


def decoding_block_bias(
    compressed_len: int, position_ids: torch.Tensor, cache_end: int, prompt_length: int, compress_rate: int
) -> torch.Tensor:
    """`[B, 1, S, compressed_len]`: 0 where a query sees an entry, -inf elsewhere; prompt rows by position id,
    generated rows (cache index >= `prompt_length`) by cache index, as one-token decoding sees them."""
    cache_index = torch.arange(cache_end - position_ids.shape[1], cache_end, device=position_ids.device)
    seen_by_position = (position_ids + 1) // compress_rate
    seen_by_decoding = ((cache_index + 1) // compress_rate).expand_as(position_ids)
    visible = torch.where(cache_index >= prompt_length, seen_by_decoding, seen_by_position)  # [B, S]
    entries = torch.arange(compressed_len, device=position_ids.device)
    hidden = entries.view(1, 1, 1, -1) >= visible[:, None, :, None]
    return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).masked_fill(hidden, float("-inf"))


def _hook(prompt_length: int):
    def as_decoding(module: DeepseekV4HCACompressor, args: tuple, kwargs: dict, output: tuple):
        compressed_kv, block_bias = output
        _, _, position_ids, cache, layer_idx = args
        if block_bias is None or cache is None:  # a one-token forward already sees every entry
            return output
        cache_end = cache.layers[layer_idx].cumulative_length
        if bool((position_ids[:, -1] == cache_end - 1).all()):  # positions are cache indices in every row: the
            return output  # stock mask is decoding's
        bias = decoding_block_bias(
            compressed_kv.shape[2], position_ids, cache_end, prompt_length, module.compress_rate
        )
        return compressed_kv, bias.to(block_bias.dtype)

    return as_decoding


def hca_visibility_as_decoding(model: nn.Module, prompt_length: int) -> CallHooks:
    """For this call: verify rows of every HCA compressor in `model` see what one-token decoding sees."""
    hooks = CallHooks()
    hook = _hook(prompt_length)
    for module in model.modules():
        if isinstance(module, DeepseekV4HCACompressor):
            hooks.after(module, hook, with_kwargs=True)
    return hooks
