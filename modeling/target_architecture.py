"""A short hash of a target's architecture, stored in a drafter's config to warn when it runs with another target."""

from __future__ import annotations

import hashlib
import json

from transformers import PretrainedConfig

# The architecture of a target as far as its drafter cares: shapes, layer schedule, vocabulary.
FINGERPRINT_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "hc_mult",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "layer_types",
    "mlp_layer_types",
    "compress_rates",
    "sliding_window",
    "n_routed_experts",
    "moe_intermediate_size",
    "max_position_embeddings",
)


# Fields of a V4 target's config that describe the target, not a drafter built from it (a drafter's own
# `quantization_config` is set where it is loaded quantized, `release_weights.py`)
TARGET_ONLY_FIELDS = (
    "model_type",
    "architectures",
    "transformers_version",
    "auto_map",
    "layer_types",
    "mlp_layer_types",
    "quantization_config",
)


def target_fingerprint(config: PretrainedConfig) -> str:
    """Equal architecture fields, equal fingerprints."""
    described = {name: getattr(config, name, None) for name in FINGERPRINT_FIELDS}
    if hasattr(config, "hc_count"):  # Qwen4-Exp's stream count; added only where present, so that shipped
        described["hc_count"] = config.hc_count  # drafters' fingerprints of other families still match
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]
