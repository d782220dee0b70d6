"""The drafter classes, ready for `target.generate(..., assistant_model=drafter)`.

Loading a drafter class from here installs the generate() integration: a saved drafter's `auto_map` names its
class through this module (`remote_code.py`), and the library imports it (`hf_hyperdflash.modeling`).
"""

from .integration import install_generate_integration
from .modeling_deepseek_v4_dspark import DeepseekV4DSparkForDrafting
from .modeling_deepseek_v4_mtp import DeepseekV4MTPForDrafting
from .modeling_hyperdflash import HyperDFlashForDrafting

install_generate_integration()

__all__ = ["DeepseekV4DSparkForDrafting", "DeepseekV4MTPForDrafting", "HyperDFlashForDrafting"]
