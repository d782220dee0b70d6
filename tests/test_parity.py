"""Every generate() option in docs/generate_parity.md: the "exact" ones give plain decoding's output with a drafter,
the "refused" ones raise a ValueError before the target's first forward. So do the drafting options transformers
reads from the assistant's generation config (`DRAFTER_EXACT`).

An oracle drafter that is right most of the time makes verify steps accept several tokens, so logits processors
and stopping rules are exercised inside accepted blocks; the native-MTP drafter (untrained) covers rejections.
"""

import re
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from hf_hyperdflash import DeepseekV4DSparkForDrafting, DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.testing import OracleProposer, oracle_drafting

PARITY_DOC = Path(__file__).parents[1] / "docs" / "generate_parity.md"
PROMPT = torch.tensor([[5, 17, 33, 9, 250, 12, 77, 401, 3, 64, 128, 7]])
NEW = 16


class PenalizeEvenTokens(LogitsProcessor):
    """A custom processor that is a pure function of the prefix: exact with a drafter."""

    def __call__(self, input_ids, scores):
        return scores - 2.0 * (input_ids[:, -1:] % 2 == 0).float()


def _emitted(plain: torch.Tensor, k: int) -> int:
    return int(plain[0, PROMPT.shape[1] + k])


# option -> kwargs factory, given the target's plain greedy continuation (so options can pick tokens it emits)
EXACT = {
    "max_new_tokens": lambda plain: {"max_new_tokens": 9},
    "max_length": lambda plain: {"max_new_tokens": None, "max_length": PROMPT.shape[1] + 11},
    "eos_token_id": lambda plain: {"eos_token_id": _emitted(plain, 6)},
    "min_new_tokens": lambda plain: {"eos_token_id": _emitted(plain, 2), "min_new_tokens": 8},
    "pad_token_id": lambda plain: {"pad_token_id": 0},
    "repetition_penalty": lambda plain: {"repetition_penalty": 1.5},
    "no_repeat_ngram_size": lambda plain: {"no_repeat_ngram_size": 2},
    "bad_words_ids": lambda plain: {"bad_words_ids": [[_emitted(plain, 3)]]},
    "suppress_tokens": lambda plain: {"suppress_tokens": [_emitted(plain, 1), _emitted(plain, 4)]},
    "begin_suppress_tokens": lambda plain: {"begin_suppress_tokens": [_emitted(plain, 0)]},
    "sequence_bias": lambda plain: {"sequence_bias": {(_emitted(plain, 5),): -10.0}},
    "forced_eos_token_id": lambda plain: {"forced_eos_token_id": 2},
    "exponential_decay_length_penalty": lambda plain: {
        "exponential_decay_length_penalty": (4, 1.5),
        "eos_token_id": 2,
    },
    "renormalize_logits": lambda plain: {"renormalize_logits": True, "repetition_penalty": 1.2},
    "logits_processor": lambda plain: {"logits_processor": LogitsProcessorList([PenalizeEvenTokens()])},
    "do_sample": lambda plain: {"do_sample": True, "top_k": 1},
    "temperature": lambda plain: {"do_sample": True, "temperature": 0.7, "top_k": 1},
    "top_p": lambda plain: {"do_sample": True, "top_p": 0.5, "top_k": 1},
    "min_p": lambda plain: {"do_sample": True, "min_p": 0.2, "top_k": 1},
    "typical_p": lambda plain: {"do_sample": True, "typical_p": 0.5, "top_k": 1},
    "epsilon_cutoff": lambda plain: {"do_sample": True, "epsilon_cutoff": 1e-4, "top_k": 1},
    "eta_cutoff": lambda plain: {"do_sample": True, "eta_cutoff": 1e-4, "top_k": 1},
    "use_cache": lambda plain: {"use_cache": True},
    "cache_implementation": lambda plain: {"cache_implementation": "dynamic"},
    "return_dict_in_generate": lambda plain: {"return_dict_in_generate": True},
    "remove_invalid_values": lambda plain: {"remove_invalid_values": True},
    "attention_mask with zeros": lambda plain: {"attention_mask": torch.tensor([[1, 0, 0] + [1] * 9])},
}

# The drafter's generation config (where transformers reads an assistant's draft settings) -> the settings
DRAFTER_EXACT = {
    'num_assistant_tokens_schedule="adaptive"': {"num_assistant_tokens_schedule": "adaptive"},
    'num_assistant_tokens_schedule="heuristic"': {
        "num_assistant_tokens_schedule": "heuristic",
        "num_assistant_tokens": 2,
    },
    'num_assistant_tokens_schedule="heuristic_transient"': {"num_assistant_tokens_schedule": "heuristic_transient"},
    'num_assistant_tokens_schedule="constant"': {"num_assistant_tokens_schedule": "constant"},
    "assistant_confidence_threshold": {
        "assistant_confidence_threshold": 0.5,
        "num_assistant_tokens_schedule": "heuristic",
    },
}

REFUSED = {
    "num_beams": ({"num_beams": 2}, "Beam search"),
    "num_return_sequences": ({"do_sample": True, "num_return_sequences": 2}, "one sequence per prompt"),
    "use_cache=False": ({"use_cache": False}, "needs the target's cache"),
    "penalty_alpha": ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive search"),
    "dola_layers": ({"dola_layers": "low"}, "dola generation"),
    "prompt_lookup_num_tokens": ({"prompt_lookup_num_tokens": 3}, "two ways to draft"),
    "assistant_early_exit": ({"assistant_early_exit": 1}, "two ways to draft"),
    "use_mtp": ({"use_mtp": True}, "two ways to draft"),
    "assistant_ensemble_weight": ({"assistant_ensemble_weight": 0.5}, "mixes the drafter's distribution"),
    "guidance_scale": ({"guidance_scale": 1.5}, "guidance_scale=1.5"),
    "cache_implementation=static": ({"cache_implementation": "static"}, "cache_implementation='static'"),
    "cache (not rewindable)": ({"past_key_values": DynamicCache()}, "rewindable target cache"),
    "batch size > 1": ({"input_ids": PROMPT.repeat(2, 1)}, "one prompt at a time"),
}


KINDS = ["hyperdflash", "hyperdflash_heads", "mtp", "dspark"]


@pytest.fixture(scope="module")
def drafters(target):
    torch.manual_seed(1)
    drafters = {
        "hyperdflash": HyperDFlashForDrafting.from_target(target, block_size=6).eval(),
        # DSpark's Markov and confidence heads on HyperDFlash: drafts drawn left to right, as DSpark's
        "hyperdflash_heads": HyperDFlashForDrafting.from_target(target, block_size=6, markov_rank=8).eval(),
        "mtp": DeepseekV4MTPForDrafting.from_target(target).eval(),
        "dspark": DeepseekV4DSparkForDrafting.from_target(target, dspark_noise_token_id=3).eval(),
    }
    # Whole drafts every step for the generate() options: how much the adaptive default verifies depends on the
    # machine's timings, and the options must meet accepted blocks. The schedules have their own rows.
    for drafter in drafters.values():
        drafter.generation_config.num_assistant_tokens_schedule = "constant"
    return drafters


@pytest.fixture(scope="module")
def plain(target):
    return target.generate(PROMPT, max_new_tokens=NEW, do_sample=False)


def _sequences(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.sequences


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("option", sorted(EXACT))
def test_exact_option_gives_plain_decodings_output(target, drafters, plain, option, kind):
    kwargs = {"max_new_tokens": NEW, "do_sample": False} | EXACT[option](plain)
    torch.manual_seed(0)
    expected = _sequences(target.generate(PROMPT, **kwargs))
    reference = torch.cat([expected, plain[:, expected.shape[1] :]], dim=1)
    oracle = OracleProposer(target.config.vocab_size, reference, corruption=0.15, seed=3)
    torch.manual_seed(0)
    with oracle_drafting(oracle):
        got = _sequences(target.generate(PROMPT, assistant_model=drafters[kind], **kwargs))
    assert torch.equal(got, expected), option
    if kind == "hyperdflash" and expected.shape[1] - PROMPT.shape[1] > 6:
        assert max(drafters[kind].last_generation_stats.accepted_per_step) >= 2  # blocks really were accepted


@pytest.mark.parametrize(
    "sampling", [{"do_sample": False}, {"do_sample": True, "top_k": 1}], ids=["greedy", "top_k=1"]
)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("option", sorted(DRAFTER_EXACT))
def test_exact_drafter_option_gives_plain_decodings_output(target, drafters, plain, option, kind, sampling):
    drafter = drafters[kind]
    config = drafter.generation_config
    saved = {name: getattr(config, name) for name in DRAFTER_EXACT[option]}
    kwargs = {"max_new_tokens": NEW} | sampling
    torch.manual_seed(0)
    expected = target.generate(PROMPT, **kwargs)
    oracle = OracleProposer(target.config.vocab_size, plain, corruption=0.15, seed=3)
    config.update(**DRAFTER_EXACT[option])
    try:
        for _ in range(2):  # the second call starts from what the first one kept ("heuristic": the draft length)
            torch.manual_seed(0)
            with oracle_drafting(oracle):
                assert torch.equal(target.generate(PROMPT, assistant_model=drafter, **kwargs), expected), option
    finally:
        config.update(**saved)


@pytest.mark.parametrize("option", sorted(REFUSED))
def test_refused_option_raises_before_any_forward(target, drafters, option):
    kwargs, message = REFUSED[option]
    inputs = {"input_ids": PROMPT} | kwargs
    forwards = []
    hook = target.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=re.escape(message)):
            target.generate(**inputs, max_new_tokens=4, assistant_model=drafters["hyperdflash"])
    finally:
        hook.remove()
    assert not forwards, f"{option}: the target ran before the refusal"


def test_the_documented_table_is_the_tested_one():
    rows = re.findall(r"^\| `([^`]+)` \| (exact|refused) \|", PARITY_DOC.read_text(), flags=re.MULTILINE)
    documented = {name: verdict for name, verdict in rows}
    tested = {name: "exact" for name in EXACT | DRAFTER_EXACT} | {name: "refused" for name in REFUSED}
    covered_elsewhere = {"stop_strings", "stopping_criteria", "streamer", "output_scores", "output_logits"}
    covered_elsewhere |= {"output_hidden_states", "output_attentions", "cache (rewindable, continued)"}
    covered_elsewhere.add("pixel_values, pixel_values_videos")
    assert {n for n, v in documented.items() if n not in covered_elsewhere} == set(tested)
    assert all(documented[name] == verdict for name, verdict in tested.items())
    assert all(documented[name] == "exact" for name in covered_elsewhere)
