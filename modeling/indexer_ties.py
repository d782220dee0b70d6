"""Sparse-attention indexers with exact score ties broken by position: verification selects what decoding does.

An indexer keeps the `index_topk` entries (DeepSeek-V4: compressed entries; HY-V4: tokens; GLM-5-Next and Qwen4-Exp:
pools or blocks of tokens) with the highest scores,
`sum_h w_h * ReLU(q_h . k)`. With few indexer heads, whole scores are often exactly 0.0, and `torch.topk` leaves the
choice among tied entries to the kernel, which picks differently in a one-token forward and in a multi-token verify
forward (measured on the tiny V4 test target with 2 indexer heads: speculative greedy output differed from plain
decoding for 5 of 10 seeds). Here every `topk` an indexer's forward calls keeps the highest scores and, among equal
ones, the earliest entries, in every forward. Only the choice among exactly tied entries changes, for plain decoding
too once this is installed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer
from transformers.models.hy_v4.modeling_hy_v4 import HYV4Indexer
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

INDEXER_CLASSES = (DeepseekV4Indexer, HYV4Indexer, Glm5NextTextIndexer, Qwen4ExpTextQSAIndexer)
_INSTALLED = "_hyperdflash_ties_by_position"  # attribute of the wrapped forward


def topk_ties_by_position(scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """`torch.topk` whose exact ties go to the earliest entries (results always sorted)."""
    order = torch.sort(scores, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((scores.gather(dim, order), order))


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

    setattr(selects_ties_by_position, _INSTALLED, True)
    return selects_ties_by_position


def install_deterministic_indexer() -> None:
    """Idempotent, across every copy of the runtime in the process."""
    for indexer in INDEXER_CLASSES:
        if not getattr(indexer.forward, _INSTALLED, False):
            indexer.forward = _ties_by_position(indexer.forward)
