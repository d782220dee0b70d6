"""Draft-block batches: anchor validity, labels, padding, and reproducible per-epoch resampling."""

import torch

from hf_hyperdflash.training.collator import IGNORE_INDEX, BlockCollator


def example(prompt: int, reply: int, index: int, epoch: int = 0) -> dict:
    input_ids = torch.arange(100, 100 + prompt + reply)
    loss_mask = torch.arange(prompt + reply) >= prompt
    return {"input_ids": input_ids, "loss_mask": loss_mask, "index": index, "epoch": epoch}


def test_anchors_predict_reply_tokens_and_labels_are_the_next_tokens():
    collate = BlockCollator(block_size=4, anchors_per_sequence=5, pad_token_id=0)
    rows = [example(prompt=6, reply=9, index=0), example(prompt=3, reply=4, index=1)]
    batch = collate(rows)
    assert batch["input_ids"].shape == (2, 15) and batch["labels"].shape == (2, 5, 3)
    assert batch["attention_mask"].sum(1).tolist() == [15, 7] and int(batch["num_tokens"]) == 22
    assert (batch["input_ids"][1, 7:] == 0).all(), "right padding with the pad id"
    for row, ids, anchors, labels in zip(
        rows, batch["input_ids"], batch["anchor_positions"], batch["labels"], strict=True
    ):
        length = len(row["input_ids"])
        real = labels[:, 0] != IGNORE_INDEX
        valid_anchors = anchors[real]
        assert len(set(valid_anchors.tolist())) == len(valid_anchors), "anchors are distinct"
        assert row["loss_mask"][valid_anchors + 1].all(), "an anchor's first label is a reply token"
        for anchor, block in zip(valid_anchors.tolist(), labels[real], strict=True):
            for k, label in enumerate(block.tolist(), start=1):
                expected = int(ids[anchor + k]) if anchor + k < length else IGNORE_INDEX
                assert label == expected
    # The second sequence has only 4 valid anchors (positions 2..5): the fifth block is all ignored.
    assert (batch["labels"][1, :, 0] != IGNORE_INDEX).sum() == 4
    assert (batch["labels"][1][batch["labels"][1, :, 0] == IGNORE_INDEX] == IGNORE_INDEX).all()


def test_labels_skip_positions_outside_the_reply():
    """A second prompt section inside the sequence (loss mask 0) is never a label."""
    collate = BlockCollator(block_size=5, anchors_per_sequence=20)
    row = example(prompt=2, reply=10, index=0)
    row["loss_mask"][6:8] = False  # e.g. a later user turn
    batch = collate([row])
    anchors, labels = batch["anchor_positions"][0], batch["labels"][0]
    real = labels[:, 0] != IGNORE_INDEX
    assert 5 not in anchors[real].tolist() and 6 not in anchors[real].tolist()
    for anchor, block in zip(anchors[real].tolist(), labels[real], strict=True):
        for k, label in enumerate(block.tolist(), start=1):
            position = anchor + k
            if 6 <= position < 8:
                assert label == IGNORE_INDEX


def test_anchor_sampling_is_reproducible_and_changes_every_epoch():
    collate = BlockCollator(block_size=4, anchors_per_sequence=4, seed=3)
    rows = [example(prompt=4, reply=40, index=i) for i in range(3)]
    first = collate(rows)["anchor_positions"]
    assert torch.equal(first, BlockCollator(block_size=4, anchors_per_sequence=4, seed=3)(rows)["anchor_positions"])
    # Batch composition does not matter: an example's anchors depend on (seed, epoch, index) only.
    assert torch.equal(collate(rows[::-1])["anchor_positions"], first.flip(0))
    next_epoch = collate([{**row, "epoch": 1} for row in rows])["anchor_positions"]
    assert not torch.equal(next_epoch, first)
    other_seed = BlockCollator(block_size=4, anchors_per_sequence=4, seed=4)(rows)["anchor_positions"]
    assert not torch.equal(other_seed, first)
