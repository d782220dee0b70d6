"""How sure a comparison is: the ratio of two methods' tau, or of their speed, on the same prompts, with a bootstrap
interval.

tau pools every verify step of a run, so it is a ratio of sums over prompts (long replies weigh more). The
interval resamples whole prompts, both methods together: the statistic keeps its pooling, and the pairing removes
the prompt-to-prompt spread that both methods share (an easy prompt is easy for every drafter), which is most of it.
The interval covers prompt noise only, not the seed-to-seed spread of training a drafter again. To compare recipes
rather than single training runs, pool the drafters of several seeds into one side (`pooled`): their verify steps
add up per prompt, and a resampled prompt brings all of its seeds along.

Speed is compared between draft schedules of one drafter (`schedule_pairs`): the median over prompts of the
per-prompt ratio of their speedups over plain decoding. Timings on a shared machine scatter by 10% and more from one
repeat to the next, so a 2% difference between two schedules needs its interval before it means anything.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import DegenerateDataWarning, bootstrap

from ..modeling.draft_options import DEFAULT_SCHEDULE, SCHEDULES
from .options import POOL_SEPARATOR  # the --tau-ratio pooling syntax, readable by --help without torch
from .runner import PLAIN_CONTROL, MethodResult


@dataclass(frozen=True)
class PairedRatio:
    """numerator / denominator (of tau, or of speed) on the same prompts, with its interval; NaN where undefined
    (no verify steps, one prompt)."""

    numerator: str
    denominator: str
    ratio: float
    low: float
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
    return accepted, steps


def pool_members(side: str) -> list[str]:
    """The method names of one side of a tau ratio ("a+b" -> ["a", "b"])."""
    return side.split(POOL_SEPARATOR)


def pooled(methods: Sequence[MethodResult]) -> MethodResult:
    """Several methods run on the same prompts as one, named "a+b+...": per prompt, their drafts accepted and
    verify steps add up (e.g. drafters of one recipe trained with different seeds)."""
    if len(methods) == 1:
        return methods[0]
    prompts = {len(method.runs) for method in methods}
    if len(prompts) != 1:
        raise ValueError(
            f"Cannot pool {[m.name for m in methods]}: they ran different numbers of prompts ({sorted(prompts)})."
        )
    runs = [
        {key: sum(run[key] for run in prompt_runs) for key in ("accepted_drafts", "verify_steps")}
        for prompt_runs in zip(*(method.runs for method in methods), strict=True)
    ]
    name = POOL_SEPARATOR.join(method.name for method in methods)
    return MethodResult(name=name, prompts=prompts.pop(), runs=runs)


def _tau_ratio(
    accepted_a: np.ndarray, steps_a: np.ndarray, accepted_b: np.ndarray, steps_b: np.ndarray, axis: int = -1
) -> np.ndarray:
    """Pooled tau of a over pooled tau of b, along `axis` (scipy passes resamples stacked on the other axes)."""
    with np.errstate(divide="ignore", invalid="ignore"):  # a resample without verify steps has no tau: NaN
        tau_a = (accepted_a.sum(axis) + steps_a.sum(axis)) / steps_a.sum(axis)
        tau_b = (accepted_b.sum(axis) + steps_b.sum(axis)) / steps_b.sum(axis)
        return tau_a / tau_b


def _median_speed_ratio(speedups_a: np.ndarray, speedups_b: np.ndarray, axis: int = -1) -> np.ndarray:
    """The median over prompts of a's speedup over b's on each prompt."""
    return np.median(speedups_a / speedups_b, axis=axis)


def _interval(
    samples: tuple[np.ndarray, ...],
    statistic,
    confidence: float,
    resamples: int,
    seed: int,
    methods: tuple[str, ...] = ("BCa", "percentile"),
) -> tuple[float, float]:
    """The first of scipy's bootstrap `methods` that gives a finite interval: BCa has better coverage than
    percentile at 10-20 prompts for a smooth statistic such as a pooled tau, and is undefined when every resample
    gives the same ratio; its jackknife misleads for a median, which takes the percentile interval."""
    for method in methods:
        with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):  # NaN: try the next
            warnings.simplefilter("ignore", DegenerateDataWarning)
            interval = bootstrap(
                samples,
                statistic,
                paired=True,
                vectorized=True,
                confidence_level=confidence,
                n_resamples=resamples,
                method=method,
                rng=np.random.default_rng(seed),
            ).confidence_interval
        if np.isfinite(interval.low) and np.isfinite(interval.high):
            return float(interval.low), float(interval.high)
    return math.nan, math.nan


def _paired_ratio(
    numerator: MethodResult,
    denominator: MethodResult,
    per_prompt: tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]],
    statistic,
    confidence: float,
    resamples: int,
    seed: int,
    interval_methods: tuple[str, ...] = ("BCa", "percentile"),
) -> PairedRatio:
    """`statistic` of the two methods' per-prompt arrays, and its bootstrap interval resampling prompts of both."""
    prompts, other = (len(arrays[0]) for arrays in per_prompt)
    if other != prompts:
        raise ValueError(
            f"{numerator.name!r} has {prompts} prompts and {denominator.name!r} {other}; a paired ratio needs both "
            "methods on the same prompts (one `run_methods` call)."
        )
    samples = (*per_prompt[0], *per_prompt[1])
    ratio = float(statistic(*samples)) if prompts else math.nan
    low, high = math.nan, math.nan
    if prompts >= 2 and math.isfinite(ratio):
        low, high = _interval(samples, statistic, confidence, resamples, seed, interval_methods)
    return PairedRatio(numerator.name, denominator.name, ratio, low, high, confidence, prompts)


def paired_tau_ratio(
    numerator: MethodResult,
    denominator: MethodResult,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> PairedRatio:
    """tau(numerator) / tau(denominator) and its bootstrap interval over prompts, both methods resampled together."""
    per_prompt = (_per_prompt(numerator), _per_prompt(denominator))
    return _paired_ratio(numerator, denominator, per_prompt, _tau_ratio, confidence, resamples, seed)


def speculative_names(method_names: list[str]) -> list[str]:
    """The methods a tau ratio can compare: all but the first, plain decoding, and its control."""
    return [name for name in method_names[1:] if name != PLAIN_CONTROL]


def default_tau_ratio_pairs(method_names: list[str], candidate: str = "hyperdflash") -> list[tuple[str, str]]:
    """`candidate` over every other speculative method, if it is present."""
    if candidate not in method_names:
        return []
    return [(candidate, name) for name in speculative_names(method_names) if name != candidate]


def paired_speed_ratio(
    numerator: MethodResult,
    denominator: MethodResult,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> PairedRatio:
    """The median over prompts of numerator's speed over denominator's, and its bootstrap interval over prompts."""
    per_prompt = tuple((np.array(method.speed_ratios, dtype=np.float64),) for method in (numerator, denominator))
    return _paired_ratio(
        numerator, denominator, per_prompt, _median_speed_ratio, confidence, resamples, seed, ("percentile",)
    )


def median_with_interval(
    per_prompt: Sequence[float], confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """The median of per-prompt ratios (each already paired within its prompt, e.g. plain time over speculative
    time) and its percentile bootstrap interval over prompts; NaN bounds below two prompts."""
    values = np.array(per_prompt, dtype=np.float64)
    median = float(np.median(values)) if len(values) else math.nan
    if len(values) < 2:
        return median, math.nan, math.nan
    statistic = lambda sample, axis=-1: np.median(sample, axis=axis)  # noqa: E731
    return median, *_interval((values,), statistic, confidence, resamples, seed, ("percentile",))


def schedule_pairs(method_names: list[str]) -> list[tuple[str, str]]:
    """(NAME, NAME-schedule) for every method run under the default schedule and another one (`build_methods`'
    names)."""
    names = set(method_names)
    return [
        (name, f"{name}-{schedule}")
        for name in method_names
        for schedule in SCHEDULES
        if schedule != DEFAULT_SCHEDULE and f"{name}-{schedule}" in names
    ]
