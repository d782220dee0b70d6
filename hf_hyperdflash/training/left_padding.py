"""Rows left-padded as batched `generate()` pads them, so a drafter also learns the features a padded row has.

A left-padded DeepSeek-V4 row's features are not its features alone: its compressors pool the padding into the
entries its real tokens attend to (plain batched decoding does the same), so a drafter trained on unpadded rows
drafts worse for the padded rows of a batch. The collator pads a share of its rows on the left; the target then
runs as generate()'s prefill runs it (the mask, and position ids that count real tokens only).
"""

from __future__ import annotations

import torch


def real_positions(attention_mask: torch.Tensor) -> torch.LongTensor:
    """Each column's position among its row's real tokens (padding before them: 0), as generate() numbers them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def target_inputs(input_ids: torch.LongTensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """A target forward's inputs: with left-padded rows, the mask and real-token positions (generate()'s prefill
    gives exactly these features); without, the ids alone (every layer is causal, so trailing padding is unseen)."""
    if bool(attention_mask[:, 0].all()):
        return {"input_ids": input_ids}
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": real_positions(attention_mask)}
