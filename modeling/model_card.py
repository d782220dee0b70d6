"""A model card (README.md with model-index front matter) written next to every saved drafter.

A drafter is only useful with its target, so the card says which target it was built for, how it drafts, what
it measured (when the saver knows), and the four lines that use it. `push_to_hub` uploads the saved folder as is,
so the card on the Hub is this one rather than transformers' generic template.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def _front_matter(fields: dict) -> str:
    """YAML front matter; JSON scalars and flow lists are valid YAML, so no YAML library is needed."""
    lines = ["---"]
    for key, value in fields.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            lines.append(f"{key}:")
            lines.extend(f"- {json.dumps(item)}" for item in value)
        elif value is not None:
            lines.append(f"{key}: {json.dumps(value)}")
    return "\n".join([*lines, "---", ""])


def drafter_description(config) -> dict[str, object]:
    """How the drafter drafts, as the rows of the card's table."""
    if config.model_type == "deepseek_v4_mtp":
        return {"kind": "native DeepSeek-V4 MTP module", "draft steps": "`num_assistant_tokens` (one block each)"}
    if config.model_type == "deepseek_v4_dspark":
        return {
            "kind": "DSpark (DeepSeek's V4 block drafter)",
            "block size": config.dspark_block_size,
            "stages": config.num_hidden_layers,
            "context": f"stream means of target layers {config.dspark_target_layer_ids}",
        }
    if config.conditioning == "pre_collapse":
        context = "final pre-collapse mHC residual"
    else:
        context = f"outputs of target layers {config.target_layer_ids}"
    return {
        "kind": "HyperDFlash" if config.reducer == "inherited_gate" else f"DFlash-style ({config.reducer} reducer)",
        "block size": config.block_size,
        "reducer": config.reducer,
        "conditioning": config.conditioning,
        "context": context,
        "context window": config.context_window or "whole context",
        "draft layers": config.num_hidden_layers,
    }


def model_card(config, repo_id: str, measured_tau: float | None = None) -> str:
    target = getattr(config, "target_name_or_path", None)
    target_type = getattr(config, "target_model_type", None) or "deepseek_v4"
    rows = {"target model type": target_type, "target": target or "not recorded", **drafter_description(config)}
    metrics = [] if measured_tau is None else [{"type": "mean_accepted_length", "name": "tau", "value": measured_tau}]
    front = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "base_model": target if target and HUB_ID.fullmatch(target) else None,
        "tags": ["speculative-decoding", "hyperdflash", target_type],
        "model-index": [
            {
                "name": repo_id,
                "results": [{"task": {"type": "text-generation", "name": "speculative decoding"}, "metrics": metrics}],
            }
        ],
    }
    table = "\n".join(["| | |", "|---|---|", *(f"| {key} | {value} |" for key, value in rows.items())])
    tau = "" if measured_tau is None else f"Measured tau (accepted length per verify step): {measured_tau:.2f}.\n\n"
    # GLM-5-Next's generating model is an image-text-to-text one, whose text half is the mHC language model
    auto_class = "AutoModelForImageTextToText" if target_type == "glm5_next_text" else "AutoModelForCausalLM"
    usage = f"""```python
from transformers import AutoModel, {auto_class}
target = {auto_class}.from_pretrained("{target or "TARGET"}", dtype="auto", device_map="auto")
drafter = AutoModel.from_pretrained("{repo_id}", trust_remote_code=True, dtype="auto")
out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)
```"""
    return (
        _front_matter(front)
        + f"\n# {repo_id}\n\nA speculative-decoding drafter for `generate()`: greedy output is token-identical to the "
        "target's own, sampling keeps the target's distribution. Its remote code carries the whole runtime, so "
        "nothing needs installing beyond torch and transformers.\n\n"
        + table
        + "\n\n"
        + tau
        + usage
        + "\n\n`drafter.last_generation_stats` then holds tau, acceptance per position and timings.\n"
    )


class ModelCardMixin:
    """`save_pretrained` also writes README.md; pushing uploads exactly the folder `save_pretrained` wrote."""

    measured_tau: float | None = None  # set by whoever measured it (e.g. `hyperdflash train`) to put it on the card

    def save_pretrained(self, save_directory: str | os.PathLike, *args, push_to_hub: bool = False, **kwargs):
        hub_options = {name: kwargs.pop(name) for name in HUB_OPTIONS if name in kwargs}
        repo_id = hub_options.pop("repo_id", None) or Path(save_directory).name
        result = super().save_pretrained(save_directory, *args, **kwargs)
        self.generation_config.save_pretrained(save_directory)  # draft length and schedule (transformers skips it)
        (Path(save_directory) / "README.md").write_text(model_card(self.config, repo_id, self.measured_tau))
        if push_to_hub:
            _upload(save_directory, repo_id, token=kwargs.get("token"), **hub_options)
        return result

    def push_to_hub(self, repo_id: str, *, token=None, **hub_options):
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, repo_id=repo_id)
            return _upload(folder, repo_id, token=token, **hub_options)


HUB_OPTIONS = ("repo_id", "commit_message", "private", "create_pr", "revision")


def _upload(folder, repo_id: str, token=None, private: bool | None = None, commit_message: str | None = None, **rest):
    from huggingface_hub import HfApi  # transformers' own dependency; only needed when pushing

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    return api.upload_folder(
        repo_id=repo_id, folder_path=folder, commit_message=commit_message or "Upload drafter", **rest
    )
