"""How many drafted tokens each step sends to verification, whether to draft at all, and what a schedule keeps
between calls.

`AdaptiveDraftPolicy` (schedules "adaptive", the default, and "adaptive_transient") maximises expected tokens per
second. Expected tokens come from the drafter's confidence at each drafted position (the top probability of its
distribution there), mapped to an acceptance probability by a table calibrated online. Whether position j is
verified depends only on what is known before its token is drawn (confidences 1..j, past steps), never on the drawn
token or on later positions: a rule that looked at them would bias speculative sampling. Seconds come from timings
of the drafter and of target forwards over 1..k+1 tokens: on a CPU a longer verify costs more, on a GPU about the
same, so no cost is assumed. Drafting is judged against plain steps as timed: a schedule that has timed none, or
a drafter near break-even, decodes one plainly after 16 drafted steps (or more, the more drafting gains); steps that
brought one token each never pay, however they were timed. When drafting loses (over the last 16 drafted steps,
with two standard errors of benefit of the doubt unless 64 and more over the calls lost; where the last 128 and
more paid, only when those 16 lose widely), steps decode plainly with no drafter forward, and a probe drafts again
after a backoff that grows fourfold while probes keep losing (past 64 steps only when drafting loses widely, in the
window and over the calls; such a wait that would end in a call's last quarter-backoff runs on to its end, and the
probe opens the next call); a call that would decode plainly from start to end runs plain decoding's own loop. A
probe is judged as the steps after it would run, without the skipped context it caught up on.
Under "adaptive" what it learned (calibration, costs, how drafted steps fared) carries over to the drafter's next call
with the same target and setting (`ScheduleMemory`), and so does a wait unless drafting paid over the calls so far
(how well a drafter does depends on the text; up to 16 steps of it unless they lost widely); "adaptive_transient"
learns from nothing in every call.

`HeuristicDraftPolicy` ("heuristic", "heuristic_transient") and `ConfidenceThreshold`
(`assistant_confidence_threshold`) are transformers' own rules, `ConstantDraftPolicy` ("constant") drafts the full
length every step. Every rule keeps speculative sampling exact: what decides whether draft j + 1 is verified is known
before it is drawn.
"""

from __future__ import annotations

import bisect
import copy
import math
import statistics
import threading
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from .draft_options import (
    ADAPTIVE_SCHEDULE,
    ADAPTIVE_TRANSIENT_SCHEDULE,
    BLOCK_DRAFTER_TYPE,
    HEURISTIC_SCHEDULE,
    HEURISTIC_TRANSIENT_SCHEDULE,
    MAX_MTP_DEPTH,
)
from .stretches import MIN_PLAIN_STRETCH


@dataclass
class StepRecord:
    """One decoding step after the prefill, as the policy learns from it."""

    confidences: list[float]  # the drafter's confidence at each drafted position (also those not verified)
    proposed: int  # drafted tokens sent to verification
    accepted: int
    drafter_forwards: int  # 0: a plain step; 1 per block; 1 per MTP depth
    draft_seconds: float
    other_seconds: float  # the rest of the step: the verify forward, acceptance, rollback
    caught_up: bool = False  # the drafter forward also took in the prompt or skipped steps' context: a one-off cost


@dataclass(frozen=True)
class DraftedStep:
    """A step that ran the drafter, as the adaptive schedule judges whether drafting pays."""

    tokens: int  # accepted drafts + the bonus token
    verified: int  # tokens in the verify forward: drafts sent + 1 (1: every draft was cut)
    seconds: float


class DraftedSteps:
    """The last `size` drafted steps, with their typical step kept up to date as steps come and go: the mean tokens
    and the median seconds (one slow step on a busy machine must not decide). Read every step, 512 of them summed
    and sorted afresh (and `statistics.stdev`) made the adaptive schedule, drafting every step, 0.99x of the fixed
    one with native MTP k=1; kept up to date, 1.00x."""

    def __init__(self, size: int):
        self.steps: deque[DraftedStep] = deque(maxlen=size)
        self.tokens = 0
        self.sorted_seconds: list[float] = []

    def append(self, step: DraftedStep) -> None:
        if len(self.steps) == self.steps.maxlen:
            oldest = self.steps[0]
            self.tokens -= oldest.tokens
            del self.sorted_seconds[bisect.bisect_left(self.sorted_seconds, oldest.seconds)]
        self.steps.append(step)
        self.tokens += step.tokens
        bisect.insort(self.sorted_seconds, step.seconds)

    def typical(self) -> tuple[float, float]:
        """Mean tokens and median seconds (of at least one step)."""
        count, middle = len(self.steps), len(self.steps) // 2
        seconds = self.sorted_seconds
        median = seconds[middle] if count % 2 else (seconds[middle - 1] + seconds[middle]) / 2
        return self.tokens / count, median

    def clear(self) -> None:
        self.steps.clear()
        self.tokens = 0
        self.sorted_seconds = []

    def copy(self) -> DraftedSteps:
        twin = copy.copy(self)
        twin.steps, twin.sorted_seconds = self.steps.copy(), list(self.sorted_seconds)
        return twin

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[DraftedStep]:
        return iter(self.steps)

    def __getitem__(self, index: int) -> DraftedStep:
        return self.steps[index]


def sample_stdev(values: Sequence[int]) -> float:
    """The sample standard deviation of two or more values, in floats (`statistics.stdev` computes in exact
    fractions: tens of microseconds a step)."""
    mean = sum(values) / len(values)
    return math.sqrt(sum((value - mean) ** 2 for value in values) / (len(values) - 1))


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
    equals confidence) with the weight of `prior_weight` observations, so a few steps move it. A bin holds at most
    `max_weight` observations, older ones fading, so a calibration carried over many calls still follows drift.
    """

    def __init__(self, bins: int = 10, prior_weight: float = 2.0, max_weight: float = 200.0):
        self.bins, self.max_weight = bins, max_weight
        self.accepted = [prior_weight * (b + 0.5) / bins for b in range(bins)]
        self.tried = [prior_weight] * bins

    def copy(self) -> AcceptanceCalibration:
        twin = copy.copy(self)
        twin.accepted, twin.tried = list(self.accepted), list(self.tried)
        return twin

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
            if self.tried[b] > self.max_weight:
                scale = self.max_weight / self.tried[b]
                self.tried[b] *= scale
                self.accepted[b] *= scale


class RunningMean:
    """Exponentially weighted mean: recent steps count most, since costs and acceptance drift within a call."""

    def __init__(self, smoothing: float = 0.3):
        self.smoothing, self.value, self.count = smoothing, None, 0

    def add(self, value: float) -> None:
        self.value = value if self.value is None else self.value + self.smoothing * (value - self.value)
        self.count += 1


class StepCosts:
    """Seconds per drafter forward and per step by verified length (a target forward over n tokens plus the step's
    bookkeeping): a line fitted to the lengths timed, each weighted by how often it was (up to 16 steps)."""

    max_weight = 16
    plain_steps_kept = 32

    def __init__(self):
        self.drafter_forward = RunningMean()
        self.by_length: dict[int, RunningMean] = {}
        self.recent_plain_steps: deque[float] = deque(maxlen=self.plain_steps_kept)  # steps that skipped, seconds

    def copy(self) -> StepCosts:
        twin = copy.copy(self)
        twin.drafter_forward = copy.copy(self.drafter_forward)
        twin.by_length = {n: copy.copy(mean) for n, mean in self.by_length.items()}
        twin.recent_plain_steps = self.recent_plain_steps.copy()
        return twin

    def record(self, step: StepRecord) -> None:
        """A step whose drafts were all cut also verifies one token and times that length for `choose`, but it is
        no plain step: its bookkeeping around the drafter forward made it ~1.6x a skipped step's cost here, and at
        T=1, where many steps are cut, counting it so made the shipped drafter (0.63x) look near break-even."""
        if step.drafter_forwards:
            if not step.caught_up:
                self.drafter_forward.add(step.draft_seconds / step.drafter_forwards)
        else:
            self.recent_plain_steps.append(step.other_seconds)
        self.by_length.setdefault(step.proposed + 1, RunningMean()).add(step.other_seconds)

    def record_plain_loop(self, step_seconds: Sequence[float]) -> None:
        """Steps of plain decoding's own loop: the ones kept spread over the call, not its last (they attend over
        the most context)."""
        stride = max(math.ceil(len(step_seconds) / self.plain_steps_kept), 1)
        self.recent_plain_steps.extend(step_seconds[::stride])

    def draft_seconds(self, forwards: int) -> float:
        return forwards * (self.drafter_forward.value or 0.0)

    def step_seconds_up_to(self, longest: int) -> list[float] | None:
        """Entry n-1: a step verifying n tokens, for n = 1..longest; None before any step was timed. The line
        (slope >= 0) is flat while one length is known (a GPU's case: a longer verify costs about the same). Every
        length reads the line, not its own mean: a length timed once, in a slow step, would otherwise keep that
        cost, never be verified again, and never be timed again."""
        points = [(n, mean.value, min(mean.count, self.max_weight)) for n, mean in self.by_length.items()]
        if not points:
            return None
        total = sum(w for _, _, w in points)
        mean_n = sum(n * w for n, _, w in points) / total
        mean_t = sum(t * w for _, t, w in points) / total
        spread = sum(w * (n - mean_n) ** 2 for n, _, w in points)
        slope = max(0.0, sum(w * (n - mean_n) * (t - mean_t) for n, t, w in points) / spread) if spread else 0.0
        intercept = mean_t - slope * mean_n
        return [max(intercept + slope * n, 1e-9) for n in range(1, longest + 1)]

    def plain_step_seconds(self) -> float:
        """A step that skips drafting: the median of the last 32 timed (before any, the line's one-token verify).
        What drafting is judged against must not follow one slow step: while a drafter drafts, few plain steps are
        timed to correct it, and an untrained drafter at T=1 then drafted through whole calls at 0.5x of plain
        decoding after a few plain steps timed on a busy machine."""
        if self.recent_plain_steps:
            return statistics.median(self.recent_plain_steps)
        return self.step_seconds_up_to(1)[0]


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
        length = self.num_assistant_tokens + 2 if step.accepted == step.proposed else self.num_assistant_tokens - 1
        self.num_assistant_tokens = min(max(length, 1), self.max_draft)


class AdaptiveDraftPolicy(DraftPolicy):
    """Chooses each step's draft length for the most expected tokens per second (see the module docstring).

    Block drafters draft the whole block in one forward and `choose` how many drafts to verify; a drafter that spends
    one forward per token (native MTP) also asks `keep_drafting` after each one. The instance is its learned state:
    `ScheduleMemory` keeps it from one call to the next.
    """

    max_backoff = 1024  # plain steps between probes at most
    max_short_backoff = 64  # ... unless a full window of drafted steps says drafting loses widely
    backoff_growth = 4  # each losing probe: 1, 4, 16, 64 (64, ...), 256, 1024 plain steps before the next
    drafting_window = 16  # the drafted steps whose tokens and seconds decide whether drafting pays
    long_run_horizon = 512  # the drafted steps, over calls, that say whether a new call starts drafting
    long_run_minimum = 128  # ... and, once this many, whether a window that loses narrowly stops drafting
    doubt_evidence = 64  # ... and, once this many lose, a window has no benefit of the doubt
    break_even_margin = 0.05  # drafting stays on unless it loses by more than this
    wide_loss = 0.2  # drafted steps this much slower than plain ones, or more, may wait long and across calls
    control_margin = 0.25  # a drafter this close to break-even, or closer, re-times plain steps now and then
    control_cost = 0.005  # ... so often that the steps it does not draft cost it at most this share of its speed

    def __init__(self, max_draft: int):
        super().__init__(max_draft)
        self.calibration = AcceptanceCalibration()
        self.costs = StepCosts()
        self.recent_drafted_steps = DraftedSteps(self.drafting_window)
        self.long_run = DraftedSteps(self.long_run_horizon)
        self.backoff = 1
        self.plain_steps_left = 0
        self.drafted_since_plain = 0

    def copy(self) -> AdaptiveDraftPolicy:
        """A private copy for a new call, sharing only the frozen steps: `copy.deepcopy` took 16 ms over 512 of
        them, 5% of a 20-token call that decodes plainly."""
        twin = copy.copy(self)
        twin.calibration, twin.costs = self.calibration.copy(), self.costs.copy()
        twin.recent_drafted_steps, twin.long_run = self.recent_drafted_steps.copy(), self.long_run.copy()
        return twin

    def begin_call(self) -> None:
        """A call carried over from earlier ones decodes new text. How well a drafter does depends on the text
        (native MTP k=1 here: 0.66x to 1.7x of plain decoding by prompt), so a drafter whose drafted steps paid over
        the calls so far (the last 512, within `break_even_margin`) starts the call drafting with an empty window,
        however the last call ended. One that lost widely (an untrained one) keeps its wait, and later calls cost
        no probes. One in between keeps its window and at most 16 steps of its wait (and a backoff of at most 64):
        the shipped drafter at T=1, at 0.6x of plain sampling, read 0.8x-0.98x on a busy minute's timings, and
        each fresh start then drafted 16 steps and more; native MTP k=1 near break-even, whose plain steps' timings
        drift by a fifth from minute to minute, is not kept waiting through calls it would have won (64 steps of a
        wait carried from a hard prompt into an easy one were 40% of a call). They are judged against plain steps as
        timed now, not when they ran: the machine's load drifts between calls."""
        if not self.long_run:
            return
        if self._pays(*self.long_run.typical()):
            self.recent_drafted_steps.clear()
            self.backoff, self.plain_steps_left = 1, 0
        elif not self._loses_widely(self.long_run):
            self.backoff = min(self.backoff, self.max_short_backoff)
            self.plain_steps_left = min(self.plain_steps_left, self.drafting_window)

    def waiting_steps(self, steps_left: int) -> int:
        """How many of the call's next `steps_left` steps the wait covers. A long wait (drafting lost widely) that
        would end within a quarter of its backoff before the call's end runs on to the end instead, and the probe
        opens the next call: there the prefill gives the drafter its context, where mid-call the probe followed a
        plain stretch that collected features for it (0.1%-0.8% of a step each, by instruction count) and cost a
        switch of loops each way. The shipped drafter at T=1 waited 40-230 steps of a 256-token call before each
        such probe."""
        wait = min(self.plain_steps_left, steps_left)
        if 0 < wait < steps_left <= wait + self.backoff // 4 and self.backoff > self.max_short_backoff:
            return steps_left
        return wait

    def decodes_plainly(self, steps: int) -> bool:
        """Before a call: whether its next `steps` steps all decode plainly (then plain decoding's own loop runs
        them)."""
        return self.waiting_steps(steps) >= steps

    def skip(self, steps: int, step_seconds: Sequence[float]) -> None:
        """`steps` steps were decoded plainly outside the assisted loop, which timed `step_seconds` of them. Where a
        drafter loses, most of a session's plain steps run there: timed only inside the assisted loop, plain steps
        were those of the few calls that probed, minutes old, and the shipped drafter at T=1 (0.6x of plain
        sampling) was judged at 0.8x-1.08x over a session, so new calls started drafting and drafted through it."""
        self.plain_steps_left = max(self.plain_steps_left - steps, 0)
        if step_seconds:
            self.costs.record_plain_loop(step_seconds)
            self.drafted_since_plain = 0

    def should_draft(self) -> bool:
        """After 16 drafted steps with no plain step since, a step decodes plainly if none was ever timed, or, at the
        re-timing interval (`_retiming_interval`), if the drafter is near break-even: drafting is judged against
        plain steps as timed, and no other step costs what one does (a cut step's bookkeeping, a verify's longer
        input). Until one is timed the step-cost line stands in, so short calls (and the chi-square tests'
        two-token samples) draft from the start."""
        if self.plain_steps_left > 0:
            self.plain_steps_left -= 1
            return False
        if self.drafted_since_plain < self.drafting_window:
            return True
        if not self.costs.recent_plain_steps:
            return False
        if not self.recent_drafted_steps:  # a new call's window may be empty
            return True
        return self.drafted_since_plain < self._retiming_interval()

    def _retiming_interval(self) -> float:
        """Drafted steps between plain steps that re-time them, for the window's speed s over plain steps: within
        `control_margin` of break-even, drafting is judged against plain steps as timed now (a drafter that pays
        times none otherwise, and plain steps timed in a busy minute, or a first call's, made an untrained drafter
        look as if it paid). Each such step forgoes s - 1 steps' worth of drafting's gain, so the interval grows
        with it to cost at most `control_cost`, and is 16 steps at least: every 17th step cost native MTP k=1, at
        1.2x of plain decoding, about 1% of its speed (now 34 drafted steps at 1.2x, 19 at 1.1x)."""
        speed = self._speed(*self.recent_drafted_steps.typical())
        if speed >= 1.0 + self.control_margin:
            return math.inf
        return max(self.drafting_window, math.ceil((speed - 1.0) / (self.control_cost * speed)))

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

    def _speed(self, tokens: float, seconds: float) -> float:
        """`tokens` per step in `seconds` over plain steps' speed as timed now."""
        return tokens / seconds * self.costs.plain_step_seconds()

    def _loses_widely(self, steps: DraftedSteps) -> bool:
        """Whether `steps` ran `wide_loss` or more slower than plain steps (their typical step)."""
        return self._speed(*steps.typical()) < 1.0 - self.wide_loss

    def _pays(self, tokens: float, seconds: float) -> bool:
        """Whether `tokens` per step in `seconds` beat plain steps less `break_even_margin`: a drafter within it of
        break-even keeps drafting. Switching it off costs more than the margin: every skipped step still runs in
        the assisted loop, each probe catches up on the skipped context (native MTP k=1's probes measured 13%
        slower than its steps while it drafted every step), and a long wait takes many probes to end. Steps that
        brought one token each (every draft rejected, or cut before the verify) never pay, whatever the clock says: a
        drafted step costs a plain one and a drafter forward. Judged by seconds against plain steps timed in a busy
        minute, an untrained drafter whose every draft was cut read 1.2x-1.6x and drafted 227 of a call's 255 steps."""
        return tokens > 1.0 and self._speed(tokens, seconds) >= 1.0 - self.break_even_margin

    def _drafting_pays(self) -> bool:
        """Unless the recent drafted steps show drafting losing to plain steps beyond their noise: their mean tokens
        per step gets two standard errors of benefit of the doubt, each verified step counting as at least a fair
        coin's (spread 0.5); a step whose drafts were all cut verified nothing and adds no doubt. One step's
        accept/reject is a coin flip; with one standard error, native MTP k=1, which wins by about 10% here, was
        judged losing often enough to skip a quarter of its steps, while a drafter that loses by more than that
        is still caught within a few steps. Their seconds count by the median: one slow step (a first call's
        one-off costs, a busy machine) stays in the window until 16 probes replace it."""
        window = self.recent_drafted_steps
        tokens, seconds = window.typical()
        if self._pays(tokens, seconds):  # most steps of a drafter that pays: no doubt to weigh
            return True
        if self._long_run_pays() and not self._loses_widely(window):
            return True
        if self._long_run_loses():
            return False
        verified = [step.tokens for step in window if step.verified > 1]
        spread = max(sample_stdev(verified) if len(verified) > 1 else 0.0, 0.5)
        return self._pays(tokens + 2 * spread * math.sqrt(len(verified)) / len(window), seconds)

    def _long_run_pays(self) -> bool:
        """Whether the drafted steps over calls (at least `long_run_minimum`) paid, within `break_even_margin`.
        Their mean is known to a few percent where a 16-step window's is known to a fifth: native MTP k=1 at T=0,
        about 5% ahead of plain decoding, read a window losing by noise often enough to skip 14% of its steps (1.04x
        against the fixed schedule's 1.06x), so a window that loses by less than `wide_loss` does not outvote it."""
        return len(self.long_run) >= self.long_run_minimum and self._pays(*self.long_run.typical())

    def _long_run_loses(self) -> bool:
        """Whether the drafted steps over calls (at least `doubt_evidence`) lost beyond `break_even_margin`: then a
        window that pays only by the benefit of the doubt does not draft on. The doubt is for a window's noise, which
        the long run has averaged out: the shipped drafter at T=1, about 0.75x of plain sampling over the calls,
        drafted runs of 20-44 steps whose windows read 0.85x-0.94x and paid by the doubt alone (1-2% of its steps,
        0.97x-0.99x of plain sampling). Native MTP k=1 at T=0, ahead over the calls, keeps the doubt."""
        return len(self.long_run) >= self.doubt_evidence and not self._pays(*self.long_run.typical())

    def _drafted_seconds(self, step: StepRecord) -> float:
        """A drafted step's seconds as the steps after it would take: a step that caught up on the prompt or on
        skipped steps' context is judged with a typical drafter forward. Its own cost is paid once, whatever the
        step decides. Native MTP k=1, at 1.23x of plain decoding on a prompt under the fixed schedule, caught up on
        up to 64 skipped steps in each probe (40-100 ms, against 18 ms a drafted step), judged every probe losing,
        and waited through four calls of it in a row (0.97x)."""
        if step.caught_up and self.costs.drafter_forward.value is not None:
            return self.costs.draft_seconds(step.drafter_forwards) + step.other_seconds
        return step.draft_seconds + step.other_seconds

    def record(self, step: StepRecord) -> None:
        self.costs.record(step)
        if not step.drafter_forwards:
            self.drafted_since_plain = 0
            return
        self.drafted_since_plain += 1
        self.calibration.update(step.confidences, step.proposed, step.accepted)
        drafted = DraftedStep(step.accepted + 1, step.proposed + 1, self._drafted_seconds(step))
        probe = self.backoff > 1  # the first drafted step after a backoff
        self.recent_drafted_steps.append(drafted)
        self.long_run.append(drafted)
        if self._drafting_pays():
            self.backoff = 1
            return
        # Decode plainly for a while, then probe. The window still holds the steps from before the backoff, so a
        # probe that pays on its own only shortens the wait; one that loses lengthens the next. A drafter that
        # started to pay drafts again within about 1,400 steps of the longest backoff (1,700 where waits run on to a
        # call's end: `waiting_steps`), not 16 of them. Once the wait is down to one step, steps that pay on their
        # own draft back to back until the window turns: a hard stretch of text at T=0 cost HyperDFlash every other
        # step until then (10-24 steps a prompt skipped).
        if (probe or self.backoff == 1) and self._pays(drafted.tokens, drafted.seconds):
            self.backoff = max(self.backoff // self.backoff_growth, 1)
            self.plain_steps_left = self.backoff if self.backoff > 1 else 0
        else:  # a wait past 64 steps needs a full window that loses widely (a first call's one-off costs can make
            # one step lose; near break-even, a probe costs little and this machine's timings drift by more) in a
            # long run that lost widely too: a hard stretch of text left HyperDFlash at T=0, twice as fast as plain
            # decoding over the calls, waiting through the rest of a call, and native MTP k=1, near break-even over
            # the calls, waited 256 steps on an easy prompt after one rejected probe while its window still held
            # a hard prompt's steps (0.86x of the fixed schedule on it)
            self.plain_steps_left = self.backoff
            window = self.recent_drafted_steps
            wide = len(window) == self.drafting_window and self._loses_widely(window)
            wide = wide and self._loses_widely(self.long_run)
            self.backoff = min(
                self.backoff_growth * self.backoff, self.max_backoff if wide else self.max_short_backoff
            )


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


@dataclass(frozen=True)
class ScheduleKey:
    """What the adaptive schedule's learned state holds for, besides the target instance: where and in which
    precision the target and the drafter run (step costs), how tokens are picked (`temperature` None: greedy;
    acceptance depends on it) and the call's longest draft (whether drafting pays)."""

    target_device: str
    target_dtype: str
    drafter_device: str
    drafter_dtype: str
    temperature: float | None
    max_draft: int

    @classmethod
    def of(cls, target, drafter, generation_config, max_draft: int) -> ScheduleKey:
        """For a call of `target.generate(assistant_model=drafter)` under `generation_config`."""
        temperature = None
        if generation_config.do_sample:
            temperature = float(generation_config.temperature if generation_config.temperature is not None else 1.0)
        devices = (str(target.device), str(target.dtype), str(drafter.device), str(drafter.dtype))
        return cls(*devices, temperature, max_draft)


class ScheduleMemory:
    """What the adaptive schedule learned with one drafter, kept between its generate() calls: an
    `AdaptiveDraftPolicy` per target instance (held weakly: a freed target takes its entries along) and `ScheduleKey`.

    Thread-safe without serialising calls: a call decodes with a private copy of the learned policy and puts its own
    back once it completes; with concurrent calls, the one that completes last is kept (as for
    `last_generation_stats`). A copy of the drafter (deepcopy, pickle) starts with an empty memory: what it holds
    belongs to this machine and these target instances.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._policies: weakref.WeakKeyDictionary[object, dict[ScheduleKey, AdaptiveDraftPolicy]] = (
            weakref.WeakKeyDictionary()
        )

    def checkout(self, target, key: ScheduleKey) -> AdaptiveDraftPolicy:
        """A private copy of what was learned for (`target`, `key`), or a fresh policy."""
        with self._lock:
            learned = self._policies.get(target, {}).get(key)
        # A kept policy is never changed again (its call is over), so it is copied outside the lock
        return learned.copy() if learned is not None else AdaptiveDraftPolicy(key.max_draft)

    def keep(self, target, key: ScheduleKey, policy: AdaptiveDraftPolicy) -> None:
        """After a call completed: its policy is what the next call with (`target`, `key`) starts from."""
        with self._lock:
            self._policies.setdefault(target, {})[key] = policy

    def settings(self, target) -> list[ScheduleKey]:
        """The settings learned with `target`."""
        with self._lock:
            return list(self._policies.get(target, {}))

    def clear(self) -> None:
        with self._lock:
            self._policies.clear()

    def __deepcopy__(self, memo: dict) -> ScheduleMemory:
        return ScheduleMemory()

    def __reduce__(self) -> tuple:
        return ScheduleMemory, ()


_MEMORY_ATTRIBUTE = "_hyperdflash_schedule_memory"  # on the drafter instance: not a parameter, buffer or config entry


def schedule_memory(drafter) -> ScheduleMemory:
    """The drafter's `ScheduleMemory`, made on first use (`dict.setdefault` is atomic: concurrent first calls get
    the same one)."""
    return vars(drafter).setdefault(_MEMORY_ATTRIBUTE, ScheduleMemory())


@contextmanager
def schedule_memory_of(drafter, memory: ScheduleMemory) -> Iterator[None]:
    """While it lasts, `drafter`'s calls learn from and into `memory`: evaluation methods that share one drafter
    are separate sessions. Not for concurrent calls on `drafter`."""
    saved = vars(drafter).get(_MEMORY_ATTRIBUTE)
    vars(drafter)[_MEMORY_ATTRIBUTE] = memory
    try:
        yield
    finally:
        if saved is None:
            del vars(drafter)[_MEMORY_ATTRIBUTE]
        else:
            vars(drafter)[_MEMORY_ATTRIBUTE] = saved


def reset_draft_schedule(drafter) -> None:
    """Forget what the adaptive schedule learned with `drafter` (every target and setting): its next call starts
    afresh. The heuristic schedule's length is `drafter.generation_config.num_assistant_tokens`; set that."""
    memory = vars(drafter).get(_MEMORY_ATTRIBUTE)
    if memory is not None:
        memory.clear()


class CallSchedule:
    """One generate() call's draft policy and confidence threshold, and what the call leaves for the drafter's next
    one once it completes: "adaptive" what it learned (`ScheduleMemory`), "heuristic" its draft length (on
    `drafter.generation_config.num_assistant_tokens`, where transformers keeps it)."""

    def __init__(self, name: str, drafter, target, generation_config, num_draft_tokens: int):
        self.name, self.drafter, self.target = name, drafter, target
        if name == ADAPTIVE_SCHEDULE:
            self.key = ScheduleKey.of(target, drafter, generation_config, num_draft_tokens)
            self.policy: DraftPolicy = schedule_memory(drafter).checkout(target, self.key)
            self.policy.begin_call()
        elif name == ADAPTIVE_TRANSIENT_SCHEDULE:
            self.policy = AdaptiveDraftPolicy(num_draft_tokens)
        elif name in (HEURISTIC_SCHEDULE, HEURISTIC_TRANSIENT_SCHEDULE):
            self.policy = HeuristicDraftPolicy(_longest_heuristic_draft(drafter, num_draft_tokens), num_draft_tokens)
        else:
            self.policy = ConstantDraftPolicy(num_draft_tokens)
        threshold = drafter.generation_config.assistant_confidence_threshold
        self.threshold = ConfidenceThreshold(float(threshold)) if threshold else None

    @property
    def may_wait(self) -> bool:
        """Whether steps may skip drafting for a while ("adaptive"): then the call runs its waits in plain
        decoding's loop (`stretches.py`)."""
        return isinstance(self.policy, AdaptiveDraftPolicy)

    def decodes_plainly(self, steps: int) -> bool:
        """The call's `steps` steps would all skip drafting: what "adaptive" learned says drafting loses for longer."""
        return self.may_wait and self.policy.decodes_plainly(steps)

    def plain_stretch(self, steps_left: int) -> int:
        """How many of the call's next steps (of `steps_left`) to decode in plain decoding's loop: the rest of the
        wait, when it is `MIN_PLAIN_STRETCH` steps or more or reaches the call's end; else none."""
        if not self.may_wait or steps_left <= 0:
            return 0
        wait = self.policy.waiting_steps(steps_left)
        return wait if wait >= min(MIN_PLAIN_STRETCH, steps_left) else 0

    def finish(self) -> None:
        if self.name == ADAPTIVE_SCHEDULE:
            schedule_memory(self.drafter).keep(self.target, self.key, self.policy)
        elif self.name == HEURISTIC_SCHEDULE:
            self.drafter.generation_config.num_assistant_tokens = self.policy.num_assistant_tokens


def _longest_heuristic_draft(drafter, num_draft_tokens: int) -> int:
    """How far the heuristic schedule may grow the draft: a block drafter's block, else `MAX_MTP_DEPTH`."""
    config = drafter.config
    return config.block_size - 1 if config.model_type == BLOCK_DRAFTER_TYPE else max(num_draft_tokens, MAX_MTP_DEPTH)
