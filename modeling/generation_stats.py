"""What one speculative `generate` call did, and the two acceptance measures every report uses.

tau (mean accepted length per verify step) counts the bonus token the target adds at every step, so
plain decoding has tau 1 and a drafter whose drafts are all rejected does too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .draft_options import CONSTANT_SCHEDULE


def synchronized_clock() -> float:
    """perf_counter once queued CUDA kernels are done, so a timed call includes its kernels."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def mean_accepted_length(accepted_per_step: Sequence[int]) -> float:
    """tau: accepted drafts plus the bonus token, averaged over verify steps (NaN with no step)."""
    steps = len(accepted_per_step)
    return (sum(accepted_per_step) + steps) / steps if steps else math.nan


def acceptance_per_position(accepted_per_step: Sequence[int], proposed_per_step: Sequence[int]) -> list[float]:
    """Entry k-1: of the steps that drafted position k, the share whose drafts were accepted up to k."""
    outcomes = list(zip(accepted_per_step, proposed_per_step, strict=True))
    rates = []
    for k in range(1, max(proposed_per_step, default=0) + 1):
        drafted = [accepted >= k for accepted, proposed in outcomes if proposed >= k]
        rates.append(sum(drafted) / len(drafted))
    return rates


def per_decoding_step(count: float, decoding_steps: int) -> float:
    """`count` (drafts sent to verification, or skipped steps) per decoding step (NaN with none)."""
    return count / decoding_steps if decoding_steps else math.nan


@dataclass(repr=False)
class GenerationStats:
    """Per-step record of one call; `drafter.last_generation_stats` after `generate(..., assistant_model=drafter)`.

    Its repr is a one-line summary; the per-step lists stay available for analysis.
    """

    num_draft_tokens: int  # the most drafts one step may verify
    schedule: str = CONSTANT_SCHEDULE  # the draft policy (draft_options.SCHEDULES)
    target_forwards: int = 0
    new_tokens: int = 0
    seconds: float = 0.0  # wall time of the whole generate call
    accepted_per_step: list[int] = field(default_factory=list)
    proposed_per_step: list[int] = field(default_factory=list)
    skipped_steps: int = 0  # steps after the prefill that decoded plainly, without a drafter forward
    # accepted drafts of each verify step (of each row's, in a batch) by where its drafts came from: the drafter, or
    # the context (the prompt and the reply so far, `context_copy.py`)
    accepted_by_source: dict[str, list[int]] = field(default_factory=lambda: {"drafter": [], "context": []})
    # A batch: per row, the tokens it committed per verify step while it generated (`BatchRows.row_taus`); the
    # batch's own tau above counts the positions its shared cache advanced per step
    row_taus: list[float] = field(default_factory=list)
    # A target spread over processes: the collectives its ranks' agreement made (`RankAgreement`), and the wall time
    # spent in them (waiting for slower ranks included)
    rank_collectives: int = 0
    rank_agreement_seconds: float = 0.0

    @property
    def decoding_steps(self) -> int:
        """Target forwards after the prefill."""
        return max(self.target_forwards - 1, 0)

    @property
    def drafted_per_step(self) -> float:
        """Drafts sent to verification per decoding step (skipped steps count as 0)."""
        return per_decoding_step(sum(self.proposed_per_step), self.decoding_steps)

    @property
    def skipped_share(self) -> float:
        """Share of decoding steps that skipped drafting."""
        return per_decoding_step(self.skipped_steps, self.decoding_steps)

    @property
    def mean_accepted_length(self) -> float:
        return mean_accepted_length(self.accepted_per_step)

    @property
    def row_tau(self) -> float:
        """A batch's rows' mean tokens per verify step while they generate (NaN for one prompt)."""
        finite = [tau for tau in self.row_taus if tau == tau]
        return sum(finite) / len(finite) if finite else float("nan")

    @property
    def acceptance_per_position(self) -> list[float]:
        return acceptance_per_position(self.accepted_per_step, self.proposed_per_step)

    @property
    def copied_steps(self) -> int:
        """Verify steps (a batch: row steps) whose drafts were copied from the context."""
        return len(self.accepted_by_source["context"])

    def source_tau(self, source: str) -> float:
        """tau of the verify steps (a batch: row steps) whose drafts came from `source`, "drafter" or "context"."""
        return mean_accepted_length(self.accepted_by_source[source])

    def __repr__(self) -> str:
        acceptance = ", ".join(f"{rate:.2f}" for rate in self.acceptance_per_position)
        return (
            f"GenerationStats(tau={self.mean_accepted_length:.2f}, acceptance_per_position=[{acceptance}], "
            f"drafted_per_step={self.drafted_per_step:.2f}, skipped_share={self.skipped_share:.2f}, "
            f"copied_steps={self.copied_steps}, "
            f"target_forwards={self.target_forwards}, new_tokens={self.new_tokens}, seconds={self.seconds:.2f})"
        )
