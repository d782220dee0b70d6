"""Drafts copied from the context: the prompt and the tokens committed so far, beside the drafter's own.

Text often repeats what came before it (an edit of a quoted passage, a summary that reuses its source's words, code,
the question's terms in the answer). `SuffixIndex` finds, for a row's newest tokens, the most recent earlier place
they occurred and proposes what followed there, as suffix-decoding proposers do. `ChainChooser` decides each step
which chain the target verifies: the copied one or the drafter's. One chain a step, so it stays exact on every
family and in batches.

Exactness under sampling: a copied chain is deterministic, so it is verified with q one-hot at its tokens (a draft is
kept with probability p(token); a rejected one is replaced by a draw from p without that token). Which chain a step
verifies is decided from what is known before any drafter token is drawn: earlier steps, the copy's match, and the
drafter's confidence at its first position (its top probability there, computed before any token is drawn). Given the
choice, each chain is what it would be alone, so speculative sampling keeps the target's distribution either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .draft_policy import AcceptanceCalibration, DraftPolicy, expected_tokens

LONGEST_SUFFIX = 3  # the longest suffix of a row's tokens looked up; shorter ones when it has no earlier occurrence


class SuffixIndex:
    """One row's tokens, and for every n-gram (n <= `LONGEST_SUFFIX`) in them where its most recent occurrence ends.

    `extend` takes the row's newly committed tokens: O(new tokens) per step. An occurrence is indexed once a token
    follows it, so a lookup of the row's own suffix finds an earlier occurrence, never itself."""

    def __init__(self):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the column just after its most recent occurrence

    def extend(self, tokens: Sequence[int]) -> None:
        first_new_end = max(len(self.tokens), 1)
        self.tokens.extend(tokens)
        for end in range(first_new_end, len(self.tokens)):
            for n in range(1, min(LONGEST_SUFFIX, end) + 1):
                self.ends[tuple(self.tokens[end - n : end])] = end

    def continuation(self, length: int) -> tuple[list[int], int]:
        """`length` tokens that followed the most recent earlier occurrence of the row's longest suffix that has one,
        and that suffix's length (0 and no tokens: none has). Where the copy reaches the row's end it goes on with
        the tokens it copied, as a repeating stretch would."""
        for n in range(min(LONGEST_SUFFIX, len(self.tokens)), 0, -1):
            end = self.ends.get(tuple(self.tokens[-n:]))
            if end is not None:
                chain = self.tokens[end : end + length]
                while len(chain) < length:  # the stretch from `end` on, repeated
                    chain.append(chain[len(chain) - (len(self.tokens) - end)])
                return chain, n
        return [], 0


class ChainRecord:
    """P(draft j is accepted | the drafts before it were), per position, from the steps verified so far; each
    position starts from `prior` with the weight of two tries."""

    def __init__(self, length: int, prior: float = 0.5):
        self.accepted, self.tried = [2.0 * prior] * length, [2.0] * length

    def rates(self, length: int) -> list[float]:
        return [a / t for a, t in zip(self.accepted[:length], self.tried[:length], strict=True)]

    def update(self, matched: int, known: int, length: int) -> None:
        """A chain of `length` whose first `matched` drafts match the `known` tokens the target verified after the
        anchor: drafts 1..matched were accepted, the next one (if known) rejected, later ones unseen."""
        for j in range(min(matched + 1, known, length, len(self.tried))):
            self.tried[j] += 1
            self.accepted[j] += j < matched


def matched(chain: Sequence[int], known: Sequence[int]) -> int:
    """How many of `chain`'s first tokens equal the `known` ones."""
    count = 0
    for drafted, verified in zip(chain, known, strict=False):
        if drafted != verified:
            break
        count += 1
    return count


class ChainChooser:
    """Which chain a step verifies, by expected new tokens per unit of cost (`step_cost(drafter_forwards,
    verified_drafts)`, in plain steps), and how many of the copied chain's tokens.

    - Before the drafter runs (`copies_first`): copy without a drafter forward when the copy's best expected rate
      beats the drafter's from its record alone, with the drafter's forward in its cost.
    - After it ran (`copies_after`): the drafter's expected tokens from its first position's confidence (calibrated
      on the call's steps) and its record past that position, against the copy's; the forward is spent either way.

    The copy's record is kept per length of the matched suffix. It learns from every verified step (what the copied
    chain would have matched: its own steps' and the others'), the drafter's from every step the drafter ran. The
    drafter's starts optimistic, so it is tried before a copy that merely looks no worse replaces it."""

    drafter_prior = 0.8

    def __init__(self, max_draft: int, step_cost: Callable[[int, int], float] | None):
        """`step_cost`: the call's cost model (the adaptive schedule's); None: a schedule that drafts every step,
        where a copy only replaces the drafter's drafts after its forward, chosen by expected tokens alone."""
        self.max_draft = max_draft
        self.step_cost = step_cost or (lambda drafter_forwards, verified: 1.0)
        self.skips_drafter = step_cost is not None
        self.copy_records = {n: ChainRecord(max_draft) for n in range(1, LONGEST_SUFFIX + 1)}
        self.drafter_record = ChainRecord(max_draft, self.drafter_prior)
        self.first_calibration = AcceptanceCalibration()

    def copy_plan(self, chain_length: int, suffix: int, drafter_forwards: int) -> tuple[int, float]:
        """The copied chain's prefix with the best expected rate, and that rate."""
        if not chain_length:
            return 0, 1.0 / self.step_cost(drafter_forwards, 0)
        totals = expected_tokens(self.copy_records[suffix].rates(min(chain_length, self.max_draft)))
        return _best_prefix(totals, lambda k: self.step_cost(drafter_forwards, k))

    def copy_acceptance(self, suffix: int, length: int) -> list[float]:
        """The copied chain's chance of acceptance at each of its first `length` positions."""
        return self.copy_records[suffix].rates(length)

    def copies_first(self, chain_length: int, suffix: int, drafter_length: int) -> int:
        """Before the drafter's forward: how many copied drafts to verify without it (0: run the drafter)."""
        if not self.skips_drafter:
            return 0
        verified, copy_rate = self.copy_plan(chain_length, suffix, 0)
        totals = expected_tokens(self.drafter_record.rates(drafter_length))
        _, drafter_rate = _best_prefix(totals, lambda k: self.step_cost(1, k))
        return verified if verified and copy_rate > max(drafter_rate, 1.0 / self.step_cost(0, 0)) else 0

    def copies_after(self, first_confidence: float | None, drafter_length: int, chain_length: int, suffix: int) -> int:
        """After the drafter's forward: how many copied drafts to verify in place of its own (0: its own).
        `first_confidence` None: the drafter proposed nothing (its heads cut the block before its first draft)."""
        verified, copy_rate = self.copy_plan(chain_length, suffix, 1)
        if not verified:
            return 0
        totals = [1.0]  # no draft: the step gains the bonus token alone
        if first_confidence is not None:
            rates = self.drafter_record.rates(drafter_length)
            totals = expected_tokens([self.first_calibration.probability(first_confidence), *rates[1:]])
        _, drafter_rate = _best_prefix(totals, lambda k: self.step_cost(1, k))
        return verified if copy_rate > drafter_rate else 0

    def learn_copy(self, chain: Sequence[int], suffix: int, known: Sequence[int]) -> None:
        """A verified step: `known`, the tokens the target verified after the anchor (accepted drafts and the bonus
        token), against what the context offered at that anchor."""
        if chain:
            self.copy_records[suffix].update(matched(chain, known), len(known), len(chain))

    def learn_drafter(self, first_confidence: float, chain: Sequence[int], known: Sequence[int]) -> None:
        """A step the drafter ran for: its `chain` (the drafts it proposed, verified or not) against `known`."""
        if chain:
            count = matched(chain, known)
            self.first_calibration.update([first_confidence], 1, count)
            self.drafter_record.update(count, len(known), len(chain))


def _best_prefix(totals: Sequence[float], cost: Callable[[int], float]) -> tuple[int, float]:
    """The k with the best `totals[k] / cost(k)`, and that rate."""
    rates = [tokens / cost(k) for k, tokens in enumerate(totals)]
    best = max(range(len(rates)), key=rates.__getitem__)
    return best, rates[best]


def chain_chooser(policy: DraftPolicy) -> ChainChooser:
    """The call's chooser, with its schedule's cost model where it has one (the adaptive schedule's)."""
    costs = getattr(policy, "costs", None)
    return ChainChooser(policy.max_draft, None if costs is None else costs.step)
