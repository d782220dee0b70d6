"""Lets transformers' pipelines take one of our drafters by name: `pipeline(..., assistant_model="<folder or id>")`.

transformers' `pipelines.base.load_assistant_model` loads a string assistant with the class its config's
`architectures` names in the transformers namespace, then a tokenizer from the same folder. A drafter has neither (its
class is registered with `AutoModel`; it uses the target's tokenizer), so the pipeline failed with "Pipeline cannot
infer suitable model classes". Installed once per process when the library is imported.
"""

import functools
import os

import transformers.pipelines.base as pipeline_base
from transformers import AutoModel, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from .modeling.draft_options import DRAFTER_TYPES

_INSTALLED = "_loads_hyperdflash_drafters"


def _names_a_drafter(assistant_model: object) -> bool:
    if not isinstance(assistant_model, (str, os.PathLike)):
        return False
    config, _ = PreTrainedConfig.get_config_dict(assistant_model)
    return config.get("model_type") in DRAFTER_TYPES


def install_pipeline_assistant_loading() -> None:
    """Wrap `load_assistant_model` so a string naming a drafter loads it through `AutoModel`, in the target's dtype
    and on its device (what transformers does for a string); every other assistant goes to transformers as before."""
    original = pipeline_base.load_assistant_model
    if getattr(original, _INSTALLED, False):
        return

    @functools.wraps(original)
    def load_assistant_model(
        model: PreTrainedModel,
        assistant_model: str | os.PathLike | PreTrainedModel | None,
        assistant_tokenizer: PreTrainedTokenizerBase | None,
    ) -> tuple[PreTrainedModel | None, PreTrainedTokenizerBase | None]:
        if _names_a_drafter(assistant_model):
            assistant_model = AutoModel.from_pretrained(assistant_model, dtype=model.dtype).to(model.device)
        return original(model, assistant_model, assistant_tokenizer)

    setattr(load_assistant_model, _INSTALLED, True)
    pipeline_base.load_assistant_model = load_assistant_model
