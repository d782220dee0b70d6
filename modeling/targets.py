"""Target adapters, one per mHC model family, by the target's `config.model_type`."""

from __future__ import annotations

from transformers import PreTrainedModel

from .target_base import HyperConnectionTarget
from .target_deepseek_v4 import DeepseekV4Target
from .target_hy_v4 import HYV4Target
from .target_linear_attention import Glm5NextTarget, Qwen4ExpCompositeTarget, Qwen4ExpTarget

TARGET_FAMILIES: dict[str, type[HyperConnectionTarget]] = {
    "deepseek_v4": DeepseekV4Target,
    "hy_v4": HYV4Target,
    "glm5_next": Glm5NextTarget,
    "qwen4_exp_text": Qwen4ExpTarget,
    "qwen4_exp": Qwen4ExpCompositeTarget,
}


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
