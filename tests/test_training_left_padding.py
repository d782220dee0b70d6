"""Training on rows left-padded as batched generate() pads prompts: the collator pads a share of its rows, the target
runs as generate()'s prefill runs it, and a row's blocks and labels stay the row's own."""

import pytest
import torch
from test_training_collator import example

from hf_hyperdflash.modeling import DeepseekV4DSparkForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.testing import tiny_deepseek_v4
from hf_hyperdflash.training.collator import IGNORE_INDEX, BlockCollator
from hf_hyperdflash.training.dspark import DSparkWithFrozenTarget
from hf_hyperdflash.training.left_padding import target_inputs
from hf_hyperdflash.training.losses import LossConfig
from hf_hyperdflash.training.trainer import DrafterWithFrozenTarget


def test_a_share_of_the_rows_is_left_padded_with_its_anchors_and_labels_its_own():
    rows = [example(prompt=4, reply=30, index=i) for i in range(8)]
    plain = BlockCollator(block_size=4, anchors_per_sequence=5, seed=1)(rows)
    collate = BlockCollator(block_size=4, anchors_per_sequence=5, seed=1, left_padding=(0.5, 6))
    padded = collate(rows)
    pads = (~padded["attention_mask"]).long().argmin(dim=1)  # leading padding of each row
    assert 0 < int((pads > 0).sum()) < len(rows) and int(pads.max()) <= 6
    for row in range(len(rows)):
        pad = int(pads[row])
        length = len(rows[row]["input_ids"])
        assert torch.equal(padded["input_ids"][row, pad : pad + length], rows[row]["input_ids"])
        assert (padded["input_ids"][row, :pad] == 0).all() and padded["attention_mask"][row].sum() == length
        assert torch.equal(padded["anchor_positions"][row], plain["anchor_positions"][row] + pad)
        assert torch.equal(padded["labels"][row], plain["labels"][row])
    assert torch.equal(collate(rows)["input_ids"], padded["input_ids"]), "a fixed function of (seed, epoch, index)"
    unpadded = BlockCollator(block_size=4, anchors_per_sequence=5, seed=1, left_padding=(0.0, 6))(rows)
    assert torch.equal(unpadded["input_ids"], plain["input_ids"])


@pytest.mark.parametrize("left_padding", [(1.5, 4), (-0.1, 4), (0.5, 0)])
def test_a_bad_left_padding_is_refused(left_padding):
    with pytest.raises(ValueError, match="left_padding"):
        BlockCollator(block_size=4, anchors_per_sequence=2, left_padding=left_padding)


def test_the_target_runs_on_left_padded_rows_as_generates_prefill():
    """A left-padded DeepSeek-V4 row's features depend on its padding; the training forward gives the ones batched
    generate() computes for it."""
    target = tiny_deepseek_v4(seed=0).eval()
    input_ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    input_ids[1, :9], attention_mask[1, :9] = 0, False
    with torch.no_grad():
        prefill = target.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=0,
            output_hidden_states=True,
            return_dict_in_generate=True,
        ).hidden_states[0]
        trained = target.model(**target_inputs(input_ids, attention_mask), output_hidden_states=True).hidden_states
        unpadded = target.model(input_ids=input_ids[1:, 9:], output_hidden_states=True).hidden_states
    for ours, theirs in zip(trained, prefill, strict=True):
        torch.testing.assert_close(ours[attention_mask], theirs[attention_mask], rtol=1e-5, atol=1e-5)
    assert (trained[-1][1, 9:] - unpadded[-1][0]).abs().max() > 1e-2, "padding changes a V4 row's features"


def _drafter_module(target, kind: str):
    torch.manual_seed(0)
    if kind == "dspark":
        drafter = DeepseekV4DSparkForDrafting.from_target(target, num_hidden_layers=1, dspark_markov_rank=4)
        return DSparkWithFrozenTarget(drafter, target), drafter.config.dspark_block_size + 1
    drafter = HyperDFlashForDrafting.from_target(target, block_size=4, num_hidden_layers=1)
    return DrafterWithFrozenTarget(drafter, target, LossConfig()), 4


@pytest.mark.parametrize("kind", ["hyperdflash", "dspark"])
def test_a_left_padded_row_trains_as_itself_given_its_features(kind):
    """Given each row's target outputs placed after its padding (a target whose features ignore padding), a batch of
    left-padded rows gives the losses of the same rows unpadded: the drafter masks the padding, and each block keeps
    its row's tokens and positions."""
    target = tiny_deepseek_v4(seed=0).eval().requires_grad_(False)
    module, block_size = _drafter_module(target, kind)
    vocab = target.config.vocab_size
    rows = [example(prompt=5, reply=20 + 3 * i, index=i) for i in range(3)]
    for row in rows:
        row["input_ids"] = row["input_ids"] % (vocab - 3) + 3
    plain = BlockCollator(block_size, anchors_per_sequence=4, seed=2)(rows)
    padded = BlockCollator(block_size, anchors_per_sequence=4, seed=2, left_padding=(1.0, 7))(rows)
    pads = (~padded["attention_mask"]).long().argmin(dim=1).tolist()
    assert min(pads) > 0 and (plain["labels"] != IGNORE_INDEX).any()

    def losses(batch: dict) -> dict:
        with torch.no_grad():
            return module(**{name: value for name, value in batch.items() if name != "num_tokens"})

    theirs = losses(plain)
    with torch.no_grad():
        unpadded = module._target_pass(plain["input_ids"], plain["attention_mask"], plain["anchor_positions"])
    width = padded["input_ids"].shape[1]
    features = unpadded[0].new_zeros(unpadded[0].shape[0], width, *unpadded[0].shape[2:])
    for row, pad in enumerate(pads):
        kept = min(width - pad, unpadded[0].shape[1])
        features[row, pad : pad + kept] = unpadded[0][row, :kept]
    module._target_pass = lambda *args: (features, *unpadded[1:])
    ours = losses(padded)
    for name in ("loss", "ce"):
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
