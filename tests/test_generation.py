"""`target.generate(..., assistant_model=drafter)` on the stock DeepSeek-V4: lossless, and like plain generate."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

import hf_hyperdflash  # noqa: F401  (installs the generate() integration)
from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT
from hf_hyperdflash.testing import OracleProposer, oracle_drafting, tiny_deepseek_v4

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

# Prompt lengths below, inside and well beyond the sliding window (8) and many compression windows (4 and 8).
PROMPT_LENGTHS = (3, 11, 37)


def _drafters(target):
    torch.manual_seed(1)
    drafters = {
        "hyperdflash": HyperDFlashForDrafting.from_target(target, block_size=8).eval(),
        "vanilla_dflash": HyperDFlashForDrafting.from_target(
            target, block_size=8, reducer="dense", conditioning="intermediate"
        ).eval(),
        "mtp": DeepseekV4MTPForDrafting.from_target(target).eval(),
    }
    for drafter in drafters.values():  # every step drafts: the untrained drafters' drafts go through verification
        drafter.generation_config.num_assistant_tokens_schedule = "constant"
    return drafters


@pytest.fixture(scope="module")
def drafters(target):
    return _drafters(target)


def _prompt(length: int, seed: int = 0) -> torch.LongTensor:
    return torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(seed))


def test_partial_acceptance_stays_lossless_and_is_counted(target, drafters):
    """A drafter right part of the time: full, partial and zero acceptance all happen, output unchanged."""
    drafter = drafters["hyperdflash"]
    seen = {"full": 0, "partial": 0, "zero": 0}
    for length in PROMPT_LENGTHS:
        prompt = _prompt(length, seed=100 + length)
        plain = target.generate(prompt, max_new_tokens=40, do_sample=False)
        with oracle_drafting(OracleProposer(512, plain, corruption=0.08, seed=length)):
            speculative = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter)
        assert torch.equal(plain, speculative)
        stats = drafter.last_generation_stats
        accepted, proposed = stats.accepted_per_step, stats.proposed_per_step
        for a, p in zip(accepted, proposed, strict=True):
            seen["full" if a == p else "zero" if a == 0 else "partial"] += 1
        assert stats.target_forwards < stats.new_tokens, "an oracle drafter must save target forwards"
        assert stats.mean_accepted_length == pytest.approx(sum(accepted) / len(accepted) + 1)
    assert all(seen.values()), seen


def test_generation_stats_read_as_attributes_and_print_a_summary(target, drafters):
    drafter = drafters["hyperdflash"]
    prompt = _prompt(12, seed=7)
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)
    with oracle_drafting(OracleProposer(512, plain, corruption=0.1, seed=7)):
        target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter)
    stats = drafter.last_generation_stats
    assert stats.mean_accepted_length > 1.5
    assert stats.new_tokens == 30
    assert stats.seconds > 0
    assert len(stats.accepted_per_step) == len(stats.proposed_per_step) == stats.target_forwards - 1
    summary = repr(stats)
    assert summary.startswith(f"GenerationStats(tau={stats.mean_accepted_length:.2f}, acceptance_per_position=[")
    assert "target_forwards=" in summary and "new_tokens=30" in summary and "\n" not in summary
    assert "accepted_per_step" not in summary  # the per-step lists stay out of the printout
    assert f"drafted_per_step={stats.drafted_per_step:.2f}" in summary


@pytest.mark.parametrize("kind", ["hyperdflash", "mtp"])
def test_continuing_from_a_returned_cache_matches_plain_decoding(target, drafters, kind):
    """A second chat turn on the cache the first speculative call returned: the first forward feeds only the new
    tokens, as plain decoding does (transformers' assisted loop would feed the whole prompt again)."""
    drafter = drafters[kind]
    prompt = _prompt(14, seed=21)
    first = target.generate(
        prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter, return_dict_in_generate=True
    )
    cache = getattr(first, CACHE_ARGUMENT)
    assert cache.get_seq_length() == first.sequences.shape[1] - 1
    second_prompt = torch.cat([first.sequences, _prompt(9, seed=22)], dim=1)
    forwarded = []
    hook = target.register_forward_pre_hook(
        lambda _, args, kwargs: forwarded.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        continued = target.generate(
            second_prompt, max_new_tokens=16, do_sample=False, assistant_model=drafter, **{CACHE_ARGUMENT: cache}
        )
    finally:
        hook.remove()
    assert forwarded[0] == 10  # the 9 new tokens and the last token of the first reply, not the whole prompt
    assert torch.equal(continued, target.generate(second_prompt, max_new_tokens=16, do_sample=False))
    assert drafter.last_generation_stats.new_tokens == 16
    with pytest.raises(ValueError, match="already holds .* tokens, but the prompt has"):
        target.generate(first.sequences[:, :-2], max_new_tokens=4, assistant_model=drafter, **{CACHE_ARGUMENT: cache})


def test_bf16_mtp_drafter_loaded_like_the_shipped_one(target, tmp_path):
    """Loaded in bf16, V4 keeps some norms in fp32, so `drafter.dtype` is not the projections' dtype."""
    DeepseekV4MTPForDrafting.from_target(target).save_pretrained(tmp_path / "mtp")
    drafter = DeepseekV4MTPForDrafting.from_pretrained(tmp_path / "mtp", dtype=torch.bfloat16).eval()
    assert drafter.e_proj.weight.dtype == torch.bfloat16
    prompt = _prompt(11, seed=5)
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter), plain)


def _assert_same_per_step_outputs(speculative, plain, new_tokens: int) -> None:
    """Scores and logits per token; hidden states and attentions per step, layer by layer, in the same shapes."""
    assert torch.equal(speculative.sequences, plain.sequences)
    for name in ("scores", "logits", "hidden_states", "attentions"):
        ours, theirs = getattr(speculative, name), getattr(plain, name)
        assert len(ours) == len(theirs) == new_tokens, name
        for step, (step_ours, step_theirs) in enumerate(zip(ours, theirs, strict=True)):
            if name in ("scores", "logits"):
                step_ours, step_theirs = (step_ours,), (step_theirs,)
            assert [t.shape for t in step_ours] == [t.shape for t in step_theirs], (name, step)
            for layer_ours, layer_theirs in zip(step_ours, step_theirs, strict=True):
                torch.testing.assert_close(layer_ours, layer_theirs, rtol=1e-4, atol=1e-4)


ALL_OUTPUTS = dict(
    do_sample=False,
    return_dict_in_generate=True,
    output_scores=True,
    output_logits=True,
    output_hidden_states=True,
    output_attentions=True,
)


@pytest.mark.parametrize("kind", ["hyperdflash", "mtp"])
def test_per_step_outputs_match_plain_decoding_on_a_continued_cache(target, drafters, kind):
    """The first step of a continued call covers only the new tokens, then one step per token, as plain decoding."""
    prompt = _prompt(14, seed=23)
    options = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    first_plain = target.generate(prompt, **options)
    first_speculative = target.generate(prompt, assistant_model=drafters[kind], **options)
    second_prompt = torch.cat([first_plain.sequences, _prompt(9, seed=24)], dim=1)
    plain_cache, speculative_cache = (getattr(o, CACHE_ARGUMENT) for o in (first_plain, first_speculative))
    plain = target.generate(second_prompt, max_new_tokens=12, **ALL_OUTPUTS, **{CACHE_ARGUMENT: plain_cache})
    with oracle_drafting(OracleProposer(512, plain.sequences, corruption=0.15, seed=4)):
        speculative = target.generate(
            second_prompt,
            max_new_tokens=12,
            assistant_model=drafters[kind],
            **ALL_OUTPUTS,
            **{CACHE_ARGUMENT: speculative_cache},
        )
    _assert_same_per_step_outputs(speculative, plain, new_tokens=12)
    assert plain.attentions[0][0].shape[-2] == 10  # the 9 new tokens and the last token of the first reply


def test_windowed_drafter_is_lossless_at_long_context_with_a_bounded_cache(target, monkeypatch):
    torch.manual_seed(1)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=8, context_window=16).eval()
    caches = []
    make = drafter.make_context_cache
    monkeypatch.setattr(drafter, "make_context_cache", lambda: caches.append(make()) or caches[-1])
    prompt = _prompt(300, seed=11)
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    speculative = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter)
    assert torch.equal(speculative, plain)
    (cache,) = caches
    assert cache.get_seq_length() > 300 and all(layer.keys.shape[-2] == 16 for layer in cache.layers)


def test_target_offloaded_to_disk_by_accelerate(target, tmp_path):
    """Layers and head offloaded (weights on the meta device until their forward): embedding, head and the drafter's
    placement follow accelerate's execution device."""
    target.save_pretrained(tmp_path / "target")
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "target",
        dtype=torch.float32,
        device_map="auto",
        max_memory={"cpu": "1MB"},
        offload_folder=str(tmp_path / "offload"),
    ).eval()
    assert {"cpu", "disk"} <= set(offloaded.hf_device_map.values()) and offloaded.lm_head.weight.is_meta
    torch.manual_seed(1)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=6).eval()
    prompt = _prompt(19, seed=13)
    plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(offloaded.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=drafter), plain)
    assert drafter.last_generation_stats.new_tokens == 16


def test_max_new_tokens_ending_inside_a_block(target, drafters):
    prompt = _prompt(6, seed=4)
    for max_new_tokens in (1, 2, 5, 10):
        plain = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
        with oracle_drafting(OracleProposer(512, plain, corruption=0.0)):
            spec = target.generate(
                prompt, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafters["hyperdflash"]
            )
        assert torch.equal(plain, spec)


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.chunks.append("end")


def test_streamer_receives_prompt_then_every_token_once(target, drafters):
    prompt = _prompt(8, seed=7)
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    streamer = _Collect()
    with oracle_drafting(OracleProposer(512, plain, corruption=0.2, seed=7)):
        target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafters["mtp"], streamer=streamer)
    assert streamer.chunks[-1] == "end"
    streamed = [token for chunk in streamer.chunks[1:-1] for token in chunk]
    assert streamer.chunks[0] == prompt[0].tolist()
    assert streamed == plain[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 6])
def test_mtp_depths_are_lossless(target, drafters, num_draft_tokens):
    drafter = drafters["mtp"]
    drafter.generation_config.num_assistant_tokens = num_draft_tokens
    try:
        prompt = _prompt(20, seed=num_draft_tokens)
        plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
        spec = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter)
    finally:
        drafter.generation_config.num_assistant_tokens = 3
    assert torch.equal(plain, spec)
    assert len(drafter.last_generation_stats.acceptance_per_position) == num_draft_tokens


def test_stateful_guard_is_lifted_only_during_the_call(target, drafters):
    prompt = _prompt(5)
    target.generate(prompt, max_new_tokens=4, do_sample=False, assistant_model=drafters["hyperdflash"])
    assert "_is_stateful" not in vars(target) and getattr(target, "_is_stateful", True) is True  # the guard, < 5.25
    assert "_get_candidate_generator" not in vars(target)
    stock_assistant = tiny_deepseek_v4(seed=3)  # transformers' own assisted decoding: exact once the package loads
    assisted = target.generate(prompt, max_new_tokens=4, do_sample=False, assistant_model=stock_assistant)
    assert torch.equal(assisted, target.generate(prompt, max_new_tokens=4, do_sample=False))
    assert "_is_stateful" not in vars(target) and "_get_candidate_generator" not in vars(target)
