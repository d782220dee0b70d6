"""Sparse-attention indexers with exact score ties broken by position: verification selects what decoding does.

An indexer keeps the `index_topk` entries (DeepSeek-V4: compressed entries; HY-V4: tokens; GLM-5-Next and Qwen4-Exp:
pools or blocks of tokens) with the highest scores,
`sum_h w_h * ReLU(q_h . k)`. With few indexer heads, whole scores are often exactly 0.0, and `torch.topk` leaves the
choice among tied entries to the kernel, which picks differently in a one-token forward and in a multi-token verify
forward (measured on the tiny V4 test target with 2 indexer heads: speculative greedy output differed from plain
decoding for 5 of 10 seeds). Here every `topk` an indexer's forward calls keeps the highest scores and, among equal
ones, the earliest entries, in every forward. Only the choice among exactly tied entries changes, for plain decoding
too once this is installed.

How, by family: DeepSeek-V4's indexer scores with a submodule (`DeepseekV4IndexerScorer`) and uses the scores for
nothing but its top-k, so the scorer returns each entry's rank instead (no ties left, the same selection). The other
three score inline, so their indexer's forward runs under a torch function mode that replaces its `topk`. A mode
sees every torch call of the forward: on the reference target it made plain decoding execute 4.9% more instructions
than stock transformers, the ranks 0.4% (`benchmarks/package_cost.py --instructions`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer
from transformers.models.hy_v4.modeling_hy_v4 import HYV4Indexer
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

SCORER_CLASSES = (DeepseekV4IndexerScorer,)  # their scores feed only a top-k: they return ranks
INDEXER_CLASSES = (HYV4Indexer, Glm5NextTextIndexer, Qwen4ExpTextQSAIndexer)  # their forward's topk is replaced
_INSTALLED = "_hyperdflash_ties_by_position"  # attribute of the wrapped forward


def topk_ties_by_position(scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """`torch.topk` whose exact ties go to the earliest entries (results always sorted)."""
    order = torch.sort(scores, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((scores.gather(dim, order), order))


def ranks_by_position(scores: torch.Tensor) -> torch.Tensor:
    """Minus each entry's rank along the last dimension, highest score first and exact ties by position, in float32
    (exact up to 2**24 entries): a top-k of these selects what `topk_ties_by_position` selects, in the same order."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order.argsort(dim=-1).neg_().to(torch.float32)  # a permutation's argsort: its inverse, the ranks


class _TopKTiesByPosition(TorchFunctionMode):
    """Routes every `topk` inside the block to `topk_ties_by_position`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.topk or func is torch.Tensor.topk:
            return topk_ties_by_position(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _ties_by_position(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def selects_ties_by_position(self, *args, **kwargs):
        with _TopKTiesByPosition():
            return forward(self, *args, **kwargs)

    return selects_ties_by_position


def _ranked_by_position(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def ranks_ties_by_position(self, *args, **kwargs):
        return ranks_by_position(forward(self, *args, **kwargs))

    return ranks_ties_by_position


def install_deterministic_indexer() -> None:
    """Idempotent, across every copy of the runtime in the process."""
    for classes, wrap in ((SCORER_CLASSES, _ranked_by_position), (INDEXER_CLASSES, _ties_by_position)):
        for module in classes:
            if not getattr(module.forward, _INSTALLED, False):
                module.forward = wrap(module.forward)
                setattr(module.forward, _INSTALLED, True)
