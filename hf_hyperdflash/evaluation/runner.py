"""Run a drafter against plain decoding on the same prompts: losslessness, tau, acceptance, speed.

Plain and speculative runs alternate per prompt and repeat, so machine noise lands on both; the
speedup is the median over prompts of (plain seconds / speculative seconds) of each prompt's
repeats' medians.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel


@dataclass
class MethodResult:
    name: str
    prompts: int = 0
    lossless: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    proposed_per_step: list[int] = field(default_factory=list)
    speed_ratios: list[float] = field(default_factory=list)
    plain_tokens_per_second: list[float] = field(default_factory=list)
    tokens_per_second: list[float] = field(default_factory=list)

    @property
    def tau(self) -> float:
        steps = len(self.accepted_per_step)
        return (sum(self.accepted_per_step) + steps) / steps if steps else float("nan")

    @property
    def acceptance_per_position(self) -> list[float]:
        longest = max(self.proposed_per_step, default=0)
        rates = []
        for k in range(1, longest + 1):
            outcomes = [a >= k for a, p in zip(self.accepted_per_step, self.proposed_per_step, strict=True) if p >= k]
            rates.append(sum(outcomes) / len(outcomes))
        return rates

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / self.new_tokens if self.new_tokens else float("nan")

    @property
    def speedup(self) -> float:
        return statistics.median(self.speed_ratios) if self.speed_ratios else float("nan")


def _timed_generate(target: PreTrainedModel, input_ids: torch.LongTensor, **settings) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = target.generate(input_ids, **settings)
    return time.perf_counter() - start, out


@torch.no_grad()
def compare_with_plain(
    name: str,
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    prompts: list[torch.LongTensor],
    max_new_tokens: int = 128,
    repeats: int = 1,
    progress=None,
) -> MethodResult:
    """Greedy decoding of every prompt with and without `drafter`; counts token-identical outputs."""
    result = MethodResult(name=name)
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False)
    for input_ids in prompts:
        plain_times, spec_times = [], []
        for _ in range(repeats):
            seconds, plain = _timed_generate(target, input_ids, **settings)
            plain_times.append(seconds)
            seconds, speculative = _timed_generate(target, input_ids, assistant_model=drafter, **settings)
            spec_times.append(seconds)
        stats = drafter.last_generation_stats
        new_tokens = plain.shape[1] - input_ids.shape[1]
        result.prompts += 1
        result.lossless += int(torch.equal(plain, speculative))
        result.new_tokens += stats["new_tokens"]
        result.target_forwards += stats["target_forwards"]
        result.accepted_per_step += stats["accepted_per_step"]
        result.proposed_per_step += stats["proposed_per_step"]
        result.speed_ratios.append(statistics.median(plain_times) / statistics.median(spec_times))
        result.plain_tokens_per_second.append(new_tokens / statistics.median(plain_times))
        result.tokens_per_second.append(new_tokens / statistics.median(spec_times))
        if progress is not None:
            progress.update(1)
    return result
