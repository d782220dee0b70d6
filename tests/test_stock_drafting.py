"""transformers' own drafting modes on mHC targets once the package is loaded: prompt lookup and a stock
same-family assistant model. Stock transformers refuses both on DeepSeek-V4 (its cache cannot roll back), and before
5.25 on GLM-5-Next and Qwen4-Exp; from 5.25 it runs them there, inexactly (`target_linear_attention.py`); on HY-V4
a stock assistant crashed once the package was loaded. The runtime gives the target, and the assistant, caches that
roll back exactly, and the same per-token stopping and output split as for our drafters, so the output is plain
decoding's.
"""

import pytest
import torch
from transformers import AutoTokenizer, GenerationMixin

import hf_hyperdflash  # noqa: F401  (installs the generate() integration)
from hf_hyperdflash import reference
from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT
from hf_hyperdflash.testing import tiny_deepseek_v4, tiny_glm5_next, tiny_hy_v4, tiny_qwen4_exp

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

FAMILIES = {
    "deepseek_v4": lambda seed, **overrides: tiny_deepseek_v4(seed=seed, index_n_heads=2, **overrides),
    "glm5_next": tiny_glm5_next,
    "hy_v4": tiny_hy_v4,
    "qwen4_exp": tiny_qwen4_exp,
}
# DeepSeek-V4 on the fast path; the other families, a few seconds a case, in CI (`-m slow`). Every family meets
# prompt lookup and a stock assistant on the fast path in tests/test_lossless.py too.
FAST_FAMILY = "deepseek_v4"
EACH_FAMILY = [
    pytest.param(family, marks=() if family == FAST_FAMILY else pytest.mark.slow) for family in sorted(FAMILIES)
]
SEEDS = {"deepseek_v4": range(4), "glm5_next": range(2), "hy_v4": range(2), "qwen4_exp": range(2)}
NEW_TOKENS = 24
OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_hidden_states=True, output_attentions=True)


def _repetitive_prompt(seed: int) -> torch.LongTensor:
    """40 tokens whose second half repeats its first, so prompt lookup finds n-grams to draft from."""
    half = torch.randint(3, 512, (1, 20), generator=torch.Generator().manual_seed(seed))
    return torch.cat([half, half], dim=1)


def _target(family: str, seed: int):
    target = FAMILIES[family](seed)
    target.set_attn_implementation("eager")  # attentions to compare (GLM-5-Next and Qwen4-Exp default to sdpa)
    return target


def _drafting(kind: str, seed: int, target, family: str = "deepseek_v4") -> dict:
    if kind == "prompt-lookup":
        return {"prompt_lookup_num_tokens": 4}
    assistant = target if kind == "same-model" else _target(family, seed + 100)
    return {"assistant_model": assistant}


@pytest.mark.parametrize("family", EACH_FAMILY)
@pytest.mark.parametrize("kind", ["prompt-lookup", "same-model"])  # another model: tests/test_lossless.py
def test_stock_drafting_is_plain_greedy_decoding(family, kind):
    forwards, target_forwards = [], 0
    for seed in SEEDS[family]:
        target = _target(family, seed)
        prompt = _repetitive_prompt(seed)
        plain = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **OUTPUTS)
        before = target_forwards
        hook = target.register_forward_pre_hook(lambda *_: forwards.append(1))
        try:
            drafted = target.generate(
                prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **_drafting(kind, seed, target, family), **OUTPUTS
            )
        finally:
            hook.remove()
        assert len(forwards) > before
        assert torch.equal(drafted.sequences, plain.sequences)
        for name in ("scores", "hidden_states", "attentions"):
            for step_ours, step_theirs in zip(getattr(drafted, name), getattr(plain, name), strict=True):
                pairs = [(step_ours, step_theirs)] if name == "scores" else zip(step_ours, step_theirs, strict=True)
                for a, b in pairs:
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        target_forwards = len(forwards)
    if kind == "prompt-lookup" and family == "deepseek_v4":  # these targets continue the repetition: drafts accepted
        assert target_forwards < NEW_TOKENS * len(SEEDS[family])


@pytest.mark.parametrize("family", ["glm5_next", "qwen4_exp"])
def test_a_stock_assistant_whose_heuristic_lengthens_its_drafts_stays_exact(family):
    """transformers' heuristic adds 2 drafts after a step whose drafts were all accepted (the prompt's step, which has
    none, counts); from 5.25 a linear-attention target's cache keeps states for the draft length at the call's start,
    so rejecting a longer draft failed in `crop` (IndexError) when sampling. Each verify forward now keeps its own."""
    target, assistant = _target(family, seed=0), _target(family, seed=100)
    assistant.generation_config.num_assistant_tokens = 2
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic_transient"
    prompt = _repetitive_prompt(0)[:, :13]
    for sampling in ({"do_sample": False}, {"do_sample": True, "top_k": 1}):
        torch.manual_seed(0)
        plain = target.generate(prompt, max_new_tokens=16, **sampling)
        torch.manual_seed(0)
        assert torch.equal(target.generate(prompt, max_new_tokens=16, assistant_model=assistant, **sampling), plain)


def test_stock_drafting_refuses_a_passed_cache_before_any_forward():
    target = tiny_deepseek_v4(seed=0)
    prompt = _repetitive_prompt(0)
    first = target.generate(prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    forwards = []
    hook = target.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="cannot continue from a passed cache"):
            target.generate(
                first.sequences,
                max_new_tokens=4,
                prompt_lookup_num_tokens=3,
                **{CACHE_ARGUMENT: getattr(first, CACHE_ARGUMENT)},
            )
    finally:
        hook.remove()
    assert not forwards


@pytest.fixture(scope="module")
def two_tokenizers():
    """The reference tokenizer, and a copy with two tokens of its own (transformers takes them for different ones)."""
    target_tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    assistant_tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    assistant_tokenizer.add_tokens(["<assistant_only_a>", "<assistant_only_b>"])
    return target_tokenizer, assistant_tokenizer


@pytest.mark.parametrize("family", EACH_FAMILY)
@pytest.mark.parametrize("mode", ["other-tokenizer", "early-exit"])
def test_the_other_stock_assisted_modes_are_exact_or_fail_as_without_the_package(family, mode, two_tokenizers):
    """transformers' other assisted modes: an assistant with another tokenizer (its drafts re-tokenized), and early
    exit (the target's first layer drafts). With the package each call gives plain greedy decoding's tokens, or fails
    as stock transformers (the unwrapped generate()) fails on the same call; a call stock runs exactly, it runs too.
    Measured on 5.25: early exit fails in stock on all but HY-V4, which the package leaves to transformers; another
    tokenizer crashes stock on Qwen4-Exp (seed 1: the assistant crops past its last crop, which a linear-attention
    layer cannot undo) and the package too, and the package runs it on DeepSeek-V4, which stock refuses."""
    target_tokenizer, assistant_tokenizer = two_tokenizers
    stock_generate = GenerationMixin.generate.__wrapped__
    vocab = len(target_tokenizer)
    for seed in range(3):
        target = FAMILIES[family](seed, vocab_size=vocab)
        prompt = torch.randint(3, vocab, (1, 20), generator=torch.Generator().manual_seed(seed))
        plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
        if mode == "early-exit":
            drafting = {"assistant_early_exit": 1}
        else:
            assistant = FAMILIES[family](seed + 100, vocab_size=len(assistant_tokenizer))
            drafting = dict(
                assistant_model=assistant, tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer
            )
        outcomes = []
        for generate in (GenerationMixin.generate, stock_generate):
            try:
                output = generate(target, prompt, max_new_tokens=16, do_sample=False, **drafting)
                outcomes.append("plain" if torch.equal(output, plain) else "other tokens")
            except Exception as error:  # noqa: BLE001  (what stock raises is what is compared)
                outcomes.append(type(error).__name__)
        with_package, stock = outcomes
        assert with_package == "plain" or with_package == stock, f"seed {seed}: {with_package}, stock {stock}"
