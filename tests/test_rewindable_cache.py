"""RewindableDeepseekV4Cache: exact `crop` rollback, checked against the stock V4 cache and the no-cache forward."""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from transformers import DeepseekV4ForCausalLM, DynamicCache
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, DynamicSlidingWindowLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache, DeepseekV4HCACache

from hf_hyperdflash.modeling import cache_deepseek_v4 as rewindable_module
from hf_hyperdflash.modeling.cache_deepseek_v4 import RewindableDeepseekV4Cache
from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT
from hf_hyperdflash.testing import tiny_deepseek_v4

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

TOLERANCE = 1e-4
MAX_DRAFT = 16


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """The tiny model's ops are too small to split; on a busy 2-core machine, threaded ops can stall for ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> DeepseekV4ForCausalLM:
    # 16 indexer heads instead of 2. An index score is exactly 0 when ReLU zeroes it on every head, which with 2 random
    # heads happens for about a quarter of the entries; the CSA top-k then often has to pick among exact ties, and the
    # multi-token, token-by-token and no-cache paths break them differently (logits then differ by ~0.1 even between
    # a prefill and token-by-token decoding, both with the stock cache). With 16 heads an exact zero is a ~2^-16 event.
    return tiny_deepseek_v4(0, index_n_heads=16)


@pytest.fixture(scope="module")
def sliding_only_model() -> DeepseekV4ForCausalLM:
    """Shaped like a native-MTP block's own stack: sliding-window attention only."""
    return tiny_deepseek_v4(
        1, num_hidden_layers=2, layer_types=["sliding_attention"] * 2, mlp_layer_types=["moe", "moe"]
    )


@torch.no_grad()
def forward(model: DeepseekV4ForCausalLM, ids: list[int] | list[list[int]], cache: Cache | None) -> torch.Tensor:
    """Logits `[S, V]` (`[B, S, V]` for a batch of id lists); no cache at all when `cache` is None."""
    batch = torch.tensor(ids if isinstance(ids[0], list) else [ids])
    logits = model(batch, **{CACHE_ARGUMENT: cache}, use_cache=cache is not None).logits
    return logits if isinstance(ids[0], list) else logits[0]


def stepwise(model: DeepseekV4ForCausalLM, tokens: list[int]) -> tuple[torch.Tensor, DynamicCache]:
    """Straight token-by-token decoding with the stock cache: the reference a rolled-back cache must reproduce."""
    cache = DynamicCache(config=model.config)
    return torch.cat([forward(model, [token], cache) for token in tokens]), cache


def speculative_session(
    model: DeepseekV4ForCausalLM, rng: random.Random, rounds: int, undo_single_token_forwards: bool = True
) -> tuple[list[int], torch.Tensor, RewindableDeepseekV4Cache]:
    """A random prompt, then `rounds` of what assisted decoding does: verify a draft of K tokens behind the pending
    token (K + 1 tokens in one forward), accept a random n of them, `crop` the other K - n; or a run of steps that
    skip drafting (one-token forwards, `crop(0)`).

    Returns the committed tokens, the logits the cache produced for each of them, and the cache.
    """
    vocab = model.config.vocab_size
    tokens = [rng.randrange(3, vocab) for _ in range(rng.randint(5, 60))]
    cache = RewindableDeepseekV4Cache(
        model.config, max_draft=MAX_DRAFT, undo_single_token_forwards=undo_single_token_forwards
    )
    cache.activate_past_recording()  # assisted decoding calls this; it must change nothing
    logits = [forward(model, tokens, cache)]
    for _ in range(rounds):
        if rng.random() < 0.3:  # long enough runs to close compressor windows and slide past the window
            for _ in range(rng.randint(1, 40)):
                tokens.append(rng.randrange(3, vocab))
                logits.append(forward(model, tokens[-1:], cache))
                cache.crop(0)
            continue
        pending = rng.randrange(3, vocab)  # the token the target picked after the previous round
        draft = [rng.randrange(3, vocab) for _ in range(rng.randint(1, MAX_DRAFT))]
        verify_logits = forward(model, [pending] + draft, cache)
        accepted = rng.randint(0, len(draft))
        rejected = len(draft) - accepted
        if rejected >= 2 and rng.random() < 0.3:  # a rollback may also come in several crops
            first = rng.randint(1, rejected - 1)
            cache.crop(-first)
            cache.crop(first - rejected)
        else:
            cache.crop(-rejected)  # also `crop(0)` when all are accepted, as assisted decoding does
        tokens += [pending] + draft[:accepted]
        assert cache.get_seq_length() == len(tokens)
        logits.append(verify_logits[: accepted + 1])
    return tokens, torch.cat(logits), cache


def assert_same_state(cache: RewindableDeepseekV4Cache, reference: DynamicCache) -> None:
    """The stock-layout state of `cache` equals that of a stock cache that saw the same tokens one by one."""
    for layer, expected in zip(cache.layers, reference.layers, strict=True):
        assert layer.get_seq_length() == expected.get_seq_length()
        torch.testing.assert_close(layer.keys, expected.keys, atol=TOLERANCE, rtol=0)
        if not isinstance(expected, DeepseekV4HCACache):
            continue
        assert layer.entry_count == expected.entry_count
        states = ["compressed_kv", "buffer_kv", "buffer_gate"]
        if isinstance(expected, DeepseekV4CSACache):
            states += ["overlap_kv", "overlap_gate"]
        for state in states:
            for name, tensor in getattr(expected, state).items():
                if tensor is None:
                    assert getattr(layer, state)[name] is None, (state, name)
                else:
                    torch.testing.assert_close(getattr(layer, state)[name], tensor, atol=TOLERANCE, rtol=0)


def check_session(
    model: DeepseekV4ForCausalLM, seed: int, rounds: int, undo_single_token_forwards: bool = True
) -> None:
    tokens, logits, cache = speculative_session(model, random.Random(seed), rounds, undo_single_token_forwards)
    reference_logits, reference_cache = stepwise(model, tokens)
    torch.testing.assert_close(logits, reference_logits, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(logits, forward(model, tokens, cache=None), atol=TOLERANCE, rtol=0)
    assert_same_state(cache, reference_cache)


# 32 random sessions: 12 on the fast path, the rest with the long tests (`-m slow`)
@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow) if s >= 12 else s for s in range(32)])
def test_rollback_matches_stepwise_and_no_cache_decoding(model, seed):
    # Half the sessions with the target's verify cache, whose one-token forwards run the stock code
    check_session(model, seed, rounds=4, undo_single_token_forwards=seed % 2 == 0)


def test_verify_cache_does_not_undo_one_token_forwards(model):
    cache = RewindableDeepseekV4Cache(model.config, max_draft=4, undo_single_token_forwards=False)
    forward(model, list(range(3, 33)), cache)
    forward(model, [40], cache)
    with pytest.raises(ValueError, match="latest forward pass was of one token"):
        cache.crop(-1)
    assert cache.get_seq_length() == 31
    forward(model, [41, 42, 43], cache)  # the history starts again here
    cache.crop(-2)
    assert cache.get_seq_length() == 32
    with pytest.raises(ValueError, match="shortest reachable length is 31"):
        cache.crop(-2)


@pytest.mark.parametrize("seed", range(4))
def test_sliding_only_config(sliding_only_model, seed):
    check_session(sliding_only_model, seed, rounds=3)


def test_rewinding_past_the_kept_history_raises(model):
    tokens = list(range(3, 33))
    cache = RewindableDeepseekV4Cache(model.config, max_draft=4)
    forward(model, tokens, cache)
    with pytest.raises(ValueError, match=r"max_draft=4 .* larger `max_draft`"):
        cache.crop(-5)
    assert cache.get_seq_length() == 30
    cache.crop(-3)
    with pytest.raises(ValueError, match="shortest reachable length is 26"):
        cache.crop(-2)
    # The refused crops left the cache intact
    logits = forward(model, [7, 8], cache)
    torch.testing.assert_close(logits, stepwise(model, tokens[:27] + [7, 8])[0][-2:], atol=TOLERANCE, rtol=0)


def test_crop_length_conventions(model):
    tokens = list(range(40, 60))
    cache = RewindableDeepseekV4Cache(model.config)
    forward(model, tokens, cache)
    assert cache.is_croppable
    cache.crop(0)  # removes nothing, as in transformers
    assert cache.get_seq_length() == 20
    cache.crop(17)  # a positive length is the length to keep
    cache.crop(25)  # ... and never grows the cache
    assert cache.get_seq_length() == 17
    assert_same_state(cache, stepwise(model, tokens[:17])[1])


def test_history_stays_bounded(model):
    config, max_draft = model.config, 4
    cache = RewindableDeepseekV4Cache(config, max_draft=max_draft)
    forward(model, [random.Random(0).randrange(3, 512) for _ in range(200)], cache)
    for step in range(12):
        forward(model, [step + 3, step + 4], cache)
        cache.crop(-1)
    for layer, layer_type in zip(cache.layers, config.layer_types, strict=True):
        assert layer.key_history.shape[-2] <= config.sliding_window - 1 + max_draft
        histories = [layer.key_history]
        if layer_type != "sliding_attention":
            rate = layer.compress_rate
            assert layer.compressed_kv["compressor"].shape[1] == 212 // rate  # the compressed entries are the cache
            for name in layer.raw_kv:
                assert layer.raw_kv[name].shape[1] <= rate - 1 + max_draft
                histories += [layer.raw_kv[name], layer.raw_gate[name]]
        if layer_type == "compressed_sparse_attention":
            for name in layer.window_kv:
                assert layer.window_kv[name].shape[1] <= max_draft // layer.compress_rate + 2
                histories += [layer.window_kv[name], layer.window_gate[name]]
        # None of the kept history is a view pinning a large tensor (the 200-token prefill)
        for history in histories:
            assert history.untyped_storage().nbytes() <= 2 * history.nbytes


def test_batch_ops_and_reset(model):
    rng = random.Random(1)
    first, second = ([rng.randrange(3, 512) for _ in range(23)] for _ in range(2))
    cache = RewindableDeepseekV4Cache(model.config)
    forward(model, [first, second], cache)
    forward(model, [[5, 6, 7, 8], [9, 10, 11, 12]], cache)
    cache.crop(-2)
    first, second = first + [5, 6], second + [9, 10]

    cache.reorder_cache(torch.tensor([1, 0]))
    logits = forward(model, [[13], [14]], cache)
    expected = forward(model, [second + [13], first + [14]], cache=None)
    torch.testing.assert_close(logits, expected[:, -1:], atol=TOLERANCE, rtol=0)
    second += [13]

    cache.batch_select_indices(torch.tensor([0]))
    cache.batch_repeat_interleave(2)
    logits = forward(model, [[15, 16], [17, 18]], cache)
    expected = forward(model, [second + [15, 16], second + [17, 18]], cache=None)
    torch.testing.assert_close(logits, expected[:, -2:], atol=TOLERANCE, rtol=0)

    cache.reset()
    assert cache.get_seq_length() == 0
    torch.testing.assert_close(forward(model, first, cache), forward(model, first, None), atol=TOLERANCE, rtol=0)


def test_prompt_lookup_assisted_decoding_matches_greedy(monkeypatch):
    """End to end through transformers' `_assisted_decoding`, which verifies n-gram drafts and `crop`s the rejects."""
    model = tiny_deepseek_v4(0, index_n_heads=16)
    prompt = torch.tensor([[5, 6, 7, 8, 9] * 8])
    greedy = model.generate(prompt, max_new_tokens=40, do_sample=False)
    # The stock model refuses assisted modes as its own cache cannot roll back; lifted on this private instance only
    model._is_stateful = False
    cache = RewindableDeepseekV4Cache(model.config, max_draft=10)
    crops = []
    crop = cache.crop
    monkeypatch.setattr(cache, "crop", lambda max_length: (crops.append(max_length), crop(max_length)))
    assisted = model.generate(
        prompt, max_new_tokens=40, do_sample=False, **{CACHE_ARGUMENT: cache}, prompt_lookup_num_tokens=10
    )
    assert torch.equal(assisted, greedy)
    assert any(max_length < 0 for max_length in crops)


def test_global_layer_type_mapping_is_untouched():
    assert DYNAMIC_LAYER_TYPE_MAPPING["sliding_attention"] is DynamicSlidingWindowLayer
    assert DYNAMIC_LAYER_TYPE_MAPPING["heavily_compressed_attention"] is DeepseekV4HCACache
    assert DYNAMIC_LAYER_TYPE_MAPPING["compressed_sparse_attention"] is DeepseekV4CSACache
    assert all(cls.__module__ != rewindable_module.__name__ for cls in DYNAMIC_LAYER_TYPE_MAPPING.values())


def test_stock_v4_cache_internals_still_match(model, monkeypatch):
    """Fails loudly if the stock V4 cache internals the rewindable layers hook into change in a transformers update."""
    config = model.config
    # Names and signatures the rewindable layers override or read
    hca, csa = DeepseekV4HCACache(config), DeepseekV4CSACache(config)
    for state in ("buffer_kv", "buffer_gate", "compressed_kv", "entry_count"):
        assert set(getattr(hca, state)) == {"compressor"}
        assert set(getattr(csa, state)) == {"compressor", "indexer"}
    for state in ("overlap_kv", "overlap_gate"):
        assert set(getattr(csa, state)) == {"compressor", "indexer"}
    assert issubclass(DeepseekV4CSACache, DeepseekV4HCACache)
    assert issubclass(DeepseekV4HCACache, DynamicSlidingWindowLayer)
    signatures = {
        DeepseekV4HCACache.store_compression_weights: ["self", "name", "kv", "gate"],
        DeepseekV4HCACache.update_compressor_states: ["self", "name", "compressed"],
        DeepseekV4CSACache.update_overlap_state: ["self", "name", "chunk_kv", "chunk_gate", "head_dim"],
    }
    for method, parameters in signatures.items():
        assert list(inspect.signature(method).parameters) == parameters, method.__qualname__

    # Call protocol, per attention forward: the sliding `update` first, then per entry `store_compression_weights`,
    # `update_overlap_state` (CSA, only when a window closes), `update_compressor_states`
    events = []

    def spy(cls: type, method: str):
        original = getattr(cls, method)

        def recorded(self, *args, **kwargs):
            events.append((self, method, args[0] if method != "update" else None))
            return original(self, *args, **kwargs)

        return recorded

    for cls, method in [
        (DeepseekV4HCACache, "update"),
        (DeepseekV4HCACache, "store_compression_weights"),
        (DeepseekV4HCACache, "update_compressor_states"),
        (DeepseekV4CSACache, "update_overlap_state"),
    ]:
        monkeypatch.setattr(cls, method, spy(cls, method))
    inputs = {}  # layer index -> the compressor's input hidden states, one tensor per forward
    hooks = [
        layer.self_attn.compressor.register_forward_pre_hook(
            lambda module, args, index=index: inputs.setdefault(index, []).append(args[0])
        )
        for index, layer in enumerate(model.model.layers)
        if layer.self_attn.compressor is not None
    ]
    cache = DynamicCache(config=config)
    try:
        forward(model, list(range(3, 16)), cache)
        events.clear()
        forward(model, [16, 17, 18], cache)  # closes a CSA and an HCA window
    finally:
        for hook in hooks:
            hook.remove()
    length = 16
    for index, layer in enumerate(cache.layers):
        assert layer.keys.shape == (1, 1, config.sliding_window - 1, config.head_dim)
        if index not in inputs:
            continue
        assert layer.values is layer.keys
        compressor = model.model.layers[index].self_attn.compressor
        modules = {"compressor": compressor}
        if isinstance(layer, DeepseekV4CSACache):
            modules["indexer"] = compressor.indexer
        protocol = [("update", None)]
        for name in modules:
            protocol += [("store_compression_weights", name)]
            protocol += [("update_overlap_state", name)] if isinstance(layer, DeepseekV4CSACache) else []
            protocol += [("update_compressor_states", name)]
        assert [event[1:] for event in events if event[0] is layer] == protocol

        # State layout: `entry_count` closed windows, the raw (kv, gate) since as buffer, and on CSA the Ca half of the
        # last closed window as overlap, its gate including `position_bias`
        hidden = torch.cat(inputs[index], dim=1)
        with torch.no_grad():
            for name, module in modules.items():
                kv, gate = module.kv_proj(hidden), module.gate_proj(hidden)
                rate = module.compress_rate
                entries = length // rate
                assert layer.entry_count[name] == entries == layer.compressed_kv[name].shape[1]
                torch.testing.assert_close(layer.buffer_kv[name], kv[:, entries * rate :])
                torch.testing.assert_close(layer.buffer_gate[name], gate[:, entries * rate :])
                if isinstance(layer, DeepseekV4CSACache):
                    window = slice((entries - 1) * rate, entries * rate)
                    expected_gate = gate[:, window] + module.position_bias
                    torch.testing.assert_close(layer.overlap_kv[name], kv[:, window, : module.head_dim])
                    torch.testing.assert_close(layer.overlap_gate[name], expected_gate[..., : module.head_dim])
