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

from collections.abc import Sequence
from dataclasses import dataclass

ADAPTIVE_SCHEDULE = "adaptive"
CONSTANT_SCHEDULE = "constant"
SCHEDULES = (ADAPTIVE_SCHEDULE, CONSTANT_SCHEDULE)


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

    def step_seconds(self, length: int) -> float | None:
        """A step verifying `length` tokens; None before any step was timed. With one length seen, the cost is taken
        as flat in the length (a GPU's case); with more, a least-squares line (slope >= 0)."""
        points = [(n, mean.value) for n, mean in self.by_length.items()]
        if not points:
            return None
        if length in self.by_length:
            return self.by_length[length].value
        if len(points) == 1:
            return points[0][1]
        mean_n = sum(n for n, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        spread = sum((n - mean_n) ** 2 for n, _ in points)
        slope = max(0.0, sum((n - mean_n) * (t - mean_t) for n, t in points) / spread)
        return max(mean_t + slope * (length - mean_n), 1e-9)


class ConstantDraftPolicy:
    """Every step drafts and verifies `max_draft` tokens (transformers' "constant" schedule)."""

    schedule = CONSTANT_SCHEDULE

    def __init__(self, max_draft: int):
        self.max_draft = max_draft

    def should_draft(self) -> bool:
        return True

    def keep_drafting(self, confidences: Sequence[float]) -> bool:
        return True

    def choose(self, confidences: Sequence[float]) -> int:
        return len(confidences)

    def record(self, step: StepRecord) -> None:
        pass


class AdaptiveDraftPolicy(ConstantDraftPolicy):
    """Chooses each step's draft length for the most expected tokens per second (see the module docstring).

    `sequential`: the drafter spends one forward per drafted token (native MTP), so drafting can stop early.
    """

    schedule = ADAPTIVE_SCHEDULE
    max_backoff = 64  # plain steps between probes at most
    backoff_growth = 4  # each losing probe: 1, 4, 16, 64 plain steps before the next

    def __init__(self, max_draft: int, sequential: bool):
        super().__init__(max_draft)
        self.sequential = sequential
        self.calibration = AcceptanceCalibration()
        self.costs = StepCosts()
        self.tokens_per_drafted_step = RunningMean()
        self.seconds_per_drafted_step = RunningMean()
        self.backoff = 1
        self.plain_steps_left = 0

    def should_draft(self) -> bool:
        if self.plain_steps_left > 0:
            self.plain_steps_left -= 1
            return False
        return True

    def _rate(self, totals: Sequence[float], drafted: int, forwards: int, sunk: bool) -> float | None:
        """Expected tokens per second of verifying `drafted` drafts; the draft's cost is left out once spent."""
        seconds = self.costs.step_seconds(drafted + 1)
        if seconds is None:
            return None
        if not sunk:
            seconds += self.costs.draft_seconds(forwards)
        return totals[drafted] / seconds

    def choose(self, confidences: Sequence[float]) -> int:
        """How many of the drafts to verify: position j joins while it raises the expected rate, judged from
        confidences 1..j. The drafter forward is spent, so only the verify's cost counts. Expected tokens grow by
        less with each position and costs grow linearly, so the first position that lowers the rate ends the best
        prefix."""
        totals = expected_tokens([self.calibration.probability(c) for c in confidences])
        if self._rate(totals, 0, 0, sunk=True) is None:  # nothing timed yet: verify everything (times that length)
            return len(confidences)
        for k in range(1, len(confidences) + 1):
            if self._rate(totals, k, 0, sunk=True) < self._rate(totals, k - 1, 0, sunk=True):
                return k - 1
        return len(confidences)

    def keep_drafting(self, confidences: Sequence[float]) -> bool:
        """For a sequential drafter: draft one more token if that beats stopping here, taking the next draft to be
        accepted as often as the last one was."""
        if len(confidences) >= self.max_draft:
            return False
        acceptance = [self.calibration.probability(c) for c in confidences]
        totals = expected_tokens([*acceptance, acceptance[-1]])
        depth = len(confidences)
        now = self._rate(totals, depth, depth, sunk=False)
        deeper = self._rate(totals, depth + 1, depth + 1, sunk=False)
        return now is None or deeper >= now

    def record(self, step: StepRecord) -> None:
        self.costs.record(step)
        if not step.drafter_forwards:
            return
        self.calibration.update(step.confidences, step.proposed, step.accepted)
        self.tokens_per_drafted_step.add(step.accepted + 1)
        self.seconds_per_drafted_step.add(step.draft_seconds + step.other_seconds)
        plain_seconds = self.costs.step_seconds(1)
        drafting_rate = self.tokens_per_drafted_step.value / self.seconds_per_drafted_step.value
        if drafting_rate >= 1.0 / plain_seconds:
            self.backoff = 1
        else:  # decode plainly for a while, then probe; wait longer each time a probe loses
            self.plain_steps_left = self.backoff
            self.backoff = min(self.backoff_growth * self.backoff, self.max_backoff)


def make_draft_policy(schedule: str, max_draft: int, sequential: bool) -> ConstantDraftPolicy:
    if schedule == ADAPTIVE_SCHEDULE:
        return AdaptiveDraftPolicy(max_draft, sequential)
    return ConstantDraftPolicy(max_draft)
