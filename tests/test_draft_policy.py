"""The draft schedules: their arithmetic on synthetic steps, what they keep between calls, and what they do inside
generate()."""

import copy
import dataclasses
import gc
import pickle
import random
import statistics
import subprocess
import sys
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModel

from hf_hyperdflash.modeling import DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.modeling.draft_policy import (
    AcceptanceCalibration,
    AdaptiveDraftPolicy,
    CallSchedule,
    ConfidenceThreshold,
    ConstantDraftPolicy,
    DraftedStep,
    DraftedSteps,
    HeuristicDraftPolicy,
    ScheduleKey,
    ScheduleMemory,
    StepCosts,
    StepRecord,
    expected_tokens,
    lowest_cost_threshold,
    reset_draft_schedule,
    sample_stdev,
    schedule_memory,
)
from hf_hyperdflash.testing import tiny_deepseek_v4


def _step(proposed: int, accepted: int, seconds: float, draft: float = 0.0, confidences=None) -> StepRecord:
    confidences = confidences if confidences is not None else [0.5] * proposed
    forwards = 1 if draft else 0
    return StepRecord(confidences, proposed, accepted, forwards, draft, seconds)


def test_expected_tokens_multiply_acceptance_along_the_block():
    assert expected_tokens([]) == [1.0]  # exact: the starting value, no arithmetic
    assert expected_tokens([0.5, 0.5, 1.0]) == pytest.approx([1.0, 1.5, 1.75, 2.0])


def test_calibration_counts_accepted_drafts_and_the_first_rejected_one_only():
    calibration = AcceptanceCalibration(bins=2, prior_weight=2.0)
    assert calibration.probability(0.9) == pytest.approx(0.75)  # the prior: acceptance = bin centre
    calibration.update([0.9, 0.9, 0.1, 0.1], proposed=4, accepted=2)  # drafts 1-2 accepted, 3 rejected, 4 unseen
    assert calibration.probability(0.9) == pytest.approx((1.5 + 2) / 4)
    assert calibration.probability(0.1) == pytest.approx(0.5 / 3)
    calibration.update([0.1], proposed=0, accepted=0)  # drafted but nothing verified: nothing learned
    assert calibration.probability(0.1) == pytest.approx(0.5 / 3)


def test_calibration_evidence_is_capped_so_old_calls_fade():
    calibration = AcceptanceCalibration(bins=1, prior_weight=2.0, max_weight=10.0)
    for _ in range(20):
        calibration.update([0.5], proposed=1, accepted=1)
    assert calibration.tried == [10.0] and calibration.probability(0.5) > 0.9
    for _ in range(10):  # the drafter stops matching: ten rejections outweigh the twenty acceptances
        calibration.update([0.5], proposed=1, accepted=0)
    assert calibration.tried == [10.0] and calibration.probability(0.5) < 0.4


def test_drafted_steps_keep_the_mean_tokens_and_median_seconds_of_the_last_ones():
    """Kept up to date step by step, they read what `statistics` reads from the steps kept (exactly: the tokens are
    counts, the median is one or the mean of two of the seconds), through evictions and equal seconds."""
    rng = random.Random(0)
    steps = DraftedSteps(size=7)
    for i in range(60):
        step = DraftedStep(tokens=rng.randint(1, 8), verified=8, seconds=rng.choice([0.5, 1.0, rng.random()]))
        steps.append(step)
        kept = list(steps)
        assert len(kept) == min(i + 1, 7) and kept[-1] is step
        assert steps.typical() == (
            statistics.fmean(s.tokens for s in kept),
            statistics.median(s.seconds for s in kept),
        )
    twin = steps.copy()
    twin.append(DraftedStep(tokens=100, verified=8, seconds=100.0))
    assert steps.typical()[0] < 9 and twin.typical()[0] > 9
    steps.clear()
    steps.append(DraftedStep(tokens=2, verified=3, seconds=0.25))
    assert steps.typical() == (2.0, 0.25) and len(steps) == 1
    assert sample_stdev([1, 2, 2, 5]) == pytest.approx(statistics.stdev([1, 2, 2, 5]), rel=1e-12)


def test_step_costs_are_flat_from_one_length_and_a_line_from_several():
    costs = StepCosts()
    assert costs.step_seconds_up_to(4) is None
    costs.record(_step(proposed=7, accepted=7, seconds=2.0, draft=0.5))
    assert costs.step_seconds_up_to(8) == [2.0] * 8  # one length seen: a GPU-like flat cost (2.0 + 0.0 * n, exact)
    assert costs.draft_seconds(2) == pytest.approx(1.0)
    costs.record(_step(proposed=0, accepted=0, seconds=1.0))
    assert costs.step_seconds_up_to(8) == pytest.approx([1.0 + n / 7 for n in range(8)])  # the line (1, 1.0)-(8, 2.0)
    falling = StepCosts()
    falling.record(_step(proposed=0, accepted=0, seconds=2.0))
    falling.record(_step(proposed=7, accepted=0, seconds=1.0, draft=0.1))
    assert falling.step_seconds_up_to(4) == pytest.approx([1.5] * 4)  # slope 0 at least: longer is never cheaper
    assert falling.plain_step_seconds() == 2.0  # a skipped step as timed


def test_a_plain_step_is_what_most_of_the_last_32_took():
    """One slow plain step must not make drafting look cheap: while a drafter drafts, no plain step corrects it."""
    costs = StepCosts()
    for seconds in [1.0] * 20 + [5.0, 4.0] + [1.1] * 10:
        costs.record(_step(proposed=0, accepted=0, seconds=seconds))
    assert costs.plain_step_seconds() == 1.0
    for _ in range(20):  # cut steps verify one token too, but after a drafter forward: no plain steps
        costs.record(_step(proposed=0, accepted=0, seconds=3.0, draft=0.3))
    assert costs.plain_step_seconds() == 1.0 and costs.step_seconds_up_to(1)[0] > 2.0


def test_plain_decodings_own_loop_leaves_32_steps_spread_over_the_call():
    costs = StepCosts()
    costs.record_plain_loop([0.001 * n for n in range(255)])
    assert list(costs.recent_plain_steps) == pytest.approx([0.001 * n for n in range(0, 255, 8)])  # 32 of them
    assert costs.plain_step_seconds() == pytest.approx(0.001 * (8 * 15 + 8 * 16) / 2)


def test_a_schedule_that_timed_no_plain_step_decodes_its_17th_step_plainly():
    """Until a plain step is timed the step-cost line stands in for one (so short calls draft from the start); after
    16 drafted steps one step decodes plainly to time it, and a drafter far ahead of it never stops again."""
    policy = AdaptiveDraftPolicy(max_draft=7)
    probes = _decode(policy, 60, _step(proposed=3, accepted=3, seconds=1.0, draft=0.2, confidences=[0.9] * 7))
    assert probes == [i for i in range(60) if i != 16]
    assert policy.costs.plain_step_seconds() == 1.0


def test_every_length_reads_the_line_weighted_by_how_often_it_was_timed():
    costs = StepCosts()
    for _ in range(20):  # lengths 1 and 8, timed often, on the line 1 + (n - 1) / 7
        costs.record(_step(proposed=0, accepted=0, seconds=1.0))
        costs.record(_step(proposed=7, accepted=0, seconds=2.0, draft=0.1))
    costs.record(_step(proposed=3, accepted=0, seconds=5.0, draft=0.1))  # length 4 once, in a slow step
    seconds = costs.step_seconds_up_to(8)
    assert seconds == sorted(seconds)  # longer never cheaper, length 4 included
    # The slow step moves the line by its weight: 1 of 33
    assert (
        seconds[3] < 2.0 and seconds[0] == pytest.approx(1.0, abs=0.15) and seconds[7] == pytest.approx(2.0, abs=0.15)
    )


def test_choose_truncates_where_more_drafts_cost_more_than_they_bring():
    policy = AdaptiveDraftPolicy(max_draft=4)
    confident, unsure = [0.95, 0.95, 0.05, 0.05], [0.05] * 4
    assert policy.choose(confident) == 4  # nothing timed yet: verify everything
    policy.costs.record(_step(proposed=4, accepted=2, seconds=1.0, draft=0.2))
    assert policy.choose(confident) == 4  # one length seen, flat cost: every draft with any chance is free
    policy.costs.record(_step(proposed=0, accepted=0, seconds=0.5))  # a CPU: 1 token 0.5 s, 5 tokens 1.0 s
    assert policy.choose(confident) == 2
    assert policy.choose(unsure) == 0


def _time_plain_steps(policy: AdaptiveDraftPolicy) -> None:
    """Three plain steps timed, at 1 second each."""
    for _ in range(3):
        policy.record(_step(proposed=0, accepted=0, seconds=1.0))


def _decode(policy: AdaptiveDraftPolicy, steps: int, drafted: StepRecord) -> list[int]:
    """Run `steps` steps, recording `drafted` for each one that drafts and a 1-second plain step otherwise; the
    indices of the steps that drafted."""
    probes = []
    for i in range(steps):
        if policy.should_draft():
            probes.append(i)
            policy.record(drafted)
        else:
            policy.record(_step(proposed=0, accepted=0, seconds=1.0))
    return probes


def _gaps(probes: list[int]) -> list[int]:
    """Plain steps between consecutive drafted ones."""
    return [b - a - 1 for a, b in zip(probes, probes[1:], strict=False)]


def test_losing_drafts_back_off_fourfold_and_a_winning_probe_resumes_drafting():
    policy = AdaptiveDraftPolicy(max_draft=7)
    _time_plain_steps(policy)  # plain steps: 1 token per second
    # Every draft is rejected and costs half a step on top: 1 token per 1.5 s. Two standard errors of benefit of the
    # doubt (a coin's at least) and the 5% break-even margin keep the first 5 drafted steps; then the waits grow,
    # past 64 steps once 16 drafted steps (the window) agree
    losing = _step(proposed=1, accepted=0, seconds=1.0, draft=0.5, confidences=[0.01])
    probes = _decode(policy, 2000, losing)
    gaps = _gaps(probes)
    assert gaps == [0] * 5 + [1, 4, 16] + [64] * 8 + [256, 1024]
    assert policy.backoff == 1024
    left = policy.plain_steps_left  # a call up to a quarter of the backoff longer waits on to its end
    assert policy.decodes_plainly(left + 256) and not policy.decodes_plainly(left + 257)
    # Drafts now bring 4 tokens per step: one probe turns the window, and every step drafts again
    winning = _step(proposed=3, accepted=3, seconds=1.0, draft=0.5, confidences=[0.9] * 3)
    waiting = policy.plain_steps_left
    assert _decode(policy, waiting + 400, winning) == list(range(waiting, waiting + 400))
    assert policy.backoff == 1


def test_a_long_wait_ending_near_the_calls_end_runs_on_to_it():
    """Past 64 steps (a wide loss), a wait that would end up to a quarter of its backoff before the call's end covers
    the call: the probe opens the next one. Shorter waits, and calls that go on longer, end the wait where it ends."""
    policy = AdaptiveDraftPolicy(max_draft=7)
    policy.backoff, policy.plain_steps_left = 1024, 40
    assert [policy.waiting_steps(steps) for steps in (30, 40, 296, 297)] == [30, 40, 296, 40]
    policy.skip(296, [])
    assert policy.plain_steps_left == 0 and policy.waiting_steps(256) == 0  # the next call probes first
    policy.backoff, policy.plain_steps_left = 64, 40  # a short wait: drafting did not lose widely
    assert policy.waiting_steps(50) == 40 and not policy.decodes_plainly(50)


def test_steps_that_bring_one_token_never_pay_whatever_the_clock_says():
    """Plain steps timed slow (a busy minute: 1 s) and drafted steps timed fast (0.5 s), every draft cut before the
    verify: one token a step reads 2x of plain decoding by the clock, yet gains nothing. Such steps back off; one
    accepted draft a step is judged by the clock as before."""
    policy = AdaptiveDraftPolicy(max_draft=7)
    _time_plain_steps(policy)
    cut = _step(proposed=0, accepted=0, seconds=0.3, draft=0.2)
    assert len(_decode(policy, 400, cut)) < 40 and policy.backoff > 1
    policy = AdaptiveDraftPolicy(max_draft=7)
    _time_plain_steps(policy)
    assert len(_decode(policy, 400, _step(3, 1, 0.3, draft=0.2))) > 300


def test_probes_that_pay_shorten_the_wait_until_the_window_turns():
    policy = AdaptiveDraftPolicy(max_draft=7)
    _time_plain_steps(policy)
    for _ in range(17):  # a full window of losing steps, and the longest backoff
        policy.record(_step(proposed=1, accepted=0, seconds=1.0, draft=0.5))
    assert policy.backoff == 1024
    waiting = policy.plain_steps_left
    # 2 tokens per 1.5 s: each probe pays on its own, and shortens the wait fourfold; the third turns the window
    better = _step(proposed=3, accepted=1, seconds=1.0, draft=0.5)
    probes = _decode(policy, waiting + 400, better)
    assert probes[0] == waiting
    assert _gaps(probes[:3]) == [256, 64]
    assert probes[2:] == list(range(probes[2], waiting + 400))


def test_a_probe_is_judged_without_the_context_it_caught_up_on():
    """A probe's drafter forward also takes in the skipped steps' context (or the prompt): paid once, it says nothing
    of the steps after. Judged with a typical drafter forward (0.5 s), a probe at 2 tokens per 1.5 s pays and
    shortens the wait; by its own 4.5 s it would lose and lengthen it. A drafter never timed counts what it took."""
    policy = AdaptiveDraftPolicy(max_draft=1)
    _time_plain_steps(policy)
    for _ in range(17):  # a full window losing widely: the longest backoff
        policy.record(_step(proposed=1, accepted=0, seconds=1.0, draft=0.5))
    assert policy.backoff == 1024
    judged_by_its_own_seconds = policy.copy()
    probe = _step(proposed=1, accepted=1, seconds=1.0, draft=3.5)
    judged_by_its_own_seconds.record(probe)
    policy.record(dataclasses.replace(probe, caught_up=True))
    assert (policy.backoff, policy.plain_steps_left) == (256, 256)
    assert judged_by_its_own_seconds.plain_steps_left == 1024
    assert policy.costs.drafter_forward.value == pytest.approx(0.5) and policy.recent_drafted_steps[-1].seconds == 1.5
    fresh = AdaptiveDraftPolicy(max_draft=1)
    fresh.record(dataclasses.replace(probe, caught_up=True))
    assert fresh.recent_drafted_steps[-1].seconds == 4.5 and fresh.costs.drafter_forward.value is None


def test_after_a_one_step_wait_steps_that_pay_on_their_own_draft_back_to_back():
    """A hard stretch of text turns the window losing; once the drafts pay again, each step that pays on its own
    drafts the next one too, however many losing steps the window still holds (not every other step)."""
    policy = AdaptiveDraftPolicy(max_draft=7)
    _time_plain_steps(policy)
    losing = _step(proposed=1, accepted=0, seconds=1.0, draft=0.5, confidences=[0.01])
    for _ in range(16):
        policy.record(losing)  # a full window of losing steps
    policy.backoff, policy.plain_steps_left = 4, 0  # as after its first, one-step wait
    better = _step(proposed=3, accepted=1, seconds=1.0, draft=0.5)  # 2 tokens per 1.5 s: pays on its own
    # Step 0 re-times a plain step (16 drafted steps near break-even since the last), then every step drafts
    assert _decode(policy, 20, better) == list(range(1, 20))
    assert (policy.backoff, policy.plain_steps_left) == (1, 0)


def test_a_step_whose_drafts_were_all_cut_is_one_certain_token_in_the_window():
    """A drafter forward that verified nothing brought one token for sure: alone in the window it loses at once (an
    untrained drafter on a busy machine drafted every step and verified nothing, while the doubt a coin flip
    deserves kept it on), where a step that verified its draft and lost it keeps drafting for a few steps; among
    steps that paid, one cut step is outweighed, not a loss that starts a wait."""
    cut, rejected, paying = (AdaptiveDraftPolicy(max_draft=7) for _ in range(3))
    for policy in (cut, rejected, paying):
        _time_plain_steps(policy)
    for _ in range(8):
        paying.record(_step(proposed=3, accepted=3, seconds=1.0, draft=0.2, confidences=[0.9] * 7))
    cut_step = _step(proposed=0, accepted=0, seconds=1.0, draft=0.1, confidences=[0.01] * 7)
    cut.record(cut_step)
    paying.record(cut_step)
    rejected.record(_step(proposed=1, accepted=0, seconds=1.0, draft=0.1, confidences=[0.01] * 7))
    assert (cut.plain_steps_left, cut.backoff) == (1, 4)
    assert (rejected.plain_steps_left, rejected.backoff) == (0, 1)
    assert (paying.plain_steps_left, paying.backoff) == (0, 1)


def test_a_new_call_drafts_again_when_drafting_paid_over_the_calls_so_far():
    """What text a call decodes decides how well a drafter does: a drafter that paid over its drafted steps starts
    the next call drafting, with an empty window, however the last call ended; one that never paid keeps its wait."""
    winning = _step(proposed=1, accepted=1, seconds=1.0, draft=0.2, confidences=[0.9])
    losing = _step(proposed=1, accepted=0, seconds=1.0, draft=0.5, confidences=[0.5])
    paid, never_paid = AdaptiveDraftPolicy(max_draft=1), AdaptiveDraftPolicy(max_draft=1)
    _decode(paid, 100, winning)  # 2 tokens per 1.2 s over 100 steps, then a hard stretch
    for policy in (paid, never_paid):
        _decode(policy, 200, losing)
        assert policy.backoff > 16 and policy.plain_steps_left > 0
        waiting = (policy.backoff, policy.plain_steps_left)
        policy.begin_call()
    assert (paid.backoff, paid.plain_steps_left, len(paid.recent_drafted_steps)) == (1, 0, 0)
    assert (never_paid.backoff, never_paid.plain_steps_left) == waiting
    assert paid.should_draft() and not never_paid.should_draft()


def test_near_break_even_waits_stay_short_also_into_the_next_call():
    """A drafter that loses by less than a fifth (here 1 token per 1.1 s against plain steps' 1 per second: its
    drafts all cut, so no doubt keeps it on) waits 64 steps at most, and a new call keeps its window and at most 16
    steps of the wait (a fresh start drafted a full window again each call); one that loses widely keeps a wait of
    up to 1024 steps (`test_losing_drafts_back_off_fourfold...`), one that paid starts drafting
    (`test_a_new_call_drafts_again...`)."""
    policy = AdaptiveDraftPolicy(max_draft=7)
    _time_plain_steps(policy)
    close = _step(proposed=0, accepted=0, seconds=1.0, draft=0.1, confidences=[0.01] * 7)
    probes = _decode(policy, 2000, close)
    gaps = _gaps(probes)
    assert gaps[:4] == [1, 4, 16, 64] and set(gaps[4:]) == {64}
    policy.backoff, policy.plain_steps_left = 256, 200  # as a hard stretch's wide window could have left it
    policy.begin_call()
    assert (policy.backoff, policy.plain_steps_left, len(policy.recent_drafted_steps)) == (64, 16, 16)
    assert not policy.should_draft()


def test_a_drafter_that_paid_over_the_long_run_waits_short_through_a_hard_stretch():
    """Drafting loses widely for a while (one token per 1.5 s against plain steps' 1 per second) after 100 steps
    at 2 tokens per 1.2 s: the waits stop at 64 steps, so drafting resumes soon after the text gets easy again."""
    policy = AdaptiveDraftPolicy(max_draft=1)
    _decode(policy, 100, _step(proposed=1, accepted=1, seconds=1.0, draft=0.2, confidences=[0.9]))
    probes = _decode(policy, 2000, _step(proposed=1, accepted=0, seconds=1.0, draft=0.5, confidences=[0.5]))
    gaps = _gaps(probes)
    assert max(gaps) == 64 and gaps.count(64) > 10


def test_waits_past_64_steps_need_a_long_run_that_lost_widely_too():
    """A hard stretch after 300 drafted steps near break-even (1 token per 1.1 s, 0.91x of plain steps) fills
    the window with steps that lose widely (1 token per 1.5 s): the waits stop at 64 steps, as the next easier text
    may pay again. A drafter whose every drafted step lost widely waits up to 1024."""
    near, losing = AdaptiveDraftPolicy(max_draft=1), AdaptiveDraftPolicy(max_draft=1)
    for policy in (near, losing):
        _time_plain_steps(policy)
    for _ in range(300):
        near.long_run.append(DraftedStep(tokens=1, verified=1, seconds=1.1))
    assert not near._loses_widely(near.long_run)
    hard = _step(proposed=1, accepted=0, seconds=1.0, draft=0.5, confidences=[0.5])
    assert max(_gaps(_decode(near, 3000, hard))) == 64 and near._loses_widely(near.recent_drafted_steps)
    assert max(_gaps(_decode(losing, 3000, hard))) == 1024


def test_a_window_that_loses_narrowly_does_not_outvote_a_long_run_that_paid():
    """After 200 drafted steps at 1.25x of plain steps, steps whose drafts are all cut (1 token per 1.1 s: 0.91x)
    keep drafting, but for a plain step every 17th, until the long run itself stops paying (after about 185 of
    them); after only 100 paying steps, or against steps that lose widely (1 per 1.5 s), the window decides."""
    paying = _step(proposed=1, accepted=1, seconds=1.4, draft=0.2, confidences=[0.9])
    narrow = _step(proposed=0, accepted=0, seconds=1.0, draft=0.1, confidences=[0.01])
    wide = _step(proposed=1, accepted=0, seconds=1.0, draft=0.5, confidences=[0.5])
    long_run, short_run, hard_stretch = (AdaptiveDraftPolicy(max_draft=1) for _ in range(3))
    for policy, paid_steps in ((long_run, 200), (short_run, 100), (hard_stretch, 200)):
        _time_plain_steps(policy)
        assert len(_decode(policy, paid_steps + paid_steps // 16, paying)) >= paid_steps
    gaps = _gaps(_decode(long_run, 600, narrow))
    assert set(gaps[:150]) == {0, 1} and gaps[:150].count(1) < 12  # only the plain steps that re-time one
    assert max(gaps) >= 64 and not long_run._long_run_pays()
    assert max(_gaps(_decode(short_run, 600, narrow))[:30]) >= 4
    assert max(_gaps(_decode(hard_stretch, 600, wide))[:30]) >= 4


def test_a_long_run_that_lost_leaves_a_window_no_benefit_of_the_doubt():
    """Steps at 1 token per 1.1 s (0.91x of plain steps) pay only by the benefit of the doubt: with nothing drafted
    before they draft on, but for a plain step now and then, until 64 of them make a long run that lost; after 64
    drafted steps over calls at 0.87x, the first of them waits, and the waits grow. 40 such steps are no evidence
    yet (until 24 more join them); 64 at 1.33x (two tokens a step) leave the doubt in place."""
    near = _step(proposed=1, accepted=0, seconds=1.0, draft=0.1, confidences=[0.5])
    policies = {name: AdaptiveDraftPolicy(max_draft=1) for name in ("fresh", "lost", "too_few", "paid")}
    for name, (count, tokens, seconds) in {
        "lost": (64, 1, 1.15),
        "too_few": (40, 1, 1.15),
        "paid": (64, 2, 1.5),
    }.items():
        for _ in range(count):
            policies[name].long_run.append(DraftedStep(tokens=tokens, verified=2, seconds=seconds))
    for policy in policies.values():
        _time_plain_steps(policy)
    gaps = {name: _gaps(_decode(policy, 300, near)) for name, policy in policies.items()}
    assert max(gaps["fresh"][:60]) <= 1 and max(gaps["fresh"][60:]) >= 16
    assert gaps["lost"][:3] == [1, 4, 16]
    assert max(gaps["too_few"][:16]) <= 1 and max(gaps["too_few"][16:40]) >= 4 and max(gaps["paid"][:60]) <= 1


def test_a_drafter_near_break_even_re_times_plain_steps_the_more_often_the_nearer_it_is():
    """Plain steps timed in a busy minute (2 s) make a drafter at 2 tokens per 3.6 s look as if it paid (1.11x): its
    steps decode plainly at intervals that cost at most 0.5% of its speed (every 22nd step here), and once those
    (1 s now) outnumber the stale ones it loses and waits. At 1.18x (2 tokens per 1.7 s) every 32nd step decodes
    plainly; a drafter 25% or more ahead of plain steps never stops for one."""
    stale, ahead = AdaptiveDraftPolicy(max_draft=1), AdaptiveDraftPolicy(max_draft=1)
    for policy in (stale, ahead):
        for _ in range(3):
            policy.record(_step(proposed=0, accepted=0, seconds=2.0))
    probes = _decode(stale, 300, _step(proposed=1, accepted=1, seconds=2.6, draft=1.0, confidences=[0.9]))
    assert probes[:63] == [i for i in range(65) if i not in (21, 43)]
    assert len(probes) < 70 and stale.backoff == stale.max_backoff and stale.costs.plain_step_seconds() == 1.0
    assert _decode(ahead, 300, _step(proposed=1, accepted=1, seconds=2.0, draft=0.4, confidences=[0.9])) == list(
        range(300)
    )
    closer = AdaptiveDraftPolicy(max_draft=1)
    _time_plain_steps(closer)
    probes = _decode(closer, 300, _step(proposed=1, accepted=1, seconds=1.5, draft=0.2, confidences=[0.9]))
    assert probes == [i for i in range(300) if i % 32 != 31]
    near = AdaptiveDraftPolicy(max_draft=1)  # a new call that starts with an empty window drafts its first step
    _time_plain_steps(near)
    _decode(near, 16, _step(proposed=1, accepted=1, seconds=1.6, draft=0.1, confidences=[0.9]))
    near.begin_call()
    assert near.drafted_since_plain == 16 and not near.recent_drafted_steps and near.should_draft()


def test_sequential_drafting_stops_when_the_next_draft_does_not_pay():
    policy = AdaptiveDraftPolicy(max_draft=4)
    assert policy.keep_drafting([0.01])  # nothing timed yet: draft on
    policy.costs.record(_step(proposed=1, accepted=1, seconds=1.0, draft=0.5))  # a drafter step costs 0.5 s
    policy.costs.record(_step(proposed=0, accepted=0, seconds=1.0))
    assert not policy.keep_drafting([0.05])
    policy.calibration.update([0.95] * 4, proposed=4, accepted=4)
    assert policy.keep_drafting([0.95])
    assert not policy.keep_drafting([0.95] * 4)  # at the maximum depth


def test_constant_policy_always_drafts_everything():
    policy = ConstantDraftPolicy(max_draft=3)
    assert policy.should_draft() and policy.keep_drafting([0.0]) and policy.choose([0.0, 0.0]) == 2
    assert policy.draft_length == 3


def test_heuristic_grows_by_two_after_a_fully_accepted_step_and_shrinks_by_one_otherwise():
    """transformers' rule, within 1..max_draft; a step at the end of the budget (nothing drafted) counts as full."""
    policy = HeuristicDraftPolicy(max_draft=7, num_assistant_tokens=3)
    lengths = []
    for proposed, accepted in [(3, 3), (5, 2), (4, 4), (6, 6), (7, 0), (6, 0), (5, 0), (4, 0), (3, 0), (2, 0), (0, 0)]:
        assert policy.draft_length == proposed or proposed == 0
        policy.record(_step(proposed=proposed, accepted=accepted, seconds=1.0, draft=0.1))
        lengths.append(policy.draft_length)
    assert lengths == [5, 4, 6, 7, 6, 5, 4, 3, 2, 1, 3]
    assert policy.should_draft() and policy.choose([0.0] * 3) == 3 and policy.max_draft == 7


def test_lowest_cost_threshold_is_the_roc_point_transformers_picks():
    """Against the rule written out: every score as a threshold (positive at or above it), cost fpr + 3 fnr, the
    highest of equal costs."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        scores = torch.randint(1, 8, (12,), generator=generator).div(8).tolist()  # ties included
        positives = (torch.rand(12, generator=generator) < 0.6).tolist()
        if all(positives) or not any(positives):
            continue

        def cost(threshold, scores=scores, positives=positives):
            predicted = [score >= threshold for score in scores]
            false_positive = sum(p and not y for p, y in zip(predicted, positives, strict=True))
            false_negative = sum(y and not p for p, y in zip(predicted, positives, strict=True))
            return false_positive / positives.count(False) + 3 * false_negative / positives.count(True)

        lowest = min(cost(t) for t in scores)
        expected = max(t for t in scores if cost(t) == pytest.approx(lowest))
        assert lowest_cost_threshold(scores, positives) == expected


def test_confidence_threshold_cuts_after_the_first_unlikely_draft_and_retunes():
    threshold = ConfidenceThreshold(0.4)
    assert threshold.cut([0.9, 0.5, 0.3, 0.8]) == 3  # the draft below the threshold is still verified
    assert threshold.cut([0.9, 0.5]) == 2 and threshold.cut([0.1]) == 1
    assert threshold.keep_drafting([0.9, 0.5]) and not threshold.keep_drafting([0.9, 0.3])
    threshold.record([0.9, 0.8, 0.3], accepted=1)  # 0.9 accepted, 0.8 rejected, 0.3 not judged
    assert threshold.probabilities == [0.9, 0.8] and threshold.accepted == [True, False]
    threshold.record([0.7, 0.6], accepted=2)
    threshold.record([0.95], accepted=1)
    assert threshold.threshold == 0.4  # 5 judged drafts are not more than 5 yet
    threshold.record([0.65, 0.5], accepted=0)
    assert len(threshold.probabilities) == 6
    # At 0.6 every accepted draft passes and both rejected ones do too: fpr 1 + 3 * fnr 0 is the lowest cost
    assert threshold.threshold == lowest_cost_threshold(threshold.probabilities, threshold.accepted) == 0.6


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_deepseek_v4(seed=3)


def _untrained(target, schedule: str) -> HyperDFlashForDrafting:
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=8).eval()
    drafter.generation_config.num_assistant_tokens_schedule = schedule
    return drafter


def _drafted_steps(target, drafter, prompt, new_tokens: int, **sampling) -> int:
    """The drafter forwards (a block drafter's steps that drafted) of one call; a greedy call is checked against
    plain decoding."""
    forwards = []
    hook = drafter.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        out = target.generate(prompt, assistant_model=drafter, max_new_tokens=new_tokens, **sampling)
    finally:
        hook.remove()
    if not sampling:
        assert torch.equal(out, target.generate(prompt, max_new_tokens=new_tokens))
    return len(forwards)


def test_adaptive_carries_what_it_learned_to_the_next_call_per_setting(tiny_target, monkeypatch):
    """Drafting loses widely every time here (so the backoff is the same on a busy machine): after a 30-token call, the
    next one starts in the 64-step backoff it left and never drafts, where a fresh start (adaptive_transient, another
    temperature, a reset) probes at decoding steps 1 and 3."""
    monkeypatch.setattr(AdaptiveDraftPolicy, "_pays", lambda self, tokens, cost: False)
    monkeypatch.setattr(AdaptiveDraftPolicy, "_loses_widely", lambda self, steps: True)
    drafter = _untrained(tiny_target, "adaptive")
    prompt = torch.randint(3, tiny_target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    assert _drafted_steps(tiny_target, drafter, prompt, 30) >= 3
    assert _drafted_steps(tiny_target, drafter, prompt, 10) == 0
    (learned,) = schedule_memory(drafter).settings(tiny_target)
    assert learned.temperature is None and learned.max_draft == 7 and learned.target_dtype == "torch.float32"
    drafter.generation_config.num_assistant_tokens_schedule = "adaptive_transient"
    assert _drafted_steps(tiny_target, drafter, prompt, 10) >= 2
    drafter.generation_config.num_assistant_tokens_schedule = "adaptive"
    torch.manual_seed(0)
    assert _drafted_steps(tiny_target, drafter, prompt, 10, do_sample=True, temperature=0.7) >= 2
    assert {key.temperature for key in schedule_memory(drafter).settings(tiny_target)} == {None, 0.7}
    assert _drafted_steps(tiny_target, drafter, prompt, 10) == 0  # greedy still resumes its own backoff
    reset_draft_schedule(drafter)
    assert _drafted_steps(tiny_target, drafter, prompt, 10) >= 2


def test_a_call_the_schedule_would_decode_plainly_runs_plain_decodings_loop(tiny_target, monkeypatch):
    """Once what "adaptive" learned skips more steps than a call has, the call is plain decoding's own (no assisted
    loop, no drafter forward) and counts against the backoff; the call that reaches the probe drafts again."""
    monkeypatch.setattr(AdaptiveDraftPolicy, "_pays", lambda self, tokens, cost: False)
    monkeypatch.setattr(AdaptiveDraftPolicy, "_loses_widely", lambda self, steps: True)  # the wait carries over
    drafter = _untrained(tiny_target, "adaptive")
    prompt = torch.randint(3, tiny_target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    _drafted_steps(tiny_target, drafter, prompt, 30)
    key = schedule_memory(drafter).settings(tiny_target)[0]
    policy = schedule_memory(drafter).checkout(tiny_target, key)
    policy.plain_steps_left = 25  # as if the last probe had lost with 25 steps of its backoff left
    schedule_memory(drafter).keep(tiny_target, key, policy)
    assisted = []
    original = type(tiny_target)._assisted_decoding
    monkeypatch.setattr(
        type(tiny_target),
        "_assisted_decoding",
        lambda *args, **kwargs: assisted.append(1) or original(*args, **kwargs),
    )
    streamed = []

    class Streamer:
        def put(self, value):
            streamed.append(value.reshape(-1))

        def end(self):
            pass

    out = tiny_target.generate(prompt, assistant_model=drafter, max_new_tokens=20, streamer=Streamer())
    assert torch.equal(out, tiny_target.generate(prompt, max_new_tokens=20)) and torch.equal(
        torch.cat(streamed), out[0]
    )
    stats = drafter.last_generation_stats
    assert not assisted and stats.new_tokens == 20 and stats.skipped_share == 1.0 and stats.prefill_seconds > 0
    learned = schedule_memory(drafter).checkout(tiny_target, key)
    assert learned.plain_steps_left == 5
    # plain decoding's loop timed its steps (20 forwards: the prefill, then 19 steps, the last untimed) for the
    # schedule, which judges drafting against them
    assert len(learned.costs.recent_plain_steps) == min(len(policy.costs.recent_plain_steps) + 18, 32)
    assert learned.drafted_since_plain == 0 and all(seconds > 0 for seconds in learned.costs.recent_plain_steps)
    assert _drafted_steps(tiny_target, drafter, prompt, 10) >= 1 and assisted  # 5 plain steps, then the probe


def test_a_long_wait_ending_near_a_calls_end_moves_the_probe_to_the_next_call(tiny_target, monkeypatch):
    """A wait past 64 steps whose end falls in a call's last quarter-backoff covers the whole call (plain decoding's
    own, its output plain decoding's), and the next call's first step is the probe."""
    monkeypatch.setattr(AdaptiveDraftPolicy, "_pays", lambda self, tokens, cost: False)
    monkeypatch.setattr(AdaptiveDraftPolicy, "_loses_widely", lambda self, steps: True)
    drafter = _untrained(tiny_target, "adaptive")
    prompt = torch.randint(3, tiny_target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    _drafted_steps(tiny_target, drafter, prompt, 30)
    memory = schedule_memory(drafter)
    key = memory.settings(tiny_target)[0]
    policy = memory.checkout(tiny_target, key)
    policy.backoff, policy.plain_steps_left = 1024, 15  # a wide loss's wait, ending 5 steps before the call's end
    memory.keep(tiny_target, key, policy)
    assert _drafted_steps(tiny_target, drafter, prompt, 20) == 0
    assert drafter.last_generation_stats.skipped_share == 1.0
    assert memory.checkout(tiny_target, key).plain_steps_left == 0
    assert _drafted_steps(tiny_target, drafter, prompt, 3) == 1  # the step after the prefill drafted


def test_nothing_learned_is_saved_or_copied(tiny_target, tmp_path):
    """The learned state is this machine's: save_pretrained writes what a fresh drafter writes, and copies start
    empty."""
    drafter = _untrained(tiny_target, "adaptive")
    torch.manual_seed(0)
    fresh = HyperDFlashForDrafting.from_target(tiny_target, block_size=8).eval()
    tiny_target.generate(torch.tensor([[5, 6, 7, 8]]), assistant_model=drafter, max_new_tokens=24)
    assert schedule_memory(drafter).settings(tiny_target)
    used, unused = tmp_path / "used" / "drafter", tmp_path / "fresh" / "drafter"  # the card names the folder
    drafter.save_pretrained(used)
    fresh.save_pretrained(unused)
    saved = sorted(path.name for path in used.iterdir())
    assert saved == sorted(path.name for path in unused.iterdir())
    for name in saved:
        assert (used / name).read_bytes() == (unused / name).read_bytes(), name
    loaded = AutoModel.from_pretrained(used, trust_remote_code=True)
    assert schedule_memory(loaded).settings(tiny_target) == []
    assert schedule_memory(copy.deepcopy(drafter)).settings(tiny_target) == []


@pytest.mark.parametrize("kind", ["hyperdflash", "mtp"])
def test_heuristic_keeps_its_length_on_the_generation_config_and_transient_restores_it(tiny_target, kind):
    torch.manual_seed(0)
    if kind == "mtp":
        drafter, longest = DeepseekV4MTPForDrafting.from_target(tiny_target).eval(), 8
    else:
        drafter, longest = HyperDFlashForDrafting.from_target(tiny_target, block_size=8).eval(), 7
    config = drafter.generation_config
    config.num_assistant_tokens = 5
    prompt = torch.tensor([[5, 17, 33, 9, 250, 12]])
    plain = tiny_target.generate(prompt, max_new_tokens=30)
    for schedule in ("heuristic", "heuristic", "heuristic_transient"):
        config.num_assistant_tokens_schedule = schedule
        start = config.num_assistant_tokens
        assert torch.equal(tiny_target.generate(prompt, assistant_model=drafter, max_new_tokens=30), plain)
        stats = drafter.last_generation_stats
        assert stats.proposed_per_step[0] == start and stats.num_draft_tokens == longest
        steps = list(zip(stats.proposed_per_step, stats.accepted_per_step, strict=True))
        for (proposed, accepted), (following, _) in zip(steps[:-3], steps[1:-2], strict=True):  # the last may be cut
            assert following == min(max(proposed + 2 if accepted == proposed else proposed - 1, 1), longest)
        assert 1 <= config.num_assistant_tokens <= longest
        if schedule == "heuristic_transient":
            assert config.num_assistant_tokens == start


def test_adaptive_is_the_default_and_skips_an_untrained_drafter_losslessly(tiny_target):
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(tiny_target, block_size=8).eval()
    assert drafter.generation_config.num_assistant_tokens_schedule == "adaptive"
    # The tiny drafter's forward costs a fifth of the tiny target's step, so a drafter that accepts nothing is near
    # break-even on this machine's noise; made to cost what a target step does, it loses whatever the load
    drafter.register_forward_pre_hook(lambda *_: time.sleep(0.015))
    prompt = torch.randint(3, tiny_target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = tiny_target.generate(prompt, max_new_tokens=40, do_sample=False)
    # A first call pays one-off costs (lazy imports, first kernels) inside the steps it times; the next call, as in a
    # chat session, starts from what it learned
    tiny_target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    adaptive = tiny_target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    stats = drafter.last_generation_stats
    assert torch.equal(adaptive, plain)
    assert stats.schedule == "adaptive" and stats.skipped_share > 0.5
    assert stats.decoding_steps == stats.target_forwards - 1 and stats.drafted_per_step < 7 / 2
    assert len(stats.step_seconds) == len(stats.accepted_per_step) == len(stats.proposed_per_step)


def test_the_first_drafted_step_and_each_after_skipped_ones_are_marked_as_catching_up(tiny_target, monkeypatch):
    """They are the steps whose drafter forward also took in the prompt or the skipped steps' context; the schedule
    judges them with a typical drafter forward (`test_a_probe_is_judged_without_the_context_it_caught_up_on`)."""
    drafts = iter([True, True, False, False, True, True, False, True] + [True] * 20)
    monkeypatch.setattr(AdaptiveDraftPolicy, "should_draft", lambda self: next(drafts))
    steps = []
    monkeypatch.setattr(AdaptiveDraftPolicy, "record", lambda self, step: steps.append(step))
    drafter = _untrained(tiny_target, "adaptive")
    prompt = torch.tensor([[5, 17, 33, 9, 250, 12]])
    out = tiny_target.generate(prompt, assistant_model=drafter, max_new_tokens=12)
    assert torch.equal(out, tiny_target.generate(prompt, max_new_tokens=12))
    marks = [(bool(step.drafter_forwards), step.caught_up) for step in steps[:8]]
    drafted, skipped = (True, False), (False, False)
    assert marks == [(True, True), drafted, skipped, skipped, (True, True), drafted, skipped, (True, True)]


def test_constant_schedule_drafts_every_step(tiny_target):
    drafter = _untrained(tiny_target, "constant")
    prompt = torch.randint(3, tiny_target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    tiny_target.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False)
    stats = drafter.last_generation_stats
    assert stats.skipped_steps == 0 and stats.proposed_per_step[:10] == [7] * 10  # shorter only near max_length


def test_unknown_schedule_and_bad_threshold_are_refused(tiny_target):
    drafter = _untrained(tiny_target, "dynamic")
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule.*'dynamic'.*'adaptive'.*'heuristic'"):
        tiny_target.generate(torch.tensor([[5, 6, 7]]), assistant_model=drafter, max_new_tokens=4)
    drafter = _untrained(tiny_target, "heuristic")
    drafter.generation_config.assistant_confidence_threshold = 1.5
    with pytest.raises(ValueError, match=r"assistant_confidence_threshold` must be a probability in \[0, 1\]"):
        tiny_target.generate(torch.tensor([[5, 6, 7]]), assistant_model=drafter, max_new_tokens=4)


def _key(**changes) -> ScheduleKey:
    devices = {"target_device": "cpu", "target_dtype": "torch.float32", "drafter_device": "cpu"}
    return ScheduleKey(**devices | {"drafter_dtype": "torch.float32", "temperature": None, "max_draft": 7} | changes)


def test_a_checked_out_policy_shares_nothing_a_call_changes_with_the_kept_one():
    kept = AdaptiveDraftPolicy(7)
    for step in (_step(7, 3, 0.02, draft=0.01), _step(0, 0, 0.01), _step(4, 0, 0.03, draft=0.01)):
        kept.record(step)
    snapshot = pickle.dumps(kept)
    twin = kept.copy()
    mutable = [name for name, value in vars(kept).items() if not isinstance(value, int | float | str | type(None))]
    assert mutable and all(getattr(twin, name) is not getattr(kept, name) for name in mutable)
    for step in (_step(7, 7, 0.02, draft=0.01), _step(0, 0, 0.5), _step(2, 1, 0.04, draft=0.02)):
        twin.record(step)
    twin.costs.drafter_forward.add(9.0)
    assert pickle.dumps(kept) == snapshot


def test_schedule_memory_hands_out_copies_per_target_and_setting():
    memory, target, other = ScheduleMemory(), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    policy = memory.checkout(target, _key())
    assert policy.max_draft == 7 and policy.backoff == 1  # nothing learned yet: a fresh policy
    policy.backoff = 16
    assert memory.checkout(target, _key()).backoff == 1  # a call's policy is its own until the call completes
    memory.keep(target, _key(), policy)
    resumed = memory.checkout(target, _key())
    assert resumed.backoff == 16 and resumed is not policy
    resumed.calibration.update([0.9], proposed=1, accepted=1)
    assert memory.checkout(target, _key()).calibration.tried == policy.calibration.tried  # still a copy
    for fresh in (memory.checkout(other, _key()), memory.checkout(target, _key(temperature=0.7))):
        assert fresh.backoff == 1
    assert memory.settings(target) == [_key()] and memory.settings(other) == []
    assert copy.deepcopy(memory).settings(target) == [] and pickle.loads(pickle.dumps(memory)).settings(target) == []
    gone = weakref.ref(target)
    del target, resumed, fresh
    gc.collect()
    assert gone() is None and not memory._policies  # a freed target takes what was learned with it along
    memory.keep(other, _key(), policy)
    memory.clear()
    assert memory.settings(other) == []


def test_call_schedule_picks_the_policy_and_keeps_what_it_learned():
    drafter = SimpleNamespace(
        config=SimpleNamespace(model_type="hyperdflash", block_size=8),
        generation_config=SimpleNamespace(num_assistant_tokens=3, assistant_confidence_threshold=None),
        device="cpu",
        dtype=torch.float32,
    )
    target = type("Target", (), {"device": "cpu", "dtype": torch.float32})()  # hashable, as a model is
    greedy = SimpleNamespace(do_sample=False)

    def call(name: str, num_draft_tokens: int = 3) -> CallSchedule:
        return CallSchedule(name, drafter, target, greedy, num_draft_tokens)

    heuristic = call("heuristic")
    assert type(heuristic.policy) is HeuristicDraftPolicy and heuristic.policy.max_draft == 7
    heuristic.policy.record(_step(proposed=3, accepted=3, seconds=1.0, draft=0.1))
    heuristic.finish()
    assert drafter.generation_config.num_assistant_tokens == 5  # the next call starts there, as in transformers
    transient = call("heuristic_transient", 5)
    transient.policy.record(_step(proposed=5, accepted=0, seconds=1.0, draft=0.1))
    transient.finish()
    assert drafter.generation_config.num_assistant_tokens == 5 and transient.policy.draft_length == 4
    assert type(call("constant").policy) is ConstantDraftPolicy and call("constant").threshold is None
    adaptive = call("adaptive")
    adaptive.policy.backoff = 4
    adaptive.finish()
    assert call("adaptive").policy.backoff == 4 and call("adaptive_transient").policy.backoff == 1
    paid = call("adaptive")  # a wait after drafted steps that ran faster than plain ones: the next call drafts
    paid.policy.costs.record(_step(proposed=0, accepted=0, seconds=1.0))
    paid.policy.long_run.append(DraftedStep(tokens=3, verified=4, seconds=2.5))
    paid.policy.backoff, paid.policy.plain_steps_left = 16, 16
    paid.finish()
    assert (call("adaptive").policy.backoff, call("adaptive").policy.plain_steps_left) == (1, 0)
    for _ in range(10):  # plain steps timed at half that since: the same drafted steps ran at 0.6x
        paid.policy.costs.record(_step(proposed=0, accepted=0, seconds=0.5))
    paid.finish()
    assert (call("adaptive").policy.backoff, call("adaptive").policy.plain_steps_left) == (16, 16)
    assert call("adaptive", 5).policy.backoff == 1  # another draft length: another setting
    drafter.generation_config.assistant_confidence_threshold = 0.3
    assert call("constant").threshold.threshold == 0.3
    reset_draft_schedule(drafter)
    assert call("adaptive").policy.backoff == 1


def test_draft_settings_survive_save_and_load(tiny_target, tmp_path):
    drafter = _untrained(tiny_target, "constant")
    drafter.generation_config.num_assistant_tokens = 3
    drafter.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    assert loaded.generation_config.num_assistant_tokens_schedule == "constant"
    assert loaded.generation_config.num_assistant_tokens == 3
    (tmp_path / "generation_config.json").unlink()  # a folder saved before the file existed: the defaults
    assert AutoModel.from_pretrained(tmp_path).generation_config.num_assistant_tokens_schedule == "adaptive"


def test_eval_options_take_the_runtimes_schedules_without_importing_torch():
    """`hyperdflash eval --help` names the schedules from their one home, which imports nothing heavy."""
    script = (
        "import sys\nfrom hf_hyperdflash.evaluation import options\n"
        "from hf_hyperdflash.modeling import draft_options\n"
        "assert options.SCHEDULES is draft_options.SCHEDULES\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
