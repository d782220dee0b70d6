"""Verification selects the indexer entries token-by-token decoding selects, also when index scores tie exactly.

With 2 indexer heads (the upstream V4 tester's setting) many index scores are exactly 0.0 (ReLU), and stock
`torch.topk` picks among them differently in a one-token forward and in a multi-token verify forward. The package
makes every indexer top-k give ties to the earliest entry, in every forward (`indexer_ties.py`): DeepSeek-V4's by
ranking its scores, the other families' by replacing the `topk` their forward calls. That speculative decoding then
matches plain decoding with 2 indexer heads is `tests/test_lossless.py` (its DeepSeek-V4 cases); here, the top-k
itself, and that without the fix verification differs.
"""

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.modeling.indexer_ties import ranks_by_position, topk_ties_by_position
from hf_hyperdflash.testing import OracleProposer, oracle_drafting, tiny_deepseek_v4

SEEDS = range(10)
NEW_TOKENS = 24
PROMPT_TOKENS = 40  # past the sliding window (8) and the indexer budget (index_topk 4 of 40 / 4 entries)


def test_topk_keeps_the_score_order_and_puts_earlier_entries_first_among_ties():
    scores = torch.tensor([[[3.0, 0.0, 0.0, 5.0, 0.0, 3.0]], [[0.0, 0.0, 0.0, 0.0, 1.0, float("-inf")]]])
    values, indices = topk_ties_by_position(scores, 4, dim=-1)
    assert indices.tolist() == [[[3, 0, 5, 1]], [[4, 0, 1, 2]]]
    # Exact: top-k selects input values (small integers), it computes none
    assert values.tolist() == [[[5.0, 3.0, 3.0, 0.0]], [[1.0, 0.0, 0.0, 0.0]]]
    assert torch.equal(values, scores.topk(4, dim=-1).values)  # the same values as stock top-k


def test_ranks_select_what_topk_with_ties_by_position_selects():
    scores = torch.tensor([[[3.0, 0.0, 0.0, 5.0, 0.0, 3.0]], [[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]])
    ranks = ranks_by_position(scores)
    assert ranks.tolist() == [[[-1.0, -3.0, -4.0, -0.0, -5.0, -2.0]], [[-1.0, -2.0, -3.0, -4.0, -0.0, -5.0]]]
    assert ranks.unique().numel() == 6  # no ties left within a row
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (4, 5, 64), generator=generator).float()  # ties everywhere
    for k in (1, 7, 64):
        expected = topk_ties_by_position(scores, k, dim=-1).indices
        assert torch.equal(ranks_by_position(scores).topk(k, dim=-1).indices, expected)


def _decode_pairs(kind: str):
    """(plain, speculative) greedy outputs per seed, on tiny targets with 2 indexer heads, drafts mostly accepted."""
    for seed in SEEDS:
        target = tiny_deepseek_v4(seed=seed, index_n_heads=2)
        torch.manual_seed(seed)
        if kind == "mtp":
            drafter = DeepseekV4MTPForDrafting.from_target(target).eval()
        else:
            drafter = HyperDFlashForDrafting.from_target(target, block_size=8).eval()
        drafter.generation_config.num_assistant_tokens_schedule = "constant"  # every step a multi-token verify
        prompt = torch.randint(
            3, target.config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed)
        )
        plain = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        with oracle_drafting(OracleProposer(target.config.vocab_size, plain, corruption=0.15, seed=seed)):
            speculative = target.generate(prompt, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False)
        yield plain, speculative


def test_stock_tie_breaking_makes_verification_differ(monkeypatch):
    """Negative control: with the stock scorer the same runs differ from plain decoding (transformers 5.23/5.24)."""
    monkeypatch.setattr(DeepseekV4IndexerScorer, "forward", DeepseekV4IndexerScorer.forward.__wrapped__)
    assert any(not torch.equal(plain, speculative) for plain, speculative in _decode_pairs("hyperdflash"))
