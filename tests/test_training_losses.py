"""Decayed cross-entropy, KL only on the first two slots, and the two teacher distributions."""

import math

import pytest
import torch

from hf_hyperdflash.modeling.target_deepseek_v4 import DeepseekV4Target
from hf_hyperdflash.testing import tiny_deepseek_v4
from hf_hyperdflash.training.collator import IGNORE_INDEX
from hf_hyperdflash.training.losses import LossConfig, block_losses, position_weights, teacher_logits

VOCAB = 11


@pytest.fixture(scope="module")
def target():
    model = tiny_deepseek_v4(seed=0)
    with torch.no_grad():  # give the gate a real, input-dependent shape so the two teachers differ
        model.model.hc_head.hc_fn.normal_(std=0.5)
        model.model.hc_head.hc_base.normal_()
    return DeepseekV4Target(model)


def test_position_weights_decay_with_gamma_scaled_to_the_block():
    assert torch.allclose(position_weights(16), torch.exp(-torch.arange(15.0) / 7))
    assert torch.allclose(position_weights(8), torch.exp(-torch.arange(7.0) / (7 * 7 / 15)))
    assert torch.equal(position_weights(4, gamma=math.inf), torch.ones(3))  # exact: exp(-k / inf) = exp(-0.0) = 1


def test_cross_entropy_is_the_decay_weighted_mean_over_valid_slots():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, VOCAB, generator=generator)
    labels = torch.randint(VOCAB, (2, 3, 5), generator=generator)
    labels[1, 2] = IGNORE_INDEX
    labels[0, 1, 3:] = IGNORE_INDEX
    config = LossConfig(gamma=2.0, kl_weight=0.0)
    terms = block_losses(logits, labels, torch.zeros(2, 3, 2, VOCAB), config)

    nll = torch.nn.functional.cross_entropy(
        logits.flatten(0, 2), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    ).view(2, 3, 5)
    weights = torch.exp(-torch.arange(5.0) / 2.0).expand(2, 3, 5) * (labels != IGNORE_INDEX)
    assert terms["ce"].item() == pytest.approx(((nll * weights).sum() / weights.sum()).item(), rel=1e-5)
    assert terms["loss"].item() == pytest.approx(terms["ce"].item(), rel=1e-6), "kl_weight 0: KL only logged"
    # Uniform weights give a different value (the decay matters).
    uniform = block_losses(logits, labels, torch.zeros(2, 3, 2, VOCAB), LossConfig(gamma=math.inf))["ce"]
    assert uniform.item() != pytest.approx(terms["ce"].item(), rel=1e-3)


def test_kl_acts_on_the_first_two_slots_only(target):
    """Changing the residual that teaches slot 3 (or the drafter's slot-3 logits) leaves the KL unchanged."""
    generator = torch.Generator().manual_seed(1)
    residual = torch.randn(1, 12, target.hc_mult, target.hidden_size, generator=generator)
    anchors = torch.tensor([[4]])
    logits = torch.randn(1, 1, 5, target.vocab_size, generator=generator)
    labels = torch.randint(target.vocab_size, (1, 1, 5), generator=generator)
    config = LossConfig(kl_weight=0.5)

    def losses(residual, logits):
        with torch.no_grad():
            teacher = teacher_logits(target, residual, anchors, config.kl_positions, config.teacher)
        return block_losses(logits, labels, teacher, config)

    base = losses(residual, logits)
    assert base["kl"] > 0
    assert base["loss"].item() == pytest.approx((base["ce"] + 0.5 * base["kl"]).item(), rel=1e-6)

    later = residual.clone()
    later[:, 6] += 3.0  # position a + 2 teaches slot 3
    assert losses(later, logits)["kl"].item() == pytest.approx(base["kl"].item(), abs=1e-7)
    second = residual.clone()
    second[:, 5] += 3.0  # position a + 1 teaches slot 2
    assert losses(second, logits)["kl"].item() != pytest.approx(base["kl"].item(), abs=1e-4)

    drafted = logits.clone()
    drafted[..., 2, :] += torch.randn(target.vocab_size, generator=generator)
    changed = losses(residual, drafted)
    assert changed["kl"].item() == pytest.approx(base["kl"].item(), abs=1e-7)
    assert changed["ce"].item() != pytest.approx(base["ce"].item(), abs=1e-5)


def test_gated_teacher_is_the_targets_real_prediction_and_differs_from_mean_pool(target):
    input_ids = torch.randint(3, target.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[1, 5], [0, 7]])
    with torch.no_grad(), target.capture() as capture:
        real_logits = target.model(input_ids=input_ids).logits
        residual = capture.features()
        gated = teacher_logits(target, residual, anchors, 2, "gated")
        mean_pool = teacher_logits(target, residual, anchors, 2, "mean_pool")
    expected = torch.stack([real_logits[b, anchors[b].unsqueeze(1) + torch.arange(2)] for b in range(2)])
    assert torch.allclose(gated, expected, atol=1e-5)
    assert not torch.allclose(mean_pool, gated, atol=1e-3)
    streams_mean = target.lm_head(target.model.model.norm(residual.mean(2)))
    assert torch.allclose(mean_pool[1, 1, 1], streams_mean[1, 8], atol=1e-5)
