"""How many drafted tokens each step sends to verification, and whether to draft at all.

The adaptive schedule ("adaptive", the default) judges drafting by a cost model fixed for the call and by the
tokens alone, never by the clock, so a seeded call samples the same text every time it runs:

- A step that runs the drafter `f` times and verifies `k` drafts costs `1 + draft_cost * f + verify_cost * k` plain
  decoding steps (`DraftCosts`: defaults by the target's device kind, overridable on the drafter's
  `generation_config` as `draft_cost` and `verify_cost`).
- A drafted step verifies the prefix of its drafts with the most expected tokens per unit of cost. A draft's chance
  of acceptance, given the ones before it were accepted, comes from the drafter's confidence at its position (its
  top probability there), through a table the call calibrates as drafts are verified. A sequential drafter (native
  MTP) drafts one more token while that raises the expected rate.
- Drafting pays while the last `window` drafted steps brought at least `1 - margin` tokens per unit of cost (plain
  decoding brings 1; a batch's tokens are what its slowest row gained). When they do not, the next `wait` steps
  decode without the drafter, then one step probes, verifying one draft at least, and joins the window. Each wait is
  `wait_growth` times the last (to `max_wait`); a batch's is also long enough that a probe losing what the recent
  drafted steps lost costs at most `margin` of the wait and the probe together (a drafted step costs a large batch
  several plain steps). A probe that pays on its own quarters the wait before it, and a window that pays again
  resumes drafting with the wait back at 1.
- What decides whether draft j is verified is known before it is drawn (confidences 1..j, earlier steps), so
  speculative sampling stays exact.

`HeuristicDraftPolicy` ("heuristic", "heuristic_transient"), `ConfidenceThreshold` (`assistant_confidence_threshold`)
and `ConstantDraftPolicy` ("constant") are transformers' own rules.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .draft_options import (
    ADAPTIVE_SCHEDULE,
    BLOCK_DRAFTER_TYPE,
    DRAFT_COSTS_BY_DEVICE,
    DSPARK_DRAFTER_TYPE,
    HEURISTIC_SCHEDULE,
    HEURISTIC_TRANSIENT_SCHEDULE,
    MAX_MTP_DEPTH,
)


@dataclass
class StepRecord:
    """One decoding step after the prefill, as a policy learns from it."""

    confidences: list[float]  # the drafter's confidence at each drafted position (also those not verified)
    proposed: int  # drafted tokens sent to verification
    accepted: int
    drafter_forwards: int  # 0: the step decoded without the drafter; 1 per block; 1 per MTP depth


@dataclass(frozen=True)
class RowStep:
    """One row of a batched step: its drafts' confidences, how many were verified and accepted."""

    confidences: list[float]
    proposed: int
    accepted: int


@dataclass(frozen=True)
class BatchStepRecord:
    """A batched decoding step as a policy learns from it: its rows, how many tokens the batch's slowest row
    gained (its pace: a plain step gains 1), the drafted positions of its verify forward and the drafter forwards
    spent."""

    rows: list[RowStep]
    tokens: int
    width: int
    drafter_forwards: int


class DraftPolicy(ABC):
    """What the candidate generator asks each step: whether to draft, how many tokens to draft at most, whether a
    sequential drafter (one forward per token) drafts one more, and how many of the drafts to verify; then it
    reports how the step went."""

    def __init__(self, max_draft: int):
        self.max_draft = max_draft  # the most drafts any step of the call verifies (its caches are sized for it)

    @property
    def draft_length(self) -> int:
        """The most tokens the next step drafts."""
        return self.max_draft

    @abstractmethod
    def should_draft(self) -> bool:
        """Before the step: False decodes it without a drafter forward."""

    @abstractmethod
    def keep_drafting(self, confidences: Sequence[float]) -> bool:
        """After each token of a sequential drafter, from the drafter's confidences so far."""

    @abstractmethod
    def choose(self, confidences: Sequence[float]) -> int:
        """How many of the drafts (a prefix) to verify."""

    @abstractmethod
    def record(self, step: StepRecord) -> None:
        """After the step: learn from how it went."""

    def acceptance(self, confidences: Sequence[float]) -> list[float]:
        """Each draft's chance of acceptance once the ones before it were, from the drafter's confidences."""
        return list(confidences)

    def choose_width(self, uncached: Sequence[int], acceptance: Sequence[Sequence[float]]) -> int:
        """A batch (`batched_drafting.py`): how many drafted positions its verify forward carries. Row r feeds its
        `uncached[r]` committed tokens first (its anchor last), then its drafts (each one's chance of acceptance,
        `acceptance`). Default: every row's whole draft."""
        return max((a - 1 + len(c) for a, c in zip(uncached, acceptance, strict=True) if c), default=0)

    @abstractmethod
    def record_batch(self, step: BatchStepRecord) -> None:
        """After a batched step: learn from how it went."""


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

    def record_batch(self, step: BatchStepRecord) -> None:
        pass


class HeuristicDraftPolicy(ConstantDraftPolicy):
    """transformers' "heuristic" schedule (`AssistedCandidateGenerator.update_candidate_strategy`): after a step
    whose drafts were all accepted the draft length grows by 2, after any other it shrinks by 1 (to 1 at least).

    It starts from `num_assistant_tokens` and stays within what the call drafts (`max_draft`: for a block drafter,
    its block), so the length it leaves for the next call is one that call can draft. A step at the end of the
    budget that drafts nothing counts as all accepted, as in transformers.
    """

    def __init__(self, max_draft: int, num_assistant_tokens: int):
        super().__init__(max_draft)
        self.num_assistant_tokens = num_assistant_tokens

    @property
    def draft_length(self) -> int:
        return self.num_assistant_tokens

    def record(self, step: StepRecord) -> None:
        self._grow(step.accepted == step.proposed)

    def record_batch(self, step: BatchStepRecord) -> None:
        self._grow(all(row.accepted == row.proposed for row in step.rows))

    def _grow(self, all_accepted: bool) -> None:
        length = self.num_assistant_tokens + 2 if all_accepted else self.num_assistant_tokens - 1
        self.num_assistant_tokens = min(max(length, 1), self.max_draft)


@dataclass(frozen=True)
class DraftCosts:
    """A step's cost in plain decoding steps: `1 + draft_cost * drafter_forwards + verify_cost * verified_drafts`."""

    draft_cost: float  # one drafter forward
    verify_cost: float  # each draft a verify forward carries besides the token plain decoding feeds
    draft_row_cost: float = 0.0  # what each further row of a batch adds to a batched drafter's forward
    # (batch size, factor on verify_cost) points, measured: what a drafted position costs a batch of that size
    verify_growth: tuple[tuple[int, float], ...] = ()

    def step(self, drafter_forwards: int, verified: int) -> float:
        return 1.0 + self.draft_cost * drafter_forwards + self.verify_cost * verified

    @classmethod
    def for_call(cls, device_type: str, drafter) -> DraftCosts:
        """The defaults for the target's device type (an accelerator's other than CUDA's: CUDA's) and the drafter's
        kind, each overridden where the drafter's `generation_config` sets `draft_cost` or `verify_cost`."""
        by_kind = DRAFT_COSTS_BY_DEVICE.get(device_type, DRAFT_COSTS_BY_DEVICE["cuda"])
        costs = dict(by_kind[drafter.config.model_type])
        for name in ("draft_cost", "verify_cost", "draft_row_cost"):
            value = getattr(drafter.generation_config, name, None)
            if value is not None:
                costs[name] = float(value)
        return cls(**costs)

    def for_batch(self, batch_size: int, drafts_row_by_row: bool) -> DraftCosts:
        """The same costs for a batch, relative to a plain step of the batch. A plain batched step pays a fixed part
        (the weights read once) plus a part per row (its own cache to attend over and update), so it grows with the
        batch; `verify_cost`, one more token on a one-row forward, says how they split. A draft adds a position to
        every row's forward, which attends over the same cache, so it costs far less than a row, and grows with the
        batch as measured (`verify_growth`, interpolated over log batch size; flat where none is measured). A batched
        drafter's forward grows with the batch by `draft_row_cost` per further row; one that drafts row by row pays
        its forward once per row."""
        per_row = self.verify_cost / (1.0 - self.verify_cost)  # per-row part over the fixed part
        plain_one, plain_batch = 1.0 + per_row, 1.0 + batch_size * per_row
        if drafts_row_by_row:
            draft = self.draft_cost * batch_size * plain_one / plain_batch
        else:
            draft = self.draft_cost + self.draft_row_cost * (batch_size - 1)
        verify = self.verify_cost * _interpolated(((1, 1.0), *self.verify_growth), batch_size)
        return DraftCosts(draft, verify, self.draft_row_cost, self.verify_growth)


def _interpolated(points: Sequence[tuple[int, float]], batch_size: int) -> float:
    """The factor at `batch_size`, linear in log batch size between measured points, held past the last one."""
    x = math.log(batch_size)
    for (b0, f0), (b1, f1) in zip(points, points[1:], strict=False):
        if batch_size <= b1:
            t = (x - math.log(b0)) / (math.log(b1) - math.log(b0))
            return f0 + max(t, 0.0) * (f1 - f0)
    return points[-1][1]


def expected_tokens(acceptance: Sequence[float]) -> list[float]:
    """Entry k: expected tokens a step adds when it verifies the first k drafts (the bonus token included),
    given each draft's acceptance probability once the ones before it were accepted."""
    totals, reach = [1.0], 1.0
    for probability in acceptance:
        reach *= probability
        totals.append(totals[-1] + reach)
    return totals


class AcceptanceCalibration:
    """P(a draft is accepted | the drafts before it were) by the drafter's confidence in it, learned in the call.

    Confidences fall in equal-width bins; each bin starts from the prior that the drafter is calibrated (acceptance
    equals confidence) with the weight of `prior_weight` observations, so a few verified drafts move it.
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


class AdaptiveDraftPolicy(DraftPolicy):
    """Drafts where drafting pays by the call's cost model, verifying the best prefix (the module docstring)."""

    window = 16  # drafted steps that say whether drafting pays
    margin = 0.05  # drafting goes on unless it brings this much less than plain decoding per unit of cost
    wait_growth = 4  # each wait this many times the last: 1, 4, 16, 64 steps (a batch's: at least)
    max_wait = 64  # steps without the drafter between probes, at most

    def __init__(self, max_draft: int, costs: DraftCosts, amortise_probes: bool = False):
        """`amortise_probes`: size each wait so a losing probe costs at most the margin (a batch's schedule; for one
        prompt frequent probes find easy stretches sooner, which measured better)."""
        super().__init__(max_draft)
        self.costs = costs
        self.amortise_probes = amortise_probes
        self.calibration = AcceptanceCalibration()
        self.recent: deque[tuple[int, float]] = deque(maxlen=self.window)  # (tokens, cost) of drafted steps
        self.wait = 1  # the next wait, once drafting stops paying
        self.steps_to_wait = 0
        self.probing = False  # the next drafted step follows a wait

    def should_draft(self) -> bool:
        if self.steps_to_wait:
            self.steps_to_wait -= 1
            return False
        return True

    def acceptance(self, confidences: Sequence[float]) -> list[float]:
        return [self.calibration.probability(c) for c in confidences]

    def _expected_rates(self, confidences: Sequence[float], drafter_forwards: int) -> list[float]:
        """Entry k: expected tokens per unit of cost when the step verifies its first k drafts."""
        totals = expected_tokens(self.acceptance(confidences))
        return [tokens / self.costs.step(drafter_forwards, k) for k, tokens in enumerate(totals)]

    def choose(self, confidences: Sequence[float]) -> int:
        """The prefix with the best expected rate (the drafter forwards are spent either way); a probe verifies one
        draft at least, so the calibration learns whether the text got easier.

        Invariant: each draft adds at most what the one before it added (acceptance multiplies along the block) at
        the same cost, so the rate rises to its best prefix and then falls. The best prefix is where it first stops
        rising, and whether a draft is verified depends only on the confidences up to it, known before it was drawn:
        sampling stays exact for drafters whose later confidences follow the drawn tokens (native MTP)."""
        rates = self._expected_rates(confidences, drafter_forwards=1)
        best = max(range(len(rates)), key=rates.__getitem__)
        return max(best, 1) if self.probing else best

    def keep_drafting(self, confidences: Sequence[float]) -> bool:
        """One more token if verifying it, accepted as often as the last one, raises the expected rate."""
        depth = len(confidences)
        if depth >= self.max_draft:
            return False
        now = self._expected_rates(confidences, depth)[depth]
        deeper = self._expected_rates([*confidences, confidences[-1]], depth + 1)[depth + 1]
        return deeper > now

    def _pays(self, steps: Sequence[tuple[int, float]]) -> bool:
        return sum(tokens for tokens, _ in steps) >= (1.0 - self.margin) * sum(cost for _, cost in steps)

    def choose_width(self, uncached: Sequence[int], acceptance: Sequence[Sequence[float]]) -> int:
        """The width with the best expected rate of new tokens per row: a row adds its bonus token plus the drafts
        it is expected to accept when the forward reaches its newest token (a row further ahead adds none), and every
        drafted position costs the batch `verify_cost`. Each row's drafts are verified as far as the forward reaches,
        decided from what was known before its tokens were drawn, as for one row. Each width's rate is computed
        once, up to the first that does not rise: plain Python on the host, which for a batch's rows costs less than
        tensor calls."""
        widest = super().choose_width(uncached, acceptance)
        reach = [expected_tokens(row) for row in acceptance]
        best, best_rate = 0, None  # the rate rises to its best width and then falls: stop where it first stops rising
        for width in range(widest + 1):
            tokens = sum(
                row_reach[min(width - ahead + 1, len(row_reach) - 1)]
                for ahead, row_reach in zip(uncached, reach, strict=True)
                if ahead <= width + 1
            )
            rate = tokens / len(reach) / self.costs.step(1, width)
            if best_rate is not None and rate <= best_rate:
                break
            best, best_rate = width, rate
        return max(best, 1) if self.probing else best

    def record(self, step: StepRecord) -> None:
        if not (step.drafter_forwards or step.proposed):  # a plain step
            return
        self.calibration.update(step.confidences, step.proposed, step.accepted)
        self._learn_pace(step.accepted + 1, self.costs.step(step.drafter_forwards, step.proposed))

    def record_batch(self, step: BatchStepRecord) -> None:
        for row in step.rows:
            self.calibration.update(row.confidences, row.proposed, row.accepted)
        self._learn_pace(step.tokens, self.costs.step(max(step.drafter_forwards, 1), step.width))

    def _learn_pace(self, tokens: float, cost: float) -> None:
        """Whether drafting pays over the recent drafted steps; if not, wait longer and longer before probing."""
        drafted = (tokens, cost)
        self.recent.append(drafted)
        probe, self.probing = self.probing, False
        if self._pays(self.recent):
            self.wait = 1
            return
        if probe and self._pays([drafted]):  # the text may have got easier: wait less before the next probe
            self.wait = max(self.wait // 4, 1)
        self.steps_to_wait = max(self.wait, self._amortising_wait()) if self.amortise_probes else self.wait
        self.probing = True
        self.wait = min(self.wait_growth * self.wait, self.max_wait)

    def _amortising_wait(self) -> int:
        """The shortest wait W over which a probe that brings `t` tokens at cost `c` (the recent drafted steps' mean)
        keeps the margin: (W + t) / (W + c) >= 1 - margin. The costlier drafting is against what it brings (a large
        batch on a CPU), the rarer the probes."""
        tokens = sum(t for t, _ in self.recent) / len(self.recent)
        cost = sum(c for _, c in self.recent) / len(self.recent)
        wait = ((1.0 - self.margin) * cost - tokens) / self.margin
        return min(max(math.ceil(wait), 1), self.max_wait)


def lowest_cost_threshold(scores: Sequence[float], positives: Sequence[bool]) -> float:
    """The threshold (positive at or above it) among `scores` with the least false positive rate + 3 x false negative
    rate, the highest of equals: the point transformers picks on sklearn's `roc_curve` (whose first threshold, above
    every score, costs 3 and never wins). Needs both outcomes among `positives`."""
    num_positive = sum(positives)
    num_negative = len(positives) - num_positive
    ranked = sorted(zip(scores, positives, strict=True), key=lambda pair: -pair[0])
    best, lowest = math.inf, 3.0
    true_positives = false_positives = 0
    for i, (score, positive) in enumerate(ranked):
        true_positives += positive
        false_positives += not positive
        if i + 1 < len(ranked) and ranked[i + 1][0] == score:  # a threshold takes in every equal score
            continue
        cost = false_positives / num_negative + 3 * (1 - true_positives / num_positive)
        if cost < lowest:
            best, lowest = score, cost
    return best


class ConfidenceThreshold:
    """transformers' `assistant_confidence_threshold`: a step's drafts end with the first one whose probability
    under the drafter is below the threshold (that draft is still verified; for a block drafter the block is cut
    there, a sequential one stops drafting).

    After every step the threshold moves to `lowest_cost_threshold` of the call's verified drafts (probability
    against accepted), once more than 5 are known with both outcomes among them, as
    `AssistedCandidateGenerator.update_candidate_strategy` does; like transformers, which tunes a copy of the
    assistant's generation config, each call starts from the configured value.
    """

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.probabilities: list[float] = []
        self.accepted: list[bool] = []

    def keep_drafting(self, probabilities: Sequence[float]) -> bool:
        """After each token of a sequential drafter, from the probabilities of the drafts so far."""
        return probabilities[-1] >= self.threshold

    def cut(self, probabilities: Sequence[float]) -> int:
        """How many of the drafts to verify: up to and including the first below the threshold."""
        below = next((k for k, probability in enumerate(probabilities, 1) if probability < self.threshold), None)
        return len(probabilities) if below is None else below

    def record(self, probabilities: Sequence[float], accepted: int) -> None:
        """`probabilities` of a step's verified drafts, of which the first `accepted` were accepted."""
        judged = probabilities[: accepted + 1]
        self.probabilities += judged
        self.accepted += [True] * accepted + [False] * (len(judged) - accepted)
        if len(self.probabilities) > 5 and True in self.accepted and False in self.accepted:
            self.threshold = lowest_cost_threshold(self.probabilities, self.accepted)


class CallSchedule:
    """One generate() call's draft policy and confidence threshold; "heuristic" leaves its draft length for the
    drafter's next call on `drafter.generation_config.num_assistant_tokens`, where transformers keeps it."""

    def __init__(self, name: str, drafter, target, num_draft_tokens: int, batch: tuple[int, bool] = (1, False)):
        """`batch`: the rows of the call and whether the drafter drafts them row by row (`DraftCosts.for_batch`)."""
        self.name, self.drafter = name, drafter
        if name == ADAPTIVE_SCHEDULE:
            costs = DraftCosts.for_call(target.device.type, drafter)
            if batch[0] > 1:
                costs = costs.for_batch(*batch)
            self.policy: DraftPolicy = AdaptiveDraftPolicy(num_draft_tokens, costs, amortise_probes=batch[0] > 1)
        elif name in (HEURISTIC_SCHEDULE, HEURISTIC_TRANSIENT_SCHEDULE):
            self.policy = HeuristicDraftPolicy(_longest_heuristic_draft(drafter, num_draft_tokens), num_draft_tokens)
        else:
            self.policy = ConstantDraftPolicy(num_draft_tokens)
        threshold = drafter.generation_config.assistant_confidence_threshold
        self.threshold = ConfidenceThreshold(float(threshold)) if threshold else None

    def finish(self) -> None:
        if self.name == HEURISTIC_SCHEDULE:
            self.drafter.generation_config.num_assistant_tokens = self.policy.num_assistant_tokens


def _longest_heuristic_draft(drafter, num_draft_tokens: int) -> int:
    """How far the heuristic schedule may grow the draft: a block drafter's block, else `MAX_MTP_DEPTH`."""
    config = drafter.config
    if config.model_type == BLOCK_DRAFTER_TYPE:
        return config.block_size - 1
    if config.model_type == DSPARK_DRAFTER_TYPE:
        return config.dspark_block_size
    return max(num_draft_tokens, MAX_MTP_DEPTH)
