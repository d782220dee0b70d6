"""Train a HyperDFlash (or vanilla-DFlash) drafter against a frozen mHC target of any supported family.

Target features are computed online: every batch runs the frozen target once over the padded sequences,
capturing the final pre-collapse residual (conditioning and KL teacher) and, for `conditioning="intermediate"`,
the outputs of `target_layer_ids`; or they are read from a feature store built once (`feature_store.py`). The
drafter then drafts all sampled blocks of every sequence in one forward.
The loop is `run_training` (accelerate: multi-process, accumulation, cosine LR, clipping, bf16, resume).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ..loading import import_bitsandbytes
from ..modeling.draft_options import CONSTANT_SCHEDULE, DSPARK_DRAFTER_TYPE
from ..modeling.generation_stats import mean_accepted_length
from ..modeling.modeling_deepseek_v4_dspark import DeepseekV4DSparkForDrafting
from ..modeling.modeling_hyperdflash import HyperDFlashForDrafting, special_token_ids
from ..modeling.rank_agreement import spread_group
from ..modeling.request_checks import check_compatible
from ..modeling.strict_loading import check_drafter_path, unreachable_hub_id
from ..modeling.target_base import activation_dtype
from ..modeling.targets import get_target_adapter
from .collator import IGNORE_INDEX, BlockCollator
from .curves import plot_curves
from .dspark import DSparkWithFrozenTarget
from .feature_store import FeatureStore, StoredFeatureCollator, batch_features
from .loop import DataShards, EvalFn, LoopConfig, OptimizerFactory, adamw, run_training
from .losses import (
    LossConfig,
    acceptance_terms,
    block_losses,
    block_terms,
    l1_term,
    slot_weights,
    teacher_logits,
)
from .options import DSPARK as DSPARK_KIND
from .options import deepseek_markov_rank

# The draft layers' projections (attention and SwiGLU); the reducer, norms and mask embedding stay frozen.
LORA_TARGET_MODULES = r".*layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def optimizer_factory(name: str) -> OptimizerFactory:
    """The optimizer factory for `name`: adamw (torch) or adamw_8bit (bitsandbytes, checked now, before any work)."""
    if name == "adamw":
        return adamw
    if name == "adamw_8bit":
        bnb = import_bitsandbytes("The 8-bit optimizer (optimizer='adamw_8bit')")
        return lambda params, config: bnb.optim.AdamW8bit(
            params, lr=config.learning_rate, weight_decay=config.weight_decay
        )
    raise ValueError(f"`optimizer` must be 'adamw' or 'adamw_8bit', got {name!r}.")


def build_drafter(
    target: PreTrainedModel,
    init_from: str | Path | None = None,
    lora_rank: int = 0,
    lora_alpha: float = 16.0,
    lora_dropout: float = 0.0,
    **overrides,
) -> HyperDFlashForDrafting | DeepseekV4DSparkForDrafting | PeftModel:
    """A new drafter for `target` (config `overrides`; `kind="dspark"` for DSpark), or a saved one to fine-tune;
    with `lora_rank` > 0, the saved drafter wrapped with LoRA adapters on its draft layers' projections."""
    if init_from is None:
        if lora_rank:
            raise ValueError("LoRA fine-tunes an existing drafter: pass `init_from` (a saved drafter directory).")
        if overrides.pop("kind", None) == DSPARK_KIND:
            return new_dspark(target, **overrides)
        return HyperDFlashForDrafting.from_target(target, **overrides)
    if overrides:
        raise ValueError(
            f"Drafter settings {sorted(overrides)} only apply to a new drafter; `init_from` keeps the saved config."
        )
    check_drafter_path(init_from)
    try:
        is_dspark = PretrainedConfig.get_config_dict(init_from)[0].get("model_type") == DSPARK_DRAFTER_TYPE
    except OSError as error:  # a Hub id (or a relative path shaped like one) that could not be fetched
        raise unreachable_hub_id(init_from, error) from error
    if is_dspark and lora_rank:
        raise ValueError("LoRA fine-tuning covers HyperDFlash and vanilla DFlash drafters; fine-tune DSpark fully.")
    drafter_class = DeepseekV4DSparkForDrafting if is_dspark else HyperDFlashForDrafting
    drafter = drafter_class.from_pretrained(init_from, dtype=torch.float32)
    adapter = get_target_adapter(target)
    check_compatible(adapter, drafter)
    if is_dspark:
        return drafter
    drafter.config.update(special_token_ids(adapter.config))  # a drafter saved before configs carried them
    if not lora_rank:
        return drafter
    config = LoraConfig(
        r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=LORA_TARGET_MODULES
    )
    return get_peft_model(drafter, config)


def without_markov_bias(drafter: HyperDFlashForDrafting) -> HyperDFlashForDrafting:
    """The heads with the Markov bias off: `markov_w2` zero and frozen, so drafts get no bias from the previous token
    in training or decoding, while the confidence head still reads its embedding (an ablation of the two heads)."""
    if not drafter.config.markov_rank:
        raise ValueError("The Markov bias is one of DSpark's heads: pass --markov-rank > 0 with --no-markov-bias.")
    with torch.no_grad():
        drafter.markov_w2.weight.zero_()
    drafter.markov_w2.weight.requires_grad_(False)
    return drafter


def new_dspark(target: PreTrainedModel, **dspark) -> DeepseekV4DSparkForDrafting:
    """An untrained DSpark for `target` whose noise token is the target's padding token, and whose Markov rank is
    DeepSeek's ratio to the hidden size (256 at 4096) unless `dspark` sets them."""
    config = target.config.get_text_config()
    dspark.setdefault("dspark_noise_token_id", config.pad_token_id or 0)
    dspark.setdefault("dspark_markov_rank", deepseek_markov_rank(config.hidden_size))
    return DeepseekV4DSparkForDrafting.from_target(target, **dspark)


def merge_lora(drafter: HyperDFlashForDrafting | PeftModel) -> HyperDFlashForDrafting:
    """A plain drafter: LoRA adapters folded into the weights, so it saves and loads like any drafter."""
    return drafter.merge_and_unload() if isinstance(drafter, PeftModel) else drafter


def _plain_copy(trained: nn.Module) -> PreTrainedModel:
    """The drafter inside `trained` (a drafter next to its frozen target) as it stands, LoRA merged into a copy so
    that training goes on with its adapters."""
    drafter = trained.drafter
    return merge_lora(copy.deepcopy(drafter)) if isinstance(drafter, PeftModel) else drafter


def _draft_model(drafter: HyperDFlashForDrafting | PeftModel) -> HyperDFlashForDrafting:
    """The drafter module `generate` calls (under LoRA, the base model with adapters injected)."""
    return drafter.get_base_model() if isinstance(drafter, PeftModel) else drafter


class DrafterWithFrozenTarget(nn.Module):
    """The trainable drafter next to a frozen target; `forward` returns the loss terms of one batch.

    The target is held by its adapter, not as a submodule, so it stays out of the optimiser, the checkpoint
    and DistributedDataParallel.
    """

    def __init__(self, drafter: HyperDFlashForDrafting | PeftModel, target: PreTrainedModel, losses: LossConfig):
        super().__init__()
        self.drafter = drafter
        self.target = get_target_adapter(target)
        self.losses = losses
        config = drafter.config
        self.layer_ids = list(config.target_layer_ids) if config.conditioning == "intermediate" else None
        self.with_heads = config.markov_rank > 0
        if self.with_heads and not losses.confidence_weight:  # the Markov bias alone: the confidence head untouched
            _draft_model(drafter).confidence_head.requires_grad_(False)
        # The target's real logits at every slot: the confidence head's label, the L1 term's teacher, the argmax labels
        self.every_slot = self.with_heads or losses.l1_weight > 0 or losses.ce_label == "argmax"

    @torch.no_grad()
    def _target_pass(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        anchor_positions: torch.LongTensor,
        residual: torch.Tensor | None = None,
        layers: torch.Tensor | None = None,
    ):
        """Conditioning features, KL teacher logits, every-slot logits and anchor embeddings. The final pre-collapse
        residual (and the conditioning layers' outputs) come from the feature store where the batch carries them
        (`residual`, `layers`), else from one frozen target forward (`feature_store.batch_features`)."""
        residual, features = batch_features(self.target, input_ids, attention_mask, self.layer_ids, residual, layers)
        kl_positions, kind = self.losses.kl_positions, self.losses.teacher
        teacher = teacher_logits(self.target, residual, anchor_positions, kl_positions, kind)
        every_slot = None
        if self.every_slot:
            drafted = self.drafter.config.block_size - 1
            every_slot = teacher_logits(self.target, residual, anchor_positions, drafted, "gated")
        return features, teacher, every_slot, self.target.embed_tokens(input_ids.gather(1, anchor_positions))

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        anchor_positions: torch.LongTensor,
        labels: torch.LongTensor,
        target_residual: torch.Tensor | None = None,
        target_layers: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The batch's loss terms; `target_residual` and `target_layers`: the target's stored tensors of the batch
        (`feature_store.StoredFeatureCollator`), in place of a target forward."""
        features, teacher, every_slot, anchor_embeds = self._target_pass(
            input_ids, attention_mask, anchor_positions, target_residual, target_layers
        )
        batch, length = input_ids.shape
        out = self.drafter(  # positions by column: a row's left padding shifts them all alike (RoPE is relative)
            anchor_embeds=anchor_embeds,
            target_hidden=features,
            context_position_ids=torch.arange(length, device=input_ids.device).expand(batch, length),
            anchor_position_ids=anchor_positions,
            context_mask=attention_mask,
        )
        blocks = anchor_positions.shape[1]
        drafted = out.last_hidden_state.unflatten(1, (blocks, -1))[:, :, 1:]  # slot 0 is the anchor
        lm_head = self.target.lm_head
        logits = lm_head(drafted.to(activation_dtype(lm_head, drafted.dtype)))
        if every_slot is None:
            return block_losses(logits, labels, teacher, self.losses)
        weights = slot_weights(labels, self.losses.gamma)
        ce_labels = labels
        if self.losses.ce_label == "argmax":
            ce_labels = torch.where(labels == IGNORE_INDEX, labels, every_slot.argmax(dim=-1))
        if not self.with_heads:
            log_q = logits.float().log_softmax(dim=-1)
            terms = block_terms(log_q, ce_labels, teacher, self.losses) | {"l1": l1_term(log_q, every_slot, weights)}
            return terms | {"loss": terms["loss"] + self.losses.l1_weight * terms["l1"]}
        # DSpark's heads: the Markov bias of each slot's previous token (teacher-forced) and the confidence loss
        anchors = input_ids.gather(1, anchor_positions)
        previous = torch.cat([anchors.unsqueeze(-1), labels[..., :-1].clamp(min=0)], dim=-1)
        drafter = _draft_model(self.drafter)
        bias, markov_embedding = drafter.markov(previous)
        log_q = (logits + bias).float().log_softmax(dim=-1)
        terms = block_terms(log_q, ce_labels, teacher, self.losses)
        residual = out.residual.unflatten(1, (blocks, -1))[:, :, 1:]
        confidence_logits = drafter.confidence_logit(residual, markov_embedding)
        heads = acceptance_terms(log_q, every_slot, confidence_logits, weights)
        extra = self.losses.l1_weight * heads["l1"] + self.losses.confidence_weight * heads["confidence"]
        return terms | heads | {"loss": terms["loss"] + extra}


def _batch_losses(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return model(**{name: value for name, value in batch.items() if name != "num_tokens"})


def tau_evaluator(target: PreTrainedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> EvalFn:
    """Greedy tau (mean accepted length with the bonus token, pooled over all verify steps) on `prompts`,
    measured through the real `target.generate(..., assistant_model=drafter)` path, every step verifying a whole
    block (the "constant" schedule: the adaptive default would skip the steps of a drafter still learning)."""

    def evaluate(model: DrafterWithFrozenTarget) -> dict[str, float]:
        drafter = _draft_model(model.drafter)
        device = target.get_input_embeddings().weight.device
        config = drafter.generation_config
        schedule, config.num_assistant_tokens_schedule = config.num_assistant_tokens_schedule, CONSTANT_SCHEDULE
        accepted_per_step = []
        try:
            for prompt in prompts:
                input_ids = torch.tensor([list(prompt)], device=device)
                target.generate(input_ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
                accepted_per_step += drafter.last_generation_stats.accepted_per_step
        finally:
            config.num_assistant_tokens_schedule = schedule
        return {"tau": mean_accepted_length(accepted_per_step)}

    return evaluate


def train_drafter(
    drafter: HyperDFlashForDrafting | PeftModel,
    target: PreTrainedModel,
    examples: Sequence[dict[str, torch.Tensor]],
    run_dir: str | Path,
    loop: LoopConfig,
    losses: LossConfig | None = None,
    anchors_per_sequence: int = 16,
    eval_prompts: Sequence[Sequence[int]] = (),
    eval_max_new_tokens: int = 64,
    make_optimizer: OptimizerFactory = adamw,
    accelerator: Accelerator | None = None,
    on_checkpoint: Callable[[int], None] | None = None,
    shards: DataShards | None = None,
    left_padding: tuple[float, int] = (0.0, 0),
    feature_store: str | Path | None = None,
    on_cycle_end: Callable[[PreTrainedModel, int], None] | None = None,
) -> HyperDFlashForDrafting:
    """Train `drafter` on `examples` (from `load_examples`) and return it as a plain drafter (LoRA merged). A DSpark
    drafter trains with DeepSpec's objective (`dspark.py`; `losses` is HyperDFlash's). `left_padding` (share, most):
    that share of the sequences is left-padded by up to `most` tokens, as batched generate() pads prompts
    (`left_padding.py`).

    `target` must sit on the accelerator's device, or be spread over the processes by transformers' parallel plans
    (`hf_hyperdflash.distributed.load_spread_target`; `shards` then gives each group of processes its share of the
    data, and every process takes part in the tau evaluation). `run_dir` receives the checkpoint (resumed
    automatically), `log.jsonl` (every loss term, accuracies, lr, throughput, and `tau` on `eval_prompts` every
    `loop.eval_every` steps; also sent to the accelerator's trackers) and `curves.png`.

    `feature_store`: a store built from `examples` with this target (`feature_store.build_feature_store`), read in
    place of the target's forward (its collapse, norm and `lm_head` still derive the teachers from the stored
    residual); the losses are those of online training.

    `on_cycle_end(drafter, step)`: with warm restarts (`loop.cycle_steps`), the drafter as it stands at the end of
    each cycle but the last (a plain drafter: LoRA merged into a copy).
    """
    losses = losses or LossConfig()
    if isinstance(_draft_model(drafter), DeepseekV4DSparkForDrafting):  # DeepSpec's objective (`dspark.py`)
        block_size, module = drafter.config.dspark_block_size + 1, DSparkWithFrozenTarget(drafter, target)
    else:
        block_size, module = drafter.config.block_size, DrafterWithFrozenTarget(drafter, target, losses)
        if losses.kl_positions > block_size - 1:
            raise ValueError(f"`kl_positions` ({losses.kl_positions}) exceeds the {block_size - 1} drafted slots.")
    pad_token_id = target.config.get_text_config().pad_token_id
    pad_token_id = pad_token_id if pad_token_id is not None else 0
    collate = BlockCollator(block_size, anchors_per_sequence, pad_token_id, loop.seed, left_padding)
    if feature_store is not None:
        store = FeatureStore(feature_store)
        store.check(module.target, module.layer_ids)
        store.check_covers(examples)
        collate = StoredFeatureCollator(collate, store, module.layer_ids)
    module = run_training(
        module,
        examples,
        collate,
        _batch_losses,
        run_dir,
        loop,
        accelerator=accelerator,
        description="drafter",
        on_checkpoint=on_checkpoint,
        evaluate=tau_evaluator(target, eval_prompts, eval_max_new_tokens) if eval_prompts else None,
        make_optimizer=make_optimizer,
        shards=shards,
        evaluate_on_every_rank=spread_group(target) is not None,
        on_cycle_end=None if on_cycle_end is None else lambda trained, step: on_cycle_end(_plain_copy(trained), step),
    )
    if PartialState().is_main_process:
        plot_curves({"drafter": Path(run_dir) / "log.jsonl"}, Path(run_dir) / "curves.png", title="drafter training")
    return merge_lora(module.drafter)
