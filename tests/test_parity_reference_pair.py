"""The parity issue's cases on the shipped reference pair: trained drafters as shipped (the native-MTP one in bf16,
`dtype="auto"`), the fp32 target, a chat prompt, compared with plain generate(). Stop strings on this pair are in
`tests/test_stopping.py`; the documented table is checked option by option on tiny targets in `tests/test_lossless.py`.
"""

import re

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from hf_hyperdflash import reference
from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT

NEW = 24
KINDS = ("hyperdflash", "mtp")


class PenalizeEvenTokens(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores - 2.0 * (input_ids[:, -1:] % 2 == 0).float()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(reference.tokenizer_path())


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def drafters():
    loaded = {
        "hyperdflash": AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype="auto").eval(),
        "mtp": AutoModel.from_pretrained(reference.mtp_path(), dtype="auto").eval(),
    }
    for drafter in loaded.values():  # every step verifies a multi-token draft
        drafter.generation_config.num_assistant_tokens_schedule = "constant"
    return loaded


def _chat(tokenizer, *turns: str) -> torch.LongTensor:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def _assert_same(speculative, plain) -> None:
    assert torch.equal(speculative.sequences, plain.sequences)
    for name in ("scores", "hidden_states", "attentions"):
        ours, theirs = getattr(speculative, name), getattr(plain, name)
        if theirs is None:
            assert ours is None, name
            continue
        assert len(ours) == len(theirs), name
        for step_ours, step_theirs in zip(ours, theirs, strict=True):
            pairs = [(step_ours, step_theirs)] if name == "scores" else zip(step_ours, step_theirs, strict=True)
            for a, b in pairs:
                assert a.shape == b.shape, name
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_shipped_mtp_drafter_loads_in_bf16(drafters):
    assert drafters["mtp"].e_proj.weight.dtype == torch.bfloat16
    assert drafters["hyperdflash"].dtype == torch.bfloat16


@pytest.mark.parametrize("kind", KINDS)
def test_returned_outputs_match_plain_decoding(tokenizer, target, drafters, kind):
    prompt = _chat(tokenizer, "What should I pack for a weekend of hiking?")
    options = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_scores=True)
    options |= dict(output_hidden_states=True, output_attentions=True)
    plain = target.generate(prompt, **options)
    speculative = target.generate(prompt, assistant_model=drafters[kind], **options)
    _assert_same(speculative, plain)
    assert max(drafters[kind].last_generation_stats.accepted_per_step) >= 2


@pytest.mark.parametrize("kind", KINDS)
def test_second_turn_on_the_returned_cache(tokenizer, target, drafters, kind):
    prompt = _chat(tokenizer, "Name a good book about the sea.")
    first = target.generate(
        prompt, max_new_tokens=NEW, do_sample=False, assistant_model=drafters[kind], return_dict_in_generate=True
    )
    reply = tokenizer.decode(first.sequences[0, prompt.shape[1] :], skip_special_tokens=True)
    second = _chat(tokenizer, "Name a good book about the sea.", reply, "Why that one?")
    if not torch.equal(second[:, : first.sequences.shape[1] - 1], first.sequences[:, :-1]):
        second = torch.cat([first.sequences, second[:, prompt.shape[1] :]], dim=1)  # keep the cached prefix
    continued = target.generate(
        second,
        max_new_tokens=NEW,
        do_sample=False,
        assistant_model=drafters[kind],
        **{CACHE_ARGUMENT: getattr(first, CACHE_ARGUMENT)},
    )
    assert torch.equal(continued, target.generate(second, max_new_tokens=NEW, do_sample=False))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sampled", [False, True])
def test_attention_mask_with_zeros(tokenizer, target, drafters, kind, sampled):
    prompt = _chat(tokenizer, "Explain what a compiler does, briefly, for someone new to programming.")
    mask = torch.ones_like(prompt)
    mask[0, 2:5] = mask[0, 12:14] = 0
    options = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=sampled)
    if sampled:
        options["top_k"] = 1
    torch.manual_seed(0)
    plain = target.generate(prompt, **options)
    torch.manual_seed(0)
    assert torch.equal(target.generate(prompt, assistant_model=drafters[kind], **options), plain)


@pytest.mark.parametrize("kind", KINDS)
def test_cache_implementation_dynamic_and_a_pure_processor(tokenizer, target, drafters, kind, monkeypatch):
    prompt = _chat(tokenizer, "Give me three tips for sleeping better.")
    monkeypatch.setattr(target.generation_config, "cache_implementation", "dynamic")  # as from a Hub config
    processors = LogitsProcessorList([PenalizeEvenTokens()])
    plain = target.generate(prompt, max_new_tokens=NEW, do_sample=False, logits_processor=processors)
    speculative = target.generate(
        prompt, max_new_tokens=NEW, do_sample=False, logits_processor=processors, assistant_model=drafters[kind]
    )
    assert torch.equal(speculative, plain)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"guidance_scale": 1.5}, "guidance_scale=1.5"),
        ({"prompt_lookup_num_tokens": 3}, "two ways to draft"),
    ],
)
def test_refused_before_any_forward(tokenizer, target, drafters, options, message):
    prompt = _chat(tokenizer, "Hello!")
    forwards = []
    hook = target.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=re.escape(message)):
            target.generate(prompt, max_new_tokens=4, assistant_model=drafters["hyperdflash"], **options)
    finally:
        hook.remove()
    assert not forwards


def test_a_cache_left_by_a_shorter_draft_continues_with_a_longer_one(tokenizer, target, drafters):
    """The cache the MTP drafter's call returns (3 drafts per step) is plain decoding's, so a HyperDFlash block (7
    drafts) continues from it: the call makes it rewindable for its own drafts, and the output is plain decoding's
    over the whole conversation."""
    prompt = _chat(tokenizer, "Hello!")
    first = target.generate(
        prompt, max_new_tokens=6, do_sample=False, assistant_model=drafters["mtp"], return_dict_in_generate=True
    )
    follow_up = torch.cat([first.sequences, prompt[:, -3:]], dim=1)
    cache = {CACHE_ARGUMENT: getattr(first, CACHE_ARGUMENT)}
    continued = target.generate(
        follow_up, max_new_tokens=12, do_sample=False, assistant_model=drafters["hyperdflash"], **cache
    )
    assert torch.equal(continued, target.generate(follow_up, max_new_tokens=12, do_sample=False))
