"""The target cache of GLM-5-Next (KDA) and Qwen4-Exp (GatedDeltaNet, PLE conv and n-gram states) a speculative call
uses (transformers' own with past recording from 5.25, `RewindableHybridCache` before): after any sequence of
multi-token forwards and rollbacks, the cache equals one that decoded the kept tokens one at a time.

Property test: 1,000 random speculative sessions per family (prompt of 1-12 tokens, then up to 3 steps that each
feed 1-6 tokens and roll back a random number of them, as verification does). After every step, every
linear-attention state (recurrent, conv, PLE conv, n-gram history) and the next-token logits must match a stock cache
that received the kept tokens one by one (its prompt as one prefill), within 1e-5 in fp32 (states: relative to
1 + |value|, as some grow past 1; logits: absolute); the history kept stays bounded by `max_draft`.
"""

import random

import pytest
import torch
from transformers import DynamicCache

from hf_hyperdflash.modeling.cache_linear_attention import RewindableLinearAttentionLayer
from hf_hyperdflash.modeling.targets import get_target_adapter
from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT, STOCK_LINEAR_ATTENTION_ROLLBACK
from hf_hyperdflash.testing import tiny_glm5_next, tiny_qwen4_exp

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

SESSIONS = 1000
MAX_DRAFT = 6
TOLERANCE = 1e-5
FAMILIES = {"glm5_next": tiny_glm5_next, "qwen4_exp": tiny_qwen4_exp}
# Two layers (linear attention, then indexed attention) keep 2,000 sessions inside a CI budget
SMALL = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "indexed_attention"]}
SMALL_MLP = {"glm5_next": {"mlp_layer_types": ["dense", "dense"], "indexer_types": ["full", "full"]}}
SMALL_MLP["qwen4_exp"] = {"ple_layer_ids": [1], "num_experts": 2, "num_experts_per_tok": 1}
before_5_25 = pytest.mark.skipif(
    STOCK_LINEAR_ATTENTION_ROLLBACK, reason="`RewindableHybridCache`: the rollback before transformers 5.25"
)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    model = FAMILIES[request.param](seed=0, **SMALL, **SMALL_MLP[request.param])
    return request.param, model, get_target_adapter(model)


def _forward(model, cache, token_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=token_ids, use_cache=True, **{CACHE_ARGUMENT: cache}).logits[:, -1]


def _linear_states(cache) -> list[torch.Tensor]:
    states = []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            states.append(layer.recurrent_states[0])
            # From 5.25 a recording cache holds fewer columns than the kernel after a short prompt, where plain
            # decoding's holds zeros (the convolution pads with zeros either way)
            states += [
                torch.nn.functional.pad(window, (layer.conv_kernel_size[i] - window.shape[-1], 0)).float()
                for i, window in layer.conv_states.items()
                if window is not None
            ]
    return states


@pytest.mark.slow
def test_random_speculative_sessions_match_token_by_token_decoding(family):
    name, model, target = family
    rng = random.Random(0)
    worst = 0.0
    for session in range(SESSIONS):
        generator = torch.Generator().manual_seed(session)
        prompt = torch.randint(3, 512, (1, rng.randint(1, 12)), generator=generator)
        if session % 4 == 0:  # an EOS inside the prompt: Qwen4-Exp's n-grams restart after it
            prompt[0, rng.randrange(prompt.shape[1])] = 2
        cache, reference = target.make_cache(max_draft=MAX_DRAFT), DynamicCache(config=target.config)
        with target.verify_as_decoding(prompt_length=0, cache=cache):
            if STOCK_LINEAR_ATTENTION_ROLLBACK:  # as assisted decoding does, before its first forward
                cache.activate_past_recording(recurrent_states_to_keep=MAX_DRAFT)
            _forward(model, cache, prompt)
            _forward(model, reference, prompt)
            for _ in range(rng.randint(1, 3)):
                fed = torch.randint(3, 512, (1, rng.randint(1, MAX_DRAFT)), generator=generator)
                _forward(model, cache, fed)
                kept = rng.randint(0, fed.shape[1])
                cache.crop(kept - fed.shape[1])
                for token in fed[0, :kept]:
                    _forward(model, reference, token.view(1, 1))
                for ours, theirs in zip(_linear_states(cache), _linear_states(reference), strict=True):
                    worst = max(worst, ((ours - theirs).abs() / (1 + theirs.abs())).max().item())
            assert cache.get_seq_length() == reference.get_seq_length()
            probe = torch.tensor([[7]])
            worst = max(worst, (_forward(model, cache, probe) - _forward(model, reference, probe)).abs().max().item())
    assert worst < TOLERANCE, f"{name}: largest difference {worst:.2e}"


@before_5_25
def test_kept_history_is_bounded_by_max_draft(family):
    _, model, target = family
    cache = target.make_cache(max_draft=MAX_DRAFT)
    with target.verify_as_decoding(prompt_length=0):
        _forward(model, cache, torch.randint(3, 512, (1, 64), generator=torch.Generator().manual_seed(0)))
        for step in range(40):
            _forward(model, cache, torch.randint(3, 512, (1, 5), generator=torch.Generator().manual_seed(step)))
            cache.crop(-2)
    for layer in cache.layers:
        if isinstance(layer, RewindableLinearAttentionLayer):
            kept_tokens = sum(forward.num_tokens for forward in layer.forwards)
            assert kept_tokens <= 3 * MAX_DRAFT + 1 and len(layer.forwards) <= MAX_DRAFT + 1


@before_5_25
def test_rolling_back_beyond_max_draft_is_refused_and_leaves_the_cache_untouched(family):
    _, model, target = family
    cache = target.make_cache(max_draft=3)
    with target.verify_as_decoding(prompt_length=0):
        _forward(model, cache, torch.randint(3, 512, (1, 10), generator=torch.Generator().manual_seed(1)))
        _forward(model, cache, torch.randint(3, 512, (1, 3), generator=torch.Generator().manual_seed(2)))
    before = [state.clone() for state in _linear_states(cache)]
    with pytest.raises(ValueError, match="shortest reachable length is 10"):
        cache.crop(-4)
    assert cache.get_seq_length() == 13
    # Exact: a refused crop does no arithmetic; the states must be the very values cloned before
    assert all(torch.equal(a, b) for a, b in zip(before, _linear_states(cache), strict=True))


@before_5_25
def test_a_state_stored_without_a_recorded_kernel_is_an_error(family):
    _, model, target = family
    with pytest.raises(RuntimeError, match="without a recorded kernel call"):
        _forward(model, target.make_cache(max_draft=2), torch.tensor([[5, 6, 7]]))


@before_5_25
def test_stock_crop_leaves_the_recurrent_state_where_rejected_tokens_put_it(family):
    """Negative control: what the stock cache does with past recording (transformers 5.23/5.24)."""
    _, model, target = family
    stock, reference = DynamicCache(config=target.config), DynamicCache(config=target.config)
    stock.activate_past_recording()
    prompt = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    _forward(model, stock, prompt)
    _forward(model, reference, prompt)
    _forward(model, stock, torch.tensor([[9, 10, 11]]))
    stock.crop(-3)
    pairs = zip(_linear_states(stock), _linear_states(reference), strict=True)
    differences = [(a - b).abs().max().item() for a, b in pairs]
    assert max(differences) > 1e-4


@before_5_25
def test_verify_rows_equal_one_token_forwards(family):
    """Each row of a multi-token forward on a rewindable cache gives the logits a one-token forward at that position
    gives on a stock cache (the indexer's ties broken by position)."""
    _, model, target = family
    for seed in range(4):
        prompt = torch.randint(3, 512, (1, 21 + seed), generator=torch.Generator().manual_seed(seed))
        fed = torch.randint(3, 512, (1, 7), generator=torch.Generator().manual_seed(50 + seed))
        cache, reference = target.make_cache(max_draft=8), DynamicCache(config=target.config)
        with target.verify_as_decoding(prompt_length=0), torch.no_grad():
            model(input_ids=prompt, use_cache=True, **{CACHE_ARGUMENT: cache})
            rows = model(input_ids=fed, use_cache=True, **{CACHE_ARGUMENT: cache}).logits[0]
        _forward(model, reference, prompt)
        one_by_one = torch.cat([_forward(model, reference, fed[:, i : i + 1]) for i in range(fed.shape[1])])
        torch.testing.assert_close(rows, one_by_one, rtol=0, atol=TOLERANCE)
