"""`hyperdflash train --replies FILE.jsonl`: replies from a serving engine, checked against the target's tokenizer
and chat template, become the same training examples built-in generation makes."""

import json

import pytest
from transformers import AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.prompts import encode_prompt
from hf_hyperdflash.training.replies import load_replies

CHAT = [{"role": "user", "content": "How do I brew tea?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(reference.tokenizer_path())


def write(tmp_path, *records) -> str:
    path = tmp_path / "replies.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def test_text_and_token_replies_become_prompt_plus_reply_examples(tokenizer, tmp_path):
    prompt = encode_prompt(tokenizer, CHAT, enable_thinking=False)
    reply_ids = tokenizer("Boil water, then steep.", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    path = write(
        tmp_path,
        {"messages": CHAT, "reply": "Boil water, then steep."},
        {"messages": CHAT, "reply_ids": reply_ids, "prompt_ids": prompt},
    )
    text, ids = load_replies(path, tokenizer, enable_thinking=False)
    for example in (text, ids):
        assert example["input_ids"].tolist() == prompt + reply_ids
        assert example["loss_mask"].tolist() == [False] * len(prompt) + [True] * len(reply_ids)
    (cut,) = load_replies(
        write(tmp_path, {"messages": CHAT, "reply": "Boil."}), tokenizer, False, max_length=len(prompt) + 1
    )
    assert cut["input_ids"].shape == (len(prompt) + 1,) and cut["loss_mask"][-1]


@pytest.mark.parametrize(
    "record, message",
    [
        ({"messages": CHAT, "reply": "x", "prompt_ids": [1, 2, 3]}, "differ from this target's chat template"),
        ({"messages": CHAT, "reply_ids": [5, 10**6]}, r"outside this tokenizer's 8192 tokens"),
        ({"messages": [*CHAT, {"role": "assistant", "content": "hi"}], "reply": "x"}, "ends with a user turn"),
        ({"messages": CHAT}, "needs 'reply' \\(text\\) or 'reply_ids'"),
    ],
)
def test_mismatched_or_malformed_replies_are_refused_with_the_line(tokenizer, tmp_path, record, message):
    path = write(tmp_path, {"messages": CHAT, "reply": "fine"}, record)
    with pytest.raises(ValueError, match=rf"line 2: .*{message}"):
        load_replies(path, tokenizer, enable_thinking=False)


def test_thinking_mode_changes_the_expected_prompt(tokenizer, tmp_path):
    """Replies made with thinking off do not pass as thinking-mode data."""
    prompt = encode_prompt(tokenizer, CHAT, enable_thinking=False)
    path = write(tmp_path, {"messages": CHAT, "reply": "x", "prompt_ids": prompt})
    assert load_replies(path, tokenizer, enable_thinking=False)
    with pytest.raises(ValueError, match="same --thinking setting"):
        load_replies(path, tokenizer, enable_thinking=True)
