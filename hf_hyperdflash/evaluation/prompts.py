"""Evaluation prompts as chat-formatted token ids."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from ..sharegpt import load_conversations
from ..training.data import encode_prompt


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, thinking: bool = False) -> torch.LongTensor:
    """[1, S] ids of a one-turn chat ending in the assistant prefix (thinking section open or closed)."""
    return torch.tensor([encode_prompt(tokenizer, [{"role": "user", "content": prompt}], thinking)])


def held_out_prompts(count: int, max_chars: int = 2000) -> list[str]:
    """The first user turns of the first `count` held-out ShareGPT conversations (never trained on)."""
    prompts = [c.first_prompt[:max_chars] for c in load_conversations("held_out") if c.first_prompt]
    if len(prompts) < count:
        raise ValueError(f"Only {len(prompts)} held-out prompts exist; ask for at most that many.")
    return prompts[:count]
