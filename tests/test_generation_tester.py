"""What transformers' `GenerationTesterMixin` assisted-decoding tests check, with our drafters as the assistant.

Written here, not copied: the same tiny DeepSeek-V4 as the upstream V4 tester (2 layers, HCA then CSA, hc_mult 2,
2 indexer heads), its inputs (7 random ids out of 99, batch 1, the mask `[1, 0, 0, 0, 0, 0, 0]` that the tester's
lower-triangular mask gives the first row), its generate() arguments (no EOS, 4 new tokens, every output in the
returned dict, the repetition-penalty / bad-words / invalid-values processors, 2 draft tokens on a constant
schedule), and its checks: greedy speculative output equals plain greedy output, scores and logits agree, and both
have the shapes plain decoding has per step. We also compare hidden states and attentions value by value, and run
10 seeds instead of one (ties in the 2-head indexer show up in about 1 of 6 inputs).
"""

import contextlib

import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from hf_hyperdflash import DeepseekV4DSparkForDrafting, DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT
from hf_hyperdflash.testing import (
    OracleProposer,
    image_prompt,
    oracle_drafting,
    tiny_glm5_next,
    tiny_hy_v4,
    tiny_qwen4_exp,
    tiny_qwen4_exp_composite,
)

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

SEEDS = range(10)
PROMPT_TOKENS = 7
VOCAB = 99
NEW_TOKENS = 4


def upstream_tester_config() -> DeepseekV4Config:
    """The upstream `DeepseekV4ModelTester` settings."""
    return DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_hidden_layers=2,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=64,
        head_dim=32,
        partial_rotary_factor=8 / 32,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=4,
        n_shared_experts=1,
        mlp_layer_types=["moe", "moe"],
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        sliding_window=8,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        hc_eps=1.0e-6,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=2,
        num_nextn_predict_layers=0,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        attention_bias=False,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def upstream_tester_inputs(seed: int) -> dict:
    input_ids = torch.randint(VOCAB, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed))
    attention_mask = torch.tril(torch.ones(PROMPT_TOKENS, PROMPT_TOKENS, dtype=torch.long))[:1]
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def generation_kwargs(do_sample: bool = False) -> dict:
    kwargs = dict(
        eos_token_id=-1,
        max_new_tokens=NEW_TOKENS,
        num_beams=1,
        do_sample=do_sample,
        output_scores=True,
        output_logits=True,
        output_hidden_states=True,
        output_attentions=True,
        return_dict_in_generate=True,
        use_cache=True,
        bad_words_ids=[[1, 0]],
        repetition_penalty=1.2,
        remove_invalid_values=True,
    )
    if do_sample:
        kwargs |= dict(top_k=10, top_p=0.7, temperature=0.7)
    return kwargs


def _target(seed: int) -> DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    return DeepseekV4ForCausalLM._from_config(upstream_tester_config(), attn_implementation="eager").float().eval()


def _drafter(target: DeepseekV4ForCausalLM, kind: str, seed: int):
    torch.manual_seed(seed)
    if kind == "mtp":
        drafter = DeepseekV4MTPForDrafting.from_target(target).eval()
    else:
        drafter = HyperDFlashForDrafting.from_target(target, block_size=4).eval()
    drafter.generation_config.num_assistant_tokens = 2
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    return drafter


def check_generate_outputs(output, config: DeepseekV4Config) -> None:
    """The shapes plain decoding returns: one entry per new token; the first step covers the prompt."""
    assert output.sequences.shape == (1, PROMPT_TOKENS + NEW_TOKENS)
    for name in ("scores", "logits"):
        assert [tuple(t.shape) for t in getattr(output, name)] == [(1, config.vocab_size)] * NEW_TOKENS
    assert len(output.attentions) == len(output.hidden_states) == NEW_TOKENS
    for step, (attentions, hidden_states) in enumerate(zip(output.attentions, output.hidden_states, strict=True)):
        queries = PROMPT_TOKENS if step == 0 else 1
        assert len(attentions) == config.num_hidden_layers
        assert all(a.shape[:3] == (1, config.num_attention_heads, queries) for a in attentions)
        assert len(hidden_states) == config.num_hidden_layers + 1
        assert all(h.shape == (1, queries, config.hc_mult, config.hidden_size) for h in hidden_states[:-1])
        assert hidden_states[-1].shape == (1, queries, config.hidden_size)


def assert_similar_outputs(assisted, plain) -> None:
    assert assisted.sequences.tolist() == plain.sequences.tolist()
    for name in ("scores", "logits"):
        for ours, theirs in zip(getattr(assisted, name), getattr(plain, name), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for name in ("attentions", "hidden_states"):
        for ours, theirs in zip(getattr(assisted, name), getattr(plain, name), strict=True):
            for layer_ours, layer_theirs in zip(ours, theirs, strict=True):
                torch.testing.assert_close(layer_ours, layer_theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("assistant", ["hyperdflash-accepted", "hyperdflash-random", "mtp-random"])
def test_assisted_decoding_matches_greedy_search(assistant):
    """`accepted`: an oracle drafter whose drafts are all accepted (upstream: the target as its own assistant);
    `random`: an untrained drafter whose drafts are mostly rejected (upstream: a randomly initialised assistant)."""
    kind, behaviour = assistant.split("-")
    for seed in SEEDS:
        target, inputs = _target(seed), upstream_tester_inputs(seed)
        drafter = _drafter(target, kind, seed)
        plain = target.generate(**inputs, **generation_kwargs())
        oracle = OracleProposer(VOCAB, plain.sequences, corruption=0.0)
        with oracle_drafting(oracle) if behaviour == "accepted" else contextlib.nullcontext():
            assisted = target.generate(**inputs, assistant_model=drafter, **generation_kwargs())
        assert_similar_outputs(assisted, plain)
        for output in (plain, assisted):
            check_generate_outputs(output, target.config)
        if behaviour == "accepted":
            assert drafter.last_generation_stats.accepted_per_step[0] == 2


def test_assisted_decoding_sample():
    """Sampling with the tester's top-k / top-p / temperature: plain decoding's shapes; and under a fixed seed with
    top_k=1, plain decoding's tokens."""
    for seed in SEEDS:
        target, inputs = _target(seed), upstream_tester_inputs(seed)
        drafter = _drafter(target, "hyperdflash", seed)
        torch.manual_seed(seed)
        check_generate_outputs(
            target.generate(**inputs, assistant_model=drafter, **generation_kwargs(do_sample=True)), target.config
        )
        single = generation_kwargs(do_sample=True) | {"top_k": 1}
        torch.manual_seed(seed)
        plain = target.generate(**inputs, **single)
        torch.manual_seed(seed)
        with oracle_drafting(OracleProposer(VOCAB, plain.sequences, corruption=0.3, seed=seed)):
            assisted = target.generate(**inputs, assistant_model=drafter, **single)
        assert_similar_outputs(assisted, plain)


@pytest.mark.parametrize("assistant", ["prompt-lookup", "stock-same", "stock-random"])
def test_stock_drafting_matches_greedy_search(assistant):
    """transformers' own drafting on the stateful V4 target once the package is loaded (stock transformers refuses
    it): prompt lookup (`prompt_lookup_num_tokens=2, max_matching_ngram_size=2`, as upstream), the target as its
    own assistant, and a randomly initialised V4 assistant."""
    for seed in SEEDS:
        target, inputs = _target(seed), upstream_tester_inputs(seed)
        plain = target.generate(**inputs, **generation_kwargs())
        if assistant == "prompt-lookup":
            drafting = {"prompt_lookup_num_tokens": 2, "max_matching_ngram_size": 2}
        else:
            model = target if assistant == "stock-same" else _target(seed + 100)
            model.generation_config.num_assistant_tokens = 2
            model.generation_config.num_assistant_tokens_schedule = "constant"
            drafting = {"assistant_model": model}
        assisted = target.generate(**inputs, **drafting, **generation_kwargs())
        assert_similar_outputs(assisted, plain)
        for output in (plain, assisted):
            check_generate_outputs(output, target.config)


OTHER_FAMILIES = {"glm5_next": tiny_glm5_next, "hy_v4": tiny_hy_v4, "qwen4_exp": tiny_qwen4_exp}


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
@pytest.mark.parametrize("assistant", ["prompt-lookup", "stock-same", "stock-random"])
def test_stock_drafting_on_the_other_families_matches_greedy_search(family, assistant):
    """The same test on the other mHC families (tiny GLM-5-Next, HY-V4 and Qwen4-Exp, 2 indexer heads, eager
    attention), with the tester's inputs, mask and generate() arguments. HY-V4 is stateless, so stock transformers runs
    its assistants itself; with the package imported they take the package's exact path (they once crashed there)."""
    for seed in range(4):
        target = OTHER_FAMILIES[family](seed=seed)
        target.set_attn_implementation("eager")
        inputs = upstream_tester_inputs(seed)
        plain = target.generate(**inputs, **generation_kwargs())
        if assistant == "prompt-lookup":
            drafting = {"prompt_lookup_num_tokens": 2, "max_matching_ngram_size": 2}
        else:
            model = target if assistant == "stock-same" else OTHER_FAMILIES[family](seed=seed + 100)
            model.generation_config.num_assistant_tokens = 2
            model.generation_config.num_assistant_tokens_schedule = "constant"
            drafting = {"assistant_model": model}
        assisted = target.generate(**inputs, **drafting, **generation_kwargs())
        assert_similar_outputs(assisted, plain)
        assert len(assisted.attentions) == len(assisted.hidden_states) == NEW_TOKENS
        assert [a.shape[-2] for a in assisted.attentions[0]] == [PROMPT_TOKENS] * len(assisted.attentions[0])


# Every family, every drafter kind it supports, as the mixin checks them: the tester's inputs and generate()
# arguments, tokens, scores, logits, per-step hidden states and attentions, and the returned cache by exact type
# and state. Tiny targets of each family (2 indexer heads, eager attention).
FAMILY_BUILDERS = {
    "deepseek_v4": lambda seed: _target(seed),
    "hy_v4": tiny_hy_v4,
    "glm5_next": tiny_glm5_next,
    "qwen4_exp": tiny_qwen4_exp,
    "qwen4_exp_composite": tiny_qwen4_exp_composite,
}
DRAFTER_KINDS = {
    "deepseek_v4": ("hyperdflash", "vanilla_dflash", "mtp", "dspark", "prompt-lookup"),
    "hy_v4": ("hyperdflash", "vanilla_dflash", "prompt-lookup"),
    "glm5_next": ("hyperdflash", "vanilla_dflash", "prompt-lookup"),
    "qwen4_exp": ("hyperdflash", "vanilla_dflash", "prompt-lookup"),
    "qwen4_exp_composite": ("hyperdflash", "vanilla_dflash", "prompt-lookup"),
}
CASES = [(family, kind) for family, kinds in DRAFTER_KINDS.items() for kind in kinds]


def family_target(family: str, seed: int):
    target = FAMILY_BUILDERS[family](seed)
    target.set_attn_implementation("eager")
    return target


def drafting_arguments(target, kind: str, seed: int) -> dict:
    if kind == "prompt-lookup":
        return {"prompt_lookup_num_tokens": 2, "max_matching_ngram_size": 2}
    torch.manual_seed(seed)
    if kind == "mtp":
        drafter = DeepseekV4MTPForDrafting.from_target(target)
    elif kind == "dspark":
        drafter = DeepseekV4DSparkForDrafting.from_target(target, dspark_noise_token_id=3)
    else:
        dense = {"reducer": "dense", "conditioning": "intermediate"} if kind == "vanilla_dflash" else {}
        drafter = HyperDFlashForDrafting.from_target(target, block_size=4, **dense)
    drafter.generation_config.num_assistant_tokens = 2
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    return {"assistant_model": drafter.eval()}


def _assert_same_state(ours, theirs, where: str) -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.shape == theirs.shape, where
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=where)
    elif isinstance(theirs, dict | list | tuple):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        if isinstance(theirs, dict):
            assert ours.keys() == theirs.keys(), where
            ours, theirs = list(ours.values()), list(theirs.values())
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _assert_same_state(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, where


def assert_same_cache(ours, theirs) -> None:
    """What the mixin asks of a returned cache (layer classes by exact type), and beyond it: the same state."""
    assert type(ours) is type(theirs)
    assert [type(layer) for layer in ours.layers] == [type(layer) for layer in theirs.layers]
    for index, (layer, plain_layer) in enumerate(zip(ours.layers, theirs.layers, strict=True)):
        assert vars(layer).keys() == vars(plain_layer).keys(), f"layer {index}"
        for name, value in vars(plain_layer).items():
            _assert_same_state(vars(layer)[name], value, f"layer {index}.{name}")


def check_per_step_shapes(output, plain) -> None:
    """One entry per new token; per step, every layer's hidden states and attentions shaped as plain decoding's."""
    assert len(output.hidden_states) == len(output.attentions) == NEW_TOKENS
    for name in ("hidden_states", "attentions"):
        for step, (ours, theirs) in enumerate(zip(getattr(output, name), getattr(plain, name), strict=True)):
            assert [t.shape for t in ours] == [t.shape for t in theirs], f"{name} step {step}"


@pytest.mark.parametrize(("family", "kind"), CASES)
def test_every_family_and_drafter_kind_returns_plain_decodings_outputs_and_cache(family, kind):
    for seed in range(2):
        target, inputs = family_target(family, seed), upstream_tester_inputs(seed)
        plain = target.generate(**inputs, **generation_kwargs())
        assisted = target.generate(**inputs, **drafting_arguments(target, kind, seed), **generation_kwargs())
        assert_similar_outputs(assisted, plain)
        check_per_step_shapes(assisted, plain)
        assert_same_cache(getattr(assisted, CACHE_ARGUMENT), getattr(plain, CACHE_ARGUMENT))


@pytest.mark.parametrize("family", ["glm5_next", "qwen4_exp", "deepseek_v4"])
def test_a_returned_cache_continues_exactly_with_and_without_a_drafter(family):
    """A second chat turn on the cache a speculative call returned (stock classes): plain `generate()` and a
    speculative call both continue from it as plain decoding over the whole conversation does."""
    target = family_target(family, seed=0)
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(3, vocab, (1, 20), generator=torch.Generator().manual_seed(0))
    drafting = drafting_arguments(target, "hyperdflash", seed=0)
    first = target.generate(prompt, max_new_tokens=12, do_sample=False, return_dict_in_generate=True, **drafting)
    conversation = torch.cat([first.sequences, torch.tensor([[7, 8, 9]])], dim=-1)
    expected = target.generate(conversation, max_new_tokens=12, do_sample=False)
    for continuation in ({}, drafting):
        second = target.generate(prompt, max_new_tokens=12, do_sample=False, return_dict_in_generate=True, **drafting)
        cache = getattr(second, CACHE_ARGUMENT)
        output = target.generate(
            conversation, max_new_tokens=12, do_sample=False, **continuation, **{CACHE_ARGUMENT: cache}
        )
        assert torch.equal(output, expected), "with a drafter" if continuation else "plain"
        assert type(cache).__name__ == "DynamicCache"  # stock again after the continuation too


def test_stock_prompt_lookup_on_hy_v4_gives_plain_decodings_hidden_states():
    """HY-V4 is stateless, so transformers runs prompt lookup on it without the package; transformers' own output
    split cuts the mHC stream axis (per step `[1, 1, 1, D]`). With the package loaded every family gets the exact
    split."""
    target = family_target("hy_v4", seed=0)
    inputs = upstream_tester_inputs(0)
    plain = target.generate(**inputs, **generation_kwargs())
    lookup = target.generate(**inputs, prompt_lookup_num_tokens=2, max_matching_ngram_size=2, **generation_kwargs())
    for ours, theirs in zip(lookup.hidden_states, plain.hidden_states, strict=True):
        for layer_ours, layer_theirs in zip(ours, theirs, strict=True):
            assert layer_ours.shape == layer_theirs.shape
            torch.testing.assert_close(layer_ours, layer_theirs, rtol=1e-5, atol=1e-5)


IMAGE_TEXT_CASES = [
    (family, kind, modality)
    for family in ("glm5_next", "qwen4_exp_composite")
    for kind in DRAFTER_KINDS[family]
    for modality in ("image", "video")
]


@pytest.mark.parametrize(("family", "kind", "modality"), IMAGE_TEXT_CASES)
def test_image_and_video_prompts_return_plain_decodings_outputs_and_cache(family, kind, modality):
    """The image-text targets with an image (or a video) in the prompt, as their testers build it: the prefill
    carries the pixels (and Qwen4-Exp's 3-D rope positions), the drafter conditions on the target's features at every
    prompt position, verify forwards continue as plain decoding. Drafts from an oracle, so steps accept several."""
    new_tokens = 12
    for seed in range(2):
        target = family_target(family, seed)
        inputs = image_prompt(target, seed, video=modality == "video")
        options = generation_kwargs() | {"max_new_tokens": new_tokens}
        plain = target.generate(**inputs, **options)
        drafting = drafting_arguments(target, kind, seed)
        oracle = OracleProposer(target.config.get_text_config().vocab_size, plain.sequences, corruption=0.2, seed=seed)
        with oracle_drafting(oracle):
            assisted = target.generate(**inputs, **drafting, **options)
        assert_similar_outputs(assisted, plain)
        assert len(assisted.hidden_states) == len(assisted.attentions) == new_tokens
        assert_same_cache(getattr(assisted, CACHE_ARGUMENT), getattr(plain, CACHE_ARGUMENT))
        if kind != "prompt-lookup":
            assert max(drafting["assistant_model"].last_generation_stats.accepted_per_step) >= 2


@pytest.mark.parametrize("family", ["glm5_next", "qwen4_exp_composite"])
def test_a_conversation_with_an_image_continues_on_the_returned_cache(family):
    """A second turn on the cache a speculative call with an image returned, with and without a drafter: as plain
    decoding over the whole conversation. GLM-5-Next's second turn brings a second image; Qwen4-Exp's is text (its
    plain decoding computes the second turn's 3-D positions from the first image's stored deltas)."""
    target = family_target(family, seed=0)
    drafting = drafting_arguments(target, "hyperdflash", seed=0)
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
