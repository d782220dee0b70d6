"""The adaptive draft policy: its arithmetic on synthetic steps, and what it does inside generate()."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModel

from hf_hyperdflash.modeling import HyperDFlashForDrafting
from hf_hyperdflash.modeling.draft_policy import (
    AcceptanceCalibration,
    AdaptiveDraftPolicy,
    ConstantDraftPolicy,
    StepCosts,
    StepRecord,
    expected_tokens,
    make_draft_policy,
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
    assert falling.step_seconds_up_to(4)[1:] == pytest.approx([1.5] * 3)  # slope 0 at least: longer is never cheaper


def test_choose_truncates_where_more_drafts_cost_more_than_they_bring():
    policy = AdaptiveDraftPolicy(max_draft=4)
    confident, unsure = [0.95, 0.95, 0.05, 0.05], [0.05] * 4
    assert policy.choose(confident) == 4  # nothing timed yet: verify everything
    policy.costs.record(_step(proposed=4, accepted=2, seconds=1.0, draft=0.2))
    assert policy.choose(confident) == 4  # one length seen, flat cost: every draft with any chance is free
    policy.costs.record(_step(proposed=0, accepted=0, seconds=0.5))  # a CPU: 1 token 0.5 s, 5 tokens 1.0 s
    assert policy.choose(confident) == 2
    assert policy.choose(unsure) == 0


def test_losing_drafts_back_off_fourfold_and_a_winning_probe_resumes_drafting():
    policy = AdaptiveDraftPolicy(max_draft=7)
    policy.record(_step(proposed=0, accepted=0, seconds=1.0))  # a plain step: 1 token per second
    pattern = []
    for _ in range(160):
        drafts = policy.should_draft()
        pattern.append(drafts)
        if drafts:  # every draft is rejected and costs half a step on top
            policy.record(_step(proposed=1, accepted=0, seconds=1.0, draft=0.5, confidences=[0.01]))
        else:
            policy.record(_step(proposed=0, accepted=0, seconds=1.0))
    probes = [i for i, drafts in enumerate(pattern) if drafts]
    assert [b - a - 1 for a, b in zip(probes, probes[1:], strict=False)] == [0, 1, 4, 16, 64, 64]
    assert policy.backoff == 64
    for _ in range(70):  # drafts now bring 4 tokens per step: drafting resumes every step
        if policy.should_draft():
            policy.record(_step(proposed=3, accepted=3, seconds=1.0, draft=0.5, confidences=[0.9] * 3))
        else:
            policy.record(_step(proposed=0, accepted=0, seconds=1.0))
    assert policy.backoff == 1
    assert all(policy.should_draft() for _ in range(5))


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
    policy = make_draft_policy("constant", max_draft=3)
    assert type(policy) is ConstantDraftPolicy
    assert policy.should_draft() and policy.keep_drafting([0.0]) and policy.choose([0.0, 0.0]) == 2
    assert type(make_draft_policy("adaptive", 3)) is AdaptiveDraftPolicy


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_deepseek_v4(seed=3)


def _untrained(target, schedule: str) -> HyperDFlashForDrafting:
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=8).eval()
    drafter.generation_config.num_assistant_tokens_schedule = schedule
    return drafter


def test_adaptive_is_the_default_and_skips_an_untrained_drafter_losslessly(tiny_target):
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(tiny_target, block_size=8).eval()
    assert drafter.generation_config.num_assistant_tokens_schedule == "adaptive"
    prompt = torch.randint(3, tiny_target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = tiny_target.generate(prompt, max_new_tokens=40, do_sample=False)
    # A first call pays one-off costs (lazy imports, first kernels) inside the steps the policy times; measure the next
    tiny_target.generate(prompt, assistant_model=drafter, max_new_tokens=8, do_sample=False)
    adaptive = tiny_target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    stats = drafter.last_generation_stats
    assert torch.equal(adaptive, plain)
    assert stats.schedule == "adaptive" and stats.skipped_share > 0.5
    assert stats.decoding_steps == stats.target_forwards - 1 and stats.drafted_per_step < 7 / 2
    assert len(stats.step_seconds) == len(stats.accepted_per_step) == len(stats.proposed_per_step)


def test_constant_schedule_drafts_every_step(tiny_target):
    drafter = _untrained(tiny_target, "constant")
    prompt = torch.randint(3, tiny_target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    tiny_target.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False)
    stats = drafter.last_generation_stats
    assert stats.skipped_steps == 0 and stats.proposed_per_step[:10] == [7] * 10  # shorter only near max_length


def test_unknown_schedule_is_refused(tiny_target):
    drafter = _untrained(tiny_target, "heuristic")
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule.*'heuristic'.*'adaptive'"):
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
