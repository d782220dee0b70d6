"""The HyperDFlash drafter (Hub remote code in `modeling/`): reducers, masks, cache, from_target, save/load."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from transformers import (
    DeepseekV4Config,
    DynamicCache,
    Glm5NextConfig,
    HYV4Config,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen4ExpTextConfig,
)

from hf_hyperdflash.modeling.configuration_hyperdflash import HyperDFlashConfig
from hf_hyperdflash.modeling.draft_options import DEFAULT_CONTEXT_WINDOW
from hf_hyperdflash.modeling.modeling_hyperdflash import (
    HyperDFlashForDrafting,
    drafter_config_for,
    spread_target_layers,
)
from hf_hyperdflash.testing import tiny_deepseek_v4

HIDDEN, HC_MULT = 64, 4
COMBINATIONS = [(r, c) for r in ("inherited_gate", "dense") for c in ("pre_collapse", "intermediate")]


@pytest.fixture(scope="module")
def target():
    model = tiny_deepseek_v4()
    with torch.no_grad():  # the stock init leaves base 0 and scale 1; make the copy check meaningful
        model.model.hc_head.hc_base.normal_()
        model.model.hc_head.hc_scale.fill_(0.7)
    return model


def drafter_for(target, **overrides) -> HyperDFlashForDrafting:
    torch.manual_seed(0)
    return HyperDFlashForDrafting.from_target(target, block_size=4, **overrides).eval()


def draft(drafter, target_hidden, anchors, anchor_positions, context_positions=None, **kwargs) -> torch.Tensor:
    """Run the drafter; context positions default to 0..L-1."""
    batch, length = target_hidden.shape[:2]
    if context_positions is None:
        context_positions = torch.arange(length).expand(batch, length)
    with torch.no_grad():
        out = drafter(anchors, target_hidden, context_positions, torch.as_tensor(anchor_positions), **kwargs)
    return out.last_hidden_state


def random_inputs(drafter, batch=1, length=12, blocks=2, seed=1):
    generator = torch.Generator().manual_seed(seed)
    streams = drafter.config.num_conditioning_layers * HC_MULT
    target_hidden = torch.randn(batch, length, streams, HIDDEN, generator=generator)
    anchors = torch.randn(batch, blocks, HIDDEN, generator=generator)
    return target_hidden, anchors


def test_reducer_parameter_counts_at_v4_flash_dims():
    with torch.device("meta"):
        inherited = HyperDFlashForDrafting(HyperDFlashConfig(hidden_size=4096, hc_mult=4, vocab_size=8))
        dense = HyperDFlashForDrafting(HyperDFlashConfig(hidden_size=4096, hc_mult=4, vocab_size=8, reducer="dense"))
    assert sum(p.numel() for p in inherited.reducer.parameters()) == 65_541
    assert sum(p.numel() for p in dense.reducer.parameters()) == 67_108_864
    shapes = {name: tuple(p.shape) for name, p in inherited.reducer.named_parameters()}
    assert shapes == {"hc_heads.0.hc_fn": (4, 16384), "hc_heads.0.hc_base": (4,), "hc_heads.0.hc_scale": (1,)}


def test_from_target_copies_hc_head_and_reproduces_it(target):
    drafter = drafter_for(target)
    head = target.model.hc_head
    assert (drafter.config.hidden_size, drafter.config.vocab_size, drafter.config.hc_mult) == (64, 512, 4)
    assert drafter.config.max_position_embeddings == target.config.max_position_embeddings
    x = torch.randn(2, 7, HC_MULT, HIDDEN)
    with torch.no_grad():
        # Exact: the same module class with bit-copied weights on the same input; the mean over one layer is a no-op
        assert torch.equal(drafter.reducer(x), head(x))

    # Copies, not shared storage or submodules: the target's embedding/head never come along.
    target_storage = {p.data_ptr() for p in target.parameters()}
    assert not target_storage & {p.data_ptr() for p in drafter.parameters()}
    assert not any(m is t for m in drafter.modules() for t in target.modules())
    assert not any("embed_tokens" in key or "lm_head" in key for key in drafter.state_dict())


def test_from_target_intermediate_follows_dflash_layer_choice():
    assert spread_target_layers(36, 5) == [1, 9, 17, 25, 33]  # DFlash's choice for a 36-layer target
    assert spread_target_layers(8, 2) == [1, 5]
    assert spread_target_layers(4, 2) == [1]  # DFlash picks [1, 1] on 4 layers; the repeat is dropped
    assert spread_target_layers(2, 3) == [1]
    assert spread_target_layers(1, 2) == [0]
    assert spread_target_layers(36, 1) == [18]


def test_intermediate_defaults_to_the_dflash_spread_and_copies_every_gate(target):
    assert drafter_for(target, conditioning="intermediate").config.target_layer_ids == [1]
    drafter = drafter_for(target, conditioning="intermediate", target_layer_ids=[0, 3])
    for gate in drafter.reducer.hc_heads:  # exact: parameters copied, no arithmetic
        assert torch.equal(gate.hc_fn, target.model.hc_head.hc_fn)
        assert torch.equal(gate.hc_base, target.model.hc_head.hc_base)

    # Two layers' streams: each collapsed by its own gate, then averaged.
    layers = torch.randn(3, 5, 2, HC_MULT, HIDDEN)
    with torch.no_grad():
        expected = (target.model.hc_head(layers[:, :, 0]) + target.model.hc_head(layers[:, :, 1])) / 2
        torch.testing.assert_close(drafter.reducer(layers.flatten(2, 3)), expected)


@pytest.mark.parametrize("reducer, conditioning", COMBINATIONS)
def test_every_reducer_and_conditioning_drafts_blocks(target, reducer, conditioning):
    drafter = drafter_for(target, reducer=reducer, conditioning=conditioning, target_layer_ids=None)
    target_hidden, anchors = random_inputs(drafter, batch=2, blocks=3)
    assert target_hidden.shape[2] == HC_MULT * drafter.config.num_conditioning_layers
    out = draft(drafter, target_hidden, anchors, [[3, 6, 9], [2, 5, 12]])
    assert out.shape == (2, 3 * 4, HIDDEN)
    assert torch.isfinite(out).all()
    if reducer == "dense":
        assert drafter.reducer.proj.weight.shape == (HIDDEN, target_hidden.shape[2] * HIDDEN)
    with pytest.raises(ValueError, match="target_hidden"):
        draft(drafter, target_hidden[:, :, :2], anchors, [[3, 6, 9], [2, 5, 12]])


def test_training_mask_isolates_blocks(target):
    drafter = drafter_for(target)
    target_hidden, anchors = random_inputs(drafter)
    anchor_positions = [[4, 9]]
    base = draft(drafter, target_hidden, anchors, anchor_positions)
    block1, block2 = slice(0, 4), slice(4, 8)
    # The mask slots share one embedding; only their positions (anchor + 1, + 2, ...) tell them apart.
    assert not torch.allclose(base[:, 1], base[:, 2]) and not torch.allclose(base[:, 2], base[:, 3])

    # Block 2's anchor and all context from block 1's anchor on (position 4 included) are invisible to block 1.
    later = target_hidden.clone()
    later[:, 4:] += 1.0
    other_anchor = anchors.clone()
    other_anchor[:, 1] += 1.0
    changed = draft(drafter, later, other_anchor, anchor_positions)
    # Exact: same shapes and kernels, and the changed keys get exactly zero attention weight from block 1
    torch.testing.assert_close(changed[:, block1], base[:, block1], rtol=0, atol=0)
    assert not torch.allclose(changed[:, block2], base[:, block2])

    # Context strictly before block 1's anchor is visible to it.
    earlier = target_hidden.clone()
    earlier[:, 3] += 1.0
    assert not torch.allclose(draft(drafter, earlier, anchors, anchor_positions)[:, block1], base[:, block1])

    # Each block equals a one-block forward over only the context before its anchor.
    for n, (anchor_position, rows) in enumerate(zip(anchor_positions[0], (block1, block2), strict=True)):
        alone = draft(drafter, target_hidden[:, :anchor_position], anchors[:, n : n + 1], [[anchor_position]])
        torch.testing.assert_close(alone, base[:, rows], rtol=1e-5, atol=1e-5)


def test_context_mask_drops_padding(target):
    drafter = drafter_for(target)
    target_hidden, anchors = random_inputs(drafter)
    positions = torch.arange(12).unsqueeze(0)
    keep = torch.ones(1, 12, dtype=torch.bool)
    keep[0, 2] = False
    masked = draft(drafter, target_hidden, anchors, [[4, 9]], positions, context_mask=keep)
    removed = draft(drafter, target_hidden[:, keep[0]], anchors, [[4, 9]], positions[:, keep[0]])
    torch.testing.assert_close(masked, removed, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(masked, draft(drafter, target_hidden, anchors, [[4, 9]], positions))


@pytest.mark.parametrize("conditioning", ["pre_collapse", "intermediate"])
def test_cached_inference_matches_uncached(target, conditioning):
    drafter = drafter_for(target, conditioning=conditioning)
    target_hidden, anchors = random_inputs(drafter, length=10, blocks=2)
    uncached = draft(drafter, target_hidden, anchors[:, 1:], [[10]])

    cache = DynamicCache()
    positions = torch.arange(10).unsqueeze(0)
    draft(drafter, target_hidden[:, :6], anchors[:, :1], [[6]], positions[:, :6], cache=cache)
    cached = draft(drafter, target_hidden[:, 6:], anchors[:, 1:], [[10]], positions[:, 6:], cache=cache)
    torch.testing.assert_close(cached, uncached, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 10  # context only; block K/V are not stored
    assert len(cache.layers) == drafter.config.num_hidden_layers

    with pytest.raises(ValueError, match="one block"):
        draft(drafter, target_hidden[:, :1], anchors, [[11, 12]], positions[:, :1] + 10, cache=cache)


@pytest.mark.slow
def test_save_load_roundtrip_offline_without_the_library(target, tmp_path):
    drafter = drafter_for(target, reducer="dense", conditioning="intermediate", target_layer_ids=[0, 3])
    target_hidden, anchors = random_inputs(drafter, blocks=2)
    inputs = {
        "anchor_embeds": anchors,
        "target_hidden": target_hidden,
        "context_position_ids": torch.arange(12).unsqueeze(0),
        "anchor_position_ids": torch.tensor([[4, 9]]),
    }
    with torch.no_grad():
        expected = drafter(**inputs).last_hidden_state
    save_dir = tmp_path / "drafter"
    drafter.save_pretrained(save_dir)
    torch.save({"inputs": inputs, "expected": expected}, tmp_path / "case.pt")

    config = json.loads((save_dir / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_hyperdflash.HyperDFlashConfig",
        "AutoModel": "drafting.HyperDFlashForDrafting",
    }
    expected_files = {"configuration_hyperdflash.py", "modeling_hyperdflash.py", "drafting.py"}
    assert expected_files <= {p.name for p in save_dir.iterdir()}
    with safe_open(save_dir / "model.safetensors", "pt") as weights:
        assert set(weights.keys()) == set(drafter.state_dict())

    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModel
        model = AutoModel.from_pretrained({str(save_dir)!r}, trust_remote_code=True)
        case = torch.load({str(tmp_path / "case.pt")!r})
        with torch.no_grad():
            out = model(**case["inputs"]).last_hidden_state
        torch.testing.assert_close(out, case["expected"], rtol=1e-5, atol=1e-5)  # a fresh process: own threads
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        assert model.config.target_layer_ids == [0, 3] and model.config.reducer == "dense"
        assert model.generation_config.num_assistant_tokens == 3
        assert "hf_hyperdflash" not in sys.modules
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"reducer": "linear"}, "reducer"),
        ({"conditioning": "final"}, "conditioning"),
        ({"target_model_type": "llama"}, "target_model_type"),
        ({"block_size": 1}, "block_size"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "num_attention_heads"),
        ({"attention_dropout": 1.0}, "attention_dropout"),
        ({"hc_eps": 0.0}, "hc_eps"),
        ({"conditioning": "intermediate"}, "target_layer_ids"),
        ({"conditioning": "intermediate", "target_layer_ids": [1, 1]}, "target_layer_ids"),
        ({"conditioning": "intermediate", "target_layer_ids": [-1]}, "target_layer_ids"),
        ({"target_layer_ids": [1]}, "target_layer_ids"),
    ],
)
def test_invalid_config_values_raise(overrides, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        HyperDFlashConfig(**overrides)


def test_from_target_rejects_other_targets_and_missing_layers(target):
    with pytest.raises(ValueError, match="target_layer_ids"):
        HyperDFlashForDrafting.from_target(target, conditioning="intermediate", target_layer_ids=[1, 4])
    llama_config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    llama = LlamaForCausalLM(llama_config)
    with pytest.raises(ValueError, match="does not support target model type .llama."):
        HyperDFlashForDrafting.from_target(llama)


def test_generation_config_and_init(target):
    config = HyperDFlashConfig(hidden_size=HIDDEN, head_dim=16, intermediate_size=128, block_size=6)
    drafter = HyperDFlashForDrafting(config)
    assert drafter.generation_config.num_assistant_tokens == 5
    assert drafter.generation_config.num_assistant_tokens_schedule == "adaptive"
    assert 0.01 < drafter.mask_embedding.std().item() < 0.03
    gate = drafter.reducer.hc_heads[0]
    # Exact: constant initialisation, no arithmetic
    assert torch.equal(gate.hc_base, torch.zeros(HC_MULT)) and torch.equal(gate.hc_scale, torch.ones(1))
    assert torch.equal(drafter.norm.weight, torch.ones(HIDDEN))


def test_gradients_reach_reducer_and_mask_embedding(target):
    drafter = drafter_for(target).train()
    target_hidden, anchors = random_inputs(drafter)
    out = drafter(anchors, target_hidden, torch.arange(12).unsqueeze(0), torch.tensor([[4, 9]])).last_hidden_state
    out.square().mean().backward()
    for name in ("reducer.hc_heads.0.hc_fn", "reducer.hc_heads.0.hc_base", "mask_embedding"):
        assert drafter.get_parameter(name).grad.abs().sum() > 0, name


def test_bfloat16_forward_close_to_float32(target):
    drafter = drafter_for(target)
    target_hidden, anchors = random_inputs(drafter)
    reference = draft(drafter, target_hidden, anchors, [[4, 9]])
    out = draft(drafter.to(torch.bfloat16), target_hidden.bfloat16(), anchors.bfloat16(), [[4, 9]])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=0.1, atol=0.1)


def test_context_window_bounds_the_cache_and_sees_only_the_last_positions(target):
    """Windowed: drafting over a long context, fed in any chunks, equals drafting from just its last `window`
    positions; the cache keeps `window` entries; training sees the same window."""
    full = drafter_for(target)
    windowed = drafter_for(target, context_window=5)
    windowed.load_state_dict(full.state_dict())
    generator = torch.Generator().manual_seed(1)
    target_hidden = torch.randn(1, 12, HC_MULT, HIDDEN, generator=generator)
    anchor = torch.randn(1, 1, HIDDEN, generator=generator)
    positions = torch.arange(12)[None]
    only_last = draft(full, target_hidden[:, 7:], anchor, [[12]], positions[:, 7:], cache=DynamicCache())
    for chunks in ([(0, 7), (7, 12)], [(0, 3), (3, 9), (9, 12)]):
        cache = windowed.make_context_cache()
        for start, end in chunks:
            out = draft(windowed, target_hidden[:, start:end], anchor, [[end]], positions[:, start:end], cache=cache)
        # Chunked windowed-cache forwards vs one forward: other shapes, other kernel paths (6e-7 apart on an EPYC)
        torch.testing.assert_close(out, only_last, rtol=1e-5, atol=1e-5, msg=lambda m, c=chunks: f"{c}: {m}")
        assert cache.get_seq_length() == 12 and all(layer.keys.shape[-2] == 5 for layer in cache.layers)
    training = draft(windowed, target_hidden, anchor, [[12]], positions)  # no cache: the training path
    torch.testing.assert_close(training, only_last, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="`context_window` must be a positive integer or None"):
        HyperDFlashConfig(context_window=0)


def test_new_drafters_get_the_measured_window_and_old_checkpoints_keep_the_whole_context(target, tmp_path):
    assert HyperDFlashForDrafting.from_target(target).config.context_window == DEFAULT_CONTEXT_WINDOW == 512
    assert HyperDFlashForDrafting.from_target(target, context_window=None).config.context_window is None
    drafter_for(target).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["context_window"]  # as saved before the field existed
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert HyperDFlashForDrafting.from_pretrained(tmp_path).config.context_window is None


def test_drafter_configs_for_every_family_flagship_are_valid():
    """Default draft-layer sizes follow the target's hidden size; HY-V4's 2816 gives 22 heads, so the KV heads must
    be a divisor of it (about a quarter), not 22 // 4."""
    for target_config in (DeepseekV4Config(), HYV4Config(), Glm5NextConfig().text_config, Qwen4ExpTextConfig()):
        config = drafter_config_for(target_config)
        assert config.num_attention_heads % config.num_key_value_heads == 0
        assert 1 <= config.num_attention_heads // config.num_key_value_heads <= 11
    assert drafter_config_for(DeepseekV4Config()).num_key_value_heads == 8  # unchanged for V4-Flash
