"""Drafter checkpoints load completely or not at all.

transformers would otherwise warn and randomly initialise missing weights, which for a drafter
means silently useless drafts. Any missing, unexpected or mis-shaped weight, and any unreadable
file, becomes a ValueError that names the checkpoint and the fix.
"""

import json

from safetensors import SafetensorError

LOAD_PROBLEMS = ("missing_keys", "unexpected_keys", "mismatched_keys")


class StrictLoadingMixin:
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        return_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
            )
        except (OSError, SafetensorError, json.JSONDecodeError, RuntimeError) as error:
            raise ValueError(
                f"Could not load the {cls.__name__} checkpoint at {pretrained_model_name_or_path}: {error}. "
                "The checkpoint is corrupt or incomplete; save it again or re-download it."
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
        return (model, info) if return_info else model
