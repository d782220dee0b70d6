"""Drafting for a batch whose rows have committed different numbers of tokens (`batched_decoding.py`).

Each row drafts from its own anchor, the newest token it committed, with the target features of every position before
it as context. Block drafters draft every row in one forward; native MTP and DSpark, whose modules take no padding
mask, row by row. `BatchDrafts` holds each row's drafts until the row commits again, and decides the step's verify
width for the batch (`BatchDrafts.cut`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .candidate_generator import BlockProposer, TokenPicker, make_proposer
from .draft_options import BLOCK_DRAFTER_TYPE
from .draft_policy import DraftPolicy
from .target_base import HyperConnectionTarget


@dataclass
class DraftRequest:
    """What the drafters get: target features for columns [first_column, first_column + n) [B, n, ..], each row's
    anchor column (its newest committed token; its features are valid before it), the committed tokens, the rows to
    draft for and how many drafts each may use, and the cache length the target rolls back to after this step."""

    features: torch.Tensor
    first_column: int
    anchors: list[int]
    ids: torch.LongTensor  # [B, columns]: each row's committed tokens, padding after them
    drafting: list[bool]
    num_tokens: list[int]
    cache_length: int
    pick: TokenPicker
    schedule: BatchSchedule
    pad_id: int


@dataclass
class RowDrafts:
    """Drafts of some rows: tokens [B, k], the processed logits they were picked from [B, k, V], per-row lengths (0
    for a row that did not draft) and per-row confidences [B, k], and the drafter forwards spent."""

    tokens: torch.LongTensor
    logits: torch.Tensor
    lengths: list[int]
    confidences: torch.Tensor
    drafter_forwards: int


class BatchSchedule:
    """The proposers' view of the call's draft policy for a batch. A block is drawn whole: how much of it is verified
    is decided for the batch afterwards, from every row's confidences (`BatchDrafts.cut`); a drafter that spends a
    forward per token asks the policy with its own row's confidences."""

    def __init__(self, policy: DraftPolicy):
        self.policy = policy

    def verifies(self, confidences: list[float]) -> bool:
        return True

    def keep_drafting(self, confidences: list[float], probabilities: list[float]) -> bool:
        return self.policy.keep_drafting(confidences)


def right_aligned(ids: torch.LongTensor, lengths: list[int], pad_id: int) -> torch.LongTensor:
    """Each row's first `lengths[r]` tokens, right-aligned in one tensor (padding in front): every row's anchor is
    then the last column, as a proposer expects."""
    width = max(lengths)
    shift = torch.tensor(lengths, device=ids.device)[:, None] - width
    columns = torch.arange(width, device=ids.device)[None] + shift  # negative: in front of the row
    aligned = ids.gather(1, columns.clamp(min=0))
    return aligned.masked_fill(columns < 0, pad_id)


class BlockDrafting:
    """HyperDFlash and vanilla DFlash (heads or not): every row's block in one drafter forward. The drafter's context
    cache holds, for every row, the columns the target cache holds; a row ahead sees its further committed positions
    for this forward only (masked per row), and they leave the drafter's cache with it, to come back from the verify
    forward that feeds them again."""

    row_by_row = False

    def __init__(self, drafter: PreTrainedModel, target: HyperConnectionTarget, padding: list[int]):
        self.proposer = BlockProposer(drafter, target)
        if drafter.config.context_window is not None:  # a windowed cache rolls back only while recording its past
            self.proposer.cache.activate_past_recording()
        self.padding = padding
        self.context_start: int | None = None  # column of the first position the drafter saw

    @property
    def feature_layers(self) -> list[int] | None:
        return self.proposer.feature_layers

    def first_needed_column(self, cache_length: int) -> int:
        return cache_length

    def propose(self, step: DraftRequest) -> RowDrafts:
        if self.context_start is None:
            self.context_start = step.first_column
        end = step.first_column + step.features.shape[1]
        padding = torch.tensor(self.padding, device=step.ids.device)
        columns = torch.arange(self.context_start, end, device=step.ids.device)
        anchors = torch.tensor(step.anchors, device=step.ids.device)
        context_mask = (columns[None] >= padding[:, None]) & (columns[None] < anchors[:, None])
        positions = (columns[None, -step.features.shape[1] :] - padding[:, None]).clamp(min=0)
        lengths = [anchor + 1 for anchor in step.anchors]
        draft = self.proposer.propose(
            step.features,
            positions,
            right_aligned(step.ids, lengths, step.pad_id),
            max(step.num_tokens),
            step.pick,
            step.schedule,
            context_mask=context_mask,
            rows=torch.tensor(step.drafting, device=step.ids.device),
            anchor_positions=(anchors - padding)[:, None],
        )
        if end > step.cache_length and self.proposer.cache.get_seq_length():  # (a stand-in proposer caches nothing)
            self.proposer.cache.crop(step.cache_length - end)
        k = draft.tokens.shape[1]
        lengths = [min(k, n) if drafts else 0 for drafts, n in zip(step.drafting, step.num_tokens, strict=True)]
        return RowDrafts(draft.tokens, draft.logits, lengths, draft.row_confidences, draft.drafter_forwards)


class RowPick:
    """The call's token picker for one row drafted alone. Logits processors may keep state per row (a prompt length
    per row), so they see the whole batch, with this row's padded prefix in its place; the row's token and processed
    logits come back."""

    def __init__(self, pick: TokenPicker, batch_ids: torch.LongTensor, row: int, padding: int):
        self.pick, self.batch_ids, self.row, self.padding = pick, batch_ids, row, padding

    def __call__(self, prefix_ids: torch.LongTensor, logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
        batch, width = self.batch_ids.shape[0], self.padding + prefix_ids.shape[1]
        ids = self.batch_ids.new_zeros(batch, width)
        ids[:, : min(width, self.batch_ids.shape[1])] = self.batch_ids[:, :width]
        ids[self.row, self.padding :] = prefix_ids[0]
        scores = logits.new_zeros(batch, logits.shape[-1])
        scores[self.row] = logits[0]
        token, processed = self.pick(ids, scores)
        return token[self.row : self.row + 1], processed[self.row : self.row + 1]


class RowByRowDrafting:
    """Native MTP and DSpark, whose drafters take no padding mask: one proposer per row, fed that row's context
    without its padding, at its own positions. Each proposer sees each position once (`seen[row]`: the columns it
    has), so a row ahead keeps what it saw."""

    row_by_row = True

    def __init__(self, drafter: PreTrainedModel, target: HyperConnectionTarget, padding: list[int], max_draft: int):
        self.proposers = [make_proposer(drafter, target, max_draft) for _ in padding]
        self.padding = padding
        self.seen: list[int | None] = [None] * len(padding)
        self.feature_layers = self.proposers[0].feature_layers

    def first_needed_column(self, cache_length: int) -> int:
        return min([cache_length] + [seen for seen in self.seen if seen is not None])

    def propose(self, step: DraftRequest) -> RowDrafts:
        drafts = {}
        for row in (r for r, drafts in enumerate(step.drafting) if drafts):
            seen = max(self.seen[row] if self.seen[row] is not None else step.first_column, self.padding[row])
            start, end = seen - step.first_column, step.anchors[row] - step.first_column
            positions = torch.arange(seen, step.anchors[row], device=step.ids.device)[None] - self.padding[row]
            drafts[row] = self.proposers[row].propose(
                step.features[row : row + 1, start:end],
                positions,
                step.ids[row : row + 1, self.padding[row] : step.anchors[row] + 1],
                step.num_tokens[row],
                RowPick(step.pick, step.ids, row, self.padding[row]),
                step.schedule,
            )
            self.seen[row] = step.anchors[row]
        k = max(draft.tokens.shape[1] for draft in drafts.values())
        vocab = next(iter(drafts.values())).logits.shape[-1]
        batch, device = step.ids.shape[0], step.ids.device
        tokens = step.ids.new_full((batch, k), step.pad_id)
        logits = torch.zeros(batch, k, vocab, device=device)
        confidences = torch.zeros(batch, k)
        lengths = [0] * batch
        for row, draft in drafts.items():
            n = lengths[row] = draft.tokens.shape[1]
            tokens[row, :n], logits[row, :n] = draft.tokens[0], draft.logits[0]
            confidences[row, :n] = draft.row_confidences[0].cpu()
        forwards = max(draft.drafter_forwards for draft in drafts.values())
        return RowDrafts(tokens, logits, lengths, confidences, forwards)


def drafts_row_by_row(drafter: PreTrainedModel) -> bool:
    """Native MTP and DSpark draft a batch row by row; block drafters all rows in one forward."""
    return drafter.config.model_type != BLOCK_DRAFTER_TYPE


def make_drafting(
    drafter: PreTrainedModel, target: HyperConnectionTarget, padding: list[int], max_draft: int
) -> BlockDrafting | RowByRowDrafting:
    if not drafts_row_by_row(drafter):
        return BlockDrafting(drafter, target, padding)
    return RowByRowDrafting(drafter, target, padding, max_draft)


class BatchDrafts:
    """Every row's latest drafts, kept until the row commits new tokens (its anchor moves), and the step's width.

    A row's drafts follow its uncached committed tokens in the verify forward: with `ahead[r]` of those, draft j sits
    at width position `ahead[r] + j`. The policy chooses the width from every row's confidences
    (`DraftPolicy.choose_width`): whole blocks for every row, or the adaptive schedule's best expected rate of new
    tokens per row."""

    def __init__(self, batch: int, max_draft: int, device: torch.device, pad_id: int):
        self.tokens = torch.full((batch, max_draft), pad_id, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.lengths = [0] * batch
        self.confidences = torch.zeros(batch, max_draft)
        self.anchors: list[int | None] = [None] * batch  # the anchor column each row's drafts follow
        self.row_confidences: list[list[float]] = []  # what the last cut saw

    def stale(self, row: int, anchor: int) -> bool:
        return self.anchors[row] != anchor

    def store(self, drafts: RowDrafts, anchors: list[int]) -> None:
        if self.logits is None:
            self.logits = torch.zeros(*self.tokens.shape, drafts.logits.shape[-1], device=drafts.logits.device)
        for row, length in enumerate(drafts.lengths):
            if length:
                n = min(length, self.tokens.shape[1])
                self.tokens[row, :n] = drafts.tokens[row, :n]
                self.logits[row, :n] = drafts.logits[row, :n]
                self.confidences[row, :n] = drafts.confidences[row, :n].float().cpu()
                self.lengths[row], self.anchors[row] = n, anchors[row]

    def adopt(self, tokens: torch.LongTensor, usable: list[int], anchors: list[int]) -> None:
        """Another process's drafts for this step (a spread target's rank 0): every row's tokens, and how many of
        them follow its anchor."""
        self.tokens = tokens.to(self.tokens.device)
        for row, length in enumerate(usable):
            if length:
                self.lengths[row], self.anchors[row] = length, anchors[row]
            elif self.anchors[row] == anchors[row]:
                self.lengths[row] = 0

    def usable(self, row: int, anchor: int) -> int:
        """Drafts of `row` that follow its anchor column."""
        return self.lengths[row] if self.anchors[row] == anchor else 0

    def cut(self, policy: DraftPolicy, ahead: list[int], anchors: list[int], limiting: list[bool], most: int) -> int:
        """Drafted width positions the step verifies (the verify forward is one wider), at most `most`."""
        confidences = [
            self.confidences[row, : self.usable(row, anchors[row])].tolist() if limits else []
            for row, limits in enumerate(limiting)
        ]
        self.row_confidences = confidences
        return min(policy.choose_width(ahead, confidences), most)
