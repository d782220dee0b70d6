"""A DeepSeek-V4 cache whose `crop` rolls back exactly, for speculative decoding, without recomputing anything.

The stock V4 cache layers (`DeepseekV4HCACache`, `DeepseekV4CSACache`) only move forward: their sliding keys are cut
to the last `sliding_window - 1` and their compressor state (buffer, compressed entries, CSA overlap) folds every
token in for good, so rejected draft tokens cannot be taken back. The layers here keep the stock state, fed by the
stock code, and next to it just enough history to rebuild that state at any length up to `max_draft` tokens back:

* the last `sliding_window - 1 + max_draft` sliding keys;
* per compressor entry (`"compressor"`, plus `"indexer"` on CSA layers), the raw projected `(kv, gate)` from the
  start of the oldest window a rollback can land in, which becomes the rolled-back buffer;
* on CSA layers, the Ca half of each recently closed window exactly as the compressor handed it to
  `update_overlap_state` (the gate already includes `position_bias`), which becomes the rolled-back overlap.

Compressed entries need no recomputation: entry `w` only depends on tokens before `(w + 1) * compress_rate`, so rolling
back to length `L` keeps the first `L // compress_rate` of them.

A target verified by assisted decoding never undoes a forward of one token (a step that verifies no draft), so its
cache can be built with `undo_single_token_forwards=False`: such a forward then runs the stock code alone, at plain
decoding's cost, and the history starts again from the stock state at the next forward of several tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DeepseekV4Config
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicSlidingWindowLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache, DeepseekV4HCACache


def _tail(tensor: torch.Tensor, count: int, dim: int) -> torch.Tensor:
    """The last `count` entries along `dim`. Copied out when they are a small part of a large tensor (a prefill), so
    the kept history does not pin that tensor's memory."""
    kept = tensor.narrow(dim, tensor.shape[dim] - count, count)
    return kept.clone() if tensor.shape[dim] > 2 * count else kept


class _RewindableSlidingKeysMixin(CacheLayerMixin):
    """Sliding-window keys that `crop` can move back by up to `max_draft` tokens.

    `keys` / `values` keep the stock layout: the last `min(seq_len, sliding_window - 1)` keys, as one tensor because V4
    attention is K=V (it passes the same tensor twice and only reads the keys back). `key_history` holds those keys
    plus up to `max_draft` older ones; `keys` is a view of its tail.
    """

    # A cache layer with no instance layout of its own, so a layer can switch between the stock and rewindable classes
    __slots__ = ()
    # What transformers (5.25 on) asks before assisted decoding: the stock HCA and CSA layers say False
    is_croppable = True
    sliding_window: int
    cumulative_length: int
    _history = ("max_draft", "undo_single_token_forwards", "key_history", "min_length")  # not in the stock layer

    def _init_history(self, max_draft: int, undo_single_token_forwards: bool = True) -> None:
        self.max_draft = max_draft
        self.undo_single_token_forwards = undo_single_token_forwards
        # None when there is no history: before the first forward, and after a one-token forward it will not undo
        self.key_history: torch.Tensor | None = None
        # The shortest length `crop` can still restore: `max_draft` tokens before the end of the latest forward pass
        # (or of an earlier one, if a crop went back since). Anything only needed below it is dropped.
        self.min_length = 0

    def _adopt_state(self) -> None:
        """Start the history at a stock layer's state: nothing before it can be rolled back to."""
        self.key_history = self.keys
        self.min_length = self.cumulative_length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new keys; return the cached window plus the new keys, as the stock layer does."""
        if key_states.shape[-2] == 1 and not self.undo_single_token_forwards:
            self.key_history = None
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.key_history is None:
            self._adopt_state()
        num_visible = min(self.cumulative_length, self.sliding_window - 1) + key_states.shape[-2]
        full = torch.cat([self.key_history, key_states], dim=-2)
        self.cumulative_length += key_states.shape[-2]
        self.min_length = max(self.min_length, self.cumulative_length - self.max_draft)
        # A window ending at `min_length` or later never reaches back before this position
        first_needed = max(0, self.min_length - self.sliding_window + 1)
        self.key_history = _tail(full, self.cumulative_length - first_needed, dim=-2)
        self._slide_window()
        visible = full.narrow(-2, full.shape[-2] - num_visible, num_visible)
        return visible, visible

    def _slide_window(self) -> None:
        """Point `keys` / `values` at the last `sliding_window - 1` keys of the history, as the stock layer holds."""
        window = min(self.cumulative_length, self.sliding_window - 1)
        self.keys = self.values = self.key_history.narrow(-2, self.key_history.shape[-2] - window, window)

    def activate_past_recording(self, **kwargs) -> None:
        """No-op: the history `crop` needs is always kept (bounded by `max_draft`); there is nothing to switch on."""

    def check_rewind(self, length: int) -> None:
        """Raise if `length` is out of the range `crop` can restore."""
        if self.key_history is None and length < self.cumulative_length:
            raise ValueError(
                f"Cannot roll the DeepSeek-V4 cache back to {length} tokens: its latest forward pass was of one "
                "token, which a cache built with `undo_single_token_forwards=False` does not undo (assisted decoding "
                "never does). Build RewindableDeepseekV4Cache with `undo_single_token_forwards=True` to undo them."
            )
        if self.key_history is not None and length < self.min_length:
            raise ValueError(
                f"Cannot roll the DeepSeek-V4 cache back to {length} tokens: it keeps history to undo at most "
                f"max_draft={self.max_draft} tokens of the latest forward pass, so the shortest reachable length is "
                f"{self.min_length}. Build RewindableDeepseekV4Cache with a larger `max_draft` (at least the largest "
                "number of tokens you ever remove with `crop`)."
            )

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (the stock layer sign convention: 0 removes nothing)."""
        if tokens_to_remove > 0:
            raise ValueError(f"`tokens_to_remove` must be <= 0 (minus the tokens to drop), got {tokens_to_remove}.")
        length = self.cumulative_length + tokens_to_remove
        self.check_rewind(length)
        if tokens_to_remove < 0:
            self._rewind_to(length)

    def _rewind_to(self, length: int) -> None:
        kept = self.key_history.shape[-2] - (self.cumulative_length - length)
        self.key_history = self.key_history.narrow(-2, 0, kept)
        self.cumulative_length = length
        self._slide_window()

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dimension op to every kept tensor, the stock state included (the stock layers only apply
        `batch_select_indices` / `batch_repeat_interleave` to `keys` / `values`)."""
        if not self.is_initialized:
            return
        if self.key_history is None:
            self._adopt_state()
        self.key_history = fn(self.key_history)
        self._slide_window()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda tensor: tensor[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        super().reset()
        self.key_history = None
        self.min_length = 0


class RewindableSlidingWindowLayer(_RewindableSlidingKeysMixin, DynamicSlidingWindowLayer):
    """Rewindable cache layer for V4 `sliding_attention` blocks (stock: `DynamicSlidingWindowLayer`)."""

    _layer_type = None  # keep transformers' global layer-type mapping pointing at the stock classes

    def __init__(self, config: DeepseekV4Config, max_draft: int, undo_single_token_forwards: bool = True):
        super().__init__(sliding_window=config.sliding_window)
        self._init_history(max_draft, undo_single_token_forwards)


class RewindableHCALayer(_RewindableSlidingKeysMixin, DeepseekV4HCACache):
    """Rewindable cache layer for V4 `heavily_compressed_attention` blocks.

    Intercepts `store_compression_weights` to record each entry's raw `(kv, gate)` in `raw_kv` / `raw_gate`, covering
    positions `[raw_start[name], seq_len)`; `crop` rebuilds `buffer_*`, `compressed_kv` and `entry_count` from it.
    """

    _layer_type = None  # keep transformers' global layer-type mapping pointing at the stock classes

    def __init__(self, config: DeepseekV4Config, max_draft: int, undo_single_token_forwards: bool = True):
        super().__init__(config)
        self._init_history(max_draft, undo_single_token_forwards)

    _history = ("raw_kv", "raw_gate", "raw_start")

    def _init_history(self, max_draft: int, undo_single_token_forwards: bool = True) -> None:
        super()._init_history(max_draft, undo_single_token_forwards)
        self.raw_kv: dict[str, torch.Tensor | None] = dict.fromkeys(self.compressed_kv)
        self.raw_gate: dict[str, torch.Tensor | None] = dict.fromkeys(self.compressed_kv)
        self.raw_start: dict[str, int] = dict.fromkeys(self.compressed_kv, 0)

    def _adopt_state(self) -> None:
        """The buffer holds the raw `(kv, gate)` of the tokens after the last closed window."""
        super()._adopt_state()
        for name in self.compressed_kv:
            self.raw_kv[name], self.raw_gate[name] = self.buffer_kv[name], self.buffer_gate[name]
            self.raw_start[name] = self.entry_count[name] * self.compress_rate

    def store_compression_weights(
        self, name: str, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        # Called right after `update` in the same attention forward, so `min_length` already counts these tokens
        if self.key_history is None:  # a forward it will not undo
            return super().store_compression_weights(name, kv, gate)
        if self.raw_kv[name] is not None:
            kv_history = torch.cat([self.raw_kv[name], kv], dim=1)
            gate_history = torch.cat([self.raw_gate[name], gate], dim=1)
        else:
            kv_history, gate_history = kv, gate
        # A rollback to `min_length` or later leaves a buffer that starts at or after this window boundary
        start = (self.min_length // self.compress_rate) * self.compress_rate
        kept = self.cumulative_length - start
        self.raw_kv[name], self.raw_gate[name] = _tail(kv_history, kept, dim=1), _tail(gate_history, kept, dim=1)
        self.raw_start[name] = start
        return super().store_compression_weights(name, kv, gate)

    def _rewind_to(self, length: int) -> None:
        super()._rewind_to(length)
        entry_count = length // self.compress_rate
        for name in self.compressed_kv:
            self.entry_count[name] = entry_count
            self.compressed_kv[name] = self.compressed_kv[name][:, :entry_count]
            self.raw_kv[name] = self.raw_kv[name][:, : length - self.raw_start[name]]
            self.raw_gate[name] = self.raw_gate[name][:, : length - self.raw_start[name]]
            buffer_start = entry_count * self.compress_rate - self.raw_start[name]
            self.buffer_kv[name] = self.raw_kv[name][:, buffer_start:]
            self.buffer_gate[name] = self.raw_gate[name][:, buffer_start:]

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super()._map_batch(fn)
        for states in (self.buffer_kv, self.buffer_gate, self.compressed_kv, self.raw_kv, self.raw_gate):
            for name, tensor in states.items():
                if tensor is not None:
                    states[name] = fn(tensor)

    def reset(self) -> None:
        super().reset()
        for name in self.raw_kv:
            self.raw_kv[name] = self.raw_gate[name] = None
            self.raw_start[name] = 0


class RewindableCSALayer(RewindableHCALayer, DeepseekV4CSACache):
    """Rewindable cache layer for V4 `compressed_sparse_attention` blocks (compressor and indexer entries).

    On top of the HCA history, intercepts `update_overlap_state` to record the Ca half of every closed window,
    `[B, window, compress_rate, head_dim]` in `window_kv` / `window_gate` for windows `[window_start[name],
    entry_count[name])`; `crop` restores `overlap_kv` / `overlap_gate` as the last window it keeps.
    """

    _layer_type = None  # keep transformers' global layer-type mapping pointing at the stock classes

    _history = ("window_kv", "window_gate", "window_start")

    def _init_history(self, max_draft: int, undo_single_token_forwards: bool = True) -> None:
        super()._init_history(max_draft, undo_single_token_forwards)
        self.window_kv: dict[str, torch.Tensor | None] = dict.fromkeys(self.overlap_kv)
        self.window_gate: dict[str, torch.Tensor | None] = dict.fromkeys(self.overlap_kv)
        self.window_start: dict[str, int] = dict.fromkeys(self.overlap_kv, 0)

    def _adopt_state(self) -> None:
        """The overlap is the Ca half of the last closed window, `entry_count - 1`."""
        super()._adopt_state()
        for name in self.overlap_kv:
            closed = self.overlap_kv[name] is not None
            self.window_kv[name] = self.overlap_kv[name][:, None] if closed else None
            self.window_gate[name] = self.overlap_gate[name][:, None] if closed else None
            self.window_start[name] = self.entry_count[name] - 1 if closed else 0

    def update_overlap_state(
        self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # `chunk_*` are the windows closing now, `[B, n_windows, compress_rate, 2 * head_dim]`; they directly follow
        # the recorded ones, since `_rewind_to` drops every window it reopens. The gate already has `position_bias`.
        if self.key_history is None:  # a forward it will not undo
            return super().update_overlap_state(name, chunk_kv, chunk_gate, head_dim)
        ca_kv, ca_gate = chunk_kv[..., :head_dim], chunk_gate[..., :head_dim]
        if self.window_kv[name] is not None:
            ca_kv = torch.cat([self.window_kv[name], ca_kv], dim=1)
            ca_gate = torch.cat([self.window_gate[name], ca_gate], dim=1)
        # A rollback to `min_length` or later needs the overlap of the window before its first open one
        start = max(0, self.min_length // self.compress_rate - 1)
        kept = self.window_start[name] + ca_kv.shape[1] - start
        self.window_kv[name], self.window_gate[name] = _tail(ca_kv, kept, dim=1), _tail(ca_gate, kept, dim=1)
        self.window_start[name] = start
        return super().update_overlap_state(name, chunk_kv, chunk_gate, head_dim)

    def _rewind_to(self, length: int) -> None:
        super()._rewind_to(length)
        for name in self.overlap_kv:
            closed = self.entry_count[name] - self.window_start[name]
            if self.entry_count[name] == 0:
                self.window_kv[name] = self.window_gate[name] = None
                self.overlap_kv[name] = self.overlap_gate[name] = None
            else:
                self.window_kv[name] = self.window_kv[name][:, :closed]
                self.window_gate[name] = self.window_gate[name][:, :closed]
                self.overlap_kv[name] = self.window_kv[name][:, -1]
                self.overlap_gate[name] = self.window_gate[name][:, -1]

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super()._map_batch(fn)
        for states in (self.overlap_kv, self.overlap_gate, self.window_kv, self.window_gate):
            for name, tensor in states.items():
                if tensor is not None:
                    states[name] = fn(tensor)

    def reset(self) -> None:
        super().reset()
        for name in self.window_kv:
            self.window_kv[name] = self.window_gate[name] = None
            self.window_start[name] = 0


_REWINDABLE_LAYER_CLASSES = {
    "sliding_attention": RewindableSlidingWindowLayer,
    "heavily_compressed_attention": RewindableHCALayer,
    "compressed_sparse_attention": RewindableCSALayer,
}
# The layer class plain decoding's cache holds, for each rewindable one
STOCK_LAYER_CLASSES = {
    RewindableSlidingWindowLayer: DynamicSlidingWindowLayer,
    RewindableHCALayer: DeepseekV4HCACache,
    RewindableCSALayer: DeepseekV4CSACache,
}


class RewindableDeepseekV4Cache(DynamicCache):
    """Drop-in cache for the stock `DeepseekV4ForCausalLM` whose `crop` rolls back exactly.

    After any forward pass, `crop` can remove up to `max_draft` of the latest tokens (in one or several calls),
    which is what verifying a draft of at most `max_draft` tokens and rejecting some of them needs. The extra memory
    is bounded by `max_draft` and the compression rates; it does not grow with the sequence.

    Args:
        config: the V4 config; one rewindable layer is built per `config.layer_types` entry (a config with only
            `sliding_attention` layers, such as a native-MTP block's, works too).
        max_draft: the largest number of tokens `crop` must be able to remove.
        undo_single_token_forwards: False for a cache that only ever undoes tokens of a forward of several (a target
            verifying drafts): a one-token forward then costs what it costs in plain decoding.
    """

    def __init__(self, config: DeepseekV4Config, max_draft: int = 16, undo_single_token_forwards: bool = True):
        if max_draft < 0:
            raise ValueError(f"`max_draft` must be >= 0, got {max_draft}.")
        unsupported = sorted(set(config.layer_types) - _REWINDABLE_LAYER_CLASSES.keys())
        if unsupported:
            raise ValueError(f"RewindableDeepseekV4Cache has no rewindable layer for layer types {unsupported}.")
        layers = [
            _REWINDABLE_LAYER_CLASSES[layer_type](config, max_draft, undo_single_token_forwards)
            for layer_type in config.layer_types
        ]
        # Straight to `Cache.__init__`: `DynamicCache.__init__(config=...)` would build the stock layers instead
        Cache.__init__(self, layers=layers)
        self.max_draft = max_draft

    def crop(self, max_length: int) -> None:
        """Roll back to a shorter length.

        A negative `max_length` removes that many trailing tokens and 0 removes none (transformers' convention,
        which assisted decoding relies on with `crop(-number_of_tokens_to_crop)`); a positive one keeps that many
        tokens. Raises `ValueError`, leaving the cache untouched, if that goes further back than the kept history.
        """
        current = self.get_seq_length()
        length = current + max_length if max_length <= 0 else min(max_length, current)
        if length == current:  # every step that accepts all it verified, or verified no draft
            return
        for layer in self.layers:
            layer.check_rewind(length)
        for layer in self.layers:
            layer.crop(length - current)


def make_rewindable(
    cache: DynamicCache, max_draft: int, undo_single_token_forwards: bool = True
) -> RewindableDeepseekV4Cache:
    """Turn a stock V4 cache (plain decoding's, or one a speculative call returned) into a rewindable one, in place:
    its layers keep their state and start their history there, so a continuation can roll back its own drafts."""
    rewindable = {stock: klass for klass, stock in STOCK_LAYER_CLASSES.items()}
    for layer in cache.layers:
        layer.__class__ = rewindable[type(layer)]
        layer._init_history(max_draft, undo_single_token_forwards)
        if layer.is_initialized:
            layer._adopt_state()
    cache.__class__ = RewindableDeepseekV4Cache
    cache.max_draft = max_draft
    return cache


def make_stock(cache: RewindableDeepseekV4Cache) -> DynamicCache:
    """The reverse, in place: the stock classes and state plain decoding leaves, the rollback history dropped."""
    for layer in cache.layers:
        if layer.is_initialized:  # `keys` is a view of the history: keep the window only
            layer.keys = layer.values = layer.keys.clone()
        for klass in type(layer).__mro__:
            for name in vars(klass).get("_history", ()):
                delattr(layer, name)
        layer.__class__ = STOCK_LAYER_CLASSES[type(layer)]
    del cache.max_draft
    cache.__class__ = DynamicCache
    return cache
