"""Tiny DeepSeek-V4 targets for tests and CPU benchmarks.

The stock `DeepseekV4ForCausalLM` is used unchanged; only the config is shrunk. The layer schedule
covers every attention type (sliding, CSA with its indexer, HCA) and both MoE kinds (hash, top-k),
with compression rates small enough that several windows close within a short prompt.
"""

from __future__ import annotations

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM


def tiny_deepseek_v4_config(**overrides) -> DeepseekV4Config:
    """A 4-layer V4 config (sliding, CSA, HCA, CSA; hash-MoE then top-k MoE) that runs in milliseconds."""
    settings = dict(
        vocab_size=512,
        hidden_size=64,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        hc_mult=4,
        sliding_window=8,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    settings.update(overrides)
    return DeepseekV4Config(**settings)


def randomize_hash_table(model: DeepseekV4ForCausalLM, seed: int = 0) -> None:
    """Give every hash-MoE router a real token->expert table (the stock init leaves it all zeros)."""
    generator = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        router = layer.mlp.gate
        if hasattr(router, "tid2eid"):
            vocab, top_k = router.tid2eid.shape
            table = torch.stack([torch.randperm(router.num_experts, generator=generator)[:top_k] for _ in range(vocab)])
            router.tid2eid.copy_(table)


def tiny_deepseek_v4(seed: int = 0, **overrides) -> DeepseekV4ForCausalLM:
    """A randomly initialised tiny stock V4 model in fp32 eval mode, deterministic for a given seed."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_deepseek_v4_config(**overrides)).float().eval()
    randomize_hash_table(model, seed)
    return model
