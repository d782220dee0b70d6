"""Evaluation prompts as chat-formatted token ids."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from ..prompts import Messages, encode_prompt
from .datasets import load_prompt_set


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: Messages, thinking: bool = False) -> torch.LongTensor:
    """[1, S] ids of a chat ending in the assistant prefix (thinking section open or closed)."""
    return torch.tensor([encode_prompt(tokenizer, messages, thinking)])


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, thinking: bool = False) -> torch.LongTensor:
    """[1, S] ids of a one-turn chat with the user message `prompt`."""
    return chat_ids(tokenizer, [{"role": "user", "content": prompt}], thinking)


def held_out_prompts(count: int, max_chars: int = 2000) -> list[str]:
    """The first user turns of the first `count` held-out ShareGPT conversations (never trained on)."""
    chats = load_prompt_set("sharegpt", max_chars=max_chars)
    if len(chats) < count:
        raise ValueError(f"Only {len(chats)} held-out prompts exist; ask for at most that many.")
    return [chat[-1]["content"] for chat in chats[:count]]
