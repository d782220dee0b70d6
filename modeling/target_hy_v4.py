"""Adapter for stock transformers HY-V4 targets (`HYV4ForCausalLM`).

Laid out like DeepSeek-V4 where the drafter looks: `[B, S, hc, D]` streams, collapsed by `model.hc_head` (the same
parameters and, algebraically, the same formula as V4's head, so the inherited gate is a copy of it) and normed by
`model.norm`. Its attention is full (DSA over every cached token), kept in a stock `DynamicCache` of
`DynamicIndexedLayer`s whose `crop` already removes keys, values and indexer keys exactly; so the stock cache is the
rewindable one, and verify rows need nothing to match one-token decoding. No native MTP weights load in
transformers.
"""

from __future__ import annotations

from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicIndexedLayer

from .target_base import HyperConnectionTarget
from .transformers_compat import CACHE_ARGUMENT


class HYV4Target(HyperConnectionTarget):
    family = "hy_v4"
    stock_cache_rolls_back = True

    def make_cache(self, max_draft: int) -> DynamicCache:
        return DynamicCache(config=self.config)

    def adopt_cache(self, cache: Cache, max_draft: int) -> Cache:
        if not isinstance(cache, DynamicCache) or not all(
            isinstance(layer, DynamicIndexedLayer) for layer in cache.layers
        ):
            raise ValueError(
                f"Speculative decoding on HY-V4 needs the stock dynamic cache (`DynamicCache(config=...)`, whose "
                f"indexed layers crop exactly), got {type(cache).__name__}. Omit `{CACHE_ARGUMENT}` (one is created)."
            )
        return cache
