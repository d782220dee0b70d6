"""How many drafted tokens each step sends to verification, and whether to draft at all.

`AdaptiveDraftPolicy` (schedule "adaptive", the default) maximises expected tokens per second. Expected tokens
come from the drafter's confidence at each drafted position (the top probability of its distribution there),
mapped to an acceptance probability by a table calibrated during the call. Whether position j is verified depends
only on what is known before its token is drawn (confidences 1..j, past steps), never on the drawn token or on later
positions: a rule that looked at them would bias speculative sampling. Seconds come from this call's own
timings of the drafter and of target forwards over 1..k+1 tokens: on a CPU a longer verify costs more, on a GPU
about the same, so no cost is assumed. When drafting loses to plain decoding, steps decode plainly with no drafter
forward, and a probe drafts again after a backoff that grows fourfold while probes keep losing.

`ConstantDraftPolicy` (schedule "constant") drafts the full length every step.
"""

from __future__ import annotations

import math
import statistics
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .draft_options import ADAPTIVE_SCHEDULE, CONSTANT_SCHEDULE


@dataclass
class StepRecord:
    """One decoding step after the prefill, as the policy learns from it."""

    confidences: list[float]  # the drafter's confidence at each drafted position (also those not verified)
    proposed: int  # drafted tokens sent to verification
    accepted: int
    drafter_forwards: int  # 0: a plain step; 1 per block; 1 per MTP depth
    draft_seconds: float
    other_seconds: float  # the rest of the step: the verify forward, acceptance, rollback


def expected_tokens(acceptance: Sequence[float]) -> list[float]:
    """Entry k: expected tokens a step adds when it verifies the first k drafts (the bonus token included),
    given each draft's acceptance probability once the ones before it were accepted."""
    totals, reach = [1.0], 1.0
    for probability in acceptance:
        reach *= probability
        totals.append(totals[-1] + reach)
    return totals


class AcceptanceCalibration:
    """P(a draft is accepted | the drafts before it were) by the drafter's confidence in it, learned online.

    Confidences fall in equal-width bins; each bin starts from the prior that the drafter is calibrated (acceptance
    equals confidence) with the weight of `prior_weight` observations, so a few steps move it.
    """

    def __init__(self, bins: int = 10, prior_weight: float = 2.0):
        self.bins = bins
        self.accepted = [prior_weight * (b + 0.5) / bins for b in range(bins)]
        self.tried = [prior_weight] * bins

    def _bin(self, confidence: float) -> int:
        return min(int(confidence * self.bins), self.bins - 1)

    def probability(self, confidence: float) -> float:
        b = self._bin(confidence)
        return self.accepted[b] / self.tried[b]

    def update(self, confidences: Sequence[float], proposed: int, accepted: int) -> None:
        """Drafts 1..accepted were accepted; draft accepted + 1, if verified, was rejected; later ones were unseen."""
        for position, confidence in enumerate(confidences[: min(accepted + 1, proposed)]):
            b = self._bin(confidence)
            self.tried[b] += 1
            self.accepted[b] += position < accepted


class RunningMean:
    """Exponentially weighted mean: recent steps count most, since costs and acceptance drift within a call."""

    def __init__(self, smoothing: float = 0.3):
        self.smoothing, self.value = smoothing, None

    def add(self, value: float) -> None:
        self.value = value if self.value is None else self.value + self.smoothing * (value - self.value)


class StepCosts:
    """Seconds per drafter forward and per step by verified length (a target forward over n tokens plus the step's
    bookkeeping), measured during the call. Lengths not yet seen are read off a line fitted to the ones seen."""

    def __init__(self):
        self.drafter_forward = RunningMean()
        self.by_length: dict[int, RunningMean] = {}

    def record(self, step: StepRecord) -> None:
        if step.drafter_forwards:
            self.drafter_forward.add(step.draft_seconds / step.drafter_forwards)
        self.by_length.setdefault(step.proposed + 1, RunningMean()).add(step.other_seconds)

    def draft_seconds(self, forwards: int) -> float:
        return forwards * (self.drafter_forward.value or 0.0)

    def step_seconds_up_to(self, longest: int) -> list[float] | None:
        """Entry n-1: a step verifying n tokens, for n = 1..longest; None before any step was timed. Timed lengths
        use their own mean; others a least-squares line through them (slope >= 0), flat while one length is known
        (a GPU's case: a longer verify costs about the same)."""
        points = [(n, mean.value) for n, mean in self.by_length.items()]
        if not points:
            return None
        intercept, slope = points[0][1], 0.0
        if len(points) > 1:
            mean_n = statistics.fmean(n for n, _ in points)
            mean_t = statistics.fmean(t for _, t in points)
            spread = sum((n - mean_n) ** 2 for n, _ in points)
            slope = max(0.0, sum((n - mean_n) * (t - mean_t) for n, t in points) / spread)
            intercept = mean_t - slope * mean_n
        return [
            self.by_length[n].value if n in self.by_length else max(intercept + slope * n, 1e-9)
            for n in range(1, longest + 1)
        ]


class DraftPolicy(ABC):
    """What the candidate generator asks each step: whether to draft, whether a sequential drafter (one forward per
    token) drafts one more, and how many of the drafts to verify; then it reports how the step went."""

    def __init__(self, max_draft: int):
        self.max_draft = max_draft

    @abstractmethod
    def should_draft(self) -> bool:
        """Before the step: False decodes it plainly, with no drafter forward."""

    @abstractmethod
    def keep_drafting(self, confidences: Sequence[float]) -> bool:
        """After each token of a sequential drafter, from the drafter's confidences so far."""

    @abstractmethod
    def choose(self, confidences: Sequence[float]) -> int:
        """How many of the drafts (a prefix) to verify."""

    @abstractmethod
    def record(self, step: StepRecord) -> None:
        """After the step: learn from how it went."""


class ConstantDraftPolicy(DraftPolicy):
    """Every step drafts and verifies `max_draft` tokens (transformers' "constant" schedule)."""

    def should_draft(self) -> bool:
        return True

    def keep_drafting(self, confidences: Sequence[float]) -> bool:
        return True

    def choose(self, confidences: Sequence[float]) -> int:
        return len(confidences)

    def record(self, step: StepRecord) -> None:
        pass


class AdaptiveDraftPolicy(DraftPolicy):
    """Chooses each step's draft length for the most expected tokens per second (see the module docstring).

    Block drafters draft the whole block in one forward and `choose` how many drafts to verify; a drafter that spends
    one forward per token (native MTP) also asks `keep_drafting` after each one.
    """

    max_backoff = 64  # plain steps between probes at most
    backoff_growth = 4  # each losing probe: 1, 4, 16, 64 plain steps before the next
    drafting_window = 16  # the drafted steps whose tokens and seconds decide whether drafting pays

    def __init__(self, max_draft: int):
        super().__init__(max_draft)
        self.calibration = AcceptanceCalibration()
        self.costs = StepCosts()
        self.recent_drafted_steps: deque[tuple[int, float]] = deque(maxlen=self.drafting_window)
        self.backoff = 1
        self.plain_steps_left = 0

    def should_draft(self) -> bool:
        if self.plain_steps_left > 0:
            self.plain_steps_left -= 1
            return False
        return True

    def choose(self, confidences: Sequence[float]) -> int:
        """How many of the drafts to verify: position j joins while it raises the expected rate, judged from
        confidences 1..j. The drafter forward is spent, so only the verify's cost counts. Expected tokens grow by
        less with each position and costs grow linearly, so the first position that lowers the rate ends the best
        prefix."""
        seconds = self.costs.step_seconds_up_to(len(confidences) + 1)
        if seconds is None:  # nothing timed yet: verify everything (which times that length)
            return len(confidences)
        totals = expected_tokens([self.calibration.probability(c) for c in confidences])
        for k in range(1, len(confidences) + 1):
            if totals[k] / seconds[k] < totals[k - 1] / seconds[k - 1]:
                return k - 1
        return len(confidences)

    def keep_drafting(self, confidences: Sequence[float]) -> bool:
        """For a sequential drafter: draft one more token if that beats stopping here, taking the next draft to be
        accepted as often as the last one was."""
        depth = len(confidences)
        if depth >= self.max_draft:
            return False
        seconds = self.costs.step_seconds_up_to(depth + 2)
        if seconds is None:
            return True
        acceptance = [self.calibration.probability(c) for c in confidences]
        totals = expected_tokens([*acceptance, acceptance[-1]])
        now = totals[depth] / (seconds[depth] + self.costs.draft_seconds(depth))
        deeper = totals[depth + 1] / (seconds[depth + 1] + self.costs.draft_seconds(depth + 1))
        return deeper >= now

    def _drafting_pays(self) -> bool:
        """Unless the recent drafted steps show drafting losing to plain steps beyond their noise: their mean tokens
        per step gets one standard error of benefit of the doubt (at least a fair coin's, 0.5 / sqrt(steps)). One
        step's accept/reject is a coin flip, and a drafter that wins by 15% would otherwise lose after two unlucky
        steps."""
        tokens = [n for n, _ in self.recent_drafted_steps]
        seconds = statistics.fmean(t for _, t in self.recent_drafted_steps)
        spread = max(statistics.stdev(tokens) if len(tokens) > 1 else 0.0, 0.5)
        optimistic_tokens = statistics.fmean(tokens) + spread / math.sqrt(len(tokens))
        return optimistic_tokens / seconds >= 1.0 / self.costs.step_seconds_up_to(1)[0]

    def record(self, step: StepRecord) -> None:
        self.costs.record(step)
        if not step.drafter_forwards:
            return
        self.calibration.update(step.confidences, step.proposed, step.accepted)
        self.recent_drafted_steps.append((step.accepted + 1, step.draft_seconds + step.other_seconds))
        if self._drafting_pays():
            self.backoff = 1
        else:  # decode plainly for a while, then probe; wait longer each time a probe loses
            self.plain_steps_left = self.backoff
            self.backoff = min(self.backoff_growth * self.backoff, self.max_backoff)


POLICIES: dict[str, type[DraftPolicy]] = {
    ADAPTIVE_SCHEDULE: AdaptiveDraftPolicy,
    CONSTANT_SCHEDULE: ConstantDraftPolicy,
}


def make_draft_policy(schedule: str, max_draft: int) -> DraftPolicy:
    return POLICIES[schedule](max_draft)
