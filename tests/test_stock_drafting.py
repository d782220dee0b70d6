"""transformers' own drafting modes on mHC targets once the package is loaded: prompt lookup and a stock
same-family assistant model. Stock transformers refuses both on DeepSeek-V4 (its cache cannot roll back), and before
5.25 on GLM-5-Next and Qwen4-Exp; from 5.25 it runs them there, inexactly (`target_linear_attention.py`); on HY-V4
a stock assistant crashed once the package was loaded. The runtime gives the target, and the assistant, caches that
roll back exactly, and the same per-token stopping and output split as for our drafters, so the output is plain
decoding's.
"""

import pytest
import torch

import hf_hyperdflash  # noqa: F401  (installs the generate() integration)
from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT
from hf_hyperdflash.testing import tiny_deepseek_v4, tiny_glm5_next, tiny_hy_v4, tiny_qwen4_exp

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

FAMILIES = {
    "deepseek_v4": lambda seed: tiny_deepseek_v4(seed=seed, index_n_heads=2),
    "glm5_next": tiny_glm5_next,
    "hy_v4": tiny_hy_v4,
    "qwen4_exp": tiny_qwen4_exp,
}
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kind", ["prompt-lookup", "same-model", "other-model"])
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stock_drafting_samples_like_plain_decoding_under_a_fixed_seed(family):
    for seed in range(1):
        target = FAMILIES[family](seed)
        prompt = _repetitive_prompt(seed)
        options = dict(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=1)
        torch.manual_seed(seed)
        plain = target.generate(prompt, **options)
        for kind in ("prompt-lookup", "other-model"):
            torch.manual_seed(seed)
            drafting = _drafting(kind, seed, target, family)
            assert torch.equal(target.generate(prompt, **drafting, **options), plain), kind


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
