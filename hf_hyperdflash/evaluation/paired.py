"""How sure a tau comparison is: the ratio of two methods' tau on the same prompts, with a bootstrap interval.

tau pools every verify step of a run, so it is a ratio of sums over prompts (long replies weigh more). The
interval resamples whole prompts, both methods together: the statistic keeps its pooling, and the pairing removes
the prompt-to-prompt spread that both methods share (an easy prompt is easy for every drafter), which is most of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import bootstrap

from .runner import MethodResult


@dataclass(frozen=True)
class TauRatio:
    numerator: str
    denominator: str
    ratio: float
    low: float  # NaN with fewer than two prompts
    high: float
    confidence: float
    prompts: int

    @property
    def label(self) -> str:
        return f"{self.numerator} / {self.denominator}"


def _per_prompt(result: MethodResult) -> tuple[np.ndarray, np.ndarray]:
    """(drafts accepted, verify steps) per prompt, over all repeats."""
    accepted = np.array([run["accepted_drafts"] for run in result.runs], dtype=np.float64)
    steps = np.array([run["verify_steps"] for run in result.runs], dtype=np.float64)
    if not len(steps) or (steps == 0).any():
        raise ValueError(
            f"{result.name!r} has prompts without verify steps (plain decoding, or replies of one token); tau "
            "ratios compare speculative methods, each with at least one verify step per prompt."
        )
    return accepted, steps


def _tau_ratio(accepted_a, steps_a, accepted_b, steps_b, axis=-1):
    tau_a = (accepted_a.sum(axis) + steps_a.sum(axis)) / steps_a.sum(axis)
    tau_b = (accepted_b.sum(axis) + steps_b.sum(axis)) / steps_b.sum(axis)
    return tau_a / tau_b


def paired_tau_ratio(
    numerator: MethodResult,
    denominator: MethodResult,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> TauRatio:
    """tau(numerator) / tau(denominator) and its percentile bootstrap interval over prompts (paired)."""
    samples = (*_per_prompt(numerator), *_per_prompt(denominator))
    prompts = len(samples[0])
    if len(samples[2]) != prompts:
        raise ValueError(
            f"{numerator.name!r} ran {prompts} prompts and {denominator.name!r} {len(samples[2])}; a paired ratio "
            "needs both methods on the same prompts (one `run_methods` call)."
        )
    ratio = float(_tau_ratio(*samples))
    low = high = math.nan
    if prompts >= 2:
        interval = bootstrap(
            samples,
            _tau_ratio,
            paired=True,
            vectorized=True,
            confidence_level=confidence,
            n_resamples=resamples,
            method="percentile",
            rng=np.random.default_rng(seed),
        ).confidence_interval
        low, high = float(interval.low), float(interval.high)
    return TauRatio(numerator.name, denominator.name, ratio, low, high, confidence, prompts)


def default_tau_ratio_pairs(method_names: list[str], candidate: str = "hyperdflash") -> list[tuple[str, str]]:
    """`candidate` over every other speculative method (all but the first, plain decoding), if it is present."""
    if candidate not in method_names:
        return []
    return [(candidate, name) for name in method_names[1:] if name != candidate]
