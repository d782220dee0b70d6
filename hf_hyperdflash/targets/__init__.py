"""Target adapters, one per mHC model family."""

from __future__ import annotations

from transformers import PreTrainedModel

from .deepseek_v4 import DeepseekV4Target, FeatureCapture

TARGET_FAMILIES = {"deepseek_v4": DeepseekV4Target}


def get_target_adapter(model: PreTrainedModel) -> DeepseekV4Target:
    """The adapter for `model`'s family; a clear error for families HyperDFlash does not support."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in TARGET_FAMILIES:
        raise ValueError(
            f"HyperDFlash does not support target model type {model_type!r} ({type(model).__name__}); "
            f"supported families: {sorted(TARGET_FAMILIES)}. Use a DeepseekV4ForCausalLM target, or decode "
            "without `assistant_model`."
        )
    return TARGET_FAMILIES[model_type](model)


__all__ = ["DeepseekV4Target", "FeatureCapture", "TARGET_FAMILIES", "get_target_adapter"]
