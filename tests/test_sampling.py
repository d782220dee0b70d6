"""Speculative sampling through `generate()` draws from the target's own distribution.

The target is the tiny stock V4 with an 8-token vocabulary and a sharpened `lm_head` (next-token distributions
peaked but far from one-hot), so the exact joint distribution of the first `NEW_TOKENS` generated tokens can be
enumerated from the target itself. Each sample is one `generate(..., do_sample=True, assistant_model=drafter)` call:
the first token comes from the prefill, the next ones are drafted and verified, so the samples mix accepted drafts,
tokens resampled from the residual after a rejection, bonus tokens, and verify steps on a rewound cache. A Pearson
chi-square test compares the samples with the exact distribution; a negative control shows that the same test, with
the same number of samples, rejects a subtly wrong sampler.

Because every sample is a whole `generate()` call, the target is cut to its cheapest form: one sliding-attention layer
with hash-MoE routing and one Sinkhorn step. The rewindable cache of every layer type is checked exactly by the greedy
tests in `test_generation.py`.
"""

import itertools
from collections import Counter
from contextlib import nullcontext

import pytest
import torch
import transformers.generation.utils as generation_utils
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper
from transformers.generation.logits_process import SuppressTokensLogitsProcessor

import hf_hyperdflash  # noqa: F401  (installs the generate() integration)
from hf_hyperdflash import DeepseekV4DSparkForDrafting, DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.modeling.draft_policy import AcceptanceCalibration, AdaptiveDraftPolicy, DraftCosts
from hf_hyperdflash.testing import (
    OracleProposer,
    chi_square_p_value,
    image_prompt,
    oracle_drafting,
    scripted_copying,
    tiny_deepseek_v4,
    tiny_glm5_next,
    tiny_qwen4_exp_composite,
)

pytestmark = pytest.mark.slow  # statistical: thousands of sampled calls (CI runs them)

VOCAB = 8
# Two drafted tokens plus a bonus token after the prefill's first one (with 2, generate has no room to draft at all).
NEW_TOKENS = 4
# The sliding window (8) fills up inside the first verify step, so rejections rewind past its truncation.
PROMPT = torch.tensor([[3, 4, 5, 6, 7, 3]])
# 1,000 samples per case (4 seeds x 250): each is a whole generate() call. The size is what the negative control
# below (a subtly wrong sampler) needs to fail far below ALPHA.
SEEDS = (0, 1, 2, 3)
SAMPLES_PER_SEED = 250
ALPHA = 1e-3  # deterministic seeds; a correct sampler sits far above this, a wrong one far below
PROCESSED = {"temperature": 0.7, "top_k": 3}


@pytest.fixture(scope="module")
def target():
    return sampling_target()


def sampling_target():
    """The cheapest tiny V4 (one sliding layer, hash MoE, one Sinkhorn step) with an 8-token vocabulary and a
    sharpened `lm_head`."""
    model = tiny_deepseek_v4(
        seed=0,
        vocab_size=VOCAB,
        eos_token_id=None,  # no EOS: every sample has NEW_TOKENS tokens
        num_hidden_layers=1,
        layer_types=["sliding_attention"],
        mlp_layer_types=["hash_moe"],
        hc_sinkhorn_iters=1,
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # top token ~0.57 on average, entropy ~1.1 nats
    return model


def exact_distribution(target, settings: dict, inputs: dict | None = None) -> torch.Tensor:
    """P(first NEW_TOKENS tokens) for every continuation of the prompt `inputs` (default `PROMPT`), flattened
    row-major; teacher-forced forwards of every prefix, in batches."""
    inputs = inputs or {"input_ids": PROMPT}
    processors = LogitsProcessorList()  # in generate()'s order: suppression before the warpers
    if "suppress_tokens" in settings:
        processors.append(SuppressTokensLogitsProcessor(settings["suppress_tokens"]))
    if "temperature" in settings:
        processors.append(TemperatureLogitsWarper(settings["temperature"]))
    if "top_k" in settings:
        processors.append(TopKLogitsWarper(settings["top_k"]))
    vocab, prompt_length = target.config.get_text_config().vocab_size, inputs["input_ids"].shape[1]
    prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=NEW_TOKENS - 1)))
    probs = []
    # A prefix holding a suppressed token has probability 0, whatever follows: the model reads another token there
    # (an image placeholder would need pixels of its own)
    readable = prefixes.masked_fill(torch.isin(prefixes, torch.tensor(settings.get("suppress_tokens", []))), 3)
    for batch in readable.split(256):
        batch_inputs = {name: _repeated(name, value, batch) for name, value in inputs.items()}
        input_ids = batch_inputs["input_ids"]
        with torch.no_grad():
            logits = target(**batch_inputs).logits[:, prompt_length - 1 :]
        steps = [processors(input_ids[:, : prompt_length + i], logits[:, i]).softmax(-1) for i in range(NEW_TOKENS)]
        probs.append(torch.stack(steps, dim=1))
    probs = torch.cat(probs)
    prefix_probs = probs[:, :-1].gather(-1, prefixes.unsqueeze(-1)).squeeze(-1).prod(-1)
    return (prefix_probs.unsqueeze(-1) * probs[:, -1]).flatten().double()


def _repeated(name: str, value: torch.Tensor, prefixes: torch.LongTensor) -> torch.Tensor:
    """One prompt input for a batch of `prompt + prefix` rows: token ids extended by the prefixes (token types by
    text, the attention mask by ones), the image inputs once per row."""
    if name == "input_ids":
        return torch.cat([value.expand(len(prefixes), -1), prefixes], dim=1)
    if name == "mm_token_type_ids":
        return torch.cat([value.expand(len(prefixes), -1), torch.zeros_like(prefixes)], dim=1)
    if name == "attention_mask":
        return torch.cat([value.expand(len(prefixes), -1), torch.ones_like(prefixes)], dim=1)
    return value.repeat(len(prefixes), *[1] * (value.dim() - 1))


def drafter_for(target, kind: str) -> HyperDFlashForDrafting | DeepseekV4MTPForDrafting | DeepseekV4DSparkForDrafting:
    """An untrained drafter that drafts every step ("constant"): under the default schedule, one whose drafts lose
    would verify few of them, which would then test plain sampling. The default schedule has its own tests below."""
    torch.manual_seed(1)
    if kind == "mtp":
        drafter = DeepseekV4MTPForDrafting.from_target(target).eval()
    elif kind == "dspark":
        drafter = DeepseekV4DSparkForDrafting.from_target(
            target, num_hidden_layers=1, dspark_target_layer_ids=[0], dspark_markov_rank=4, dspark_noise_token_id=3
        ).eval()
    else:  # "hyperdflash", or "hyperdflash_heads" with DSpark's Markov and confidence heads
        heads = {"markov_rank": 4} if kind == "hyperdflash_heads" else {}
        drafter = HyperDFlashForDrafting.from_target(target, block_size=3, num_hidden_layers=1, **heads).eval()
    if kind in ("dspark", "hyperdflash_heads"):
        with torch.no_grad():  # a real Markov bias (untrained: ~0); confidences spread over (0, 1), not all ~0.5
            drafter.markov_w2.weight.mul_(100.0)
            # HyperDFlash's pre-norm states vary little here: the previous token's Markov inputs carry the spread
            head = drafter.confidence_head.weight
            (head if kind == "dspark" else head[:, -drafter.config.markov_rank :]).mul_(-2000.0)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    return drafter


def speculative_samples(
    target,
    kind: str,
    settings: dict,
    samples_per_seed: int = SAMPLES_PER_SEED,
    drafter: HyperDFlashForDrafting | DeepseekV4MTPForDrafting | None = None,
    inputs: dict | None = None,
) -> tuple[torch.Tensor, list[int], list[int]]:
    """Counts of every continuation of `inputs` (default `PROMPT`) over all samples, and the accepted/proposed drafts
    of every verify step. The samples are calls in a row with one drafter (`drafter_for(target, kind)` unless given),
    as in a chat session.

    kind "oracle" routes a HyperDFlash drafter's proposals through an `OracleProposer` hinting the greedy continuation.
    """
    inputs = inputs or {"input_ids": PROMPT}
    vocab, prompt_length = target.config.get_text_config().vocab_size, inputs["input_ids"].shape[1]
    drafter = drafter if drafter is not None else drafter_for(target, kind)
    routing = nullcontext()
    if kind == "oracle":
        greedy = target.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        routing = oracle_drafting(OracleProposer(vocab, greedy, corruption=0.2, seed=0))
    counts = torch.zeros(vocab**NEW_TOKENS, dtype=torch.float64)
    place_values = vocab ** torch.arange(NEW_TOKENS - 1, -1, -1)
    accepted, proposed = [], []
    with routing:
        for seed in SEEDS:
            torch.manual_seed(seed)
            for _ in range(samples_per_seed):
                out = target.generate(
                    **inputs, max_new_tokens=NEW_TOKENS, do_sample=True, assistant_model=drafter, **settings
                )
                counts[int((out[0, prompt_length:] * place_values).sum())] += 1
                accepted += drafter.last_generation_stats.accepted_per_step
                proposed += drafter.last_generation_stats.proposed_per_step
    return counts, accepted, proposed


def outcomes(accepted: list[int], proposed: list[int]) -> set[str]:
    """Which branches of speculative sampling ran: full acceptance (bonus token), partial and zero (residual
    resampling)."""
    return {"full" if a == p else "zero" if a == 0 else "partial" for a, p in zip(accepted, proposed, strict=True)}


@pytest.mark.parametrize(
    "kind, settings",
    [("hyperdflash", {}), ("mtp", {"temperature": 1.3}), ("dspark", {}), ("oracle", PROCESSED)],
    ids=["untrained-hyperdflash", "mtp-temperature", "dspark", "oracle-temperature-top_k"],
)
def test_speculative_samples_follow_the_target_distribution(target, kind, settings):
    probs = exact_distribution(target, settings)
    counts, accepted, proposed = speculative_samples(target, kind, settings)
    assert counts.sum() == len(SEEDS) * SAMPLES_PER_SEED
    assert counts[probs == 0].sum() == 0, "a continuation the target (after top_k) can never produce was sampled"
    assert outcomes(accepted, proposed) == {"full", "partial", "zero"}
    if kind == "oracle":  # about twice the untrained drafters' rate: the proposals really came from the oracle
        assert sum(accepted) / sum(proposed) > 0.25
    p_value = chi_square_p_value(counts, probs)
    assert p_value > ALPHA, f"speculative samples deviate from the target distribution (p={p_value:.2e})"


@pytest.mark.parametrize("settings", [{}, PROCESSED], ids=["plain-sampling", "temperature-top_k"])
def test_copied_chains_keep_the_target_distribution(target, settings):
    """Steps verify chains copied from the context beside the oracle's drafts (`scripted_copying`): a copied chain is
    verified with q one-hot at its tokens, and which chain a step verifies is fixed before any token is drawn."""
    drafter = drafter_for(target, "hyperdflash")
    with scripted_copying() as copied:
        counts, accepted, proposed = speculative_samples(target, "oracle", settings, drafter=drafter)
    assert copied[0] > 100
    assert outcomes(accepted, proposed) == {"full", "partial", "zero"}
    p_value = chi_square_p_value(counts, exact_distribution(target, settings))
    assert p_value > ALPHA, f"samples with copied chains deviate from the target distribution (p={p_value:.2e})"


@pytest.mark.parametrize("kind", ["hyperdflash", "dspark", "hyperdflash_heads"])
def test_adaptive_truncation_keeps_the_target_distribution(target, monkeypatch, kind):
    """The adaptive schedule verifies 0, 1 or 2 of the untrained drafter's drafts by its confidence at each position
    (each verified token costing 0.3 of a step; a steep confidence-to-acceptance map so that the choice varies; every
    step drafts): sampling stays exact when the draft length depends on the drafter's distributions (HyperDFlash:
    its top probabilities; DSpark and HyperDFlash with DSpark's heads: the confidence head, fed the token before each
    position, with the Markov bias on each draft)."""
    monkeypatch.setattr(DraftCosts, "for_call", classmethod(lambda cls, *_: cls(draft_cost=0.0, verify_cost=0.3)))
    monkeypatch.setattr(AcceptanceCalibration, "probability", lambda self, c: min(max((c - 0.5) * 8, 0.0), 1.0))
    monkeypatch.setattr(AdaptiveDraftPolicy, "_pays", lambda self, steps: True)
    choices, choose = [], AdaptiveDraftPolicy.choose
    monkeypatch.setattr(AdaptiveDraftPolicy, "choose", lambda self, c: choices.append(choose(self, c)) or choices[-1])
    probs = exact_distribution(target, PROCESSED)
    drafter = drafter_for(target, kind)
    drafter.generation_config.num_assistant_tokens_schedule = "adaptive"
    drafter.generation_config.draft_from_context = False  # every step the drafter's (copies: their own test above)
    counts, _, _ = speculative_samples(target, kind, PROCESSED, drafter=drafter)
    # none, a truncated block, a whole one: each chosen more often than once in 20 calls
    assert {0, 1, 2} <= set(choices) and min(Counter(choices).values()) > len(SEEDS) * SAMPLES_PER_SEED // 20
    p_value = chi_square_p_value(counts, probs)
    assert p_value > ALPHA, f"speculative samples deviate from the target distribution (p={p_value:.2e})"


# drafter kind, sampling settings, the drafter's draft settings
SCHEDULE_CASES = {
    "heuristic-threshold": (
        "oracle",
        PROCESSED,
        {"num_assistant_tokens_schedule": "heuristic", "assistant_confidence_threshold": 0.5},
    ),
    "heuristic_transient-threshold-mtp": (
        "mtp",
        {"temperature": 1.3},
        {"num_assistant_tokens_schedule": "heuristic_transient", "assistant_confidence_threshold": 0.3},
    ),
    "adaptive": ("oracle", PROCESSED, {"num_assistant_tokens_schedule": "adaptive"}),
    "constant": ("hyperdflash", {}, {"num_assistant_tokens_schedule": "constant"}),
}


@pytest.mark.parametrize("case", sorted(SCHEDULE_CASES))
def test_every_schedule_keeps_the_target_distribution(target, case):
    """transformers' schedules too: "heuristic" carries its draft length from call to call, and the confidence
    threshold ends a step's drafts after the first unlikely one (a block is cut there, MTP stops drafting) and
    re-tunes itself: both decide on drafts already drawn, never on the one they let in."""
    kind, settings, draft_settings = SCHEDULE_CASES[case]
    drafter = drafter_for(target, kind)
    drafter.generation_config.update(**draft_settings)
    probs = exact_distribution(target, settings)
    counts, accepted, proposed = speculative_samples(target, kind, settings, drafter=drafter)
    assert counts[probs == 0].sum() == 0
    assert {"full", "zero"} <= outcomes(accepted, proposed)
    if "threshold" in case or "heuristic" in case:
        assert len(set(proposed)) > 1  # draft lengths varied
    p_value = chi_square_p_value(counts, probs)
    assert p_value > ALPHA, f"speculative samples deviate from the target distribution (p={p_value:.2e})"


def test_speculative_samples_on_a_linear_attention_target_follow_its_distribution():
    """GLM-5-Next (KDA linear attention, then indexed attention): rejections roll back its recurrent and conv states
    with past recording (5.25) or by replaying the kernel (`cache_linear_attention.py`, before); samples still follow
    the target. 800 samples: each generate() on this target costs about three times the V4 one's."""
    target = tiny_glm5_next(
        seed=0,
        vocab_size=VOCAB,
        eos_token_id=None,
        num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "dense"],
        indexer_types=["full", "full"],
    )
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)
    probs = exact_distribution(target, PROCESSED)
    counts, accepted, proposed = speculative_samples(target, "oracle", PROCESSED, samples_per_seed=200)
    assert outcomes(accepted, proposed) == {"full", "partial", "zero"}
    assert counts[probs == 0].sum() == 0
    p_value = chi_square_p_value(counts, probs)
    assert p_value > ALPHA, f"speculative samples deviate from the target distribution (p={p_value:.2e})"


IMAGE_TEXT_VOCAB = 16  # room for the image and video tokens (the last six); the test suppresses them and EOS
IMAGE_TEXT_TARGETS = {
    "glm5_next": lambda: tiny_glm5_next(
        seed=0,
        vocab_size=IMAGE_TEXT_VOCAB,
        num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "dense"],
        indexer_types=["full", "full"],
    ),
    "qwen4_exp": lambda: tiny_qwen4_exp_composite(
        seed=0,
        vocab_size=IMAGE_TEXT_VOCAB,
        num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"],
        ple_layer_ids=[1],
    ),
}


@pytest.mark.parametrize("family", sorted(IMAGE_TEXT_TARGETS))
def test_samples_after_an_image_prompt_follow_the_target_distribution(family):
    """The image-text targets with an image in the prompt (2 layers: linear attention, then indexed attention):
    speculative samples of the continuation follow the target's distribution given the image. 800 samples."""
    target = IMAGE_TEXT_TARGETS[family]()
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)
    config = target.config.get_text_config()
    special = [config.eos_token_id, *range(IMAGE_TEXT_VOCAB - 6, IMAGE_TEXT_VOCAB)]
    settings = PROCESSED | {"suppress_tokens": special}  # a generated placeholder would need pixels of its own
    inputs = image_prompt(target, seed=0)
    probs = exact_distribution(target, settings, inputs)
    counts, accepted, proposed = speculative_samples(target, "oracle", settings, samples_per_seed=200, inputs=inputs)
    assert outcomes(accepted, proposed) == {"full", "partial", "zero"}
    assert counts[probs == 0].sum() == 0
    p_value = chi_square_p_value(counts, probs)
    assert p_value > ALPHA, f"speculative samples deviate from the target distribution (p={p_value:.2e})"


def _resample_rejections_from_target(candidate_input_ids, candidate_logits, candidate_length, new_logits, **_):
    """A classic bug: after a rejection, sample from the target p instead of the residual norm(max(p - q, 0))."""
    drafts = candidate_input_ids[0, -candidate_length:]
    positions = torch.arange(candidate_length)
    p, q = new_logits[0].softmax(-1), candidate_logits[0].softmax(-1)
    accepted = torch.rand(candidate_length) <= p[positions, drafts] / q[positions, drafts]
    num_matches = int(accepted.cumprod(0).sum())
    next_token = torch.multinomial(p[num_matches], num_samples=1)
    return torch.cat([drafts[:num_matches], next_token])[None], torch.tensor(num_matches)


def test_the_test_rejects_a_subtly_wrong_sampler(target, monkeypatch):
    """Negative control: same drafter, settings, sample size and statistic as the oracle case above."""
    monkeypatch.setattr(generation_utils, "_speculative_sampling", _resample_rejections_from_target)
    counts, _, _ = speculative_samples(target, "oracle", PROCESSED)
    p_value = chi_square_p_value(counts, exact_distribution(target, PROCESSED))
    assert p_value < ALPHA, f"the chi-square test failed to detect a biased sampler (p={p_value:.2e})"
