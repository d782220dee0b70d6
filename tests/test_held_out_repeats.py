"""Train prompts that repeat a held-out ShareGPT prompt: flagged on the real data, and left out of training."""

import json
from types import SimpleNamespace

import pytest
import torch

from hf_hyperdflash.sharegpt import (
    held_out_prompt_texts,
    is_held_out,
    load_conversations,
    normalize_prompt_text,
    repeats_held_out_prompt,
)
from hf_hyperdflash.training.command import _prompts_not_to_train_on
from hf_hyperdflash.training.data import held_out_repeats, load_weighted_examples

REPEAT = "Explain quantum computing in simple terms"  # opens train conversation khWNavV_0 and a held-out one


def test_train_prompts_that_repeat_a_held_out_prompt_are_flagged():
    train = load_conversations("train")
    known = next(c for c in train if c.id == "khWNavV_0")
    assert not is_held_out(known.id) and known.first_prompt == REPEAT
    assert repeats_held_out_prompt(known.first_prompt)
    assert any(c.first_prompt == REPEAT for c in load_conversations("held_out"))
    assert repeats_held_out_prompt("  explain QUANTUM\n computing in\tsimple terms ")  # whitespace and case aside
    assert not repeats_held_out_prompt(REPEAT + " please")
    assert len(held_out_prompt_texts()) == 920
    first = [c.first_prompt for c in train[:8000] if c.first_prompt is not None]
    assert sum(map(repeats_held_out_prompt, first)) == 320
    assert normalize_prompt_text(" A\n  b ") == "a b"
    with pytest.raises(ValueError, match="must be a string"):
        repeats_held_out_prompt(None)


def _write_replies(data_dir, count):
    """A reply folder as `generate_replies` leaves it: record i has prompt tokens [i, i] and reply tokens [i, i]."""
    data_dir.mkdir()
    records = [{"index": i, "input_ids": [i] * 4, "loss_mask": [0, 0, 1, 1]} for i in range(count)]
    (data_dir / "shard-000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reversed(records)))


def test_training_examples_leave_out_the_replies_to_held_out_repeats(tmp_path, capsys):
    prompts = [
        [{"role": "user", "content": "A question nobody held out, number 0?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": REPEAT}],
        [{"role": "user", "content": "A question nobody held out, number 2?"}],
        [{"role": "user", "content": "  explain quantum computing in SIMPLE terms"}],
    ]
    for name in ("greedy", "sampled"):
        _write_replies(tmp_path / name, len(prompts))
    main = SimpleNamespace(is_main_process=True)

    settings = {"data": "sharegpt", "data_split": "train"}
    skipped = _prompts_not_to_train_on(settings, prompts, main)
    assert skipped == {1, 3} and settings["held_out_repeats_left_out"] == 2
    assert "leaves out the replies to 2 of 4 ShareGPT train prompts" in capsys.readouterr().out
    examples = load_weighted_examples([tmp_path / "greedy", tmp_path / "sampled"], [2, 1], skip_indices=skipped)
    firsts = [int(example["input_ids"][0]) for example in examples]
    assert firsts == [0, 2, 0, 2, 0, 2], "each folder, by its weight, less the replies to the flagged prompts"
    assert torch.equal(examples[0]["loss_mask"], torch.tensor([False, False, True, True]))

    own = {"data": str(tmp_path / "prompts.jsonl"), "data_split": "train"}  # a user's own prompts are used whole
    assert _prompts_not_to_train_on(own, prompts, main) == frozenset()
    assert "held_out_repeats_left_out" not in own and capsys.readouterr().out == ""
    assert len(load_weighted_examples([tmp_path / "greedy"], [1])) == 4

    with pytest.raises(ValueError, match="Prompt 1 does not end with a user turn"):
        held_out_repeats([prompts[0], [{"role": "assistant", "content": "Hi."}]])
