"""The draft schedules: the adaptive one drafts where drafting pays by the call's cost model and repeats under a seed;
transformers' own (heuristic, constant, confidence threshold) keep their meaning. Behaviour, not exact sequences."""

import json
import random
import subprocess
import sys

import pytest
import torch
from transformers import AutoModel

from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting  # public names: the runtime loads
from hf_hyperdflash.modeling.draft_options import DRAFT_COSTS_BY_DEVICE
from hf_hyperdflash.modeling.draft_policy import (
    AcceptanceCalibration,
    AdaptiveDraftPolicy,
    ConfidenceThreshold,
    ConstantDraftPolicy,
    DraftCosts,
    HeuristicDraftPolicy,
    StepRecord,
    expected_tokens,
    lowest_cost_threshold,
)
from hf_hyperdflash.testing import OracleProposer, oracle_drafting, tiny_deepseek_v4

COSTS = DraftCosts(draft_cost=0.3, verify_cost=0.07)


def _step(proposed: int, accepted: int, confidences=None) -> StepRecord:
    confidences = confidences if confidences is not None else [0.5] * proposed
    return StepRecord(confidences, proposed, accepted, drafter_forwards=1)


def _decode(policy: AdaptiveDraftPolicy, steps: int, confidences: list[float], accepted) -> list[int]:
    """Drive `policy` through `steps` decoding steps whose drafts have `confidences`; `accepted(step, verified)` says
    how many of the verified drafts the target accepts. Entry i: the drafts step i verified (-1: it did not draft)."""
    verified = []
    for i in range(steps):
        if not policy.should_draft():
            policy.record(StepRecord([], 0, 0, drafter_forwards=0))
            verified.append(-1)
            continue
        k = policy.choose(confidences)
        policy.record(_step(k, accepted(i, k), confidences))
        verified.append(k)
    return verified


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
        policy.record(_step(proposed, accepted))
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
    drafter = _untrained(tiny_target, "adaptive_transient")  # a name of earlier versions: the fix is named
    with pytest.raises(ValueError, match="'adaptive_transient' is now 'adaptive', which keeps nothing between calls"):
        tiny_target.generate(torch.tensor([[5, 6, 7]]), assistant_model=drafter, max_new_tokens=4)
    drafter = _untrained(tiny_target, "heuristic")
    drafter.generation_config.assistant_confidence_threshold = 1.5
    with pytest.raises(ValueError, match=r"assistant_confidence_threshold` must be a probability in \[0, 1\]"):
        tiny_target.generate(torch.tensor([[5, 6, 7]]), assistant_model=drafter, max_new_tokens=4)


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


def test_a_drafter_whose_drafts_are_all_rejected_drafts_on_few_steps():
    """Every drafted step brings one token at more than a plain step's cost: drafting stops at once, and probes
    come after waits that grow fourfold up to `max_wait`."""
    policy = AdaptiveDraftPolicy(max_draft=7, costs=COSTS)
    verified = _decode(policy, 256, [0.9] * 7, accepted=lambda step, k: 0)
    drafted = [i for i, k in enumerate(verified) if k >= 0]
    assert drafted[0] == 0 and len(drafted) <= 8
    waits = [later - earlier - 1 for earlier, later in zip(drafted, drafted[1:], strict=False)]
    assert waits[:4] == [1, 4, 16, 64] and max(waits) == AdaptiveDraftPolicy.max_wait


def test_a_batchs_waits_amortise_a_losing_probe():
    """A batch's schedule: each wait is long enough that a probe losing what the drafted steps lost keeps the
    margin over the wait and the probe ((W + 1) / (W + 1.79) >= 0.95 here: 15 steps, not 1)."""
    policy = AdaptiveDraftPolicy(max_draft=7, costs=COSTS, amortise_probes=True)
    verified = _decode(policy, 256, [0.9] * 7, accepted=lambda step, k: 0)
    drafted = [i for i, k in enumerate(verified) if k >= 0]
    waits = [later - earlier - 1 for earlier, later in zip(drafted, drafted[1:], strict=False)]
    first_cost = COSTS.step(1, verified[0])  # one token for it
    assert (waits[0] + 1) / (waits[0] + first_cost) >= 1 - AdaptiveDraftPolicy.margin
    assert waits[-1] == max(waits) == AdaptiveDraftPolicy.max_wait


def test_a_drafter_whose_drafts_are_accepted_drafts_every_step_and_verifies_them_all():
    policy = AdaptiveDraftPolicy(max_draft=7, costs=COSTS)
    assert _decode(policy, 100, [0.9] * 7, accepted=lambda step, k: k) == [7] * 100


def test_a_probe_that_pays_brings_drafting_back():
    """A hard stretch of text (nothing accepted for 60 steps), then an easy one: each paying probe shortens the wait,
    and within a few probes every step drafts again."""
    policy = AdaptiveDraftPolicy(max_draft=7, costs=COSTS)
    verified = _decode(policy, 300, [0.9] * 7, accepted=lambda step, k: 0 if step < 60 else k)
    first_easy_probe = next(i for i, k in enumerate(verified) if i >= 60 and k >= 0)
    assert first_easy_probe < 60 + AdaptiveDraftPolicy.max_wait + 1
    back = first_easy_probe + AdaptiveDraftPolicy.max_wait
    assert all(k >= 1 for k in verified[back:])  # the calibration relearns within a few steps
    assert verified[-100:] == [7] * 100


@pytest.mark.parametrize("seed", range(4))
def test_a_losing_drafters_lucky_steps_keep_it_waiting_most_of_the_time(seed):
    """Sampling on an uncertain target: a drafted step is accepted three drafts deep one time in seven, else not at
    all (0.8x of plain decoding's rate drafting every step). Lucky probes shorten waits and may resume drafting for a
    few steps, but the drafter stays off on most steps."""
    rng = random.Random(seed)
    policy = AdaptiveDraftPolicy(max_draft=7, costs=COSTS)
    verified = _decode(policy, 512, [0.5] * 7, accepted=lambda step, k: min(k, 3) if rng.random() < 0.15 else 0)
    assert sum(k >= 0 for k in verified) < 0.12 * len(verified)


def test_a_drafter_near_break_even_keeps_drafting():
    """Two tokens a step at 1.79 plain steps' cost (7 drafts verified) pays 1.12x: it drafts throughout."""
    policy = AdaptiveDraftPolicy(max_draft=7, costs=COSTS)
    verified = _decode(policy, 100, [0.9] * 7, accepted=lambda step, k: 1)
    assert all(k >= 0 for k in verified)


def test_choose_verifies_the_prefix_worth_its_cost():
    """Expected tokens from the calibrated confidences against the cost of each draft verified: confident drafts
    are all verified, unlikely ones none, and a block that turns unlikely is cut where it turns."""
    policy = AdaptiveDraftPolicy(max_draft=7, costs=COSTS)
    assert policy.choose([0.95] * 7) == 7
    assert policy.choose([0.05] * 7) == 0
    assert policy.choose([0.95, 0.95, 0.95, 0.05, 0.05, 0.05, 0.05]) == 3
    costly = AdaptiveDraftPolicy(max_draft=7, costs=DraftCosts(draft_cost=0.3, verify_cost=0.5))
    assert costly.choose([0.65] * 7) < policy.choose([0.65] * 7)


@pytest.mark.parametrize("probing", [False, True])
def test_whether_a_draft_is_verified_depends_only_on_the_confidences_up_to_it(probing):
    """What keeps sampling exact for drafters whose later confidences follow the drawn tokens (native MTP): the best
    prefix of a block is the one that every prefix of that block would also keep, so a later confidence never drops
    an earlier draft. Random confidences, calibrations and costs."""
    rng = random.Random(0)
    for _ in range(300):
        costs = DraftCosts(draft_cost=rng.uniform(0.05, 2.0), verify_cost=rng.uniform(0.0, 0.6))
        policy = AdaptiveDraftPolicy(max_draft=8, costs=costs)
        policy.probing = probing
        for _ in range(rng.randrange(20)):  # a calibration learned from some steps
            confidences = [rng.random() for _ in range(8)]
            proposed = rng.randint(1, 8)
            policy.calibration.update(confidences, proposed, rng.randint(0, proposed))
        confidences = [rng.random() for _ in range(rng.randint(1, 8))]
        chosen = policy.choose(confidences)
        as_drawn = next((k for k in range(1, len(confidences) + 1) if policy.choose(confidences[:k]) < k), None)
        assert chosen == (len(confidences) if as_drawn is None else as_drawn - 1)


def test_a_sequential_drafter_goes_deeper_while_that_raises_the_expected_rate():
    policy = AdaptiveDraftPolicy(max_draft=3, costs=COSTS)
    assert policy.keep_drafting([0.95]) and policy.keep_drafting([0.95, 0.95])
    assert not policy.keep_drafting([0.95, 0.95, 0.95])  # the call's longest draft
    assert not policy.keep_drafting([0.05])


def test_costs_default_by_device_and_drafter_kind_and_the_drafter_config_overrides_them(tiny_target):
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(tiny_target, block_size=4)
    mtp = DeepseekV4MTPForDrafting.from_target(tiny_target)
    assert DraftCosts.for_call("cpu", drafter) == DraftCosts(**DRAFT_COSTS_BY_DEVICE["cpu"]["hyperdflash"])
    assert DraftCosts.for_call("cpu", mtp) == DraftCosts(**DRAFT_COSTS_BY_DEVICE["cpu"]["deepseek_v4_mtp"])
    assert DraftCosts.for_call("mps", drafter) == DraftCosts(**DRAFT_COSTS_BY_DEVICE["cuda"]["hyperdflash"])
    drafter.generation_config.verify_cost = 0.0
    assert DraftCosts.for_call("cpu", drafter).verify_cost == 0.0  # set, even to 0: taken
    assert DraftCosts.for_call("cpu", drafter).draft_cost == DRAFT_COSTS_BY_DEVICE["cpu"]["hyperdflash"]["draft_cost"]


def test_adaptive_is_the_default_and_an_untrained_drafter_drafts_on_few_steps(tiny_target):
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(tiny_target, block_size=8).eval()
    assert drafter.generation_config.num_assistant_tokens_schedule == "adaptive"
    prompt = torch.randint(3, tiny_target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = tiny_target.generate(prompt, max_new_tokens=80, do_sample=False)
    assert torch.equal(tiny_target.generate(prompt, assistant_model=drafter, max_new_tokens=80), plain)
    stats = drafter.last_generation_stats
    drafter_steps = len(stats.proposed_per_step) - stats.copied_steps  # copies from the context cost no forward
    assert stats.schedule == "adaptive" and drafter_steps < 0.2 * stats.decoding_steps


def test_a_drafter_that_is_mostly_right_drafts_on_nearly_every_step(tiny_target):
    drafter = _untrained(tiny_target, "adaptive")
    prompt = torch.randint(3, tiny_target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    plain = tiny_target.generate(prompt, max_new_tokens=80, do_sample=False)
    with oracle_drafting(OracleProposer(tiny_target.config.vocab_size, plain, corruption=0.05, seed=1)):
        assert torch.equal(tiny_target.generate(prompt, assistant_model=drafter, max_new_tokens=80), plain)
    stats = drafter.last_generation_stats
    assert stats.skipped_share < 0.1 and stats.mean_accepted_length > 3


SEEDED_SAMPLING = """
import json, torch
from transformers import AutoModel, AutoModelForCausalLM
from hf_hyperdflash import reference
target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype=torch.float32).eval()
torch.manual_seed(0)
calls = []
for seed in range(3):
    prompt = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(seed))
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=48, do_sample=True, temperature=1.0)
    calls.append(out[0].tolist())
print(json.dumps(calls))
"""


@pytest.mark.slow
def test_a_seeded_sampling_script_prints_the_same_tokens_in_two_fresh_processes():
    """Under the default schedule: its decisions follow the tokens, not the clock."""
    runs = [
        subprocess.run([sys.executable, "-c", SEEDED_SAMPLING], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    ]
    first, second = (json.loads(run.strip().splitlines()[-1]) for run in runs)
    assert first == second and len(first) == 3
