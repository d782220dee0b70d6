"""Lossless, as one matrix: family x drafter kind x generate() option.

Every case decodes a tiny target of one mHC family plainly and with one way of drafting, under one option of
`docs/generate_parity.md`, and asserts the same tokens (float32). The "exact" options cover every row of that table
that generate() takes, the drafter's own settings (its generation config) and the rows checked on the returned dict:
every per-step output and the returned cache by layer class and state, a conversation continued on that cache, an
image or a video in the prompt. The "refused" rows raise a ValueError before the target's first forward.

Each (kind, option) pair is one case, on a family taken in turn among those both support, so every option meets
every kind, and at least as many families as it has kinds that run on several (all five for generate() options); the
every-output row runs on every (family, kind) (`test_the_matrix_covers_every_pair`). Each case has its own prompt,
of 5, 13 or 40 tokens (below, inside and beyond every window and indexer budget); DeepSeek-V4 runs with 2 indexer
heads, where exact ties in index scores are common. Block drafts come from an oracle that is right most of the time,
so options meet accepted blocks and rejections alike; native MTP, prompt lookup and stock assistants draft for
themselves (mostly rejected).
"""

import itertools
import re
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT
from hf_hyperdflash.testing import (
    DEEPSEEK_V4_ONLY_KINDS,
    DRAFTING_KINDS,
    OWN_DRAFTER_KINDS,
    OracleProposer,
    assert_same_cache,
    assert_same_outputs,
    drafting_arguments,
    image_prompt,
    new_drafter,
    oracle_drafting,
    tiny_deepseek_v4,
    tiny_glm5_next,
    tiny_hy_v4,
    tiny_qwen4_exp,
    tiny_qwen4_exp_composite,
)

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

PARITY_DOC = Path(__file__).parents[1] / "docs" / "generate_parity.md"
# Below, inside and well beyond every family's sliding window and indexer budget (at most 8 tokens or pools)
PROMPT_LENGTHS = (5, 13, 40)
NEW_TOKENS = 12
BLOCK_SIZE = 6

FAMILIES = {
    "deepseek_v4": lambda seed: tiny_deepseek_v4(seed, index_n_heads=2),
    "hy_v4": tiny_hy_v4,
    "glm5_next": tiny_glm5_next,
    "qwen4_exp": tiny_qwen4_exp,
    "qwen4_exp_composite": tiny_qwen4_exp_composite,
}
IMAGE_FAMILIES = ("glm5_next", "qwen4_exp_composite")
EVERY_FAMILY = tuple(FAMILIES)
# drafting kind -> the families it runs on (native MTP and DSpark are DeepSeek-V4's own)
# (`new_drafter`: the heads hybrid is HyperDFlash with DSpark's heads; a stock assistant is a randomly initialised
# model of the target's family in transformers' loop; prompt lookup is transformers' own, on the package's exact path)
KINDS = {kind: ("deepseek_v4",) if kind in DEEPSEEK_V4_ONLY_KINDS else EVERY_FAMILY for kind in DRAFTING_KINDS}
OWN_DRAFTERS = OWN_DRAFTER_KINDS
BLOCK_KINDS = ("hyperdflash", "vanilla_dflash", "hyperdflash_heads", "dspark")  # drafts from the oracle


def _emitted(new: torch.Tensor, k: int) -> int:
    return int(new[0, min(k, new.shape[1] - 1)])


class PenalizeEvenTokens(LogitsProcessor):
    """A custom processor that is a pure function of the prefix: exact with a drafter."""

    def __call__(self, input_ids, scores):
        return scores - 2.0 * (input_ids[:, -1:] % 2 == 0).float()


# option -> generate() kwargs, given the new tokens of plain greedy decoding (so options can pick tokens it emits) and
# the prompt's length
EXACT = {
    "max_new_tokens": lambda new, length: {"max_new_tokens": 9},
    "max_length": lambda new, length: {"max_new_tokens": None, "max_length": length + 11},
    "eos_token_id": lambda new, length: {"eos_token_id": _emitted(new, 6)},
    "min_new_tokens": lambda new, length: {"eos_token_id": _emitted(new, 2), "min_new_tokens": 8},
    "pad_token_id": lambda new, length: {"pad_token_id": 0},
    "repetition_penalty": lambda new, length: {"repetition_penalty": 1.5},
    "no_repeat_ngram_size": lambda new, length: {"no_repeat_ngram_size": 2},
    "bad_words_ids": lambda new, length: {"bad_words_ids": [[_emitted(new, 3)]]},
    "suppress_tokens": lambda new, length: {"suppress_tokens": [_emitted(new, 1), _emitted(new, 4)]},
    "begin_suppress_tokens": lambda new, length: {"begin_suppress_tokens": [_emitted(new, 0)]},
    "sequence_bias": lambda new, length: {"sequence_bias": {(_emitted(new, 5),): -10.0}},
    "forced_eos_token_id": lambda new, length: {"forced_eos_token_id": 2},
    "exponential_decay_length_penalty": lambda new, length: {
        "exponential_decay_length_penalty": (4, 1.5),
        "eos_token_id": 2,
    },
    "renormalize_logits": lambda new, length: {"renormalize_logits": True, "repetition_penalty": 1.2},
    "logits_processor": lambda new, length: {"logits_processor": LogitsProcessorList([PenalizeEvenTokens()])},
    "do_sample": lambda new, length: {"do_sample": True, "top_k": 1},
    "temperature": lambda new, length: {"do_sample": True, "temperature": 0.7, "top_k": 1},
    "top_p": lambda new, length: {"do_sample": True, "top_p": 0.5, "top_k": 1},
    "min_p": lambda new, length: {"do_sample": True, "min_p": 0.2, "top_k": 1},
    "typical_p": lambda new, length: {"do_sample": True, "typical_p": 0.5, "top_k": 1},
    "epsilon_cutoff": lambda new, length: {"do_sample": True, "epsilon_cutoff": 1e-4, "top_k": 1},
    "eta_cutoff": lambda new, length: {"do_sample": True, "eta_cutoff": 1e-4, "top_k": 1},
    "use_cache": lambda new, length: {"use_cache": True},
    "cache_implementation": lambda new, length: {"cache_implementation": "dynamic"},
    "return_dict_in_generate": lambda new, length: {"return_dict_in_generate": True},
    "remove_invalid_values": lambda new, length: {"remove_invalid_values": True},
    "attention_mask with zeros": lambda new, length: {
        "attention_mask": torch.tensor([[1, 0, 0] + [1] * (length - 3)])
    },
}
EVERY_OUTPUT = ("output_scores", "output_logits", "output_hidden_states", "output_attentions")
CONTINUED = "cache (rewindable, continued)"
IMAGES = {"pixel_values": False, "pixel_values_videos": True}  # option -> video

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
}


def _option_kinds(option: str) -> tuple[str, ...]:
    """The kinds an option applies to: drafter settings need a drafter (prompt lookup has none; "adaptive" is the
    package's own schedule), a continued cache one of the package's drafters, images a kind that runs on an
    image-text family."""
    if option == 'num_assistant_tokens_schedule="adaptive"':
        return OWN_DRAFTERS
    if option in DRAFTER_EXACT:
        return OWN_DRAFTERS + ("stock_assistant",)
    if option == CONTINUED:  # stock drafting refuses a passed cache on a stateful target (test_stock_drafting.py)
        return OWN_DRAFTERS
    return tuple(kind for kind, families in KINDS.items() if set(families) & set(_option_families(option)))


def _option_families(option: str) -> tuple[str, ...]:
    return IMAGE_FAMILIES if option in IMAGES else EVERY_FAMILY


def _matrix() -> list[tuple[str, str, str]]:
    """One case per (kind, option): within an option, the kinds take the families it allows in turn (so an option
    that several kinds take meets several families); the every-output row runs on every (family, kind)."""
    cases = []
    for index, option in enumerate([*EXACT, *DRAFTER_EXACT, CONTINUED, *IMAGES]):
        turn = itertools.count(index)
        for kind in _option_kinds(option):
            families = [family for family in _option_families(option) if family in KINDS[kind]]
            cases.append((families[next(turn) % len(families)] if len(families) > 1 else families[0], kind, option))
    return cases + [(family, kind, "every output") for kind, families in KINDS.items() for family in families]


CASES = _matrix()


class Models:
    """The tiny targets and drafters, built once per module (options that change a drafter restore it)."""

    def __init__(self):
        self.targets, self.drafters = {}, {}

    def target(self, family: str):
        if family not in self.targets:
            self.targets[family] = FAMILIES[family](0)
            self.targets[family].set_attn_implementation("eager")  # attentions need eager attention
        return self.targets[family]

    def drafter(self, family: str, kind: str):
        if (family, kind) not in self.drafters:
            self.drafters[family, kind] = new_drafter(self.target(family), kind, BLOCK_SIZE)
            if kind == "stock_assistant":
                self.drafters[family, kind].set_attn_implementation("eager")
            # Whole drafts every step unless the case sets a schedule: the options must meet accepted blocks
            self.drafters[family, kind].generation_config.num_assistant_tokens_schedule = "constant"
        return self.drafters[family, kind]

    def drafting(self, family: str, kind: str) -> dict:
        if kind == "prompt_lookup":
            return drafting_arguments(self.target(family), kind)
        return {"assistant_model": self.drafter(family, kind)}


@pytest.fixture(scope="module")
def models():
    return Models()


def _prompt(target, case: int) -> dict:
    """A text prompt of its own per case, its second half repeating its first (ids clear of the image families'
    special tokens at the vocabulary's end)."""
    vocab = target.config.get_text_config().vocab_size
    length = PROMPT_LENGTHS[case % len(PROMPT_LENGTHS)]
    half = torch.randint(3, vocab - 8, (1, (length + 1) // 2), generator=torch.Generator().manual_seed(case))
    return {"input_ids": torch.cat([half, half], dim=1)[:, :length]}  # repeats: prompt lookup finds n-grams


def _sequences(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.sequences


def _speculative(target, kind: str, reference: torch.Tensor, case: int, inputs: dict, drafting: dict, **kwargs):
    """generate() with `drafting`; block drafts come from an oracle over `reference`, seeded per case."""
    torch.manual_seed(0)
    if kind not in BLOCK_KINDS:
        return target.generate(**inputs, **drafting, **kwargs)
    oracle = OracleProposer(target.config.get_text_config().vocab_size, reference, corruption=0.15, seed=case)
    with oracle_drafting(oracle):
        return target.generate(**inputs, **drafting, **kwargs)


def _plain(target, inputs: dict, **kwargs):
    torch.manual_seed(0)
    return target.generate(**inputs, **kwargs)


@pytest.mark.parametrize(("family", "kind", "option"), CASES)
def test_speculative_output_is_plain_decodings(models, family, kind, option):
    case = CASES.index((family, kind, option))
    target, drafting = models.target(family), models.drafting(family, kind)
    inputs = _prompt(target, case)
    greedy = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
    plain = _plain(target, inputs, **greedy) if option in {*EXACT, *DRAFTER_EXACT, CONTINUED} else None
    if option in EXACT:
        length = inputs["input_ids"].shape[1]
        kwargs = greedy | EXACT[option](plain[:, length:], length)
        expected = _sequences(_plain(target, inputs, **kwargs))
        reference = torch.cat([expected, plain[:, expected.shape[1] :]], dim=1)
        got = _sequences(_speculative(target, kind, reference, case, inputs, drafting, **kwargs))
        assert torch.equal(got, expected)
        if kind in BLOCK_KINDS and kind != "dspark" and expected.shape[1] - length > BLOCK_SIZE:
            assert max(drafting["assistant_model"].last_generation_stats.accepted_per_step) >= 2  # blocks accepted
    elif option in DRAFTER_EXACT:
        check_drafter_option(target, kind, plain, case, inputs, drafting["assistant_model"], DRAFTER_EXACT[option])
    elif option == "every output":
        every = greedy | {name: True for name in EVERY_OUTPUT} | {"return_dict_in_generate": True}
        expected = _plain(target, inputs, **every)
        got = _speculative(target, kind, expected.sequences, case, inputs, drafting, **every)
        assert_same_outputs(got, expected)
        assert_same_cache(getattr(got, CACHE_ARGUMENT), getattr(expected, CACHE_ARGUMENT))
    elif option == CONTINUED:
        check_continued_conversation(target, kind, plain, case, inputs, drafting)
    else:
        inputs = image_prompt(target, case, video=IMAGES[option])
        expected = _plain(target, inputs, **greedy, return_dict_in_generate=True)
        got = _speculative(
            target, kind, expected.sequences, case, inputs, drafting, **greedy, return_dict_in_generate=True
        )
        assert torch.equal(got.sequences, expected.sequences)
        assert_same_cache(getattr(got, CACHE_ARGUMENT), getattr(expected, CACHE_ARGUMENT))


def check_drafter_option(target, kind, plain, case, inputs, drafter, settings: dict) -> None:
    """Greedy and sampled with top_k=1, two calls in a row (the second starts from what the first kept)."""
    config = drafter.generation_config
    saved = {name: getattr(config, name) for name in settings}
    config.update(**settings)
    try:
        for sampling in ({"do_sample": False}, {"do_sample": True, "top_k": 1}):
            kwargs = {"max_new_tokens": NEW_TOKENS} | sampling
            expected = _plain(target, inputs, **kwargs)
            for _ in range(2):
                got = _speculative(target, kind, plain, case, inputs, {"assistant_model": drafter}, **kwargs)
                assert torch.equal(got, expected), sampling
    finally:
        config.update(**saved)


def check_continued_conversation(target, kind, plain, case, inputs, drafting) -> None:
    """A second turn on the cache a speculative call returned: plain generate() and a speculative call both continue
    it as plain decoding over the whole conversation does, and the cache stays the stock class."""
    turn = {"max_new_tokens": 8, "do_sample": False}
    first_turn = plain[:, : inputs["input_ids"].shape[1] + 8]
    conversation = torch.cat([first_turn, torch.tensor([[7, 8, 9]])], dim=-1)
    expected = target.generate(conversation, **turn)
    for continuation in ({}, drafting):
        first = _speculative(target, kind, plain, case, inputs, drafting, **turn, return_dict_in_generate=True)
        assert torch.equal(first.sequences, first_turn)
        cache = getattr(first, CACHE_ARGUMENT)
        second = {"input_ids": conversation, CACHE_ARGUMENT: cache}
        output = _speculative(target, kind, expected, case, second, continuation, **turn)
        assert torch.equal(output, expected), "with a drafter" if continuation else "plain"
        assert type(cache).__name__ == "DynamicCache"


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_a_conversation_with_an_image_continues_on_the_returned_cache(models, family):
    """A second turn on the cache a speculative call with an image returned, with and without a drafter: as plain
    decoding over the whole conversation. GLM-5-Next's second turn brings a second image; Qwen4-Exp's is text (its
    plain decoding computes the second turn's 3-D positions from the first image's stored deltas)."""
    target, drafting = models.target(family), models.drafting(family, "hyperdflash")
    first_turn = image_prompt(target, seed=0)
    first = target.generate(**first_turn, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, **drafting)
    if family == "glm5_next":
        second_turn = image_prompt(target, seed=1)
        new_ids, new_inputs = second_turn.pop("input_ids"), second_turn
        whole = {name: torch.cat([first_turn[name], new_inputs[name]]) for name in new_inputs}
    else:
        new_ids, new_inputs = torch.tensor([[7, 8, 9]]), {"image_grid_thw": first_turn["image_grid_thw"]}
        whole = {name: value for name, value in first_turn.items() if name != "input_ids"}
    conversation = torch.cat([first.sequences, new_ids], dim=-1)
    if family == "qwen4_exp_composite":
        new_inputs["mm_token_type_ids"] = whole["mm_token_type_ids"] = (
            conversation == target.config.image_token_id
        ).long()
    expected = target.generate(conversation, **whole, max_new_tokens=8, do_sample=False)
    for continuation in ({}, drafting):
        cache = getattr(
            target.generate(**first_turn, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, **drafting),
            CACHE_ARGUMENT,
        )
        output = target.generate(
            conversation, **new_inputs, max_new_tokens=8, do_sample=False, **continuation, **{CACHE_ARGUMENT: cache}
        )
        assert torch.equal(output, expected), "with a drafter" if continuation else "plain"


REFUSAL_CASES = [(kind, option) for kind in OWN_DRAFTERS for option in REFUSED]


@pytest.mark.parametrize(("kind", "option"), REFUSAL_CASES)
def test_refused_option_raises_before_any_forward(models, kind, option):
    target = models.target("deepseek_v4")
    kwargs, message = REFUSED[option]
    inputs = _prompt(target, 0)
    forwards = []
    hook = target.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=re.escape(message)):
            target.generate(**inputs, **kwargs, max_new_tokens=4, **models.drafting("deepseek_v4", kind))
    finally:
        hook.remove()
    assert not forwards, f"{option}: the target ran before the refusal"


def test_the_matrix_covers_every_pair():
    """Every (kind, option) the kind can take and every (family, kind) are cases; every option meets as many
    families as it allows and its kinds reach."""
    options = [*EXACT, *DRAFTER_EXACT, CONTINUED, *IMAGES]
    pairs = {(kind, option) for _, kind, option in CASES if option != "every output"}
    assert pairs == {(kind, option) for option in options for kind in _option_kinds(option)}
    assert {(family, kind) for family, kind, _ in CASES} == {(f, k) for k, families in KINDS.items() for f in families}
    for option in options:
        met = {family for family, _, name in CASES if name == option}
        spread = sum(len(KINDS[kind]) > 1 for kind in _option_kinds(option))
        assert len(met) >= min(len(_option_families(option)), spread), option


def test_the_documented_table_is_the_tested_one():
    rows = re.findall(r"^\| `([^`]+)` \| (exact|refused) \|", PARITY_DOC.read_text(), flags=re.MULTILINE)
    documented = {name: verdict for name, verdict in rows}
    exact = {*EXACT, *DRAFTER_EXACT, *EVERY_OUTPUT, CONTINUED, ", ".join(IMAGES)}
    tested = {name: "exact" for name in exact} | {name: "refused" for name in REFUSED}
    # tests/test_stopping.py, test_streaming.py; several sequences per prompt run batched (tests/test_batched.py)
    covered_elsewhere = {"stop_strings", "stopping_criteria", "streamer", "num_return_sequences"}
    assert {n for n in documented if n not in covered_elsewhere} == set(tested)
    assert all(documented[name] == verdict for name, verdict in tested.items())
    assert all(documented[name] == "exact" for name in covered_elsewhere)
