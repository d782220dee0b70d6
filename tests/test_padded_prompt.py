"""A batch-1 `attention_mask` with zeros, as plain generate() accepts it: speculative output is plain decoding's.

generate() then derives position ids from the mask, so they lag the cache; stock V4's HCA layers mask compressed
entries by position id in a multi-token forward but show a one-token forward all of them, so an unpatched verify
forward differs from token-by-token decoding (the negative control below). `compressed_visibility` fixes that.
"""

import contextlib

import pytest
import torch

import hf_hyperdflash.modeling.target_deepseek_v4 as target_deepseek_v4
from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.modeling import integration
from hf_hyperdflash.modeling.compressed_visibility import decoding_block_bias
from hf_hyperdflash.testing import OracleProposer, oracle_drafting, tiny_deepseek_v4

PROMPT_TOKENS = 30  # past the sliding window (8) and several HCA windows (8)
NEW_TOKENS = 24
PAD, EOS = 1, 2  # no prompt token: they are drawn from 3 on


def _mask(pattern: str) -> torch.Tensor:
    """`first`: only the first token attended (the upstream tester's batch-1 mask); `holes`: zeros inside."""
    mask = torch.ones(1, PROMPT_TOKENS, dtype=torch.long)
    if pattern == "first":
        mask[0, 1:] = 0
    elif pattern == "leading":
        mask[0, :5] = 0
    else:
        mask[0, 3:6] = mask[0, 17:19] = 0
    return mask


def _pairs(kind: str, pattern: str, seeds=range(2), **options):
    """(plain, speculative) outputs per seed, drafts mostly accepted, every step a multi-token verify."""
    options = {"max_new_tokens": NEW_TOKENS, "do_sample": False} | options
    for seed in seeds:
        target = tiny_deepseek_v4(seed=seed, index_n_heads=2)
        torch.manual_seed(seed)
        if kind == "mtp":
            drafter = DeepseekV4MTPForDrafting.from_target(target).eval()
        else:
            drafter = HyperDFlashForDrafting.from_target(target, block_size=8).eval()
        drafter.generation_config.num_assistant_tokens_schedule = "constant"
        prompt = torch.randint(3, 512, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed))
        if pattern == "inferred":  # no mask passed: generate() infers one from the padding tokens
            prompt[0, :5] = PAD
            inputs = {"input_ids": prompt, "pad_token_id": PAD, "eos_token_id": EOS}
        else:
            inputs = {"input_ids": prompt, "attention_mask": _mask(pattern)}
        torch.manual_seed(seed)
        plain = target.generate(**inputs, **options)
        with oracle_drafting(OracleProposer(512, plain, corruption=0.15, seed=seed)):
            torch.manual_seed(seed)
            speculative = target.generate(**inputs, assistant_model=drafter, **options)
        yield plain, speculative


@pytest.mark.parametrize("pattern", ["first", "leading", "holes"])
@pytest.mark.parametrize("kind", ["hyperdflash", "mtp"])
def test_greedy_output_with_a_padded_mask_is_plain_decodings(kind, pattern):
    for plain, speculative in _pairs(kind, pattern):
        assert torch.equal(plain, speculative)


def test_a_mask_generate_infers_from_padding_tokens_is_honoured(monkeypatch):
    """No mask passed, a prompt that starts with padding tokens (not end-of-sequence ones): generate() infers a mask
    with zeros, so position ids lag the cache as with a passed one, and verify rows must be fixed as for one. Without
    counting the inferred mask (`masks_padding` always False, as before it) the output differs."""
    for plain, speculative in _pairs("hyperdflash", "inferred", seeds=range(4)):
        assert torch.equal(plain, speculative)
    monkeypatch.setattr(integration, "masks_padding", lambda *_: False)
    pairs = _pairs("hyperdflash", "inferred", seeds=range(4))
    assert any(not torch.equal(plain, speculative) for plain, speculative in pairs)


def test_sampled_output_with_a_padded_mask_under_a_fixed_seed():
    for plain, speculative in _pairs("hyperdflash", "holes", do_sample=True, top_k=1):
        assert torch.equal(plain, speculative)


def test_without_the_fix_verification_differs(monkeypatch):
    """Negative control: stock HCA masking in verify forwards changes the output (transformers 5.23/5.24)."""
    monkeypatch.setattr(target_deepseek_v4, "hca_visibility_as_decoding", lambda *_: contextlib.nullcontext())
    pairs = _pairs("hyperdflash", "leading", seeds=range(4))
    assert any(not torch.equal(plain, speculative) for plain, speculative in pairs)


def test_block_bias_rows_of_generated_tokens_follow_the_cache_and_prompt_rows_the_positions():
    # cache indices 14..17 (prompt of 16 tokens), position ids lagging by 5, compress rate 4, 4 entries
    position_ids = torch.tensor([[9, 10, 11, 12]])
    bias = decoding_block_bias(4, position_ids, cache_end=18, prompt_length=16, compress_rate=4)
    # Exact float comparisons: the bias is filled with the constants 0.0 and -inf, not computed
    visible = (bias == 0).sum(-1).flatten().tolist()
    assert visible == [(9 + 1) // 4, (10 + 1) // 4, (16 + 1) // 4, (17 + 1) // 4]
    assert bias.shape == (1, 1, 4, 4) and set(bias.unique().tolist()) == {0.0, float("-inf")}
