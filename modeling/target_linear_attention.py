"""Adapters for hybrid mHC targets with linear attention: GLM-5-Next (KDA) and Qwen4-Exp (GatedDeltaNet with PLE).

Both keep linear-attention states. From transformers 5.25, the stock cache rolls them back itself: assisted decoding
turns on past recording, and a verify forward computes its last `recurrent_states_to_keep` states one token at a time
(with decoding's one-token kernel) for `crop` to restore. Its `crop(-n)` restores the `n`-th state back counting the
state before the forward, so it reaches `n` tokens back only when `n + 1` states were kept: each verify forward keeps
one more than its drafts (`keep_states_for_draft`; with stock's count, rejecting a whole block restored the state
before its first token: prompt lookup on tiny GLM-5-Next targets gave plain decoding's tokens for 0 of 8 prompts, 8 of
8 with one more). Before 5.25 they get a `RewindableHybridCache` (`cache_linear_attention.py`), and their delta-rule
kernels are recorded during a call so that rollback can replay the accepted part of a block.

- GLM-5-Next (`Glm5NextForConditionalGeneration`; text model `model.language_model`): `[B, S, hc, D]` streams,
  collapsed by a parameter-free mean (`hc_head`) and normed by `norm`. The inherited gate starts as that mean.
- Qwen4-Exp (`Qwen4ExpForCausalLM`, or the composite `Qwen4ExpForConditionalGeneration` on its text path, text
  model `model.language_model`): a flat `[B, S, hc * D]` residual collapsed by `hyper_connection_mixer` (a
  grouped RMSNorm and a low-rank sigmoid gate, then the mean of the gated streams), with no final norm. The
  inherited gate is a copy of that mixer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType

import torch
import transformers.models.glm5_next.modeling_glm5_next as glm5_next
import transformers.models.qwen4_exp.modeling_qwen4_exp as qwen4_exp
from torch import nn
from transformers import Cache, DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from .cache_linear_attention import RewindableHybridCache, make_rewindable, make_stock, recording_kernels
from .target_base import HyperConnectionTarget
from .transformers_compat import CACHE_ARGUMENT, STOCK_LINEAR_ATTENTION_ROLLBACK


class LinearAttentionTarget(HyperConnectionTarget):
    kernel_module: ModuleType
    kernel_names: tuple[str, str]  # the chunked and the one-token delta-rule kernels (before 5.25)

    def check_servable(self) -> None:
        """Before 5.25 a cache of linear-attention layers alone counts no tokens (`Cache.get_seq_length` raises),
        and the assisted loop needs that count: plain decoding, which never asks, runs such a target."""
        layer_types = self.config.layer_types
        if not STOCK_LINEAR_ATTENTION_ROLLBACK and set(layer_types) == {"linear_attention"}:
            raise ValueError(
                f"Speculative decoding on a {self.family} target whose `layer_types` are all linear attention "
                f"({layer_types}) needs transformers 5.25 or newer, where a cache counts tokens without an "
                "attention layer: `pip install 'transformers>=5.25'`, or decode without a drafter."
            )

    def make_cache(self, max_draft: int) -> Cache:
        if STOCK_LINEAR_ATTENTION_ROLLBACK:
            return DynamicCache(config=self.config)
        return RewindableHybridCache(self.config, max_draft=max_draft)

    def make_assistant_cache(self, max_draft: int) -> Cache | None:
        # From 5.25 transformers' own: it keeps the last `num_assistant_tokens` states of each forward, so `crop` also
        # reaches into a forward of several tokens (an assistant with another tokenizer crops those)
        return None if STOCK_LINEAR_ATTENTION_ROLLBACK else self.make_cache(max_draft)

    def adopt_cache(self, cache: Cache, max_draft: int) -> Cache:
        if self._is_plain_decodings_cache(cache):
            return cache if STOCK_LINEAR_ATTENTION_ROLLBACK else make_rewindable(cache, max_draft)
        if STOCK_LINEAR_ATTENTION_ROLLBACK:
            raise ValueError(
                f"Speculative decoding on {self.family} continues from plain decoding's cache, "
                f"`DynamicCache(config=target.config)`, got {type(cache).__name__}. Omit `{CACHE_ARGUMENT}` (one is "
                "created for you)."
            )
        self._check_rewindable(cache, max_draft, "RewindableHybridCache")
        return cache

    def release_cache(self, cache: Cache) -> None:
        if STOCK_LINEAR_ATTENTION_ROLLBACK:
            _stop_recording(cache)
        elif isinstance(cache, RewindableHybridCache):
            make_stock(cache)

    def verify_as_decoding(
        self, prompt_length: int, positions_may_lag: bool = True, cache: Cache | None = None
    ) -> AbstractContextManager:
        """Before 5.25, the delta-rule kernels hand their inputs to the cache, which replays them on a rollback. From
        5.25 the stock cache keeps states itself (`keep_states_for_draft`)."""
        if STOCK_LINEAR_ATTENTION_ROLLBACK:
            return super().verify_as_decoding(prompt_length, positions_may_lag, cache)
        return recording_kernels(self.kernel_module, *self.kernel_names)

    def keep_states_for_draft(self, cache: Cache, num_drafts: int) -> None:
        """From 5.25: each verify forward keeps one more state than its drafts (module docstring). transformers sets
        the count once per call, from the draft length at its start, which a stock assistant's heuristic schedule
        outgrows; a forward of n tokens runs its last n one token at a time either way, so the count costs nothing."""
        if STOCK_LINEAR_ATTENTION_ROLLBACK:
            for layer in cache.layers:
                if isinstance(layer, LinearAttentionLayer) and layer.record_past:
                    layer.recurrent_states_to_keep = num_drafts + 1


def _stop_recording(cache: Cache) -> None:
    """Past recording off, its history dropped: the layers as plain decoding leaves them. Assisted decoding's last
    `crop` cut the conv windows back to at most the kernel size; a window that started from a prompt shorter than the
    kernel is padded with the zeros plain decoding's holds (the convolution pads with zeros either way)."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer) and layer.record_past:
            layer.record_past = False
            del layer.recurrent_states_to_keep, layer.recurrent_states_history
            for i, window in layer.conv_states.items():
                if window is not None:
                    layer.conv_states[i] = _left_padded(window, layer.conv_kernel_size[i])


def _left_padded(window: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(window, (width - window.shape[-1], 0))


_CROPS_PRESENT_STATES = "_hyperdflash_crops_present_states"


def install_crop_of_present_states() -> None:
    """From 5.25: make `LinearAttentionCacheLayerMixin.crop` skip the states a layer never filled. Upstream's crop
    cuts every one of `number_of_states` conv windows by `conv_kernel_size[i]`, which is `None` for a state the layer
    never used: Qwen4-Exp gives every linear layer 3 states when any layer has PLE (`number_of_conv_states`), and a
    linear layer without PLE fills only the first, so its crop raised `TypeError` (transformers 5.25.0,
    `cache_utils.py`, `LinearAttentionCacheLayerMixin.crop`), stock prompt lookup included. A process-wide change,
    like the indexers' tie rule: it alters nothing but a crop that raised. Idempotent, across every copy of the
    runtime in the process; `tests/test_config_space.py` checks that upstream still needs it."""
    if STOCK_LINEAR_ATTENTION_ROLLBACK and not getattr(LinearAttentionCacheLayerMixin.crop, _CROPS_PRESENT_STATES, 0):
        LinearAttentionCacheLayerMixin.crop = _cropping_present_states(LinearAttentionCacheLayerMixin.crop)
        setattr(LinearAttentionCacheLayerMixin.crop, _CROPS_PRESENT_STATES, True)


_NO_WINDOW = torch.empty(0)


def _cropping_present_states(crop: Callable) -> Callable:
    """Upstream's crop, run with an empty, zero-width stand-in for each conv window the layer never filled (its
    slices stay empty), put back to `None` afterwards, as plain decoding leaves it."""

    @functools.wraps(crop)
    def crop_present_states(layer: LinearAttentionCacheLayerMixin, tokens_to_remove: int) -> None:
        absent = [i for i, window in layer.conv_states.items() if window is None]
        for i in absent:
            layer.conv_states[i], layer.conv_kernel_size[i] = _NO_WINDOW, 0
        try:
            crop(layer, tokens_to_remove)
        finally:
            for i in absent:
                layer.conv_states[i], layer.conv_kernel_size[i] = None, None

    return crop_present_states


class Glm5NextTarget(LinearAttentionTarget):
    family = "glm5_next"
    kernel_module = glm5_next
    kernel_names = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")

    @property
    def text_model(self) -> nn.Module:
        return self.model.model.language_model

    def init_inherited_gate(self, gate: nn.Module) -> None:
        """A V4-form head that computes GLM-5-Next's mean exactly: no mixing, every stream weighted 1/hc."""
        with torch.no_grad():
            gate.hc_fn.zero_()
            gate.hc_scale.fill_(1.0)
            gate.hc_base.fill_(math.log((1 / self.hc_mult - gate.eps) / (1 - 1 / self.hc_mult + gate.eps)))


class Qwen4ExpTarget(LinearAttentionTarget):
    family = "qwen4_exp_text"
    kernel_module = qwen4_exp
    kernel_names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")

    @property
    def hc_mult(self) -> int:
        return self.config.hc_count

    @property
    def collapse_head(self) -> nn.Module:
        return self.text_model.hyper_connection_mixer

    @property
    def final_norm(self) -> nn.Module:
        return nn.Identity()

    def as_streams(self, residual: torch.Tensor) -> torch.Tensor:
        return residual.unflatten(-1, (self.hc_mult, self.hidden_size))

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        return self.collapse_head(streams.flatten(2))


class Qwen4ExpCompositeTarget(Qwen4ExpTarget):
    """`Qwen4ExpForConditionalGeneration` (what transformers' Qwen4-Exp tests build), drafted on its text path."""

    @property
    def text_model(self) -> nn.Module:
        return self.model.model.language_model
