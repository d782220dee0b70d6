"""HyperDFlash: block speculative decoding aligned with DeepSeek-V4's multi-stream mHC residual.

The runtime makes `target.generate(..., assistant_model=drafter)` run speculative decoding when `drafter` is a
HyperDFlash / vanilla-DFlash drafter or a native V4 MTP module (loading such a drafter through `trust_remote_code`
does the same without the library), and registers their configs with the Auto classes. It loads (with torch and
transformers) on first need: `import hf_hyperdflash` in a process that has imported transformers, the first use of
a name below (`from hf_hyperdflash import HyperDFlashForDrafting`), or `hf_hyperdflash.reference` (the shipped
drafters load through the Auto classes). The command line builds its parser without it, so `hyperdflash --help`
answers at once.
"""

import functools
import importlib
import sys

__version__ = "0.2.0"

_RUNTIME_NAMES = {  # public name -> the module that defines it
    "DeepseekV4MTPConfig": ".modeling.configuration_deepseek_v4_mtp",
    "DeepseekV4MTPForDrafting": ".modeling.drafting",
    "GenerationStats": ".modeling.generation_stats",
    "HyperDFlashConfig": ".modeling.configuration_hyperdflash",
    "HyperDFlashForDrafting": ".modeling.drafting",
    "reset_draft_schedule": ".modeling.draft_policy",
}


@functools.cache
def _load_runtime() -> None:
    """Install the generate() integration; register the drafters' configs with the Auto classes."""
    from transformers import AutoConfig, AutoModel

    from .modeling.configuration_deepseek_v4_mtp import DeepseekV4MTPConfig
    from .modeling.configuration_hyperdflash import HyperDFlashConfig
    from .modeling.drafting import DeepseekV4MTPForDrafting, HyperDFlashForDrafting
    from .modeling.integration import install_generate_integration
    from .pipeline_assistants import install_pipeline_assistant_loading

    install_generate_integration()
    install_pipeline_assistant_loading()

    AutoConfig.register(HyperDFlashConfig.model_type, HyperDFlashConfig, exist_ok=True)
    AutoModel.register(HyperDFlashConfig, HyperDFlashForDrafting, exist_ok=True)
    AutoConfig.register(DeepseekV4MTPConfig.model_type, DeepseekV4MTPConfig, exist_ok=True)
    AutoModel.register(DeepseekV4MTPConfig, DeepseekV4MTPForDrafting, exist_ok=True)


def __getattr__(name: str):
    if name not in _RUNTIME_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load_runtime()
    value = getattr(importlib.import_module(_RUNTIME_NAMES[name], __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_RUNTIME_NAMES})


if "transformers" in sys.modules:  # a process that already works with models: take over generate() now
    _load_runtime()


__all__ = [
    "DeepseekV4MTPConfig",
    "DeepseekV4MTPForDrafting",
    "GenerationStats",
    "HyperDFlashConfig",
    "HyperDFlashForDrafting",
    "reset_draft_schedule",
]
