"""Adapters for hybrid mHC targets with linear attention: GLM-5-Next (KDA) and Qwen4-Exp (GatedDeltaNet with PLE).

Both keep linear-attention states that stock `crop` cannot roll back, so they get a `RewindableHybridCache`, and
their delta-rule kernels are recorded during a call so that rollback can replay the accepted part of a block.

- GLM-5-Next (`Glm5NextForConditionalGeneration`; text model `model.language_model`): `[B, S, hc, D]` streams,
  collapsed by a parameter-free mean (`hc_head`) and normed by `norm`. The inherited gate starts as that mean.
- Qwen4-Exp (`Qwen4ExpForCausalLM`, or the composite `Qwen4ExpForConditionalGeneration` on its text path, text
  model `model.language_model`): a flat `[B, S, hc * D]` residual collapsed by `hyper_connection_mixer` (a
  grouped RMSNorm and a low-rank sigmoid gate, then the mean of the gated streams), with no final norm. The
  inherited gate is a copy of that mixer.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from types import ModuleType

import torch
import transformers.models.glm5_next.modeling_glm5_next as glm5_next
import transformers.models.qwen4_exp.modeling_qwen4_exp as qwen4_exp
from torch import nn
from transformers import Cache

from .cache_linear_attention import RewindableHybridCache, make_rewindable, make_stock, recording_kernels
from .target_base import HyperConnectionTarget


class LinearAttentionTarget(HyperConnectionTarget):
    kernel_module: ModuleType
    kernel_names: tuple[str, str]  # the chunked and the one-token delta-rule kernels

    def make_cache(self, max_draft: int) -> RewindableHybridCache:
        return RewindableHybridCache(self.config, max_draft=max_draft)

    def adopt_cache(self, cache: Cache, max_draft: int) -> Cache:
        if self._is_plain_decodings_cache(cache):
            return make_rewindable(cache, max_draft)
        self._check_rewindable(cache, max_draft, "RewindableHybridCache")
        return cache

    def release_cache(self, cache: Cache) -> None:
        if isinstance(cache, RewindableHybridCache):
            make_stock(cache)

    def verify_as_decoding(self, prompt_length: int, positions_may_lag: bool = True) -> AbstractContextManager:
        """The delta-rule kernels hand their inputs to the cache, which replays them on a rollback."""
        return recording_kernels(self.kernel_module, *self.kernel_names)


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
