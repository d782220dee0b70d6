"""Bad input to speculative `generate()` raises a ValueError naming the problem; everything else is left alone.

Nothing may fall back silently to plain decoding and be reported as speculative, and importing `hf_hyperdflash`
must not change what `generate()` does for plain calls or for stock assistants.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.generation.candidate_generator import AssistedCandidateGenerator

import hf_hyperdflash  # noqa: F401  (installs the generate() integration)
from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashConfig, HyperDFlashForDrafting
from hf_hyperdflash.modeling.cache_deepseek_v4 import RewindableDeepseekV4Cache
from hf_hyperdflash.testing import tiny_deepseek_v4

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

PROMPT = torch.tensor([[5, 17, 33, 9, 250, 12]])


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    return HyperDFlashForDrafting.from_target(target, block_size=4).eval()


def _speculative(target, drafter, **kwargs):
    return target.generate(PROMPT, **({"max_new_tokens": 4, "do_sample": False} | kwargs), assistant_model=drafter)


def _tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("field, value", [("hidden_size", 96), ("hc_mult", 2), ("vocab_size", 256)])
def test_hyperdflash_drafter_for_another_target(target, drafter, field, value):
    config = HyperDFlashConfig(**{**drafter.config.to_dict(), field: value})
    other = HyperDFlashForDrafting(config).eval()
    with pytest.raises(ValueError, match=f"different target: drafter {field}={value}, target {field}="):
        _speculative(target, other)


def test_mtp_drafter_for_another_target(target):
    other = DeepseekV4MTPForDrafting.from_target(tiny_deepseek_v4(seed=0, vocab_size=256)).eval()
    with pytest.raises(ValueError, match="different target: drafter vocab_size=256, target vocab_size=512"):
        _speculative(target, other)


def test_unsupported_target_family(drafter):
    with pytest.raises(ValueError, match="does not support target model type 'llama'"):
        _speculative(_tiny_llama(seed=0), drafter)


def test_beam_search(target, drafter):
    with pytest.raises(ValueError, match="Beam search cannot be combined with a speculative drafter"):
        _speculative(target, drafter, num_beams=2)


def test_more_draft_tokens_than_a_block_holds(target, drafter):
    drafter.generation_config.num_assistant_tokens = drafter.config.block_size
    try:
        with pytest.raises(
            ValueError, match=r"`num_assistant_tokens`=4 exceeds what one block of this drafter drafts \(3\)"
        ):
            _speculative(target, drafter)
    finally:
        drafter.generation_config.num_assistant_tokens = drafter.config.block_size - 1


def test_zero_draft_tokens_is_refused(target, drafter):
    """0 used to fall back silently to the default draft length."""
    drafter.generation_config.num_assistant_tokens = 0
    try:
        with pytest.raises(ValueError, match="num_assistant_tokens` must be an integer >= 1, got 0"):
            _speculative(target, drafter)
    finally:
        drafter.generation_config.num_assistant_tokens = drafter.config.block_size - 1


def test_reused_cache_that_cannot_rewind_a_whole_draft(target, drafter):
    short = RewindableDeepseekV4Cache(target.config, max_draft=1)
    with pytest.raises(ValueError, match="can rewind 1 tokens, but this drafter drafts 3 per step"):
        _speculative(target, drafter, past_key_values=short)
    assert short.get_seq_length() == 0  # refused before any forward


def test_drafter_for_another_target_of_the_same_width_warns(target, drafter):
    plain = target.generate(PROMPT, max_new_tokens=4, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its own target: no warning
        assert torch.equal(_speculative(target, drafter), plain)
    other = tiny_deepseek_v4(seed=0, sliding_window=16)  # same width, another architecture
    with pytest.warns(UserWarning, match="built for the target .* fingerprint .* few drafts may be accepted"):
        speculative = _speculative(other, drafter)
    assert torch.equal(speculative, other.generate(PROMPT, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize(
    "option, message",
    [
        ({"prompt_lookup_num_tokens": 3}, "two ways to draft; pass one of them"),
        ({"guidance_scale": 1.5}, "guidance_scale=1.5 cannot be combined with a speculative drafter"),
        ({"cache_implementation": "static"}, "cache_implementation='static' cannot be combined"),
    ],
)
def test_conflicting_options_are_refused_before_any_forward(target, drafter, option, message):
    forwards = []
    hook = target.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            _speculative(target, drafter, **option)
    finally:
        hook.remove()
    assert not forwards


def test_dynamic_cache_implementation_is_honoured(target, drafter):
    """Also when it comes from the target's generation_config.json, as on some Hub checkpoints."""
    plain = target.generate(PROMPT, max_new_tokens=6, do_sample=False)
    assert torch.equal(_speculative(target, drafter, cache_implementation="dynamic", max_new_tokens=6), plain)
    target.generation_config.cache_implementation = "dynamic"
    try:
        assert torch.equal(_speculative(target, drafter, max_new_tokens=6), plain)
    finally:
        target.generation_config.cache_implementation = None


def test_non_rewindable_cache(target, drafter):
    with pytest.raises(ValueError, match="needs a rewindable target cache, got DynamicCache"):
        _speculative(target, drafter, past_key_values=DynamicCache())


def _saved_drafter(kind: str, target, directory) -> str:
    torch.manual_seed(1)
    if kind == "mtp":
        DeepseekV4MTPForDrafting.from_target(target).save_pretrained(directory)
    else:
        HyperDFlashForDrafting.from_target(target, block_size=4).save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("kind", ["hyperdflash", "mtp"])
def test_corrupt_checkpoint(target, tmp_path, kind):
    directory = _saved_drafter(kind, target, tmp_path / kind)
    weights = tmp_path / kind / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="checkpoint .* is corrupt or unreadable"):
        AutoModel.from_pretrained(directory, trust_remote_code=True)


@pytest.mark.parametrize("kind", ["hyperdflash", "mtp"])
def test_missing_weights_file_is_incomplete_not_corrupt(target, tmp_path, kind):
    directory = _saved_drafter(kind, target, tmp_path / kind)
    (tmp_path / kind / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has a drafter config but no weights file .* the save is incomplete"):
        AutoModel.from_pretrained(directory, trust_remote_code=True)


@pytest.mark.parametrize("kind, removed", [("hyperdflash", "mask_embedding"), ("mtp", "e_proj.weight")])
def test_partial_checkpoint(target, tmp_path, kind, removed):
    directory = _saved_drafter(kind, target, tmp_path / kind)
    weights = tmp_path / kind / "model.safetensors"
    state = load_file(weights)
    del state[removed]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"does not match its config \(missing_keys: \['{removed}'\]\)"):
        AutoModel.from_pretrained(directory, trust_remote_code=True)


@pytest.mark.slow
def test_plain_generate_is_unchanged_by_the_import(target, tmp_path):
    """Greedy and sampled plain generate give the same tokens in a process that never imports hf_hyperdflash."""
    target.save_pretrained(tmp_path / "target")
    greedy = target.generate(PROMPT, max_new_tokens=12, do_sample=False)
    torch.manual_seed(0)
    sampled = target.generate(PROMPT, max_new_tokens=12, do_sample=True, top_k=20)
    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import DeepseekV4ForCausalLM
        torch.set_num_threads(1)
        model = DeepseekV4ForCausalLM.from_pretrained({str(tmp_path / "target")!r}).float().eval()
        prompt = torch.tensor({PROMPT.tolist()})
        greedy = model.generate(prompt, max_new_tokens=12, do_sample=False)
        torch.manual_seed(0)
        sampled = model.generate(prompt, max_new_tokens=12, do_sample=True, top_k=20)
        assert "hf_hyperdflash" not in sys.modules
        torch.save({{"greedy": greedy, "sampled": sampled}}, {str(tmp_path / "stock.pt")!r})
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    stock = torch.load(tmp_path / "stock.pt")
    assert torch.equal(greedy, stock["greedy"])
    assert torch.equal(sampled, stock["sampled"])


def test_stock_assistant_keeps_transformers_assisted_decoding(monkeypatch):
    target, assistant = _tiny_llama(seed=0), _tiny_llama(seed=1)
    calls = []
    original = AssistedCandidateGenerator.get_candidates

    def spy(self, *args, **kwargs):
        calls.append(type(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(AssistedCandidateGenerator, "get_candidates", spy)
    plain = target.generate(PROMPT, max_new_tokens=10, do_sample=False)
    assisted = target.generate(PROMPT, max_new_tokens=10, do_sample=False, assistant_model=assistant)
    assert torch.equal(plain, assisted)
    assert calls and set(calls) == {AssistedCandidateGenerator}
    assert not hasattr(assistant, "last_generation_stats")


def test_a_drafter_path_given_to_generate_is_refused_with_what_to_do(target, tmp_path):
    with pytest.raises(ValueError, match=r"must be a loaded model.*AutoModel.from_pretrained\(path"):
        target.generate(torch.tensor([[5, 6, 7]]), assistant_model=str(tmp_path), max_new_tokens=2)
