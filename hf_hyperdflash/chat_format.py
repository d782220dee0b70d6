"""The reference chat format: special tokens, the chat template, and the byte-level BPE tokenizer trained on it.

Every turn is `<|role|>content<|end|>`; an assistant turn starts with a thinking section
`<think>...</think>` that is empty in non-thinking mode. `apply_chat_template(...,
add_generation_prompt=True, enable_thinking=True)` leaves the section open for the model to fill.
ShareGPT has no reasoning traces, so training data gets a short synthetic one (`synthetic_reasoning`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<|pad|>", "<|begin|>", "<|end|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS, THINK_OPEN, THINK_CLOSE]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>"
    "{% if message['role'] == 'assistant' %}"
    "<think>{{ message.get('reasoning', '') }}</think>"
    "{% endif %}"
    "{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|assistant|><think>{% if not enable_thinking | default(false) %}</think>{% endif %}"
    "{% endif %}"
)


def synthetic_reasoning(prompt: str, reply: str) -> str:
    """A short, deterministic stand-in for a reasoning trace: restate the request, plan the reply's shape."""
    first_sentence = re.split(r"(?<=[.?!])\s", prompt.strip(), maxsplit=1)[0]
    words = first_sentence.split()
    request = " ".join(words[:24]) + (" ..." if len(words) > 24 else "")
    paragraphs = max(1, len([p for p in reply.split("\n\n") if p.strip()]))
    unit = "paragraph" if paragraphs == 1 else "paragraphs"
    return f"The user asks: {request} I will answer in {paragraphs} {unit}."


def train_chat_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and wrap it with the chat template and special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[*ROLE_TOKENS, THINK_OPEN, THINK_CLOSE],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
