"""`TextStreamer` prints the same text for speculative and plain generation, with a real tokenizer.

Speculative decoding hands the streamer several tokens per verify step; the printed text must still be exactly the
decoded continuation, printed once.
"""

from contextlib import nullcontext

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TextStreamer

import hf_hyperdflash  # noqa: F401  (installs the generate() integration)
from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.testing import OracleProposer, oracle_drafting

VOCAB = 512
# Longer than the target's sliding window (8), so verify steps rewind a truncated sliding cache.
PROMPT_TEXT = "t5 t17 t33 t9 t250 t12 t77 t401 t3 t64 t128"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """Word-level: token i is the word `t{i}`, words separated by spaces, so decoded text is easy to read."""
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _streamed(capsys, target, tokenizer, **kwargs) -> tuple[str, torch.LongTensor]:
    """What a skip_prompt TextStreamer printed during `generate(**kwargs)`, and the new tokens generate returned."""
    prompt = tokenizer(PROMPT_TEXT, return_tensors="pt").input_ids
    capsys.readouterr()
    out = target.generate(prompt, max_new_tokens=20, streamer=TextStreamer(tokenizer, skip_prompt=True), **kwargs)
    return capsys.readouterr().out, out[0, prompt.shape[1] :]


@pytest.mark.parametrize("kind", ["hyperdflash-oracle", "mtp"])
def test_greedy_stream_equals_plain_stream_and_decoded_tokens(capsys, target, tokenizer, kind):
    plain_text, plain_tokens = _streamed(capsys, target, tokenizer, do_sample=False)
    torch.manual_seed(1)
    if kind == "mtp":
        drafter, routing = DeepseekV4MTPForDrafting.from_target(target).eval(), nullcontext()
    else:
        drafter = HyperDFlashForDrafting.from_target(target, block_size=8).eval()
        reference = torch.cat([tokenizer(PROMPT_TEXT, return_tensors="pt").input_ids, plain_tokens[None]], dim=1)
        routing = oracle_drafting(OracleProposer(VOCAB, reference, corruption=0.2, seed=0))
    with routing:
        text, tokens = _streamed(capsys, target, tokenizer, do_sample=False, assistant_model=drafter)

    assert torch.equal(tokens, plain_tokens)
    assert text == plain_text == tokenizer.decode(plain_tokens) + "\n"
    assert len(text.split()) == 20
    if kind == "hyperdflash-oracle":  # several tokens reached the streamer in one verify step
        assert max(drafter.last_generation_stats.accepted_per_step) >= 2


def test_sampled_stream_equals_decoded_tokens(capsys, target, tokenizer):
    torch.manual_seed(1)
    drafter = DeepseekV4MTPForDrafting.from_target(target).eval()
    torch.manual_seed(0)
    # The sample depends on which steps the schedule drafts (timed, so not fixed by the seed): min_new_tokens keeps
    # an end-of-text token from ending it early
    text, tokens = _streamed(
        capsys, target, tokenizer, do_sample=True, top_k=5, min_new_tokens=20, assistant_model=drafter
    )
    assert text == tokenizer.decode(tokens) + "\n"
    assert len(tokens) == 20
