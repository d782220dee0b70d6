"""What "temperature T" means everywhere in this project: greedy at 0, plain sampling otherwise.

Replies a drafter trains on and the runs it is evaluated on must sample the same distribution, so neither may
pick up top-k/top-p from a model's generation config (transformers fills in top_k=50 when it is unset).
"""

from __future__ import annotations


def decoding_settings(temperature: float, max_new_tokens: int) -> dict:
    """`generate` kwargs: greedy at T=0; otherwise sampling at `temperature` with no top-k/top-p truncation."""
    if temperature == 0:
        return {"max_new_tokens": max_new_tokens, "do_sample": False}
    return {"max_new_tokens": max_new_tokens, "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
