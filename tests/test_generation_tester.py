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

from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.testing import OracleProposer, assert_same_outputs, oracle_drafting

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
        assert_same_outputs(assisted, plain)
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
        assert_same_outputs(assisted, plain)
