"""Training DSpark (DeepSeek's V4 block drafter) against a frozen target, with DeepSpec's objective.

Per block of K rows after anchor `a` (row k predicts token a + k + 1, the label of slot k + 1 of a `BlockCollator`
block of K + 1), with weights `exp(-k / decay)` (DeepSpec's `loss_decay_gamma`, 4):

    loss = 0.1 * CE(draft, label) + 0.9 * L1(draft, target) + 1.0 * BCE(confidence, 1 - L1 / 2)

where the draft distribution carries the Markov bias of the row's previous token, teacher-forced (the anchor, then
the labels), L1 is the distance between the draft's and the target's next-token distributions (the target's real
logits at position a + k) and the confidence head learns that distance's acceptance rate, detached. Weights and
decay are DeepSpec's defaults (`deepseek-ai/DeepSpec`, `deepspec/modeling/dspark/loss.py`, `config/dspark/`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from ..modeling.modeling_deepseek_v4_dspark import DeepseekV4DSparkForDrafting
from ..modeling.modeling_hyperdflash import block_attention_mask
from ..modeling.target_base import activation_dtype
from ..modeling.targets import get_target_adapter
from .collator import IGNORE_INDEX
from .feature_store import batch_features
from .losses import acceptance_terms, accuracy_terms, teacher_logits

LOSS_WEIGHTS = {"ce": 0.1, "l1": 0.9, "confidence": 1.0}
DECAY = 4.0


def dspark_losses(
    logits: torch.Tensor, labels: torch.LongTensor, teacher: torch.Tensor, confidence_logits: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Loss terms of draft `logits` [batch, blocks, K, vocab] (Markov bias included), `labels` [.., K], the target's
    `teacher` logits [.., K, vocab] and the confidence head's logits [.., K]."""
    valid = labels != IGNORE_INDEX
    weights = torch.exp(-torch.arange(labels.shape[-1], device=labels.device) / DECAY) * valid
    total = weights.sum().clamp(min=1e-8)
    log_q = logits.float().log_softmax(dim=-1)
    nll = -log_q.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    terms = {"ce": (nll * weights).sum() / total} | acceptance_terms(log_q, teacher, confidence_logits, weights)
    terms["loss"] = sum(LOSS_WEIGHTS[name] * terms[name] for name in LOSS_WEIGHTS)
    return terms | accuracy_terms(log_q, labels, valid)


class DSparkWithFrozenTarget(nn.Module):
    """The trainable DSpark drafter next to a frozen V4 target; `forward` returns the loss terms of one batch (the
    `DrafterWithFrozenTarget` contract, so `run_training` drives it)."""

    def __init__(self, drafter: DeepseekV4DSparkForDrafting, target: PreTrainedModel):
        super().__init__()
        self.drafter = drafter
        self.target = get_target_adapter(target)
        self.layer_ids = list(drafter.config.dspark_target_layer_ids)

    @torch.no_grad()
    def _target_pass(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        anchor_positions: torch.LongTensor,
        residual: torch.Tensor | None = None,
        layers: torch.Tensor | None = None,
    ):
        """The tapped layers' outputs and the target's logits at each block row's position (a + k), from the feature
        store where the batch carries them (`residual`, `layers`), else from one frozen target forward
        (`feature_store.batch_features`)."""
        residual, layers = batch_features(self.target, input_ids, attention_mask, self.layer_ids, residual, layers)
        rows = self.drafter.config.dspark_block_size
        return layers, teacher_logits(self.target, residual, anchor_positions, rows, kind="gated")

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
        config, drafter = self.drafter.config, self.drafter
        rows = config.dspark_block_size
        features, teacher = self._target_pass(
            input_ids, attention_mask, anchor_positions, target_residual, target_layers
        )
        batch, length = input_ids.shape
        anchors = input_ids.gather(1, anchor_positions)
        noise = anchors.new_full((*anchors.shape, rows - 1), config.dspark_noise_token_id)
        block_ids = torch.cat([anchors.unsqueeze(-1), noise], dim=-1).flatten(1)
        offsets = torch.arange(rows, device=input_ids.device)
        block_positions = (anchor_positions.unsqueeze(-1) + offsets).flatten(1)
        # Block n sees the context before its anchor, within the window, and the real tokens only; positions by
        # column (a row's left padding shifts them all alike, and RoPE is relative)
        context = torch.arange(length, device=input_ids.device)
        before = context < anchor_positions.unsqueeze(-1)
        visible = before & (context >= anchor_positions.unsqueeze(-1) - config.sliding_window)
        visible &= attention_mask.bool().unsqueeze(1)
        embeds = self.target.embed_tokens(block_ids)
        dtype = activation_dtype(drafter.main_proj, embeds.dtype)
        out = drafter(
            block_embeds=embeds.to(dtype),
            block_position_ids=block_positions,
            context_features=features.to(dtype),
            context_position_ids=context.expand(batch, length),
            attention_mask=block_attention_mask(visible, rows, dtype),
        )
        hidden = out.residual.unflatten(1, (anchors.shape[1], rows))
        lm_head = self.target.lm_head
        normed = out.last_hidden_state.unflatten(1, (anchors.shape[1], rows))
        logits = lm_head(normed.to(activation_dtype(lm_head, normed.dtype))).float()
        previous = torch.cat([anchors.unsqueeze(-1), labels[..., :-1].clamp(min=0)], dim=-1)  # teacher-forced
        bias, markov_embedding = drafter.markov(previous)
        return dspark_losses(logits + bias, labels, teacher, drafter.confidence_logit(hidden, markov_embedding))
