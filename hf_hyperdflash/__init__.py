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
import importlib.abc
import importlib.util
import sys

__version__ = "0.2.0"

_RUNTIME_NAMES = {  # public name -> the module that defines it
    "DeepseekV4DSparkConfig": ".modeling.configuration_deepseek_v4_dspark",
    "DeepseekV4DSparkForDrafting": ".modeling.drafting",
    "DeepseekV4MTPConfig": ".modeling.configuration_deepseek_v4_mtp",
    "DeepseekV4MTPForDrafting": ".modeling.drafting",
    "GenerationStats": ".modeling.generation_stats",
    "HyperDFlashConfig": ".modeling.configuration_hyperdflash",
    "HyperDFlashForDrafting": ".modeling.drafting",
}


@functools.cache
def _load_runtime() -> None:
    """Install the generate() integration; register the drafters' configs with the Auto classes."""
    from transformers import AutoConfig, AutoModel, GenerationMixin

    stock = getattr(GenerationMixin.generate, "_hyperdflash_stock_generate", None)
    if stock is not None:  # `_load_runtime_on_first_generate` stood in until now
        GenerationMixin.generate = stock

    from .modeling.configuration_deepseek_v4_dspark import DeepseekV4DSparkConfig
    from .modeling.configuration_deepseek_v4_mtp import DeepseekV4MTPConfig
    from .modeling.configuration_hyperdflash import HyperDFlashConfig
    from .modeling.drafting import DeepseekV4DSparkForDrafting, DeepseekV4MTPForDrafting, HyperDFlashForDrafting
    from .modeling.integration import install_generate_integration
    from .pipeline_assistants import install_pipeline_assistant_loading

    install_generate_integration()
    install_pipeline_assistant_loading()

    AutoConfig.register(HyperDFlashConfig.model_type, HyperDFlashConfig, exist_ok=True)
    AutoModel.register(HyperDFlashConfig, HyperDFlashForDrafting, exist_ok=True)
    AutoConfig.register(DeepseekV4MTPConfig.model_type, DeepseekV4MTPConfig, exist_ok=True)
    AutoModel.register(DeepseekV4MTPConfig, DeepseekV4MTPForDrafting, exist_ok=True)
    AutoConfig.register(DeepseekV4DSparkConfig.model_type, DeepseekV4DSparkConfig, exist_ok=True)
    AutoModel.register(DeepseekV4DSparkConfig, DeepseekV4DSparkForDrafting, exist_ok=True)


def __getattr__(name: str):
    if name not in _RUNTIME_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load_runtime()
    value = getattr(importlib.import_module(_RUNTIME_NAMES[name], __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_RUNTIME_NAMES})


def _load_runtime_on_first_generate() -> None:
    """Until the runtime loads, the first `generate()` call loads it, then runs through it."""
    from transformers import GenerationMixin

    stock = GenerationMixin.generate

    @functools.wraps(stock)
    def generate(self, *args, **kwargs):
        _load_runtime()
        return GenerationMixin.generate(self, *args, **kwargs)

    generate._hyperdflash_stock_generate = stock  # what `_load_runtime` puts back before wrapping
    GenerationMixin.generate = generate


class _RuntimeAfterTransformers(importlib.abc.MetaPathFinder):
    """`import hf_hyperdflash` placed before transformers' import still takes over generate(): once transformers is
    imported, its first `generate()` loads the runtime (loading it during that import could meet a runtime module
    half imported; the command line's parser imports neither)."""

    def find_spec(self, name: str, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_hook(module) -> None:
            exec_module(module)
            _load_runtime_on_first_generate()

        spec.loader.exec_module = exec_then_hook
        return spec


if "transformers" in sys.modules:  # a process that already works with models: take over generate() now
    _load_runtime()
else:
    sys.meta_path.insert(0, _RuntimeAfterTransformers())


__all__ = [
    "DeepseekV4MTPConfig",
    "DeepseekV4MTPForDrafting",
    "GenerationStats",
    "HyperDFlashConfig",
    "HyperDFlashForDrafting",
]
