"""Prompts: chats that end in a user turn, read from a source and encoded with the chat template.

Sources (`load_prompts`): `"sharegpt"` (first user turn of each conversation of a split of the packaged ShareGPT),
a JSONL file of chats (`{"messages": [...]}`: messages up to the first user turn), ShareGPT-layout records
(`{"conversations": [...]}`) or prompts (`{"prompt": "..."}` / `{"instruction": "..."}`), or a Hugging Face
dataset name (needs the `datasets` library). Training answers them with the target; evaluation decodes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .sharegpt import ROLE_NAMES, load_conversations

if TYPE_CHECKING:  # a type hint only: `hyperdflash eval --help` reads the prompt set names without transformers
    from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, str]]


def _up_to_first_user_turn(messages: Sequence[dict[str, str]]) -> Messages | None:
    """The chat prefix the target answers: any system turn, then the first user turn (None without one)."""
    prefix = []
    for message in messages:
        prefix.append({"role": message["role"], "content": message["content"]})
        if message["role"] == "user":
            return prefix
    return None


def prompt_from_record(record: dict) -> Messages | None:
    if "messages" in record:
        return _up_to_first_user_turn(record["messages"])
    if "conversations" in record:  # ShareGPT layout on the Hub: {"from": "human", "value": ...}
        turns = [
            {"role": ROLE_NAMES.get(t.get("from"), ""), "content": t.get("value", "")} for t in record["conversations"]
        ]
        return _up_to_first_user_turn(turns)
    for key in ("prompt", "instruction"):
        if isinstance(record.get(key), str) and record[key].strip():
            return [{"role": "user", "content": record[key]}]
    return None


def jsonl_records(path: Path) -> Iterable[dict]:
    with path.open() as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number} is not valid JSON ({error}).") from error


def _hub_records(name: str, split: str) -> Iterable[dict]:
    try:
        import datasets
    except ImportError as error:
        raise ValueError(
            f"{name!r} is neither 'sharegpt' nor an existing JSONL file, and reading it as a Hugging Face dataset "
            "needs the `datasets` library: `pip install datasets`, or pass a JSONL file."
        ) from error
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as error:  # the library raises many types (connection, missing split, unknown name)
        raise ValueError(f"Could not load the Hugging Face dataset {name!r} (split {split!r}): {error}") from error


def load_prompts(
    source: str, split: str = "train", limit: int | None = None, max_chars: int | None = None
) -> list[Messages]:
    """Chat prefixes (ending with a user turn) to answer: from ShareGPT, a JSONL file or a Hub dataset.

    `split` picks the ShareGPT side ("train" / "held_out") or the Hub dataset split; a JSONL file is used whole.
    Prompts whose messages hold more than `max_chars` characters are skipped (long prompts dominate generation).
    """
    if source == "sharegpt":
        conversations = load_conversations(split)
        records: Iterable[dict] = ({"messages": list(c.messages)} for c in conversations)
    elif Path(source).is_file():
        records = jsonl_records(Path(source))
    elif source.endswith((".jsonl", ".json")):
        raise ValueError(f"Prompt file {source} does not exist.")
    else:
        records = _hub_records(source, split)
    prompts = []
    for record in records:
        prompt = prompt_from_record(record)
        if prompt is not None and max_chars is not None and sum(len(m["content"]) for m in prompt) > max_chars:
            continue
        if prompt is not None:
            prompts.append(prompt)
            if limit is not None and len(prompts) == limit:
                break
    if not prompts:
        raise ValueError(
            f"No usable prompts in {source!r}: records need 'messages' with a user turn, 'conversations', "
            "'prompt' or 'instruction'."
        )
    return prompts


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: Messages, enable_thinking: bool) -> list[int]:
    """Token ids of the chat template with the assistant turn opened, thinking on or off."""
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=enable_thinking, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False).input_ids
