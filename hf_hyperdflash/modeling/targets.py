"""Target adapters, one per mHC model family."""

from __future__ import annotations

import hashlib
import json

from transformers import PretrainedConfig, PreTrainedModel

from .feature_capture import FeatureCapture
from .target_base import HyperConnectionTarget
from .target_deepseek_v4 import DeepseekV4Target
from .target_hy_v4 import HYV4Target
from .target_linear_attention import Glm5NextTarget, Qwen4ExpTarget

# By the target's `config.model_type`
TARGET_FAMILIES: dict[str, type[HyperConnectionTarget]] = {
    "deepseek_v4": DeepseekV4Target,
    "hy_v4": HYV4Target,
    "glm5_next": Glm5NextTarget,
    "qwen4_exp_text": Qwen4ExpTarget,
}
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


def target_fingerprint(config: PretrainedConfig) -> str:
    """A short hash of the target config's architecture fields: equal configs, equal fingerprints."""
    described = {name: getattr(config, name, None) for name in FINGERPRINT_FIELDS}
    if hasattr(config, "hc_count"):  # Qwen4-Exp's stream count; absent elsewhere, so those hashes stay as they were
        described["hc_count"] = config.hc_count
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]


def get_target_adapter(model: PreTrainedModel) -> HyperConnectionTarget:
    """The adapter for `model`'s family; a clear error for families HyperDFlash does not support."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in TARGET_FAMILIES:
        raise ValueError(
            f"HyperDFlash does not support target model type {model_type!r} ({type(model).__name__}); "
            f"supported families: {sorted(TARGET_FAMILIES)}. Use a target of one of them, or decode without "
            "`assistant_model`."
        )
    return TARGET_FAMILIES[model_type](model)


__all__ = [
    "DeepseekV4Target",
    "Glm5NextTarget",
    "Qwen4ExpTarget",
    "FeatureCapture",
    "HYV4Target",
    "HyperConnectionTarget",
    "TARGET_FAMILIES",
    "get_target_adapter",
    "target_fingerprint",
]
