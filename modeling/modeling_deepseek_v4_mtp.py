"""DeepSeek-V4's native MTP module as a stand-alone drafter (transformers drops the `mtp.*` weights on load).

Given the target's pre-collapse residual at position i and the token at i+1, one V4 decoder block
predicts the token at i+2:

    e = enorm(embed(token)), h = hnorm(residual)            # h: [B, S, hc_mult, D]
    x = e_proj(e)[:, :, None] + h_proj(h)
    residual' = block(x)                                     # sliding-window attention, top-k MoE
    logits = lm_head(norm(hc_head(residual')))

Deeper drafts reuse the module on its own `residual'`. Embedding and `lm_head` are the target's and
are passed in at run time, never stored here.
"""

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers.core_model_loading import WeightRenaming
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4PreTrainedModel,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
)

from .configuration_deepseek_v4_mtp import DeepseekV4MTPConfig
from .draft_options import DEFAULT_MTP_DEPTH, DEFAULT_SCHEDULE
from .model_card import ModelCardMixin
from .modeling_outputs import DrafterOutput
from .release_weights import MTP_TENSOR, Release, ReleaseLoadingMixin
from .remote_code import RemoteCodeMixin
from .strict_loading import StrictLoadingMixin
from .target_base import activation_dtype, whole_state_dict
from .transformers_compat import CACHE_ARGUMENT

# After transformers' V4 renaming (`conversion_mapping.py`): the block's modules, its final norm (which the target's
# rule `\.norm\.` -> `.kv_norm.` renamed), its collapse head (the target's rules match only top-level `hc_head_*`)
MTP_RENAMES = [
    WeightRenaming(
        r"^mtp\.0\.(self_attn|mlp|input_layernorm|post_attention_layernorm|attn_hc|ffn_hc)\.", r"block.\1."
    ),
    WeightRenaming(r"^mtp\.0\.kv_norm\.", "norm."),
    WeightRenaming(r"^mtp\.0\.hc_head_(fn|base|scale)", r"hc_head.hc_\1"),
    WeightRenaming(r"^mtp\.0\.", ""),
]


def check_deepseek_v4(target: PreTrainedModel, drafter: str) -> None:
    if target.config.model_type != "deepseek_v4":
        raise ValueError(
            f"{drafter}; got a {target.config.model_type!r} target. Use `HyperDFlashForDrafting.from_target(target)` "
            "for other mHC families."
        )


def started_from_target(drafter: PreTrainedModel, target: PreTrainedModel) -> PreTrainedModel:
    """An untrained V4 drafter in the target's activation dtype, its collapse head and final norm the target's."""
    drafter.to(dtype=activation_dtype(target.lm_head, target.get_input_embeddings().weight.dtype))
    drafter.hc_head.load_state_dict(whole_state_dict(target.model.hc_head))
    drafter.norm.load_state_dict(whole_state_dict(target.model.norm))
    return drafter


class DeepseekV4MTPForDrafting(
    StrictLoadingMixin, ModelCardMixin, RemoteCodeMixin, ReleaseLoadingMixin, DeepseekV4PreTrainedModel
):
    """Inherits V4's weight init, fp32-kept modules and no-split rules; it is not a generator itself."""

    config_class = DeepseekV4MTPConfig
    release_tensor = MTP_TENSOR
    _can_record_outputs = {}

    def __init__(self, config: DeepseekV4MTPConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.enorm = DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.block = DeepseekV4DecoderLayer(config, layer_idx=0)
        self.hc_head = DeepseekV4HyperHead(config)
        self.norm = DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = DeepseekV4RotaryEmbedding(config)
        self.post_init()
        self.generation_config = GenerationConfig(
            num_assistant_tokens=DEFAULT_MTP_DEPTH, num_assistant_tokens_schedule=DEFAULT_SCHEDULE
        )

    @classmethod
    def from_target(cls, target: PreTrainedModel, **overrides) -> "DeepseekV4MTPForDrafting":
        """An untrained MTP for `target` (a DeepSeek-V4); its collapse head and final norm start from the target's."""
        check_deepseek_v4(target, "The native-MTP drafter is DeepSeek-V4's MTP block")
        config = DeepseekV4MTPConfig.from_target_config(target.config)
        for key, value in overrides.items():
            setattr(config, key, value)
        return started_from_target(cls(config), target)

    @classmethod
    def _release_config(cls, release: Release) -> tuple[DeepseekV4MTPConfig, list[WeightRenaming]]:
        """The MTP block a release ships: `mtp.0.*` (`from_target_checkpoint`)."""
        if any(name.startswith("mtp.1.") for name in release.drafter_tensor_names()):
            raise ValueError(f"{release.name_or_path} ships several MTP blocks; this drafter reads one (`mtp.0.*`).")
        return DeepseekV4MTPConfig.from_target_config(release.target_config()), MTP_RENAMES

    def forward(
        self,
        token_embeds: torch.Tensor,
        previous_residual: torch.Tensor,
        position_ids: torch.LongTensor,
        cache=None,
    ) -> DrafterOutput:
        """token_embeds [B, S, D] (target embedding of token i+1), previous_residual [B, S, hc, D] (at i)."""
        mixed = self.e_proj(self.enorm(token_embeds)).unsqueeze(2) + self.h_proj(self.hnorm(previous_residual))
        mask = create_sliding_window_causal_mask(
            config=self.config,
            inputs_embeds=token_embeds,
            attention_mask=None,
            position_ids=position_ids,
            **{CACHE_ARGUMENT: cache},
        )
        position_embeddings = {
            kind: self.rotary_emb(token_embeds, position_ids=position_ids, layer_type=kind)
            for kind in ("main", "compress")
        }
        residual = self.block(
            mixed,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            attention_mask=mask,
            **{CACHE_ARGUMENT: cache},
        )
        hidden = self.norm(self.hc_head(residual))
        return DrafterOutput(last_hidden_state=hidden, residual=residual, cache=cache)


__all__ = ["DeepseekV4MTPForDrafting"]

DeepseekV4MTPForDrafting.register_for_auto_class("AutoModel")
