"""Loading a target and its tokenizer for training and evaluation, with one-line errors for wrong paths."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    BitsAndBytesConfig,
    PreTrainedModel,
)

from .modeling.strict_loading import DRAFTER_MODEL_TYPES, local_folder
from .modeling.targets import get_target_adapter
from .training.options import QUANTIZATIONS  # the --target-quantization choices, readable by --help without torch


def import_bitsandbytes(feature: str):
    """bitsandbytes, or a ValueError naming `feature` and the fix (it is an optional extra and needs CUDA)."""
    try:
        import bitsandbytes
    except (ImportError, RuntimeError, OSError) as error:
        raise ValueError(
            f"{feature} needs bitsandbytes, which is not usable here ({error}). Install the extra with "
            "`pip install 'hf-hyperdflash[quantization]'` on a CUDA machine, or drop the option."
        ) from error
    if not torch.cuda.is_available():
        raise ValueError(f"{feature} needs bitsandbytes on a CUDA GPU, and no GPU is visible; drop the option.")
    return bitsandbytes


def check_tokenizer_path(path: str | os.PathLike) -> None:
    """A one-line ValueError for a local tokenizer path that does not exist; Hub ids pass."""
    local_folder(path, "tokenizer")


def check_target_path(path: str | os.PathLike) -> None:
    """A one-line ValueError for a local path that holds no target model (missing, no config.json, or a drafter's
    folder); Hub ids pass. Unsupported model families are refused once loaded (get_target_adapter)."""
    folder = local_folder(path, "target")
    if folder is None:
        return
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"{path} holds no model (no config.json); pass the folder of a saved mHC target, or a Hub id."
        )
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return  # transformers reports an unreadable config
    if model_type in DRAFTER_MODEL_TYPES:
        raise ValueError(f"{path} holds a drafter ({model_type!r}), not a target; pass the target model's folder.")


def load_target(
    path: str | Path,
    device: torch.device | str,
    dtype: str = "auto",
    quantization: str = "none",
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    offload_folder: str | Path | None = None,
) -> PreTrainedModel:
    """The frozen target in eval mode, optionally quantized to 8 or 4 bits (bitsandbytes).

    Without `device_map` it goes whole onto `device`. With one ("auto", "balanced", or a module -> device dict),
    accelerate spreads it over the devices this process sees, within `max_memory`, offloading what does not fit
    to CPU or to `offload_folder` on disk; the drafter trains next to the captured residual either way.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"`quantization` must be one of {QUANTIZATIONS}, got {quantization!r}.")
    if device_map is None and (max_memory is not None or offload_folder is not None):
        raise ValueError("`max_memory` and `offload_folder` only apply with a `device_map` (e.g. 'auto').")
    kwargs: dict = {}
    if device_map is not None:
        if max_memory is not None:  # GPU indices written as strings in JSON ("0") are integers to accelerate
            max_memory = {
                int(device) if str(device).isdigit() else device: size for device, size in max_memory.items()
            }
        kwargs = {"device_map": device_map, "max_memory": max_memory, "offload_folder": offload_folder}
    if quantization != "none":
        import_bitsandbytes(f"A {quantization} target (target_quantization='{quantization}')")
        bits = {"load_in_8bit": True} if quantization == "8bit" else {"load_in_4bit": True}
        kwargs = {"device_map": {"": device}} | kwargs | {"quantization_config": BitsAndBytesConfig(**bits)}
    check_target_path(path)
    target = target_auto_class(path).from_pretrained(path, dtype=dtype, **kwargs)
    get_target_adapter(target)  # a clear error for unsupported families
    if "device_map" not in kwargs:
        target.to(device)
    return target.eval().requires_grad_(False)


def target_auto_class(path: str | Path) -> type:
    """The Auto class that builds the target's generating model: a causal LM, or (GLM-5-Next) the image-text-to-text
    model whose text half is the mHC language model."""
    config = AutoConfig.from_pretrained(path)
    return AutoModelForCausalLM if type(config) in AutoModelForCausalLM._model_mapping else AutoModelForImageTextToText
