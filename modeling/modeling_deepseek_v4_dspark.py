"""DSpark, DeepSeek's block drafter for DeepSeek-V4, as a stand-alone drafter (transformers drops its `mtp.*` weights).

One forward drafts a block of `dspark_block_size` rows, `[anchor, noise, ..., noise]` at the positions after the last
verified token's, each row predicting the token after it:

    main_x = main_norm(main_proj(concat_l mean_streams(target layer l's output)))     # the context, [B, S, D]
    h = the block's embeddings, copied onto hc_mult streams                            # [B, K, hc, D]
    h = stage_i(h) for each stage                                                      # V4 blocks; attention: below
    x = hc_head(h);  logits_k = lm_head(norm(x_k)) + markov_w2(markov_w1(previous token))
    confidence_k = sigmoid(confidence_head([x_k; markov_w1(previous token)]))

A stage's attention is V4's (one shared key/value head, partial RoPE, sinks) over keys from two sources: the
context, `kv_norm(kv_proj(main_x))` of the last `sliding_window` verified positions, and the block's own rows, every
row seeing every other (non-causal). The previous token of row k is the anchor for k = 0, else draft k - 1, so the
Markov bias and the confidence run left to right while drafting. Embedding and `lm_head` are the target's, passed
in at run time. Sources: vLLM `vllm/models/deepseek_v4/nvidia/dspark.py`, DeepSeek's DSpark paper and
`deepseek-ai/DeepSpec` (`deepspec/modeling/dspark/`).
"""

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers.core_model_loading import WeightRenaming
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4PreTrainedModel,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .configuration_deepseek_v4_dspark import DeepseekV4DSparkConfig
from .draft_heads import DraftHeadsMixin
from .draft_options import DEFAULT_SCHEDULE
from .model_card import ModelCardMixin
from .modeling_deepseek_v4_mtp import check_deepseek_v4, started_from_target
from .modeling_outputs import DrafterOutput
from .release_weights import DSPARK_TENSOR, Release, ReleaseLoadingMixin
from .remote_code import RemoteCodeMixin
from .strict_loading import StrictLoadingMixin
from .target_base import activation_dtype, whole_state_dict


class DSparkContext:
    """Each stage's context keys `[B, 1, <= sliding_window, head_dim]` for the verified positions, the newest last.
    Verified positions only ever grow, so nothing is rolled back."""

    def __init__(self, num_stages: int, window: int):
        self.window = window
        self.keys: list[torch.Tensor | None] = [None] * num_stages

    def extend(self, stage: int, keys: torch.Tensor) -> torch.Tensor:
        if self.keys[stage] is not None:
            keys = torch.cat([self.keys[stage], keys], dim=2)
        self.keys[stage] = keys[:, :, -self.window :]
        return self.keys[stage]


class DSparkAttention(DeepseekV4Attention):
    """V4's attention over the context keys and the block's rows (no cache of its own: `DSparkContext` holds the
    context)."""

    def context_keys(self, main_x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]):
        keys = self.kv_norm(self.kv_proj(main_x)).view(*main_x.shape[:-1], 1, self.head_dim).transpose(1, 2)
        return apply_rotary_pos_emb(keys, *position_embeddings)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: dict[str, tuple[torch.Tensor, torch.Tensor]],
        context_keys: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        input_shape = hidden_states.shape[:-1]
        cos, sin = position_embeddings[self.rope_layer_type]
        query = self.q_b_proj(self.q_a_norm(self.q_a_proj(hidden_states)))
        query = self.q_b_norm(query.view(*input_shape, -1, self.head_dim).transpose(1, 2))
        query = apply_rotary_pos_emb(query, cos, sin)
        own = self.kv_norm(self.kv_proj(hidden_states)).view(*input_shape, 1, self.head_dim).transpose(1, 2)
        keys = torch.cat([context_keys.to(own.dtype), apply_rotary_pos_emb(own, cos, sin)], dim=2)
        output, _ = eager_attention_forward(self, query, keys, keys, attention_mask, scaling=self.scaling)
        # K = V carries RoPE on its rope slice: the conjugate rotation at the query's position takes it off (as V4)
        output = apply_rotary_pos_emb(output.transpose(1, 2), cos, -sin).transpose(1, 2)
        grouped = self.o_a_proj(output.reshape(*input_shape, self.config.o_groups, -1)).flatten(2)
        return self.o_b_proj(grouped), None


class DSparkStage(DeepseekV4DecoderLayer):
    """A V4 block whose attention reads the context (`context_keys=` is passed through to it)."""

    def __init__(self, config: DeepseekV4DSparkConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = DSparkAttention(config, layer_idx)


# After transformers' V4 renaming (`conversion_mapping.py`): stage i's modules; mtp.0's context projection; the last
# stage's final norm (which the target's rule `\.norm\.` -> `.kv_norm.` renamed), collapse head and the two heads
def dspark_renames(num_stages: int) -> list[WeightRenaming]:
    last = num_stages - 1
    return [
        WeightRenaming(r"^mtp\.(\d+)\.(?=(?:self_attn|mlp|\w+_layernorm|attn_hc|ffn_hc)\.)", r"layers.\1."),
        WeightRenaming(r"^mtp\.0\.main_(proj|norm)\.", r"main_\1."),
        WeightRenaming(rf"^mtp\.{last}\.kv_norm\.", "norm."),
        WeightRenaming(rf"^mtp\.{last}\.hc_head_(fn|base|scale)", r"hc_head.hc_\1"),
        WeightRenaming(rf"^mtp\.{last}\.markov_head\.markov_(w1|w2)\.", r"markov_\1."),
        WeightRenaming(rf"^mtp\.{last}\.confidence_head\.proj\.", "confidence_head."),
    ]


class DeepseekV4DSparkForDrafting(
    StrictLoadingMixin,
    ModelCardMixin,
    RemoteCodeMixin,
    ReleaseLoadingMixin,
    DraftHeadsMixin,
    DeepseekV4PreTrainedModel,
):
    """Inherits V4's weight init, fp32-kept modules and no-split rules; it is not a generator itself."""

    config_class = DeepseekV4DSparkConfig
    release_tensor = DSPARK_TENSOR
    _can_record_outputs = {}

    def __init__(self, config: DeepseekV4DSparkConfig):
        super().__init__(config)
        hidden, rank = config.hidden_size, config.dspark_markov_rank
        self.main_proj = nn.Linear(len(config.dspark_target_layer_ids) * hidden, hidden, bias=False)
        self.main_norm = DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)
        if config.dspark_conditioning == "pre_collapse":
            self.context_hc_head = DeepseekV4HyperHead(config)  # in place of the stream-mean
        self.layers = nn.ModuleList(DSparkStage(config, i) for i in range(config.num_hidden_layers))
        self.hc_head = DeepseekV4HyperHead(config)
        self.norm = DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)
        self.add_draft_heads(hidden, config.vocab_size, rank)
        self.rotary_emb = DeepseekV4RotaryEmbedding(config)
        self.post_init()
        self.generation_config = GenerationConfig(
            num_assistant_tokens=config.dspark_block_size, num_assistant_tokens_schedule=DEFAULT_SCHEDULE
        )

    @classmethod
    def from_target(cls, target: PreTrainedModel, **dspark) -> "DeepseekV4DSparkForDrafting":
        """An untrained DSpark for `target` (a DeepSeek-V4); `dspark` sets the config's `dspark_*` fields and
        `num_hidden_layers` (stages). Its collapse head and final norm start from the target's, and so does the
        context gate of `pre_collapse` conditioning."""
        check_deepseek_v4(target, "DSpark is DeepSeek-V4's block drafter")
        drafter = started_from_target(cls(DeepseekV4DSparkConfig.from_target_config(target.config, **dspark)), target)
        if drafter.config.dspark_conditioning == "pre_collapse":
            drafter.context_hc_head.load_state_dict(whole_state_dict(target.model.hc_head))
        return drafter

    @classmethod
    def _release_config(cls, release: Release) -> tuple[DeepseekV4DSparkConfig, list[WeightRenaming]]:
        """DSpark as a release ships it: `mtp.{0,1,2}.*` and the `dspark_*` fields (`from_target_checkpoint`)."""
        missing = [
            field for field in ("dspark_target_layer_ids", "dspark_noise_token_id") if field not in release.config
        ]
        if missing:
            raise ValueError(f"{release.name_or_path} ships DSpark weights but its config.json lacks {missing}.")
        num_stages = len({name.split(".")[1] for name in release.drafter_tensor_names()})
        config = DeepseekV4DSparkConfig.from_target_config(release.target_config(), num_hidden_layers=num_stages)
        return config, dspark_renames(num_stages)

    def make_context(self) -> DSparkContext:
        return DSparkContext(self.config.num_hidden_layers, self.config.sliding_window)

    def context_features(self, layer_outputs: torch.Tensor) -> torch.Tensor:
        """`[B, S, layers * hc, D]` target layer outputs (stacked on the stream axis) -> `main_x` `[B, S, D]`."""
        if self.config.dspark_conditioning == "pre_collapse":
            reduced = self.context_hc_head(layer_outputs)
        else:
            layers = len(self.config.dspark_target_layer_ids)
            reduced = layer_outputs.unflatten(2, (layers, -1)).mean(dim=3).flatten(2)
        # an FP8 projection (a release kept quantized) takes the activations' dtype
        return self.main_norm(self.main_proj(reduced.to(activation_dtype(self.main_proj, reduced.dtype))))

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_position_ids: torch.LongTensor,
        context_features: torch.Tensor,
        context_position_ids: torch.LongTensor,
        context: DSparkContext | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> DrafterOutput:
        """block_embeds `[B, K, D]` (the target's embedding of anchor and noise tokens); context_features the target
        layer outputs `[B, S, layers * hc, D]` at the verified positions new since the last call (S may be 0);
        returns the block's pre-norm hidden states (`residual`, what the confidence head reads) and normed ones.

        Drafting passes `context`, which keeps each stage's last `sliding_window` keys; training passes none, every
        block of a sequence at once (`block_embeds` `[B, blocks * K, D]`) and the `attention_mask` that shows each
        block its own window of the context and its own rows."""
        block_rope = {"main": self.rotary_emb(block_embeds, position_ids=block_position_ids, layer_type="main")}
        if context_features.shape[1]:
            main_x = self.context_features(context_features)
            context_rope = self.rotary_emb(main_x, position_ids=context_position_ids, layer_type="main")
        streams = block_embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for i, stage in enumerate(self.layers):
            keys = stage.self_attn.context_keys(main_x, context_rope) if context_features.shape[1] else None
            if context is not None:
                keys = context.extend(i, keys) if keys is not None else context.keys[i]
            streams = stage(streams, position_embeddings=block_rope, context_keys=keys, attention_mask=attention_mask)
        hidden = self.hc_head(streams)
        return DrafterOutput(last_hidden_state=self.norm(hidden), residual=hidden, cache=context)


__all__ = ["DeepseekV4DSparkForDrafting"]

DeepseekV4DSparkForDrafting.register_for_auto_class("AutoModel")
