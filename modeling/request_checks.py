"""What a speculative request must satisfy before any work: the drafter fits the target, its draft settings are
valid, and the generate() options can be honoured exactly (docs/generate_parity.md lists them)."""

from __future__ import annotations

import math
import warnings

import torch
from transformers import Cache, GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode

from .draft_options import (
    BLOCK_DRAFTER_TYPE,
    DEFAULT_MTP_DEPTH,
    DRAFT_FROM_CONTEXT,
    DSPARK_DRAFTER_TYPE,
    MTP_DRAFTER_TYPE,
    SCHEDULES,
)
from .target_architecture import target_fingerprint
from .target_base import HyperConnectionTarget
from .transformers_compat import cached_length


def check_compatible(target: HyperConnectionTarget, drafter: PreTrainedModel) -> None:
    """Refuse a drafter of another width or kind; warn when it was built for another target of the same width."""
    config = drafter.config
    if config.model_type in (MTP_DRAFTER_TYPE, DSPARK_DRAFTER_TYPE) and not target.has_native_mtp:
        kind = (
            "native-MTP drafter is DeepSeek-V4's MTP block"
            if config.model_type == MTP_DRAFTER_TYPE
            else ("DSpark drafter is DeepSeek-V4's block drafter")
        )
        raise ValueError(
            f"The {kind}; a {target.family} target has none. Use a HyperDFlash drafter "
            "(`HyperDFlashForDrafting.from_target(target)`, then `hyperdflash train`)."
        )
    for name, expected in (
        ("hidden_size", target.hidden_size),
        ("hc_mult", target.hc_mult),
        ("vocab_size", target.vocab_size),
    ):
        got = getattr(config, name, None)
        if got != expected:
            raise ValueError(
                f"This drafter was built for a different target: drafter {name}={got}, target {name}={expected}. "
                "Use the drafter trained for this target, or build one with "
                "`HyperDFlashForDrafting.from_target(target)`."
            )
    layer_ids = getattr(config, "target_layer_ids", None) or getattr(config, "dspark_target_layer_ids", None)
    if config.model_type == DSPARK_DRAFTER_TYPE or getattr(config, "conditioning", None) == "intermediate":
        bad = [i for i in layer_ids or [] if not 0 <= i < target.num_layers]
        if bad or not layer_ids:
            raise ValueError(
                f"The drafter conditions on target layers {layer_ids}, but the target has {target.num_layers} layers. "
                "Use a drafter trained for this target."
            )
    built_for, actual = getattr(config, "target_fingerprint", None), target_fingerprint(target.config)
    if built_for is not None and built_for != actual:
        warnings.warn(
            f"This drafter was built for the target {config.target_name_or_path!r} (config fingerprint {built_for}), "
            f"but runs with {target.config.name_or_path or type(target.model).__name__!r} (fingerprint {actual}). "
            "The widths match, so outputs stay exact, but few drafts may be accepted: use the drafter trained for "
            "this target, or train one with `hyperdflash train --target ...`.",
            UserWarning,
            stacklevel=4,
        )


def num_draft_tokens(drafter: PreTrainedModel) -> int:
    """Draft length in transformers' convention, `drafter.generation_config.num_assistant_tokens`."""
    config = drafter.config
    num = getattr(getattr(drafter, "generation_config", None), "num_assistant_tokens", None)
    most = {
        BLOCK_DRAFTER_TYPE: getattr(config, "block_size", 0) - 1,
        DSPARK_DRAFTER_TYPE: getattr(config, "dspark_block_size", 0),
    }
    if num is None:
        num = most.get(config.model_type, DEFAULT_MTP_DEPTH)
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(
            f"`drafter.generation_config.num_assistant_tokens` must be an integer >= 1, got {num!r}. To decode "
            "without drafting, call generate() without `assistant_model`."
        )
    if config.model_type in most and num > most[config.model_type]:
        raise ValueError(
            f"`num_assistant_tokens`={num} exceeds what one block of this drafter drafts ({most[config.model_type]}). "
            "Lower `drafter.generation_config.num_assistant_tokens`."
        )
    return num


def draft_schedule(drafter: PreTrainedModel) -> str:
    """`drafter.generation_config.num_assistant_tokens_schedule`, one of `SCHEDULES`."""
    schedule = getattr(getattr(drafter, "generation_config", None), "num_assistant_tokens_schedule", None)
    if schedule not in SCHEDULES:
        merged = " ('adaptive_transient' is now 'adaptive', which keeps nothing between calls)"
        raise ValueError(
            f"`drafter.generation_config.num_assistant_tokens_schedule` is {schedule!r}; this drafter takes one of "
            f"{list(SCHEDULES)}{merged if schedule == 'adaptive_transient' else ''}: 'adaptive' chooses each step's "
            "draft length from the drafter's confidence and a cost model, and skips drafting where it does not pay; "
            "'heuristic' and 'heuristic_transient' are transformers' own, 'constant' always drafts "
            "`num_assistant_tokens`."
        )
    return schedule


def draft_from_context(drafter: PreTrainedModel) -> bool:
    """`drafter.generation_config.draft_from_context`: True (or unset) lets a step verify a chain copied from the
    context instead of the drafter's."""
    value = getattr(getattr(drafter, "generation_config", None), DRAFT_FROM_CONTEXT, None)
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ValueError(
            f"`drafter.generation_config.{DRAFT_FROM_CONTEXT}` must be True (each step may verify tokens copied from "
            f"the prompt and the reply so far instead of the drafter's) or False (the drafter's only), got {value!r}."
        )
    return value


def check_confidence_threshold(drafter: PreTrainedModel) -> None:
    """`drafter.generation_config.assistant_confidence_threshold`: None or 0 (off), or a probability."""
    threshold = getattr(getattr(drafter, "generation_config", None), "assistant_confidence_threshold", None)
    number = isinstance(threshold, int | float) and not isinstance(threshold, bool)
    if threshold is not None and not (number and math.isfinite(threshold) and 0 <= threshold <= 1):
        raise ValueError(
            f"`drafter.generation_config.assistant_confidence_threshold` must be a probability in [0, 1] (drafting "
            f"stops after a draft less likely than that under the drafter) or None, got {threshold!r}."
        )


def refuse_incompatible_options(generation_config: GenerationConfig, drafter: PreTrainedModel) -> None:
    """Options whose result with a drafter would not be plain decoding's (docs/generate_parity.md lists them)."""
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            "Beam search cannot be combined with a speculative drafter (`assistant_model`). Use num_beams=1, or "
            "drop `assistant_model` for beam search."
        )
    if generation_config.use_cache is False:
        raise ValueError("Speculative decoding needs the target's cache; do not pass use_cache=False.")
    mode = generation_config.get_generation_mode(assistant_model=drafter)
    if getattr(generation_config, "dola_layers", None) is not None:  # transformers would silently drop it
        mode = GenerationMode.DOLA_GENERATION
    if mode != GenerationMode.ASSISTED_GENERATION:
        raise ValueError(
            f"These generate() options select {mode.value.replace('_', ' ')}, which cannot use a speculative drafter "
            "(only greedy decoding and sampling can). Drop `assistant_model`, or the options that select it "
            "(penalty_alpha with top_k > 1, constraints, force_words_ids, dola_layers)."
        )
    other_drafting = {
        "prompt_lookup_num_tokens": generation_config.prompt_lookup_num_tokens,
        "assistant_early_exit": generation_config.assistant_early_exit,
        "use_mtp": generation_config.use_mtp or None,
    }
    conflicting = [name for name, value in other_drafting.items() if value is not None]
    if conflicting:
        raise ValueError(
            f"`{conflicting[0]}` and a drafter (`assistant_model`) are two ways to draft; pass one of them."
        )
    if getattr(generation_config, "assistant_ensemble_weight", None) is not None:
        raise ValueError(
            "assistant_ensemble_weight mixes the drafter's distribution into the target's, so the output would not be "
            "the target's; drop it (speculative decoding with a drafter is exact without it)."
        )
    if generation_config.guidance_scale not in (None, 1, 1.0):
        raise ValueError(
            f"guidance_scale={generation_config.guidance_scale} cannot be combined with a speculative drafter: its "
            "processor keeps an unconditional context that draft verification would corrupt. Drop `assistant_model`."
        )
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"cache_implementation={generation_config.cache_implementation!r} cannot be combined with a speculative "
            "drafter, which brings its own rewindable dynamic cache. Drop `cache_implementation` (or set it to "
            "'dynamic')."
        )


def check_prompt(input_ids: torch.LongTensor | None) -> None:
    """Prompts as token ids: the drafter embeds the verified tokens."""
    if input_ids is None:
        raise ValueError(
            "Speculative decoding needs `input_ids` (the drafter embeds the verified tokens); "
            "pass input_ids instead of inputs_embeds."
        )


def refuse_batched_options(arguments: dict, generation_config: GenerationConfig, drafter: PreTrainedModel) -> None:
    """Options a batched speculative call (several rows, or `num_return_sequences` > 1) does not serve."""
    refused = {
        "output_attentions": generation_config.return_dict_in_generate and generation_config.output_attentions,
        "output_hidden_states": generation_config.return_dict_in_generate and generation_config.output_hidden_states,
        "streamer": arguments.get("streamer") is not None,
        "custom_generate": arguments.get("custom_generate") is not None,
        "synced_gpus": bool(arguments.get("synced_gpus")),
        "assistant_confidence_threshold": bool(
            getattr(getattr(drafter, "generation_config", None), "assistant_confidence_threshold", None)
        ),
    }
    named = [name for name, given in refused.items() if given]
    if named:
        raise ValueError(
            f"A batched speculative call (several prompts, or num_return_sequences > 1) does not take `{named[0]}`. "
            "Drop it, or decode one prompt at a time (batch size 1 takes it)."
        )


def check_cached_prefix(cache: Cache, prompt_length: int) -> None:
    """A cache the caller passed in holds a strict prefix of the prompt."""
    if cached_length(cache) >= prompt_length:
        raise ValueError(
            f"The target cache passed in already holds {cached_length(cache)} tokens, but the prompt has "
            f"{prompt_length}: pass the whole conversation so far plus at least one new token."
        )


def is_batched(input_ids: torch.LongTensor, num_return_sequences: int | None) -> bool:
    return input_ids.shape[0] > 1 or (num_return_sequences or 1) > 1


def left_padding(attention_mask: torch.Tensor) -> torch.LongTensor:
    """Padding tokens at the start of each row of a left-padded `attention_mask` [B, L]."""
    return (attention_mask == 0).sum(dim=1)


def check_batch(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, tensors: dict) -> None:
    """A batch speculative decoding can serve: every row left-padded (its mask zeros, then ones), and the prompt, mask
    and other tensor inputs on one device."""
    devices = {name: value.device for name, value in tensors.items() if isinstance(value, torch.Tensor)}
    if len(set(devices.values()) | {input_ids.device}) > 1:
        where = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(
            f"The batch's inputs are on different devices (input_ids on {input_ids.device}, {where}); move them to "
            "one device, e.g. `inputs.to(target.device)`."
        )
    if attention_mask is None:
        return
    mask = attention_mask.bool()
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"Rows {empty} of the attention mask are all padding; drop them from the batch.")
    unpadded_after = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1)  # a real token followed by padding
    right = (unpadded_after & ~mask[:, -1]).nonzero().flatten().tolist()
    if right:
        raise ValueError(
            f"Rows {right} are padded on the right. Batched generation needs left padding: set "
            "`tokenizer.padding_side = 'left'` before tokenizing the prompts."
        )
    holes = unpadded_after.nonzero().flatten().tolist()
    if holes:
        raise ValueError(
            f"Rows {holes} of the attention mask have padding between real tokens; speculative decoding takes "
            "left-padded rows only (zeros, then ones). Tokenize the prompts with `padding_side='left'`."
        )
