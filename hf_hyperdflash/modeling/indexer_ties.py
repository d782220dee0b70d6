"""DeepSeek-V4's lightning indexer with exact score ties broken by position: verification selects what decoding does.

The indexer keeps the `index_topk` compressed entries with the highest scores, `sum_h w_h * ReLU(q_h . k)`. With
few indexer heads, whole scores are often exactly 0.0, and `torch.topk` leaves the choice among tied entries to the
kernel, which picks differently in a one-token forward and in a multi-token verify forward (measured on the tiny
test target with 2 indexer heads: speculative greedy output differed from plain decoding for 5 of 10 seeds). Here the
scorer's output is replaced by its rank under a stable descending sort, so that top-k keeps the highest scores and,
among equal ones, the earliest entries, in every forward. The scores feed nothing but that top-k; only the choice
among exactly tied entries changes, for plain decoding too once this is installed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

_INSTALLED = "_hyperdflash_ties_by_position"  # attribute of the wrapped forward


def ranks_with_ties_by_position(scores: torch.Tensor) -> torch.Tensor:
    """Minus each entry's rank among its row (last dim) by score, descending, earlier entries first among equals."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
    )
    return -ranks.to(scores.dtype)


def _rank_scores(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def scores_as_ranks(self, *args, **kwargs):
        return ranks_with_ties_by_position(forward(self, *args, **kwargs))

    setattr(scores_as_ranks, _INSTALLED, True)
    return scores_as_ranks


def install_deterministic_indexer() -> None:
    """Idempotent, across every copy of the runtime in the process."""
    if not getattr(DeepseekV4IndexerScorer.forward, _INSTALLED, False):
        DeepseekV4IndexerScorer.forward = _rank_scores(DeepseekV4IndexerScorer.forward)
