"""The measuring loop on the tiny target: lossless counting, stats pooling, seeds."""

import copy
import math
from contextlib import contextmanager

import pytest
import torch

import hf_hyperdflash  # noqa: F401  (generate() integration)
from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.evaluation.harness import Setting, SettingResult
from hf_hyperdflash.evaluation.runner import Method, Session, drafting_settings, run_methods
from hf_hyperdflash.modeling.cache_deepseek_v4 import RewindableDeepseekV4Cache
from hf_hyperdflash.testing import OracleProposer, oracle_drafting

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def drafters(target):
    torch.manual_seed(1)
    return {
        "hyperdflash": HyperDFlashForDrafting.from_target(target, block_size=4).eval(),
        "mtp": DeepseekV4MTPForDrafting.from_target(target).eval(),
    }


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (1, length), generator=generator) for length in (9, 21)]


def oracle_method(target, drafter) -> Method:
    """The untrained drafter with its proposals replaced by the target's own (partly corrupted) continuation."""

    def context(input_ids):
        reference = target.generate(input_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        return oracle_drafting(OracleProposer(512, reference, corruption=0.2, seed=input_ids.shape[1]))

    return Method("oracle", drafter, context=context)


@contextmanager
def broken_rollback(_input_ids):
    """A deliberate bug: the target cache keeps the rejected drafts' keys and values."""
    original = RewindableDeepseekV4Cache.crop
    RewindableDeepseekV4Cache.crop = lambda self, max_length: None
    try:
        yield
    finally:
        RewindableDeepseekV4Cache.crop = original


def test_greedy_methods_are_counted_lossless_with_pooled_stats(target, drafters, prompts):
    methods = [
        Method("plain"),
        Method("hyperdflash", drafters["hyperdflash"], schedule="constant"),  # whole blocks: every position drafted
        Method("mtp-k2", drafters["mtp"], num_draft_tokens=2, schedule="constant"),
        oracle_method(target, drafters["hyperdflash"]),
    ]
    results = run_methods(target, methods, prompts, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, repeats=2)
    plain, untrained, mtp, oracle = results
    assert [r.name for r in results] == ["plain", "hyperdflash", "mtp-k2", "oracle"]
    for result in results:
        assert (result.prompts, result.compared, result.lossless) == (2, 2, 2)
        assert result.new_tokens == 2 * 2 * MAX_NEW_TOKENS  # prompts x repeats x tokens
        assert len(result.speed_ratios) == len(result.tokens_per_second) == 2
        assert all(run["identical_to_plain"] and len(run["seconds"]) == 2 for run in result.runs)
        assert sum(run["accepted_drafts"] for run in result.runs) == sum(result.accepted_per_step)
        assert sum(run["verify_steps"] for run in result.runs) == len(result.accepted_per_step)
    # Exact: n / n forwards per token and a median of x / x speed ratios are 1.0 in IEEE arithmetic
    assert plain.forwards_per_token == 1.0 and plain.speedup == 1.0
    assert drafters["mtp"].generation_config.num_assistant_tokens == 3  # the override was undone
    assert len(untrained.acceptance_per_position) == 3 and len(mtp.acceptance_per_position) == 2
    assert mtp.num_draft_tokens == 2 and oracle.num_draft_tokens == 3
    assert oracle.tau > 1.5 and oracle.forwards_per_token < 0.8
    assert all(run["verify_steps"] > 0 for run in oracle.runs)  # each prompt's own tau is available
    assert oracle.tau == pytest.approx(sum(oracle.accepted_per_step) / len(oracle.accepted_per_step) + 1)


def test_a_non_lossless_method_is_reported(target, drafters, prompts):
    drafter = copy.deepcopy(drafters["hyperdflash"])
    drafter.generation_config.num_assistant_tokens_schedule = "constant"  # drafts every step, so rollbacks happen
    methods = [Method("plain"), Method("broken", drafter, context=broken_rollback)]
    results = run_methods(target, methods, prompts, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    assert results[1].compared == 2 and results[1].lossless < 2
    assert SettingResult(Setting("fixture", 0.0, False), results).not_lossless == ["broken"]


def test_sampling_is_seeded_per_prompt_and_repeat_and_not_compared(target, drafters, prompts):
    methods = [Method("plain"), Method("mtp-k3", drafters["mtp"], num_draft_tokens=3)]  # the default schedule
    runs = [
        run_methods(target, methods, prompts[:1], temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=7)
        for _ in range(2)
    ]
    for first, second in zip(*runs, strict=True):
        assert first.compared == 0 and first.lossless == 0 and "identical_to_plain" not in first.runs[0]
        assert first.accepted_per_step == second.accepted_per_step  # same seeds, same draws


def test_plain_decoding_must_come_first(target, drafters, prompts):
    with pytest.raises(ValueError, match="first method must be plain"):
        run_methods(target, [Method("mtp", drafters["mtp"])], prompts)


def test_each_method_is_a_session_whose_first_call_is_reported_apart(target, drafters, prompts):
    """A method's first call in a setting (prompt 0, repeat 0) is reported on its own, the speed figures are its
    later calls'."""
    methods = [Method("plain"), Method("hdf", drafters["hyperdflash"])]
    plain, adaptive = run_methods(target, methods, prompts, max_new_tokens=MAX_NEW_TOKENS, repeats=2)
    assert plain.first_call.speed_ratio == 1.0 and math.isnan(plain.first_call.tau)
    assert adaptive.first_call.tokens_per_second > 0
    assert len(adaptive.speed_ratios) == 2  # prompt 0's second repeat, and prompt 1
    assert adaptive.as_dict()["first_call"]["speed_ratio"] == adaptive.first_call.speed_ratio
    (_, single) = run_methods(target, methods, prompts, max_new_tokens=MAX_NEW_TOKENS, repeats=1)
    assert len(single.speed_ratios) == 1  # prompt 0 has only its first call


def test_a_method_resumes_the_draft_length_its_last_call_left(drafters, target):
    """Methods share drafters (mtp-k1..k6, each schedule): the heuristic schedule's length is kept per method, and
    the drafter's own settings come back after every call."""
    drafter = drafters["hyperdflash"]
    config = drafter.generation_config
    heuristic, adaptive = Session(), Session()
    method = Method("hdf-heuristic", drafter, schedule="heuristic")
    with drafting_settings(method, heuristic):
        assert (config.num_assistant_tokens, config.num_assistant_tokens_schedule) == (3, "heuristic")
        config.num_assistant_tokens = 1  # what the call's heuristic schedule leaves
    assert (config.num_assistant_tokens, config.num_assistant_tokens_schedule) == (3, "adaptive")
    with drafting_settings(method, heuristic):
        assert config.num_assistant_tokens == 1
    with drafting_settings(Method("hdf", drafter), adaptive):
        assert (config.num_assistant_tokens, config.num_assistant_tokens_schedule) == (3, "adaptive")
        target.generate(torch.tensor([[5, 6, 7]]), assistant_model=drafter, max_new_tokens=3)
    assert (heuristic.draft_length, adaptive.draft_length) == (1, 3)
