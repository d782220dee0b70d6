"""HyperDFlash drafter: a block-parallel (DFlash) drafter conditioned on an mHC target's residual streams.

Hugging Face remote code: imports only torch and transformers. The drafter has no embedding or LM head; the
caller embeds the anchor tokens with the target's embedding and maps the output through the target's `lm_head`.
"""

from types import SimpleNamespace

import torch
from torch import nn
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, DynamicSlidingWindowLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedResidual, Qwen4ExpTextRMSNorm

from .configuration_hyperdflash import GATED_RESIDUAL_TARGETS, TARGET_MODEL_TYPES, HyperDFlashConfig
from .draft_heads import DraftHeadsMixin
from .draft_options import DEFAULT_CONTEXT_WINDOW, DEFAULT_SCHEDULE
from .model_card import ModelCardMixin
from .modeling_outputs import DrafterOutput
from .remote_code import RemoteCodeMixin
from .strict_loading import StrictLoadingMixin
from .target_architecture import target_fingerprint
from .targets import get_target_adapter

SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def spread_target_layers(num_target_layers: int, count: int) -> list[int]:
    """DFlash's choice of conditioning layers (z-lab's `build_target_layer_ids`): `count` layers evenly spread over
    [1, L-3], so the deepest pick sits three layers below the top. On a shallow target picks coincide; each is kept
    once, since a repeated layer adds parameters but no information."""
    if count == 1:
        return [num_target_layers // 2]
    start = min(1, num_target_layers - 1)
    end = max(start, num_target_layers - 3)
    picks = [round(start + i * (end - start) / (count - 1)) for i in range(count)]
    return list(dict.fromkeys(picks))


def apply_rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on `[batch, heads, seq, head_dim]`, one tensor at a time: queries and context keys have other positions."""
    return states * cos.unsqueeze(1) + rotate_half(states) * sin.unsqueeze(1)


def block_attention_mask(context_visible: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[batch, 1, blocks*block_size, context + blocks*block_size]` over keys `[context, blocks]`.

    `context_visible[b, n, j]` says whether block n may see context key j. Every block sees all of its own slots
    (non-causal) and none of the other blocks' slots.
    """
    batch, num_blocks, _ = context_visible.shape
    own_block = torch.eye(num_blocks, dtype=torch.bool, device=context_visible.device)
    own_block = own_block.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    visible = torch.cat(
        [context_visible.repeat_interleave(block_size, dim=1), own_block.expand(batch, -1, -1)], dim=-1
    )
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min).unsqueeze(1)


def inherited_gate(config: HyperDFlashConfig) -> nn.Module:
    """A collapse of the target family's form: DeepSeek-V4's head (`hc_fn`/`hc_base`/`hc_scale`; also HY-V4's, and a
    mean for GLM-5-Next when initialised so), or Qwen4-Exp's gated residual over flat streams."""
    if config.target_model_type in GATED_RESIDUAL_TARGETS:
        sizes = SimpleNamespace(
            hc_count=config.hc_mult,
            hidden_size=config.hidden_size,
            hc_lowrank=config.hc_lowrank,
            rms_norm_eps=config.rms_norm_eps,
        )
        return Qwen4ExpTextGatedResidual(sizes, use_combine=False)
    return DeepseekV4HyperHead(config)


class HyperDFlashGateReducer(nn.Module):
    """`reducer="inherited_gate"`: the target's own stream collapse (`inherited_gate`, so the functional form and the
    parameter names are the target's), one per conditioning layer. With several layers (`conditioning="intermediate"`)
    each layer's streams are collapsed by its own gate and the results averaged.
    """

    def __init__(self, config: HyperDFlashConfig):
        super().__init__()
        self.hc_mult = config.hc_mult
        self.flat_streams = config.target_model_type in GATED_RESIDUAL_TARGETS
        self.hc_heads = nn.ModuleList(inherited_gate(config) for _ in range(config.num_conditioning_layers))

    def forward(self, target_hidden: torch.Tensor) -> torch.Tensor:
        per_layer = target_hidden.unflatten(2, (len(self.hc_heads), self.hc_mult))
        streams = [
            per_layer[:, :, i].flatten(2) if self.flat_streams else per_layer[:, :, i]
            for i in range(len(self.hc_heads))
        ]
        return torch.stack([head(s) for head, s in zip(self.hc_heads, streams, strict=True)]).mean(0)


class HyperDFlashDenseReducer(nn.Module):
    """`reducer="dense"`: vanilla DFlash's bias-free projection of all flattened streams to one hidden vector."""

    def __init__(self, config: HyperDFlashConfig):
        super().__init__()
        in_features = config.num_conditioning_layers * config.hc_mult * config.hidden_size
        self.proj = nn.Linear(in_features, config.hidden_size, bias=False)

    def forward(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(target_hidden.flatten(2))


class HyperDFlashAttention(nn.Module):
    """Block queries attend to injected context keys/values (this layer's own projections of the context features)
    followed by the block's own keys/values. Only the context K/V go into the cache."""

    def __init__(self, config: HyperDFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, states: torch.Tensor) -> torch.Tensor:
        return states.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def _key_values(
        self, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = apply_rotary(self.k_norm(self._heads(self.k_proj(states))), cos, sin)
        return keys, self._heads(self.v_proj(states))

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        queries = apply_rotary(self.q_norm(self._heads(self.q_proj(hidden_states))), *block_rope)
        block_keys, block_values = self._key_values(hidden_states, *block_rope)
        context_keys, context_values = self._key_values(context, *context_rope)
        if cache is not None:
            context_keys, context_values = cache.update(context_keys, context_values, self.layer_idx)
        attn_output, _ = eager_attention_forward(
            self,
            queries,
            torch.cat([context_keys, block_keys], dim=2),
            torch.cat([context_values, block_values], dim=2),
            attention_mask,
            scaling=self.scaling,
            dropout=self.attention_dropout if self.training else 0.0,
        )
        return self.o_proj(attn_output.flatten(2))


class HyperDFlashDecoderLayer(nn.Module):
    """Pre-norm attention with context KV injection, then a SwiGLU MLP."""

    def __init__(self, config: HyperDFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = HyperDFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor, **attention_kwargs) -> torch.Tensor:
        attn_output = self.self_attn(self.input_layernorm(hidden_states), context, **attention_kwargs)
        hidden_states = hidden_states + attn_output
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def special_token_ids(target_config: PretrainedConfig) -> dict[str, int | list[int] | None]:
    """The target's bos/eos/pad ids, which a drafter config carries: transformers' pipeline compares them (and the
    vocabulary) to tell whether an assistant shares the target's tokenizer, and fails on a config without them."""
    return {name: getattr(target_config, name, None) for name in SPECIAL_TOKEN_IDS}


def drafter_config_for(target_config: PretrainedConfig, **overrides) -> HyperDFlashConfig:
    """The config of a drafter for a target with `target_config` (no weights needed: `hyperdflash plan` sizes
    drafters from a config alone). Target dimensions and special token ids from the target, draft-layer sizes from
    its hidden size."""
    if target_config.model_type not in TARGET_MODEL_TYPES:
        raise ValueError(
            f"HyperDFlash supports targets with model_type in {TARGET_MODEL_TYPES}, got {target_config.model_type!r}."
        )
    hidden = target_config.hidden_size
    head_dim = min(128, hidden // 4)
    num_heads = hidden // head_dim
    settings = {
        "vocab_size": target_config.vocab_size,
        "hidden_size": hidden,
        "hc_mult": getattr(target_config, "hc_mult", None) or target_config.hc_count,
        "rms_norm_eps": target_config.rms_norm_eps,
        "hc_eps": getattr(target_config, "hc_eps", HyperDFlashConfig.hc_eps),
        "hc_lowrank": getattr(target_config, "hc_lowrank", None),
        "max_position_embeddings": target_config.max_position_embeddings,
        "target_model_type": target_config.model_type,
        "target_name_or_path": target_config.name_or_path or None,
        "target_fingerprint": target_fingerprint(target_config),
        "head_dim": head_dim,
        "num_attention_heads": num_heads,
        # GQA with about 4 query heads per KV head, on a divisor of the head count (HY-V4's 2816 gives 22 heads)
        "num_key_value_heads": max(d for d in range(1, max(1, num_heads // 4) + 1) if num_heads % d == 0),
        "intermediate_size": 3 * hidden,
        "context_window": DEFAULT_CONTEXT_WINDOW,
        **special_token_ids(target_config),
        **overrides,
    }
    if settings.get("conditioning") == "intermediate" and settings.get("target_layer_ids") is None:
        num_layers = settings.get("num_hidden_layers", HyperDFlashConfig.num_hidden_layers)
        settings["target_layer_ids"] = spread_target_layers(target_config.num_hidden_layers, num_layers)
    config = HyperDFlashConfig(**settings)
    if config.conditioning == "intermediate" and max(config.target_layer_ids) >= target_config.num_hidden_layers:
        raise ValueError(
            f"`target_layer_ids` {config.target_layer_ids} must index the target's "
            f"{target_config.num_hidden_layers} decoder layers."
        )
    return config


class HyperDFlashForDrafting(StrictLoadingMixin, ModelCardMixin, RemoteCodeMixin, DraftHeadsMixin, PreTrainedModel):
    """Drafts a block of `block_size - 1` tokens after each anchor in one non-causal forward.

    The conditioning residual is reduced to one vector per context position (`reducer`), normalised (`hidden_norm`)
    and injected as keys/values into every draft layer. Block n is `[anchor_n, mask x (block_size - 1)]` at positions
    `anchor_position_ids[:, n] + 0..block_size-1`; slot k predicts the token k places after the anchor.
    """

    config_class = HyperDFlashConfig
    main_input_name = "anchor_embeds"
    _no_split_modules = ["HyperDFlashDecoderLayer"]

    def __init__(self, config: HyperDFlashConfig):
        super().__init__(config)
        reducer_class = HyperDFlashGateReducer if config.reducer == "inherited_gate" else HyperDFlashDenseReducer
        self.reducer = reducer_class(config)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.layers = nn.ModuleList(HyperDFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        if config.markov_rank:
            self.add_draft_heads(config.hidden_size, config.vocab_size, config.markov_rank)
        # Draft length in transformers' assistant convention; derived from the config, so it survives save/load.
        self.generation_config = GenerationConfig(
            num_assistant_tokens=config.block_size - 1, num_assistant_tokens_schedule=DEFAULT_SCHEDULE
        )
        self.post_init()

    def make_context_cache(self) -> Cache:
        """An empty cache for the context keys/values of generation; windowed, so it stays bounded, when
        `config.context_window` is set."""
        window = self.config.context_window
        if window is None:
            return DynamicCache()
        return Cache(layers=[DynamicSlidingWindowLayer(sliding_window=window + 1) for _ in self.layers])

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, HyperDFlashForDrafting):
            init.normal_(module.mask_embedding, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, DeepseekV4HyperHead):
            init.normal_(module.hc_fn, mean=0.0, std=self.config.initializer_range)
            init.zeros_(module.hc_base)
            init.ones_(module.hc_scale)
        elif isinstance(module, Qwen4ExpTextRMSNorm):
            init.zeros_(module.weight)  # a (1 + weight) norm

    @classmethod
    def from_target(cls, target: PreTrainedModel, **overrides) -> "HyperDFlashForDrafting":
        """An untrained drafter for `target` (a supported mHC family); `overrides` set any config field.

        Target dimensions come from the target config, draft-layer sizes from its hidden size. With
        `reducer="inherited_gate"` every gate starts as a copy of `target.model.hc_head`. No reference to the target
        is kept. For `conditioning="intermediate"` without `target_layer_ids`, a DFlash-style spread is stored.
        """
        adapter = get_target_adapter(target)
        overrides.setdefault("target_name_or_path", target.config.name_or_path or None)  # the text config has none
        config = drafter_config_for(adapter.config, **overrides)
        drafter = cls(config)
        if config.reducer == "inherited_gate":
            for head in drafter.reducer.hc_heads:
                adapter.init_inherited_gate(head)
        return drafter

    def _check_inputs(
        self,
        anchor_embeds: torch.Tensor,
        target_hidden: torch.Tensor,
        context_position_ids: torch.Tensor,
        anchor_position_ids: torch.Tensor,
        context_mask: torch.Tensor | None,
        cache: Cache | None,
    ) -> None:
        batch, num_blocks = anchor_embeds.shape[:2]
        hidden, streams = self.config.hidden_size, self.config.num_conditioning_layers * self.config.hc_mult
        if anchor_embeds.dim() != 3 or anchor_embeds.shape[2] != hidden:
            raise ValueError(f"`anchor_embeds` must be [batch, blocks, {hidden}], got {tuple(anchor_embeds.shape)}.")
        if target_hidden.dim() != 4 or target_hidden.shape[0] != batch or target_hidden.shape[2:] != (streams, hidden):
            raise ValueError(
                f"`target_hidden` must be [{batch}, context, {streams}, {hidden}] ({self.config.conditioning!r} "
                f"conditioning, hc_mult {self.config.hc_mult}), got {tuple(target_hidden.shape)}."
            )
        if context_position_ids.shape != target_hidden.shape[:2] or anchor_position_ids.shape != (batch, num_blocks):
            raise ValueError("`context_position_ids` must be [batch, context], `anchor_position_ids` [batch, blocks].")
        if cache is not None and num_blocks != 1:
            raise ValueError(f"With `cache` the drafter drafts one block per call, got {num_blocks}.")
        past = 0 if cache is None else cache.get_seq_length()
        if context_mask is not None and context_mask.shape != (batch, past + target_hidden.shape[1]):
            raise ValueError(f"`context_mask` must be [batch, {past + target_hidden.shape[1]}]: cached + new context.")

    def _visible_context(
        self,
        context: torch.Tensor,
        context_position_ids: torch.LongTensor,
        anchor_position_ids: torch.LongTensor,
        context_mask: torch.Tensor | None,
        cache: Cache | None,
    ) -> torch.Tensor:
        """[batch, blocks, keys] bool: the context keys each block sees (before its anchor, within the window, not
        padding). With a cache, the keys are what each layer gets back from it plus the new ones."""
        window = self.config.context_window
        if cache is None:
            visible = context_position_ids.unsqueeze(1) < anchor_position_ids.unsqueeze(2)
            if window is not None:
                oldest = (anchor_position_ids - window).unsqueeze(2)
                visible = visible & (context_position_ids.unsqueeze(1) >= oldest)
        else:
            # Keys a layer gets back: what its cache kept (at most `window` when windowed) plus the new ones
            past = cache.get_seq_length()
            key_length = (past if window is None else min(past, window)) + context.shape[1]
            visible = torch.ones(context.shape[0], 1, key_length, dtype=torch.bool, device=context.device)
            if window is not None:
                visible[..., : max(0, key_length - window)] = False
            if context_mask is not None:
                context_mask = context_mask[:, -key_length:]
        if context_mask is not None:
            visible = visible & context_mask.bool().unsqueeze(1)
        return visible

    def forward(
        self,
        anchor_embeds: torch.Tensor,
        target_hidden: torch.Tensor,
        context_position_ids: torch.LongTensor,
        anchor_position_ids: torch.LongTensor,
        context_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> DrafterOutput:
        r"""
        Args:
            anchor_embeds (`[batch, blocks, hidden]`): the anchor tokens embedded by the target, one per block.
            target_hidden (`[batch, context, streams, hidden]`): conditioning residual per context position; streams is
                `hc_mult` (pre_collapse) or `len(target_layer_ids) * hc_mult` (intermediate, layer-major).
            context_position_ids (`[batch, context]`): absolute positions of the context entries.
            anchor_position_ids (`[batch, blocks]`): absolute position of each anchor token.
            context_mask (`[batch, context]` bool, *optional*): False marks padding. With `cache` it covers
                the cached context followed by the new one.
            cache (`Cache`, *optional*): the drafter's context cache (e.g. an empty `DynamicCache` at the
                start). The new context K/V are appended to it and the single block (blocks must be 1) attends to all
                cached context. Without it, block n sees only context at positions before its anchor: all blocks of a
                sequence train in one forward.

        Returns:
            `DrafterOutput`: `last_hidden_state` `[batch, blocks * block_size, hidden]` after the final norm
            (feed it to the target's `lm_head`), `residual`, the same before it (the confidence head's input), and
            `cache`.
        """
        self._check_inputs(
            anchor_embeds, target_hidden, context_position_ids, anchor_position_ids, context_mask, cache
        )
        dtype = self.mask_embedding.dtype
        batch, num_blocks, hidden = anchor_embeds.shape
        block_size = self.config.block_size
        context = self.hidden_norm(self.reducer(target_hidden.to(dtype)))

        masks = self.mask_embedding.expand(batch, num_blocks, block_size - 1, hidden)
        hidden_states = torch.cat([anchor_embeds.to(dtype).unsqueeze(2), masks], dim=2).flatten(1, 2)
        slots = torch.arange(block_size, device=anchor_position_ids.device)
        block_position_ids = (anchor_position_ids.unsqueeze(-1) + slots).flatten(1)

        visible = self._visible_context(context, context_position_ids, anchor_position_ids, context_mask, cache)
        attention_kwargs = {
            "block_rope": self.rotary_emb(hidden_states, block_position_ids),
            "context_rope": self.rotary_emb(context, context_position_ids),
            "attention_mask": block_attention_mask(visible, block_size, dtype),
            "cache": cache,
        }
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, **attention_kwargs)
        return DrafterOutput(last_hidden_state=self.norm(hidden_states), residual=hidden_states, cache=cache)


HyperDFlashForDrafting.register_for_auto_class("AutoModel")
