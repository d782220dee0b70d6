"""The runtime: drafter and MTP models and configs, rewindable caches, candidate generator, generate() integration.

This folder is also the Hub remote code: `save_pretrained` copies a drafter's modeling file and everything it
imports from here (relative imports only, nothing outside torch and transformers), so a saved drafter runs in a
process that has never installed hf-hyperdflash. Keep it flat (remote code has no subpackages) and self-contained.
"""

from .configuration_deepseek_v4_mtp import DeepseekV4MTPConfig
from .configuration_hyperdflash import HyperDFlashConfig
from .modeling_deepseek_v4_mtp import DeepseekV4MTPForDrafting
from .modeling_hyperdflash import HyperDFlashForDrafting

__all__ = ["DeepseekV4MTPConfig", "DeepseekV4MTPForDrafting", "HyperDFlashConfig", "HyperDFlashForDrafting"]
