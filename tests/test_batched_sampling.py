"""Batched speculative sampling keeps every row's distribution (`test_batched.py` has the greedy and seeded tests).

Each call samples a batch of two prompts, one left-padded, with two sequences each: four rows that accept different
numbers of drafts in the same step, so rows run ahead of the batch's shortest run and feed their committed tokens
again; with an end-of-sequence id, rows also stop at different steps. A row's first
`NEW_TOKENS` tokens are compared, by a Pearson chi-square test, with the exact distribution of its prompt, enumerated
from the target as in `test_sampling.py` (the same tiny target with an 8-token vocabulary).
"""

from contextlib import nullcontext

import pytest
import torch
from test_sampling import (
    ALPHA,
    NEW_TOKENS,
    PROCESSED,
    VOCAB,
    drafter_for,
    exact_distribution,
    outcomes,
    sampling_target,
)

from hf_hyperdflash.testing import OracleProposer, chi_square_p_value, oracle_drafting, scripted_copying

pytestmark = pytest.mark.slow  # statistical: 500 batched calls per case (CI runs them)


@pytest.fixture(scope="module")
def target():
    return sampling_target()


BATCH = {
    "input_ids": torch.tensor([[3, 4, 5, 6, 7, 3], [0, 0, 5, 6, 7, 2]]),
    "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]),
}
SEQUENCES = 2  # per prompt
SEEDS = (0, 1)
CALLS_PER_SEED = 250  # 1,000 samples per prompt, the sample size of test_sampling.py's negative control


def batched_samples(target, kind: str, settings: dict) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Per prompt, the counts of every continuation over all its rows and calls; and the accepted and proposed drafts
    of every step (the batch's: how far its shared cache advanced). Kind "oracle-copied": the oracle's drafts with
    chains copied from the context in the mix (`scripted_copying`)."""
    copying = kind == "oracle-copied"
    kind = "oracle" if copying else kind
    drafter = drafter_for(target, kind)
    place_values = VOCAB ** torch.arange(NEW_TOKENS - 1, -1, -1)
    counts = [torch.zeros(VOCAB**NEW_TOKENS, dtype=torch.float64) for _ in BATCH["input_ids"]]
    accepted, proposed, copied = [], [], 0
    routing = None
    if kind == "oracle":
        greedy = target.generate(**BATCH, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        routing = OracleProposer(VOCAB, greedy.repeat_interleave(SEQUENCES, dim=0), corruption=0.2, seed=0)
    with oracle_drafting(routing) if routing else nullcontext(), scripted_copying() if copying else nullcontext():
        for seed in SEEDS:
            torch.manual_seed(seed)
            for _ in range(CALLS_PER_SEED):
                out = target.generate(
                    **BATCH,
                    max_new_tokens=NEW_TOKENS,
                    do_sample=True,
                    num_return_sequences=SEQUENCES,
                    assistant_model=drafter,
                    pad_token_id=0,
                    **settings,
                )
                new = out[:, BATCH["input_ids"].shape[1] :]
                new = torch.nn.functional.pad(new, (0, NEW_TOKENS - new.shape[1]))  # every row stopped early: padding
                for row, tokens in enumerate(new):
                    counts[row // SEQUENCES][int((tokens * place_values).sum())] += 1
                accepted += drafter.last_generation_stats.accepted_per_step
                proposed += drafter.last_generation_stats.proposed_per_step
                copied += drafter.last_generation_stats.copied_steps
    assert copied > 100 or not copying, "too few steps verified a copied chain"
    return counts, accepted, proposed


def padded_at_end_of_sequence(probs: torch.Tensor, eos: int) -> torch.Tensor:
    """The distribution of continuations as plain decoding returns them: after the first `eos`, padding (0)."""
    place_values = VOCAB ** torch.arange(NEW_TOKENS - 1, -1, -1)
    padded = torch.zeros_like(probs)
    for index, p in enumerate(probs.tolist()):
        tokens = [(index // int(v)) % VOCAB for v in place_values]
        if eos in tokens:
            end = tokens.index(eos) + 1
            tokens = tokens[:end] + [0] * (NEW_TOKENS - end)
        padded[int((torch.tensor(tokens) * place_values).sum())] += p
    return padded


@pytest.mark.parametrize(
    "kind, settings",
    [
        ("hyperdflash", {}),
        ("mtp", {"temperature": 1.3}),
        ("dspark", {}),
        ("oracle", PROCESSED),
        ("oracle", {"eos_token_id": 2}),
        ("oracle-copied", PROCESSED),
    ],
    ids=[
        "untrained-hyperdflash",
        "mtp-temperature",
        "dspark",
        "oracle-temperature-top_k",
        "oracle-rows-that-stop",
        "oracle-with-copied-chains",
    ],
)
def test_every_row_of_a_batch_follows_its_prompts_distribution(target, kind, settings):
    """With `eos_token_id`, rows stop at different steps (some inside a step whose drafts go past their stop)."""
    counts, accepted, proposed = batched_samples(target, kind, settings)
    assert {"full", "zero"} <= outcomes(accepted, proposed)
    for prompt, row_counts in enumerate(counts):
        inputs = {name: value[prompt : prompt + 1] for name, value in BATCH.items()}
        probs = exact_distribution(target, settings, inputs)
        if "eos_token_id" in settings:
            probs = padded_at_end_of_sequence(probs, settings["eos_token_id"])
        assert row_counts.sum() == len(SEEDS) * CALLS_PER_SEED * SEQUENCES
        assert row_counts[probs == 0].sum() == 0
        p_value = chi_square_p_value(row_counts, probs)
        assert p_value > ALPHA, f"prompt {prompt}: samples deviate from the target distribution (p={p_value:.2e})"
