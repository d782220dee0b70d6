"""Batches of draft blocks: random anchors per sequence, the block labels after each, right padding (and, for a share
of the rows, left padding as batched generate() pads them: `left_padding.py`).

All blocks of a sequence train in one drafter forward (the drafter masks each block to the context before
its anchor), so a batch is the padded sequences plus, per sequence, `anchors_per_sequence` anchor positions
and the `block_size - 1` tokens each block must predict.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class BlockCollator:
    """Samples anchors and builds labels; the anchors of an example are a fixed function of (seed, epoch, index).

    An anchor `a` is valid when the token it predicts first, `a + 1`, is a reply token (loss mask 1). Slot k of
    its block is labelled with token `a + k`, or IGNORE_INDEX where that falls past the sequence or outside the
    reply. A sequence with fewer valid anchors than `anchors_per_sequence` fills the rest with ignored blocks.
    Anchors are drawn anew every epoch (a different seed), identically on a resumed run. `left_padding` (share,
    most): that share of the examples is left-padded by 1 to `most` tokens, drawn from the same seed; anchors are
    then columns of the padded row.
    """

    def __init__(
        self,
        block_size: int,
        anchors_per_sequence: int,
        pad_token_id: int = 0,
        seed: int = 0,
        left_padding: tuple[float, int] = (0.0, 0),
    ):
        if block_size < 2 or anchors_per_sequence < 1:
            raise ValueError(
                f"Need block_size >= 2 and anchors_per_sequence >= 1, got {block_size} and {anchors_per_sequence}."
            )
        share, most = left_padding
        if not 0.0 <= share <= 1.0 or (share > 0 and most < 1):
            raise ValueError(
                f"`left_padding` takes a share in [0, 1] and, with a share, at least 1 token; got {left_padding}."
            )
        self.block_size = block_size
        self.anchors_per_sequence = anchors_per_sequence
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.left_padding = left_padding

    def _generator(self, epoch: int, index: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 1_000_003 + index)

    def sample_anchors(self, loss_mask: torch.Tensor, epoch: int, index: int) -> torch.LongTensor:
        """Sorted positions of up to `anchors_per_sequence` distinct valid anchors, drawn without replacement."""
        candidates = loss_mask[1:].nonzero().flatten()
        generator = self._generator(epoch, index)
        picked = torch.randperm(len(candidates), generator=generator)[: self.anchors_per_sequence]
        return candidates[picked].sort().values

    def block_labels(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[anchors, block_size - 1]: token a + k for slot k, IGNORE_INDEX outside the sequence or reply."""
        positions = anchors.unsqueeze(1) + torch.arange(1, self.block_size)
        inside = positions < len(input_ids)
        positions = positions.clamp(max=len(input_ids) - 1)
        keep = inside & loss_mask[positions]
        return torch.where(keep, input_ids[positions], IGNORE_INDEX)

    def padding(self, epoch: int, index: int) -> int:
        """Left padding of an example: 0, or for `left_padding`'s share of them 1 to its most tokens."""
        share, most = self.left_padding
        if not share:
            return 0
        generator = self._generator(epoch, index + 1_000_000_007)  # apart from the anchors' draw
        if float(torch.rand(1, generator=generator)) >= share:
            return 0
        return int(torch.randint(1, most + 1, (1,), generator=generator))

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        pads = [self.padding(row["epoch"], row["index"]) for row in rows]
        batch = len(rows)
        width = max(pad + len(row["input_ids"]) for pad, row in zip(pads, rows, strict=True))
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.bool)
        anchor_positions = torch.zeros((batch, self.anchors_per_sequence), dtype=torch.long)
        labels = torch.full((batch, self.anchors_per_sequence, self.block_size - 1), IGNORE_INDEX, dtype=torch.long)
        for i, (pad, row) in enumerate(zip(pads, rows, strict=True)):
            ids, loss_mask = row["input_ids"], row["loss_mask"].bool()
            input_ids[i, pad : pad + len(ids)] = ids
            attention_mask[i, pad : pad + len(ids)] = True
            anchors = self.sample_anchors(loss_mask, row["epoch"], row["index"])
            anchor_positions[i, : len(anchors)] = anchors + pad
            labels[i, : len(anchors)] = self.block_labels(ids, loss_mask, anchors)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "anchor_positions": anchor_positions,
            "labels": labels,
            "num_tokens": attention_mask.sum(),
        }
