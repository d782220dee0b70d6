"""Architecture of the reference DeepSeek-V4 target shipped with the package.

Small but complete: hc_mult 4; sliding, CSA (with its indexer) and HCA layers whose compression
windows (4 and 16 tokens) close within the first hundred tokens; a hash-MoE layer then top-k MoE
layers. Sized for >= 20 tokens/s greedy decoding on 2 CPU cores and a ~1 hour CPU training run.
"""

from __future__ import annotations

from transformers import DeepseekV4Config

SEQUENCE_LENGTH = 512


def reference_target_config(
    vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int
) -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=vocab_size,
        hidden_size=256,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=64,
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_shared_experts=1,
        hc_mult=4,
        sliding_window=64,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        index_n_heads=4,
        index_head_dim=32,
        index_topk=512,  # V4-Flash's value: every entry is kept below 2,048 tokens, so top-k never breaks ties
        max_position_embeddings=4096,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        num_nextn_predict_layers=1,
    )
