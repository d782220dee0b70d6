"""Drafter checkpoints load completely or not at all, and a wrong path says what is wrong with it.

transformers would otherwise warn and randomly initialise missing weights, which for a drafter means
silently useless drafts. Any missing, unexpected or mis-shaped weight, and any unreadable file, becomes a
ValueError that names the checkpoint and the fix; so does a path that holds no drafter.
"""

import json
import os
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import SafetensorError
from transformers import GenerationConfig

from .draft_options import DRAFTER_TYPES

LOAD_PROBLEMS = ("missing_keys", "unexpected_keys", "mismatched_keys")
HUB_LOADING_OPTIONS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
DRAFTER_MODEL_TYPES = DRAFTER_TYPES


def local_folder(path: str | os.PathLike, what: str) -> Path | None:
    """The folder `path` names, or None for a Hub id (transformers resolves and reports those); a one-line
    ValueError for a path that is neither (transformers would call it a malformed repo id, after a traceback)."""
    text = os.fspath(path)
    folder = Path(text).expanduser()
    if folder.exists():
        return folder
    try:
        validate_repo_id(text)
    except HFValidationError:
        raise ValueError(
            f"No {what} at {text}: the path does not exist. Check it, or pass a Hub id (org/name)."
        ) from None
    return None


def unreachable_hub_id(path: str | os.PathLike, error: Exception) -> ValueError:
    """The error for a name that is not a local folder and could not be fetched as a Hub id: not "corrupt"."""
    return ValueError(
        f"{os.fspath(path)} is not a local folder, and loading it as a Hub id failed ({error}). Check the path, or "
        "the Hub id and your connection."
    )


def check_drafter_path(path: str | os.PathLike) -> None:
    """Raise a one-line ValueError when `path` names a missing local path or a folder that holds no loadable drafter.

    Hub ids pass through untouched: transformers resolves and reports those.
    """
    text = os.fspath(path)
    folder = local_folder(path, "drafter")
    if folder is None:
        return
    if not folder.is_dir():
        raise ValueError(f"The drafter path {text} is a file; pass the folder that holds config.json and the weights.")
    config_file = folder / "config.json"
    if not config_file.exists():
        if (folder / "drafter" / "config.json").exists():
            raise ValueError(
                f"{text} is a `hyperdflash train` output directory; the drafter is its subfolder {folder / 'drafter'}."
            )
        raise ValueError(
            f"{text} holds no drafter (no config.json); pass a folder written by save_pretrained() or "
            "`hyperdflash train` (OUTPUT_DIR/drafter)."
        )
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"The drafter config {config_file} is not valid JSON ({error}); save it again.") from error
    if model_type not in DRAFTER_MODEL_TYPES:
        raise ValueError(
            f"{text} holds a {model_type!r} model, not a drafter (model_type one of {DRAFTER_MODEL_TYPES}); "
            "pass the drafter's folder, not the target's."
        )
    if not any((folder / name).exists() for name in WEIGHT_FILES):
        raise ValueError(
            f"{text} has a drafter config but no weights file ({WEIGHT_FILES[0]}): the save is incomplete; "
            "save the drafter again."
        )


class StrictLoadingMixin:
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        check_drafter_path(pretrained_model_name_or_path)
        return_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
            )
        except (OSError, SafetensorError, json.JSONDecodeError, RuntimeError) as error:
            if isinstance(error, OSError) and not Path(os.fspath(pretrained_model_name_or_path)).expanduser().exists():
                raise unreachable_hub_id(pretrained_model_name_or_path, error) from error
            raise ValueError(
                f"Could not load the {cls.__name__} checkpoint at {pretrained_model_name_or_path}: {error}. "
                "A file in it is corrupt or unreadable; save it again or re-download it."
            ) from error
        problems = {name: sorted(info[name]) for name in LOAD_PROBLEMS if info.get(name)}
        if problems:
            details = "; ".join(
                f"{name}: {keys[:5]}{' ...' if len(keys) > 5 else ''}" for name, keys in problems.items()
            )
            raise ValueError(
                f"The {cls.__name__} checkpoint at {pretrained_model_name_or_path} does not match its config "
                f"({details}). It is partial or belongs to another drafter; save it again with save_pretrained()."
            )
        _load_generation_config(model, pretrained_model_name_or_path, kwargs)
        return (model, info) if return_info else model


def _load_generation_config(model, name_or_path, loading_options: dict) -> None:
    """The saved draft settings (`generation_config.json`: draft length and schedule), which transformers reads only
    for models that generate; a folder without the file keeps the drafter's defaults."""
    options = {name: loading_options[name] for name in HUB_LOADING_OPTIONS if name in loading_options}
    try:
        model.generation_config = GenerationConfig.from_pretrained(name_or_path, **options)
    except OSError:
        pass
