"""HyperDFlash: block speculative decoding aligned with DeepSeek-V4's multi-stream mHC residual.

Importing the package makes `target.generate(..., assistant_model=drafter)` run speculative decoding
when `drafter` is a HyperDFlash / vanilla-DFlash drafter or a native V4 MTP module, and registers
their configs with the Auto classes.
"""

from transformers import AutoConfig, AutoModel

from . import generation
from .modeling.configuration_deepseek_v4_mtp import DeepseekV4MTPConfig
from .modeling.configuration_hyperdflash import HyperDFlashConfig
from .modeling.modeling_deepseek_v4_mtp import DeepseekV4MTPForDrafting
from .modeling.modeling_hyperdflash import HyperDFlashForDrafting

__version__ = "0.1.0"

AutoConfig.register(HyperDFlashConfig.model_type, HyperDFlashConfig, exist_ok=True)
AutoModel.register(HyperDFlashConfig, HyperDFlashForDrafting, exist_ok=True)
AutoConfig.register(DeepseekV4MTPConfig.model_type, DeepseekV4MTPConfig, exist_ok=True)
AutoModel.register(DeepseekV4MTPConfig, DeepseekV4MTPForDrafting, exist_ok=True)
generation.install()

__all__ = ["DeepseekV4MTPConfig", "DeepseekV4MTPForDrafting", "HyperDFlashConfig", "HyperDFlashForDrafting"]
