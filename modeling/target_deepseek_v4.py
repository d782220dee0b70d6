"""Adapter for stock transformers DeepSeek-V4 targets: a cache that rewinds sliding, CSA and HCA layers, the key
layout of its attention rows, and the HCA masking a verify forward must share with one-token decoding."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from transformers import Cache

from .cache_deepseek_v4 import RewindableDeepseekV4Cache, make_rewindable, make_stock
from .compressed_visibility import hca_visibility_as_decoding
from .target_base import HyperConnectionTarget


class DeepseekV4Target(HyperConnectionTarget):
    """What HyperDFlash needs from a `DeepseekV4ForCausalLM`, without forking its modeling file."""

    family = "deepseek_v4"
    has_native_mtp = True

    def make_cache(self, max_draft: int) -> RewindableDeepseekV4Cache:
        return RewindableDeepseekV4Cache(config=self.config, max_draft=max_draft, undo_single_token_forwards=False)

    def make_assistant_cache(self, max_draft: int) -> RewindableDeepseekV4Cache:
        return RewindableDeepseekV4Cache(config=self.config, max_draft=max_draft)

    def adopt_cache(self, cache: Cache, max_draft: int) -> Cache:
        if self._is_plain_decodings_cache(cache):
            return make_rewindable(cache, max_draft, undo_single_token_forwards=False)
        self._check_rewindable(cache, max_draft, "RewindableDeepseekV4Cache")
        return cache

    def release_cache(self, cache: Cache) -> None:
        if isinstance(cache, RewindableDeepseekV4Cache):
            make_stock(cache)

    def verify_as_decoding(
        self, prompt_length: int, positions_may_lag: bool = True, cache: Cache | None = None
    ) -> AbstractContextManager:
        """A verify forward's rows see the compressed entries one-token decoding sees, also when a padded prompt
        makes position ids lag the cache (while they are cache indices, the stock mask already is decoding's)."""
        return hca_visibility_as_decoding(self.model, prompt_length) if positions_may_lag else nullcontext()

    def one_token_key_columns(self, layer_idx: int, cache_length: int, num_queries: int, query: int) -> torch.Tensor:
        """A forward's keys are its sliding window, `min(cache_length, sliding_window - 1)` cached keys plus its own
        queries' keys, then (CSA and HCA layers) every compressed entry the cache holds after it. A one-token forward
        at cache index `c` sees the keys of positions `c - min(c, sliding_window - 1) .. c`, then `(c + 1) //
        compress_rate` compressed entries."""
        window = self.config.sliding_window - 1
        position = cache_length + query
        first_key = cache_length - min(cache_length, window)  # position of the forward's first sliding key
        sliding = torch.arange(position - min(position, window), position + 1) - first_key
        return self._with_compressed(sliding, layer_idx, cache_length, num_queries, position + 1)

    def prompt_key_columns(
        self, layer_idx: int, cache_length: int, num_queries: int, prompt_rows: int
    ) -> torch.Tensor:
        """A forward of the prompt alone has the cached window and the prompt's keys, then `prompt_end //
        compress_rate` compressed entries."""
        sliding = torch.arange(min(cache_length, self.config.sliding_window - 1) + prompt_rows)
        return self._with_compressed(sliding, layer_idx, cache_length, num_queries, cache_length + prompt_rows)

    def _with_compressed(
        self, sliding: torch.Tensor, layer_idx: int, cache_length: int, num_queries: int, seen_tokens: int
    ) -> torch.Tensor:
        """`sliding`, then on CSA and HCA layers the compressed entries closed within the first `seen_tokens`."""
        layer_type = self.config.layer_types[layer_idx]
        if layer_type == "sliding_attention":
            return sliding
        compressed_start = min(cache_length, self.config.sliding_window - 1) + num_queries
        num_compressed = seen_tokens // self.config.compress_rates[layer_type]
        return torch.cat([sliding, torch.arange(compressed_start, compressed_start + num_compressed)])


__all__ = ["DeepseekV4Target"]
