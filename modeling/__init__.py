"""The runtime: drafter and MTP models and configs, rewindable caches, target adapters, candidate generator, draft
schedule and the generate() integration.

This folder is also the Hub remote code: a saved drafter gets `drafting.py` and every module it imports from here
(relative imports only, nothing outside torch and transformers), so it runs in a process that has never installed
hf-hyperdflash. Keep it flat (remote code has no subpackages). Layering runs one way: configs <- models <-
generation, with `drafting.py` on top; this package imports a module only when one of its names is asked for, so
importing a config loads no model, cache or target family.
"""

import importlib

_PUBLIC_NAMES = {  # name -> the module that defines it; the drafters come through `drafting` (integration installed)
    "DeepseekV4DSparkConfig": ".configuration_deepseek_v4_dspark",
    "DeepseekV4DSparkForDrafting": ".drafting",
    "DeepseekV4MTPConfig": ".configuration_deepseek_v4_mtp",
    "DeepseekV4MTPForDrafting": ".drafting",
    "HyperDFlashConfig": ".configuration_hyperdflash",
    "HyperDFlashForDrafting": ".drafting",
}


def __getattr__(name: str):
    if name not in _PUBLIC_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC_NAMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC_NAMES})


__all__ = sorted(_PUBLIC_NAMES)
