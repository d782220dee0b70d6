"""Drafting for a batch whose rows have committed different numbers of tokens (`batched_decoding.py`).

Each row drafts from its own anchor, the newest token it committed, with the target features of every position before
it as context. A proposer that takes a padding mask drafts every row in one forward (block drafters); native MTP and
DSpark, whose modules take none, draft row by row, one proposer per row. `BatchDrafts` holds each row's drafts until
the row commits again, and decides the step's verify width for the batch (`BatchDrafts.cut`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedModel
from transformers.generation import logits_process

from .candidate_generator import BlockProposer, DraftRequest, Proposer, RowDrafts, TokenPicker, make_proposer
from .context_copy import ChainChooser, SuffixIndex
from .draft_policy import DraftPolicy
from .target_base import HyperConnectionTarget


def right_aligned(ids: torch.LongTensor, lengths: torch.LongTensor, pad_id: int) -> torch.LongTensor:
    """Each row's first `lengths[r]` tokens ([B] on the ids' device), right-aligned in one tensor (padding in front):
    every row's anchor is then the last column, as a proposer expects."""
    width = int(lengths.max())
    shift = lengths[:, None] - width
    columns = torch.arange(width, device=ids.device)[None] + shift  # negative: in front of the row
    aligned = ids.gather(1, columns.clamp(min=0))
    return aligned.masked_fill(columns < 0, pad_id)


class BlockDrafting:
    """HyperDFlash and vanilla DFlash (heads or not): every row's block in one drafter forward. The drafter's context
    cache holds, for every row, the columns the target cache holds; a row ahead sees its further committed positions
    for this forward only (masked per row), and they leave the drafter's cache with it, to come back from the verify
    forward that feeds them again."""

    def __init__(self, proposer: BlockProposer, padding: list[int]):
        self.proposer = proposer
        if proposer.drafter.config.context_window is not None:  # a windowed cache rolls back only while recording
            self.proposer.cache.activate_past_recording()
        self.padding = padding
        self.context_start: int | None = None  # column of the first position the drafter saw
        self._padding_tensor: torch.LongTensor | None = None

    @property
    def feature_layers(self) -> list[int] | None:
        return self.proposer.feature_layers

    def first_needed_column(self, cache_length: int) -> int:
        return cache_length

    def propose(self, step: DraftRequest) -> RowDrafts:
        if self.context_start is None:
            self.context_start = step.first_column
        device = step.ids.device
        if self._padding_tensor is None:  # the call's padding is fixed: moved to the device once
            self._padding_tensor = torch.tensor(self.padding, device=device)
        padding = self._padding_tensor
        end = step.first_column + step.features.shape[1]
        columns = torch.arange(self.context_start, end, device=device)
        anchors = torch.tensor(step.anchors, device=device)
        context_mask = (columns[None] >= padding[:, None]) & (columns[None] < anchors[:, None])
        positions = (columns[None, -step.features.shape[1] :] - padding[:, None]).clamp(min=0)
        draft = self.proposer.propose(
            step.features,
            positions,
            right_aligned(step.ids, anchors + 1, step.pad_id),
            step.num_tokens,
            step.pick,
            step.schedule,
            context_mask=context_mask,
            anchor_positions=(anchors - padding)[:, None],
        )
        if end > step.cache_length and self.proposer.cache.get_seq_length():  # (a stand-in proposer caches nothing)
            self.proposer.cache.crop(step.cache_length - end)
        k = draft.tokens.shape[1]
        lengths = [k if drafts else 0 for drafts in step.drafting]
        return RowDrafts(draft.tokens, draft.logits, lengths, draft.confidences, draft.drafter_forwards)


# Processors whose output for a row depends only on that row's tokens and scores (and the batch's width): a row
# drafted alone may be processed alone. Any other processor sees the whole batch, with the row in its place (the
# repetition penalty, for one, may hold a prompt length per row).
ROW_LOCAL_PROCESSORS = tuple(
    getattr(logits_process, name)
    for name in (
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
        "TemperatureLogitsWarper",
        "TopPLogitsWarper",
        "TopKLogitsWarper",
        "MinPLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "NoRepeatNGramLogitsProcessor",
        "SequenceBiasLogitsProcessor",
        "ForcedBOSTokenLogitsProcessor",
        "ForcedEOSTokenLogitsProcessor",
        "InfNanRemoveLogitsProcessor",
        "ExponentialDecayLengthPenalty",
        "LogitNormalization",
        "SuppressTokensAtBeginLogitsProcessor",
        "SuppressTokensLogitsProcessor",
    )
)


class RowPick:
    """The call's token picker for one row drafted alone, seeing the row's padded prefix (its width as in the
    batch). Processors that may keep state per row (a prompt length per row, a constraint function of the row's
    index) see the whole batch with this row's prefix in its place; the row's token and processed logits come back.
    With row-local processors only (`ROW_LOCAL_PROCESSORS`) the row is processed alone, so drafting a batch row by
    row costs linear, not quadratic, work in its rows."""

    def __init__(self, pick: TokenPicker, batch_ids: torch.LongTensor, row: int, padding: int):
        self.pick, self.batch_ids, self.row, self.padding = pick, batch_ids, row, padding
        self.alone = all(isinstance(processor, ROW_LOCAL_PROCESSORS) for processor in pick.logits_processor or [])

    def __call__(self, prefix_ids: torch.LongTensor, logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
        if self.alone:
            return self.pick(
                torch.cat([self.batch_ids[self.row : self.row + 1, : self.padding], prefix_ids], 1), logits
            )
        batch, width = self.batch_ids.shape[0], self.padding + prefix_ids.shape[1]
        ids = self.batch_ids.new_zeros(batch, width)
        ids[:, : min(width, self.batch_ids.shape[1])] = self.batch_ids[:, :width]
        ids[self.row, self.padding :] = prefix_ids[0]
        scores = logits.new_zeros(batch, logits.shape[-1])
        scores[self.row] = logits[0]
        token, processed = self.pick(ids, scores)
        return token[self.row : self.row + 1], processed[self.row : self.row + 1]


class RowByRowDrafting:
    """Proposers that take no padding mask (native MTP, DSpark): one per row, fed that row's context without its
    padding, at its own positions. Each proposer sees each position once (`seen[row]`: the columns it has), so a row
    ahead keeps what it saw."""

    def __init__(self, proposers: list[Proposer], padding: list[int]):
        self.proposers, self.padding = proposers, padding
        self.seen: list[int | None] = [None] * len(padding)
        self.feature_layers = proposers[0].feature_layers

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
                step.num_tokens,
                RowPick(step.pick, step.ids, row, self.padding[row]),
                step.schedule,
            )
            self.seen[row] = step.anchors[row]
        rows = range(len(step.drafting))
        lengths = [drafts[row].tokens.shape[1] if row in drafts else 0 for row in rows]

        def stacked(field: str, fill: float) -> torch.Tensor:  # every row's [n, ...], padded after its n entries
            some = getattr(next(iter(drafts.values())), field)[0]
            per_row = [getattr(drafts[row], field)[0] if row in drafts else some[:0] for row in rows]
            return pad_sequence(per_row, batch_first=True, padding_value=fill)

        forwards = max(draft.drafter_forwards for draft in drafts.values())
        return RowDrafts(
            stacked("tokens", step.pad_id), stacked("logits", 0.0), lengths, stacked("confidences", 0.0), forwards
        )


def make_drafting(
    drafter: PreTrainedModel, target: HyperConnectionTarget, padding: list[int], max_draft: int
) -> BlockDrafting | RowByRowDrafting:
    """The batch's drafting: every row in one forward where the drafter's proposer takes a padding mask, else one
    proposer per row."""
    proposer = make_proposer(drafter, target, max_draft)
    if proposer.drafts_rows_together:
        return BlockDrafting(proposer, padding)
    return RowByRowDrafting([proposer, *(make_proposer(drafter, target, max_draft) for _ in padding[1:])], padding)


class BatchDrafts:
    """Every row's latest drafts, kept until the row commits new tokens (its anchor moves), and the step's width.

    A row's drafts follow its uncached committed tokens in the verify forward: with `uncached[r]` of those, draft j
    sits at width position `uncached[r] + j`. The policy chooses the width from every row's chances of acceptance
    (`DraftPolicy.choose_width`): whole blocks for every row, or the adaptive schedule's best expected rate of new
    tokens per row. Drafter logits (q) are kept only when the call samples: greedy verification needs the tokens.
    A row whose drafts were copied from the context (`copied`) holds their estimated acceptance in place of
    confidences, and its q is one-hot at its tokens."""

    def __init__(self, batch: int, max_draft: int, device: torch.device, pad_id: int, keeps_logits: bool):
        self.tokens = torch.full((batch, max_draft), pad_id, dtype=torch.long, device=device)
        self.confidences = torch.zeros(batch, max_draft, device=device)
        self.logits: torch.Tensor | None = None
        self.keeps_logits = keeps_logits
        self.lengths = [0] * batch
        self.anchors: list[int | None] = [None] * batch  # the anchor column each row's drafts follow
        self.copied = [False] * batch
        self.cut_confidences: list[list[float]] = []  # per row, the confidences the last cut saw

    def stale(self, row: int, anchor: int) -> bool:
        return self.anchors[row] != anchor

    def store(self, drafts: RowDrafts, anchors: list[int]) -> None:
        """Keep the new drafts of the rows that drafted (one indexed copy for the batch)."""
        rows = [row for row, length in enumerate(drafts.lengths) if length]
        k = min(drafts.tokens.shape[1], self.tokens.shape[1])
        index = torch.tensor(rows, device=self.tokens.device)
        self.tokens[index, :k] = drafts.tokens[index, :k].to(self.tokens.device)
        self.confidences[index, :k] = drafts.confidences[index, :k].float().to(self.confidences.device)
        if self.keeps_logits:
            if self.logits is None:
                self.logits = drafts.logits.new_zeros(*self.tokens.shape, drafts.logits.shape[-1])
            self.logits[index, :k] = drafts.logits[index, :k]
        for row in rows:
            self.lengths[row], self.anchors[row] = min(drafts.lengths[row], k), anchors[row]
            self.copied[row] = False

    def store_copies(self, chains: dict[int, list[int]], acceptance: dict[int, list[float]], anchors: list[int]):
        """Rows whose step verifies a chain copied from the context: its tokens, with each one's estimated chance of
        acceptance in place of a confidence (one transfer each for the batch)."""
        rows = sorted(chains)
        k = max(len(chains[row]) for row in rows)
        index = torch.tensor(rows, device=self.tokens.device)
        tokens = [chains[row] + [0] * (k - len(chains[row])) for row in rows]
        chances = [acceptance[row] + [0.0] * (k - len(acceptance[row])) for row in rows]
        self.tokens[index, :k] = torch.tensor(tokens, device=self.tokens.device)
        self.confidences[index, :k] = torch.tensor(chances, device=self.confidences.device)
        for row in rows:
            self.lengths[row], self.anchors[row], self.copied[row] = len(chains[row]), anchors[row], True

    def q_logits(self, k: int, vocab: int) -> torch.Tensor:
        """The drafts' q for speculative sampling [B, k, V]: the drafter's processed logits, and for copied rows
        logits one-hot at their tokens."""
        if self.logits is None:
            logits = self.confidences.new_zeros(self.tokens.shape[0], k, vocab)
        else:
            logits = self.logits[:, :k]
        if True in self.copied:
            index = torch.tensor([row for row, copied in enumerate(self.copied) if copied], device=logits.device)
            one_hot = logits.new_full((len(index), k, vocab), float("-inf"))
            one_hot.scatter_(-1, self.tokens[index, :k, None].to(logits.device), 0.0)
            logits = logits.clone()
            logits[index] = one_hot
        return logits

    def adopt(self, tokens: torch.LongTensor, usable: list[int], anchors: list[int], copied: list[bool]) -> None:
        """Another process's drafts for this step (a spread target's rank 0): every row's tokens, how many of them
        follow its anchor, and whether they were copied from the context."""
        self.tokens = tokens.to(self.tokens.device)
        self.copied = copied
        for row, length in enumerate(usable):
            if length:
                self.lengths[row], self.anchors[row] = length, anchors[row]
            elif self.anchors[row] == anchors[row]:
                self.lengths[row] = 0

    def usable(self, row: int, anchor: int) -> int:
        """Drafts of `row` that follow its anchor column."""
        return self.lengths[row] if self.anchors[row] == anchor else 0

    def cut(
        self, policy: DraftPolicy, uncached: list[int], anchors: list[int], limiting: list[bool], most: int
    ) -> int:
        """Drafted width positions the step verifies (the verify forward is one wider), at most `most`."""
        table = self.confidences.tolist()  # one transfer for the batch
        self.cut_confidences = [
            row_confidences[: self.usable(row, anchors[row])] if limits else []
            for row, (row_confidences, limits) in enumerate(zip(table, limiting, strict=True))
        ]
        acceptance = [
            confidences if self.copied[row] else policy.acceptance(confidences)
            for row, confidences in enumerate(self.cut_confidences)
        ]
        return min(policy.choose_width(uncached, acceptance), most)


@dataclass
class Offer:
    """What a row was offered at its anchor: the context's chain and the suffix it matched, and the drafter's chain
    with its first position's confidence (None: the drafter did not run for the row)."""

    anchor: int
    chain: list[int]
    suffix: int
    drafted: list[int] | None = None
    first_confidence: float = 0.0


class RowContexts:
    """For a batch's steps that may verify chains copied from the context: each row's committed tokens in its own
    `SuffixIndex` (from its first column past the padding), and what each row was offered at its latest anchor. Once
    a row commits the tokens after that anchor, the chooser learns from them what each chain would have won."""

    def __init__(self, chooser: ChainChooser, padding: list[int]):
        self.chooser, self.padding = chooser, padding
        self.indexes = [SuffixIndex() for _ in padding]
        self.offers: dict[int, Offer] = {}

    def catch_up(self, ids: torch.LongTensor, committed: list[int], live: list[bool]) -> None:
        """Index the live rows' newly committed tokens (one transfer for the batch) and learn from them."""
        starts = [pad + len(index.tokens) for pad, index in zip(self.padding, self.indexes, strict=True)]
        growing = [row for row, alive in enumerate(live) if alive and committed[row] > starts[row]]
        if not growing:
            return
        first = min(starts[row] for row in growing)
        table = ids[:, first : max(committed[row] for row in growing)].tolist()
        for row in growing:
            new = table[row][starts[row] - first : committed[row] - first]
            offer = self.offers.pop(row, None)
            if offer is not None and offer.anchor == starts[row] - 1:
                self.chooser.learn_copy(offer.chain, offer.suffix, new)
                if offer.drafted:
                    self.chooser.learn_drafter(offer.first_confidence, offer.drafted, new)
            self.indexes[row].extend(new)

    def offer(self, row: int, anchor: int, length: int) -> Offer:
        """The context's chain for the row at `anchor` (its newest committed column), kept to learn from."""
        chain, suffix = self.indexes[row].continuation(length)
        self.offers[row] = offer = Offer(anchor, chain, suffix)
        return offer
