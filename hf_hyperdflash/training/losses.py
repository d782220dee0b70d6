"""Drafter objective: position-decayed cross-entropy plus a targeted KL to the target's LM head.

Cross-entropy weights block slot k (k = 1..B-1) by `exp(-(k - 1) / gamma)`: early slots decide how much of a
block is accepted. DFlash uses gamma = 7 for B = 16; we keep the decay per *fraction* of the block fixed,
gamma = 7 * (B - 1) / 15, so other block sizes get the same shape.

The KL term, KL(teacher || drafter), acts only on the first `kl_positions` (2) slots. Slot k of anchor a
predicts token a + k, which the target predicts at position a + k - 1; from k = 3 on that teacher has seen
ground-truth tokens the drafter only sees as masks, so distilling there pulls in conflicting directions.
The teacher is `lm_head(norm(mean over mHC streams))` (the paper's choice) or `lm_head(norm(hc_head(.)))`,
the target's real, gated output.

The acceptance-aligned term (`l1_weight` > 0) is DSpark's: at every slot, the L1 distance between the draft's and the
target's real next-token distributions, weighted by the same slot decay. A sampled draft is accepted with probability
1 - L1 / 2 (speculative sampling's acceptance is one minus the total variation), so this is the quantity sampled
decoding pays for; unlike the KL it does not conflict at later slots, since it compares against the target's
distribution given the block's real earlier tokens, which is what verification conditions on once those were accepted.

The cross-entropy's label at a slot is the reply's token (`ce_label="reply"`), or the target's most likely token after
the reply so far (`"argmax"`): the token greedy verification accepts there. On greedy replies the two agree (up to
the padding V4's compressors saw while the replies were generated in batches); on sampled replies "argmax" keeps the
CE aligned with greedy decoding while the contexts, and the L1 term, follow the sampled distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..modeling.target_base import HyperConnectionTarget
from .collator import IGNORE_INDEX
from .options import CE_LABELS, TEACHERS  # the choices, defined where --help can read them without torch


@dataclass
class LossConfig:
    gamma: float | None = None  # slot decay; None = 7 * (block_size - 1) / 15, math.inf = uniform
    kl_weight: float = 0.1  # alpha; 0 keeps the KL as a logged diagnostic only
    kl_positions: int = 2  # slots k = 1..kl_positions get the KL term
    teacher: str = "mean_pool"  # "mean_pool" (paper) | "gated" (the target's real logits)
    l1_weight: float = 0.0  # the acceptance-aligned L1 term at every slot; 0 logs it only where it is computed
    confidence_weight: float = 1.0  # DSpark's confidence head's BCE, for drafters with the heads
    ce_label: str = "reply"  # "reply" | "argmax" (the target's greedy token at each slot)

    def __post_init__(self):
        if self.teacher not in TEACHERS:
            raise ValueError(f"`teacher` must be one of {TEACHERS}, got {self.teacher!r}.")
        if self.ce_label not in CE_LABELS:
            raise ValueError(f"`ce_label` must be one of {CE_LABELS}, got {self.ce_label!r}.")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"`gamma` must be > 0 (math.inf for uniform weights), got {self.gamma!r}.")
        if self.kl_weight < 0 or self.kl_positions < 1:
            raise ValueError(f"Need kl_weight >= 0 and kl_positions >= 1, got {self.kl_weight}, {self.kl_positions}.")
        if self.l1_weight < 0 or self.confidence_weight < 0:
            raise ValueError(
                f"Need l1_weight >= 0 and confidence_weight >= 0, got {self.l1_weight}, {self.confidence_weight}."
            )


def default_gamma(block_size: int) -> float:
    return 7.0 * (block_size - 1) / 15


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[block_size - 1]: exp(-(k - 1) / gamma) for slots k = 1..block_size-1."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def teacher_logits(
    target: HyperConnectionTarget,
    residual: torch.Tensor,
    anchor_positions: torch.LongTensor,
    num_positions: int,
    kind: str = "mean_pool",
) -> torch.Tensor:
    """[batch, anchors, num_positions, vocab]: the target's prediction for slots 1..num_positions of each block.

    `residual` is the final pre-collapse residual `[batch, seq, hc_mult, hidden]`; slot k reads position
    a + k - 1 (clamped to the sequence; such slots have no label and are ignored by the loss).
    """
    batch, length = residual.shape[:2]
    positions = (anchor_positions.unsqueeze(-1) + torch.arange(num_positions, device=residual.device)).clamp(
        max=length - 1
    )
    picked = residual[torch.arange(batch, device=residual.device)[:, None], positions.flatten(1)]
    collapsed = picked.mean(dim=2) if kind == "mean_pool" else target.collapse(picked)
    logits = target.lm_head(target.final_norm(collapsed))
    return logits.unflatten(1, positions.shape[1:])


def slot_weights(labels: torch.LongTensor, gamma: float | None) -> torch.Tensor:
    """`position_weights` of each labelled slot of `labels` [.., B-1]; 0 where a slot has no label."""
    return position_weights(labels.shape[-1] + 1, gamma).to(labels.device) * (labels != IGNORE_INDEX)


def block_losses(
    logits: torch.Tensor, labels: torch.LongTensor, teacher: torch.Tensor, config: LossConfig
) -> dict[str, torch.Tensor]:
    """Loss terms and accuracies of drafter `logits` [batch, anchors, B-1, vocab] against `labels` [.., B-1]."""
    return block_terms(logits.float().log_softmax(dim=-1), labels, teacher, config)


def block_terms(
    log_q: torch.Tensor, labels: torch.LongTensor, teacher: torch.Tensor, config: LossConfig
) -> dict[str, torch.Tensor]:
    """`block_losses` from the drafter's log-probabilities `log_q` (fp32).

    `teacher` [batch, anchors, kl_positions, vocab] holds the teacher logits of the first slots. Returns
    "loss" (optimised), "ce", "kl" and `accuracy_terms`.
    """
    valid = labels != IGNORE_INDEX
    nll = -log_q.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    weights = slot_weights(labels, config.gamma)
    ce = (nll * weights).sum() / weights.sum().clamp(min=1e-8)

    kl_valid = valid[..., : config.kl_positions]
    log_p = teacher.float().log_softmax(dim=-1)
    kl_per_slot = F.kl_div(log_q[..., : config.kl_positions, :], log_p, log_target=True, reduction="none").sum(-1)
    kl = (kl_per_slot * kl_valid).sum() / kl_valid.sum().clamp(min=1)

    return {"loss": ce + config.kl_weight * kl, "ce": ce, "kl": kl} | accuracy_terms(log_q, labels, valid)


def accuracy_terms(log_q: torch.Tensor, labels: torch.LongTensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """ "acc" (all slots), "acc_1", "acc_2" and "tau_forced": the accepted length (with the bonus token) each block
    would get if its labels were the target's greedy continuation, which they are for greedy-generated data."""
    hits = (log_q.argmax(dim=-1) == labels) & valid
    blocks = valid[..., 0]
    leading_hits = hits.long().cumprod(dim=-1).sum(dim=-1)
    terms = {
        "acc": hits.sum() / valid.sum().clamp(min=1),
        "tau_forced": 1 + (leading_hits * blocks).sum() / blocks.sum().clamp(min=1),
    }
    for k in range(1, min(2, labels.shape[-1]) + 1):
        terms[f"acc_{k}"] = hits[..., k - 1].sum() / valid[..., k - 1].sum().clamp(min=1)
    return terms


def distribution_l1(log_q: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per slot, the L1 distance between the draft's (`log_q`) and the target's (`teacher` logits) next-token
    distributions: twice the total variation, so a sampled draft is accepted with probability 1 - L1 / 2."""
    return (log_q.exp() - teacher.float().softmax(dim=-1)).abs().sum(dim=-1)


def l1_term(log_q: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`distribution_l1`'s mean over slots, weighted by `weights` (the slot decay, 0 on unlabelled slots)."""
    return (distribution_l1(log_q, teacher) * weights).sum() / weights.sum().clamp(min=1e-8)


def acceptance_terms(
    log_q: torch.Tensor, teacher: torch.Tensor, confidence_logits: torch.Tensor, weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    """DSpark's distribution terms, weighted means over slots: "l1" (`l1_term`) and "confidence", the BCE of the
    confidence head's logits against the acceptance rate that distance gives (1 - L1 / 2, detached)."""
    total = weights.sum().clamp(min=1e-8)
    l1 = distribution_l1(log_q, teacher)
    acceptance = (1 - l1 / 2).detach().clamp(0, 1)
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), acceptance, reduction="none")
    return {"l1": (l1 * weights).sum() / total, "confidence": (bce * weights).sum() / total}
