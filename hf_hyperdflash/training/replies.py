"""Training examples from replies a serving engine generated (`hyperdflash train --replies FILE.jsonl`).

For a target of hundreds of billions of parameters, `generate()` is far too slow to answer thousands of prompts;
a serving engine (vLLM, SGLang) is not. Each line of the file holds one chat and the target's reply:

    {"messages": [{"role": "user", "content": "..."}], "reply": "the reply text"}
    {"messages": [...], "reply_ids": [812, 99, ...], "prompt_ids": [1, 77, ...]}

`messages` end with a user turn. The reply is either text (tokenized without special tokens; the end-of-sequence
token is appended, as the engine stopped there) or token ids (taken as they are, including any EOS). `prompt_ids`,
when given, must be exactly what this target's chat template makes of `messages` (with or without thinking, as
`--thinking` says): replies to a differently templated prompt would teach the drafter the wrong context.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from ..prompts import encode_prompt


def _reply_ids(record: dict, tokenizer: PreTrainedTokenizerBase, where: str) -> list[int]:
    if "reply_ids" in record:
        ids = record["reply_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{where}: 'reply_ids' must be a list of token ids.")
        return ids
    if isinstance(record.get("reply"), str):
        return tokenizer(record["reply"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    raise ValueError(f"{where}: each record needs 'reply' (text) or 'reply_ids' (token ids).")


def _check_prompt(record: dict, encoded: list[int], where: str) -> None:
    given = record.get("prompt_ids")
    if given is None or given == encoded:
        return
    first = next(
        (k for k, (a, b) in enumerate(zip(given, encoded, strict=False)) if a != b), min(len(given), len(encoded))
    )
    raise ValueError(
        f"{where}: 'prompt_ids' differ from this target's chat template from token {first} on ({len(given)} tokens "
        f"given, {len(encoded)} expected). Generate the replies with the target's own tokenizer and chat template "
        "(and the same --thinking setting), or drop 'prompt_ids'."
    )


def load_replies(
    path: str | Path, tokenizer: PreTrainedTokenizerBase, enable_thinking: bool, max_length: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """Examples in file order, as `load_examples` gives them: `input_ids` and a `loss_mask` over the reply."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"No replies file at {path}; pass a JSONL file of {{'messages', 'reply'}} records.")
    vocab_size = len(tokenizer)
    examples = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not valid JSON ({error}).") from error
        messages = record.get("messages") if isinstance(record, dict) else None
        if not messages or not isinstance(messages, list) or messages[-1].get("role") != "user":
            raise ValueError(f"{where}: 'messages' must be a chat that ends with a user turn.")
        prompt_ids = encode_prompt(tokenizer, messages, enable_thinking)
        _check_prompt(record, prompt_ids, where)
        reply = _reply_ids(record, tokenizer, where)
        outside = [i for i in reply if not 0 <= i < vocab_size]
        if outside:
            raise ValueError(
                f"{where}: reply token ids {outside[:5]} are outside this tokenizer's {vocab_size} tokens; the "
                "replies come from another tokenizer."
            )
        input_ids = torch.tensor((prompt_ids + reply)[:max_length], dtype=torch.long)
        loss_mask = torch.tensor(([False] * len(prompt_ids) + [True] * len(reply))[:max_length], dtype=torch.bool)
        if loss_mask[1:].any():
            examples.append({"input_ids": input_ids, "loss_mask": loss_mask})
    if not examples:
        raise ValueError(f"{path} holds no usable reply.")
    return examples
