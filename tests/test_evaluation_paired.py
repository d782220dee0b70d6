"""Paired tau ratios: the pooled ratio, its bootstrap interval over prompts, and the checks on what is compared."""

import math

import pytest

from hf_hyperdflash.evaluation.paired import (
    default_tau_ratio_pairs,
    paired_speed_ratio,
    paired_tau_ratio,
    pooled,
    schedule_pairs,
)
from hf_hyperdflash.evaluation.runner import MethodResult


def _method(name: str, accepted: list[int], steps: list[int]) -> MethodResult:
    result = MethodResult(name=name, prompts=len(steps))
    result.runs = [{"accepted_drafts": a, "verify_steps": s} for a, s in zip(accepted, steps, strict=True)]
    return result


def test_the_ratio_pools_prompts_like_tau():
    fast = _method("fast", [30, 5, 12], [10, 5, 4])  # tau (47 + 19) / 19
    slow = _method("slow", [10, 2, 6], [10, 5, 4])  # tau (18 + 19) / 19
    ratio = paired_tau_ratio(fast, slow)
    assert ratio.ratio == pytest.approx(66 / 37)
    assert ratio.low <= ratio.ratio <= ratio.high and ratio.prompts == 3 and ratio.confidence == 0.95
    assert ratio.label == "fast / slow"


def test_pairing_removes_the_spread_both_methods_share():
    # Prompts range from easy to hard, but on each one `a` accepts exactly 1.5x what `b` accepts per step.
    steps = [10, 12, 8, 10, 11, 9]
    per_step_b = [0.5, 3.0, 1.0, 5.0, 2.0, 0.2]
    b = _method("b", [round(p * s, 6) for p, s in zip(per_step_b, steps, strict=True)], steps)
    a = _method("a", [round((1.5 * (p + 1) - 1) * s, 6) for p, s in zip(per_step_b, steps, strict=True)], steps)
    ratio = paired_tau_ratio(a, b)
    assert ratio.ratio == pytest.approx(1.5)
    assert ratio.low == pytest.approx(1.5) and ratio.high == pytest.approx(1.5)


def test_a_mixed_comparison_gets_an_interval_around_one():
    a = _method("a", [20, 5, 18, 6, 15, 7, 19, 4], [10] * 8)
    b = _method("b", [6, 18, 5, 20, 7, 16, 5, 17], [10] * 8)
    ratio = paired_tau_ratio(a, b, seed=3)
    assert ratio.low < 1 < ratio.high and ratio.high - ratio.low > 0.2
    assert paired_tau_ratio(a, b, seed=3) == ratio  # seeded


def test_one_prompt_has_a_ratio_but_no_interval():
    ratio = paired_tau_ratio(_method("a", [6], [2]), _method("b", [2], [2]))
    assert ratio.ratio == 2.0 and math.isnan(ratio.low) and math.isnan(ratio.high)


def test_a_prompt_without_verify_steps_counts_for_nothing():
    """A one-token reply has no verify step; it adds nothing to either sum, and the interval still exists (only a
    resample made of such prompts alone would have no tau; with 12 prompts that never happens in practice)."""
    steps = [3, 2, 3] * 3 + [3, 2]
    a = _method("a", [0, *[9, 4, 6] * 3, 9, 4], [0, *steps])  # the first prompt: no verify step
    b = _method("b", [1, *steps], [1, *steps])  # tau 2 on every prompt
    with_empty = paired_tau_ratio(a, b)
    assert with_empty.prompts == 12
    assert with_empty.ratio == pytest.approx((70 + 29) / 29 / 2)
    assert with_empty.low <= with_empty.ratio <= with_empty.high


def test_undefined_ratios_are_nan_and_different_prompts_are_refused():
    plain = paired_tau_ratio(_method("a", [4, 4], [2, 2]), _method("plain", [0, 0], [0, 0]))
    assert math.isnan(plain.ratio) and math.isnan(plain.low)
    with pytest.raises(ValueError, match="same prompts"):
        paired_tau_ratio(_method("a", [4, 4], [2, 2]), _method("b", [4], [2]))


def test_pooled_seeds_add_up_per_prompt_and_are_resampled_together():
    """Two seeds of a recipe as one side: tau over both seeds' steps; a prompt is resampled with all its seeds."""
    seed_0 = _method("a_s0", [20, 5, 18, 6], [10, 10, 10, 10])
    seed_1 = _method("a_s1", [10, 15, 8, 16], [10, 10, 10, 10])  # good where seed 0 is bad, and vice versa
    both = pooled([seed_0, seed_1])
    assert both.name == "a_s0+a_s1" and both.prompts == 4
    assert [run["accepted_drafts"] for run in both.runs] == [30, 20, 26, 22]
    assert pooled([seed_0]) is seed_0
    reference = _method("b", [10, 10, 10, 10], [10, 10, 10, 10])
    ratio = paired_tau_ratio(both, pooled([reference]))
    assert ratio.ratio == pytest.approx((98 + 80) / 80 / 2)
    assert ratio.label == "a_s0+a_s1 / b"
    # Per prompt the seeds cancel out, so pooling shrinks the interval far below either seed's own.
    alone = paired_tau_ratio(seed_0, reference)
    assert ratio.high - ratio.low < (alone.high - alone.low) / 2
    with pytest.raises(ValueError, match="different numbers of prompts"):
        pooled([seed_0, _method("short", [1], [1])])


def test_default_pairs_put_hyperdflash_over_every_other_speculative_method():
    names = ["plain", "mtp-k1", "vanilla_dflash", "hyperdflash"]
    assert default_tau_ratio_pairs(names) == [("hyperdflash", "mtp-k1"), ("hyperdflash", "vanilla_dflash")]
    assert default_tau_ratio_pairs(["plain", "mtp-k1"]) == []


def _speeds(name: str, speed_ratios: list[float]) -> MethodResult:
    result = MethodResult(name=name, prompts=len(speed_ratios))
    result.speed_ratios = speed_ratios
    return result


def test_the_speed_ratio_is_the_median_of_per_prompt_ratios_and_pairing_removes_shared_noise():
    # Every prompt is 2% faster under `a`, while the machine moves both by -30% .. +30% from prompt to prompt
    machine = [0.7, 1.3, 0.9, 1.1, 1.0, 0.8, 1.2, 0.95]
    a = _speeds("a", [1.02 * m for m in machine])
    b = _speeds("b", machine)
    ratio = paired_speed_ratio(a, b)
    assert (ratio.ratio, ratio.low, ratio.high) == pytest.approx((1.02, 1.02, 1.02))
    noisy = paired_speed_ratio(_speeds("c", [1.1, 0.9, 1.05, 0.97, 1.0, 1.02]), _speeds("d", [1.0] * 6), seed=1)
    assert noisy.ratio == pytest.approx(1.01) and noisy.low < 1.0 < noisy.high and noisy.prompts == 6
    with pytest.raises(ValueError, match="same prompts"):
        paired_speed_ratio(_speeds("a", [1.0, 1.0]), _speeds("b", [1.0]))


def test_schedule_pairs_put_each_drafters_default_schedule_over_its_others():
    names = ["plain", "mtp-k1", "hyperdflash", "mtp-k1-constant", "hyperdflash-heuristic", "hyperdflash-constant"]
    names += ["untrained-constant"]  # no default-schedule run to compare with
    assert schedule_pairs(names) == [
        ("mtp-k1", "mtp-k1-constant"),
        ("hyperdflash", "hyperdflash-heuristic"),
        ("hyperdflash", "hyperdflash-constant"),
    ]
