"""Lossless over each family's config space, not at one point of it.

hypothesis draws configs of every mHC family that transformers' own config validation accepts (a config it
refuses is no example): layer-type patterns, MLP kinds, stream counts, windows, compression rates, indexer settings,
Qwen4-Exp's per-layer embeddings (PLE) on none, some or all linear layers, and native MTP's depth. On each drawn
target, every way of drafting the family takes gives plain greedy decoding's tokens (block drafts from an oracle that
is right most of the time, so blocks are accepted, partly accepted and rejected), and a seeded sampling call repeats.
Where plain decoding itself fails on a config transformers accepts (Qwen4-Exp with linear-attention layers only),
every way of drafting fails with the same error; where the package cannot serve a config plain decoding runs
(linear-attention layers only, before 5.25), it refuses it with a ValueError before the target's first forward.

Draws are derandomized, so CI runs the same configs every time: `FAST_EXAMPLES` per family on the fast path,
`SLOW_EXAMPLES` more under `slow`. The ranges are in the strategies below.
"""

import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import DeepseekV4Config, Glm5NextConfig, HYV4Config, Qwen4ExpTextConfig
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from hf_hyperdflash.modeling.transformers_compat import STOCK_LINEAR_ATTENTION_ROLLBACK
from hf_hyperdflash.testing import (
    DEEPSEEK_V4_ONLY_KINDS,
    DRAFTING_KINDS,
    OracleProposer,
    drafting_arguments,
    oracle_drafting,
    tiny_deepseek_v4,
    tiny_glm5_next,
    tiny_hy_v4,
    tiny_qwen4_exp,
)

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

FAST_EXAMPLES = 1
SLOW_EXAMPLES = 40
NEW_TOKENS = 10
BLOCK_SIZE = 5
BLOCK_KINDS = ("hyperdflash", "vanilla_dflash", "hyperdflash_heads", "dspark")


def _layer_pattern(draw, kinds: tuple[str, ...], layers: int) -> list[str]:
    return draw(st.lists(st.sampled_from(kinds), min_size=layers, max_size=layers))


@st.composite
def deepseek_v4_settings(draw) -> dict:
    """1-4 layers of any attention kind and either MoE kind; 2 or 4 streams; windows and compression rates from 2 to
    16 (so windows close inside a 40-token prompt); 1 to 16 indexer heads keeping 1 to 8 entries; MTP depth 1-3."""
    layers = draw(st.integers(1, 4))
    return dict(
        num_hidden_layers=layers,
        layer_types=_layer_pattern(
            draw, ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"), layers
        ),
        mlp_layer_types=_layer_pattern(draw, ("hash_moe", "moe"), layers),
        hc_mult=draw(st.sampled_from((2, 4))),
        sliding_window=draw(st.sampled_from((4, 8, 16))),
        compress_rates={
            "compressed_sparse_attention": draw(st.sampled_from((2, 4, 8))),
            "heavily_compressed_attention": draw(st.sampled_from((4, 8, 16))),
        },
        index_n_heads=draw(st.sampled_from((1, 2, 16))),
        index_topk=draw(st.sampled_from((1, 2, 4, 8))),
        num_experts_per_tok=draw(st.sampled_from((1, 2))),
        num_nextn_predict_layers=draw(st.integers(1, 3)),  # drafted as native MTP's depth below
    )


@st.composite
def hy_v4_settings(draw) -> dict:
    """1-4 layers, dense or MoE MLPs, each indexer full or sharing the previous layer's selection (the first full),
    2 or 4 streams, 1 to 4 indexer heads keeping 1 to 8 tokens."""
    layers = draw(st.integers(1, 4))
    return dict(
        num_hidden_layers=layers,
        mlp_layer_types=_layer_pattern(draw, ("dense", "sparse"), layers),
        indexer_types=["full", *_layer_pattern(draw, ("full", "shared"), layers - 1)],
        hc_mult=draw(st.sampled_from((2, 4))),
        index_n_heads=draw(st.sampled_from((1, 2, 4))),
        index_topk=draw(st.sampled_from((1, 2, 4, 8))),
    )


@st.composite
def glm5_next_settings(draw) -> dict:
    """1-4 layers, each KDA linear or indexed attention, dense or MoE; indexers full or shared (the first indexed
    layer's full: a shared one reuses an earlier selection); 2 or 4 streams; indexer pools of 2 or 4 tokens, 1 or 2
    pools kept; conv kernels of 2 to 4."""
    layers = draw(st.integers(1, 4))
    pool = draw(st.sampled_from((2, 4)))
    layer_types = _layer_pattern(draw, ("linear_attention", "indexed_attention"), layers)
    indexer_types = _layer_pattern(draw, ("full", "shared"), layers)
    if "indexed_attention" in layer_types:
        indexer_types[layer_types.index("indexed_attention")] = "full"
    return dict(
        num_hidden_layers=layers,
        layer_types=layer_types,
        mlp_layer_types=_layer_pattern(draw, ("dense", "sparse"), layers),
        indexer_types=indexer_types,
        hc_mult=draw(st.sampled_from((2, 4))),
        index_kpool=pool,
        index_topk=pool * draw(st.sampled_from((1, 2))),
        linear_conv_kernel_dim=draw(st.sampled_from((2, 3, 4))),
    )


@st.composite
def qwen4_exp_settings(draw) -> dict:
    """1-4 layers, each GatedDeltaNet linear or indexed attention; PLE on any subset of the linear layers (none,
    some, all); 2 or 4 streams; PLE convs of 2 or 4, n-grams of 2 or 3; indexer budgets of 4 or 8 in blocks of 2 or
    4; conv kernels of 2 to 4."""
    layers = draw(st.integers(1, 4))
    layer_types = _layer_pattern(draw, ("linear_attention", "indexed_attention"), layers)
    linear = [index + 1 for index, kind in enumerate(layer_types) if kind == "linear_attention"]  # one-indexed
    ratio = draw(st.sampled_from((2, 4)))
    return dict(
        num_hidden_layers=layers,
        layer_types=layer_types,
        ple_layer_ids=draw(st.lists(st.sampled_from(linear), unique=True)) if linear else [],
        hc_count=draw(st.sampled_from((2, 4))),
        ple_conv_kernel_size=draw(st.sampled_from((2, 4))),
        ngram_size=draw(st.sampled_from((2, 3))),
        indexer_compress_ratio=ratio,
        indexer_budget=ratio * draw(st.sampled_from((1, 2))),
        linear_conv_kernel_dim=draw(st.sampled_from((2, 3, 4))),
    )


# family -> (the tiny target's builder, its config class, the strategy over its settings)
FAMILIES = {
    "deepseek_v4": (tiny_deepseek_v4, DeepseekV4Config, deepseek_v4_settings()),
    "hy_v4": (tiny_hy_v4, HYV4Config, hy_v4_settings()),
    "glm5_next": (tiny_glm5_next, Glm5NextConfig, glm5_next_settings()),
    "qwen4_exp": (tiny_qwen4_exp, Qwen4ExpTextConfig, qwen4_exp_settings()),
}


def _kinds(family: str) -> tuple[str, ...]:
    return tuple(kind for kind in DRAFTING_KINDS if family == "deepseek_v4" or kind not in DEEPSEEK_V4_ONLY_KINDS)


def _validated_target(family: str, overrides: dict):
    """The tiny target with `overrides`, or None where transformers' config validation refuses them."""
    build = FAMILIES[family][0]
    try:
        return build(seed=0, **overrides)
    except ValueError:
        return None


def _generate(target, kind: str, drafting: dict, inputs: torch.Tensor, reference: torch.Tensor, seed: int, **kw):
    torch.manual_seed(seed)
    if kind not in BLOCK_KINDS:
        return target.generate(inputs, **drafting, **kw)
    oracle = OracleProposer(target.config.get_text_config().vocab_size, reference, corruption=0.3, seed=seed)
    with oracle_drafting(oracle):
        return target.generate(inputs, **drafting, **kw)


def check_every_kind_is_lossless(family: str, overrides: dict, prompt_length: int) -> None:
    target = _validated_target(family, overrides)
    assume(target is not None)  # transformers refuses this config: not an example
    vocab = target.config.get_text_config().vocab_size
    half = torch.randint(3, vocab - 8, (1, (prompt_length + 1) // 2), generator=torch.Generator().manual_seed(0))
    inputs = torch.cat([half, half], dim=1)[:, :prompt_length]  # repeats, so prompt lookup finds its n-grams
    try:
        plain, plain_error = target.generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False), None
    except Exception as error:  # transformers cannot decode this config itself
        plain, plain_error = None, error
    for kind in _kinds(family):
        drafting = drafting_arguments(target, kind, BLOCK_SIZE)
        if kind == "mtp":
            drafting["assistant_model"].generation_config.num_assistant_tokens = overrides["num_nextn_predict_layers"]
        if _refused(target):
            check_refused_before_any_forward(target, inputs, drafting)
        elif plain_error is not None:  # the package adds no failure of its own
            with pytest.raises(type(plain_error), match=re.escape(str(plain_error)[:60])):
                target.generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False, **drafting)
        else:
            greedy = _generate(target, kind, drafting, inputs, plain, 0, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert greedy.tolist() == plain.tolist(), f"{kind} on {overrides}"
            sampling = dict(max_new_tokens=NEW_TOKENS, do_sample=True)
            first, again = (_generate(target, kind, drafting, inputs, plain, 7, **sampling) for _ in range(2))
            assert first.tolist() == again.tolist(), f"{kind} sampling on {overrides}"


def _refused(target) -> bool:
    """The configs the package refuses: linear attention alone before 5.25 (`LinearAttentionTarget.check_servable`)."""
    layer_types = target.config.get_text_config().layer_types
    return not STOCK_LINEAR_ATTENTION_ROLLBACK and set(layer_types) == {"linear_attention"}


def check_refused_before_any_forward(target, inputs: torch.Tensor, drafting: dict) -> None:
    forwards = []
    hook = target.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=re.escape("`layer_types` are all linear attention")):
            target.generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False, **drafting)
    finally:
        hook.remove()
    assert not forwards


def _property_test(family: str, examples: int):
    @settings(
        max_examples=examples,
        derandomize=True,  # the same configs on every run
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(overrides=FAMILIES[family][2], prompt_length=st.sampled_from((5, 13, 40)))
    def run(overrides, prompt_length):
        check_every_kind_is_lossless(family, overrides, prompt_length)

    return run


@pytest.mark.parametrize("family", FAMILIES)
def test_drawn_configs_decode_losslessly_with_every_kind(family):
    _property_test(family, FAST_EXAMPLES)()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_more_drawn_configs_decode_losslessly_with_every_kind(family):
    _property_test(family, FAST_EXAMPLES + SLOW_EXAMPLES)()


QWEN4_EXP_PLE_ON_SOME_LINEAR_LAYERS = dict(
    num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["indexed_attention"], ple_layer_ids=[1]
)


@pytest.mark.parametrize("kind", ("hyperdflash", "vanilla_dflash", "prompt_lookup", "stock_assistant"))
def test_qwen4_exp_with_ple_on_some_linear_layers_decodes_losslessly(kind):
    """The config of issue 51: on 5.25 every way of drafting crashed in transformers' linear-attention crop."""
    target = tiny_qwen4_exp(seed=0, **QWEN4_EXP_PLE_ON_SOME_LINEAR_LAYERS)
    prompt = torch.tensor([[5, 17, 33, 9, 250, 11, 12, 40, 77, 3, 5, 17, 33]])
    plain = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    drafting = drafting_arguments(target, kind, BLOCK_SIZE)
    got = _generate(target, kind, drafting, prompt, plain, 0, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert got.tolist() == plain.tolist()


@pytest.mark.skipif(not STOCK_LINEAR_ATTENTION_ROLLBACK, reason="the package's own rollback serves 5.23 and 5.24")
def test_the_stock_crop_still_needs_the_fix_for_states_a_layer_never_filled():
    """Upstream's `LinearAttentionCacheLayerMixin.crop` (5.25) raises on a state a layer never filled; the package's
    crop (`target_linear_attention.install_crop_of_present_states`) crops the filled ones as upstream does and leaves
    the others empty. When this test fails upstream has fixed it: delete the package's crop."""
    target = tiny_qwen4_exp(seed=0, **QWEN4_EXP_PLE_ON_SOME_LINEAR_LAYERS)
    cache = target.generate(
        torch.tensor([[5, 17, 33, 9, 250]]), max_new_tokens=1, do_sample=False, return_dict_in_generate=True
    ).cache
    layer = cache.layers[1]  # linear attention without PLE: state 0 filled, PLE states 1 and 2 not
    assert layer.conv_states[0] is not None and layer.conv_states[1] is None
    layer.activate_past_recording(recurrent_states_to_keep=2)
    filled = layer.conv_states[0].clone()
    stock_crop = LinearAttentionCacheLayerMixin.crop.__wrapped__
    with pytest.raises(TypeError):
        stock_crop(layer, 0)
    LinearAttentionCacheLayerMixin.crop(layer, 0)
    assert torch.equal(layer.conv_states[0], filled[..., -layer.conv_kernel_size[0] :])
    assert layer.conv_states[1] is None and layer.conv_kernel_size[1] is None
