"""The drafter a DeepSeek-V4 release ships, read from the target's own checkpoint.

transformers loads a V4 target from DeepSeek's release and drops every `mtp.*` tensor. This module reads only those:
the release's `config.json` and shard index say which shards hold them, `safe_open` slices them lazily, and
transformers' own loader (`convert_and_load_state_dict_in_model`) applies the renaming it applies to the target
(`conversion_mapping.py`, "deepseek_v4") followed by the drafter's own, and its fine-grained FP8 quantizer keeps FP8
linears and MXFP4 experts quantized, or dequantizes them where its kernels cannot run (no CUDA device of compute
capability 8.9 or more), as `from_pretrained` does for the target. Key layouts: `deepseek_checkpoint.py`.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import DeepseekV4Config, PreTrainedModel
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming, convert_and_load_state_dict_in_model
from transformers.initialization import no_init_weights
from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear
from transformers.modeling_utils import LoadStateDictConfig
from transformers.quantizers import AutoQuantizationConfig
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers.utils import cached_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class Release:
    """A V4 release as far as its drafter goes: the raw config, and where each tensor lives."""

    name_or_path: str
    config: dict
    weight_map: dict[str, str]  # tensor name -> shard file name
    hub_options: dict

    @classmethod
    def open(cls, name_or_path: str | os.PathLike, **hub_options) -> Release:
        """A local release folder, or a Hub repo id (the config, the index and, later, the shards it needs)."""
        name = str(name_or_path)
        config = json.loads(Path(cached_file(name, "config.json", **hub_options)).read_text())
        index = cached_file(name, INDEX_FILE, _raise_exceptions_for_missing_entries=False, **hub_options)
        if index is not None:
            weight_map = json.loads(Path(index).read_text())["weight_map"]
        else:
            with safe_open(cached_file(name, SINGLE_FILE, **hub_options), "pt") as file:
                weight_map = dict.fromkeys(file.keys(), SINGLE_FILE)
        return cls(name, config, weight_map, hub_options)

    def drafter_tensor_names(self) -> list[str]:
        return sorted(name for name in self.weight_map if name.startswith("mtp."))

    def check_is_v4(self) -> None:
        """DeepSeek-V4 alone: V4.1 changes the hyper-connections (a delayed pre-mix and no collapse head) and has
        no transformers class in the supported versions."""
        model_type = self.config.get("model_type")
        if model_type != "deepseek_v4" or "text_config" in self.config:
            raise ValueError(
                f"{self.name_or_path} is a {model_type!r} checkpoint, not DeepSeek-V4: the checkpoint drafters read "
                "DeepSeek-V4 releases (DeepSeek-V4.1's drafter mixes its streams differently and transformers has no "
                "V4.1 class yet)."
            )

    def target_config(self) -> DeepseekV4Config:
        return DeepseekV4Config.from_dict(self.config)

    def lazy_tensors(self, names: list[str], files: ExitStack) -> dict:
        """Lazy slices of `names` (read when loaded); their shards stay open until `files` closes."""
        opened, tensors = {}, {}
        for name in names:
            shard = self.weight_map[name]
            if shard not in opened:
                path = cached_file(self.name_or_path, shard, **self.hub_options)
                opened[shard] = files.enter_context(safe_open(path, "pt"))
            tensors[name] = opened[shard].get_slice(name)
        return tensors


MTP_TENSOR, DSPARK_TENSOR = "mtp.0.e_proj.weight", "mtp.0.main_proj.weight"
# The tensor that tells which drafter a release ships -> (what it is, the class that reads it)
SHIPPED_DRAFTERS = {
    MTP_TENSOR: ("DeepSeek-V4's native MTP block", "DeepseekV4MTPForDrafting"),
    DSPARK_TENSOR: ("DSpark", "DeepseekV4DSparkForDrafting"),
}


def open_release(name_or_path: str | os.PathLike, marker: str, **hub_options) -> Release:
    """`name_or_path` as a DeepSeek-V4 release shipping the drafter whose tensor `marker` is (`SHIPPED_DRAFTERS`);
    a one-line ValueError saying what it ships otherwise."""
    release = Release.open(name_or_path, **hub_options)
    release.check_is_v4()
    names = release.drafter_tensor_names()
    if marker not in names:
        shipped = next((tensor for tensor in SHIPPED_DRAFTERS if tensor in names), None)
        if shipped is None:
            ships, hint = "no drafter (no `mtp.*`)", ""
        else:
            what, loader = SHIPPED_DRAFTERS[shipped]
            ships, hint = f"{what} (`{shipped}`)", f" Load it with `{loader}.from_target_checkpoint`."
        raise ValueError(f"{name_or_path} ships {ships}, not {SHIPPED_DRAFTERS[marker][0]} (`{marker}`).{hint}")
    return release


def is_deepseek_v4_release(path: str | os.PathLike) -> bool:
    """`path` is a local DeepSeek-V4 checkpoint (a target's folder, which may ship a drafter), not a drafter's."""
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "deepseek_v4"


def drafter_from_release(
    drafter_class: type[PreTrainedModel],
    config,
    release: Release,
    drafter_renames: list[WeightRenaming],
    dequantize: bool | None,
    dtype: torch.dtype,
) -> PreTrainedModel:
    """A `drafter_class(config)` holding `release`'s `mtp.*` tensors, renamed by transformers' V4 rules and then
    `drafter_renames`. FP8 stays FP8 where transformers' kernels run it, unless `dequantize`; the rest is `dtype`
    (hyper-connection parameters, sinks and norms fp32, as transformers keeps V4's). Every parameter comes from the
    release: a missing or extra tensor is a `ValueError`."""
    with no_init_weights():  # every parameter is overwritten by the release's tensors
        drafter = drafter_class._from_config(config, dtype=dtype)
    mapping = get_checkpoint_conversion_mapping("deepseek_v4") + drafter_renames
    quantizer = None
    quantization = getattr(release.target_config(), "quantization_config", None)
    if quantization is not None:
        if isinstance(quantization, dict):
            quantization = AutoQuantizationConfig.from_dict(quantization)
        quantizer = FineGrainedFP8HfQuantizer(quantization, pre_quantized=True)
        if dequantize:
            quantizer.quantization_config.dequantize = True
        elif dequantize is None:
            quantizer.validate_environment()  # dequantizes without a device that runs FP8, as from_pretrained
        if not quantizer.quantization_config.dequantize:
            replace_with_fp8_linear(
                drafter,
                modules_to_not_convert=drafter._keep_in_fp32_modules,
                quantization_config=quantizer.quantization_config,
                pre_quantized=True,
            )
        mapping = quantizer.update_weight_conversions(mapping, drafter) + quantizer.get_weight_conversions()
    load_config = LoadStateDictConfig(
        weight_mapping=mapping, hf_quantizer=quantizer, dtype=dtype, dtype_plan=drafter._get_dtype_plan(dtype)
    )
    with ExitStack() as files:
        tensors = release.lazy_tensors(release.drafter_tensor_names(), files)
        info, _ = convert_and_load_state_dict_in_model(drafter, tensors, load_config)
    _check_loaded(info, release)
    _cast_as_planned(drafter, dtype)
    # `save_pretrained` would write the release's names back; the drafter saves under its own, as any drafter does
    drafter._weight_conversions = None
    if quantizer is not None:
        quantizer._process_model_after_weight_loading(drafter)
        if not quantizer.quantization_config.dequantize:
            drafter.config.quantization_config = quantizer.quantization_config
    return drafter.eval()


def _check_loaded(info, release: Release) -> None:
    """Every tensor of the drafter came from the release, and every one of the release's went somewhere."""
    problems = {
        "missing": sorted(info.missing_keys),
        "unexpected": sorted(info.unexpected_keys),
        "of another shape": sorted(info.mismatched_keys),
        "not converted": sorted(info.conversion_errors),
    }
    said = [
        f"{len(names)} {kind} ({', '.join(map(str, names[:3]))}{', ...' if len(names) > 3 else ''})"
        for kind, names in problems.items()
        if names
    ]
    if said:
        raise ValueError(
            f"{release.name_or_path}: the drafter's weights do not load: {'; '.join(said)}. A partial or altered "
            "checkpoint?"
        )


def _cast_as_planned(drafter: PreTrainedModel, dtype: torch.dtype) -> None:
    """Unquantized parameters in the dtype transformers plans for them (fp32 for the modules it keeps fp32 in V4,
    `dtype` for the rest); transformers 5.23 leaves them in the release's (BF16). Quantized weights and their scales
    stay as loaded."""
    plan = drafter._get_dtype_plan(dtype)
    for name, parameter in drafter.named_parameters():
        if parameter.element_size() == 1 or name.endswith("scale_inv"):
            continue
        wanted = next((planned for pattern, planned in plan.items() if re.search(pattern, name)), dtype)
        parameter.data = parameter.data.to(wanted)


class ReleaseLoadingMixin:
    """`from_target_checkpoint` for a V4 drafter class: `release_tensor` marks its drafter in a release, and
    `_release_config(release)` gives its config and the renames after transformers' V4 mapping (checking the release
    further where it needs to)."""

    release_tensor: str

    @classmethod
    def from_target_checkpoint(
        cls,
        name_or_path: str | os.PathLike,
        dequantize: bool | None = None,
        dtype: torch.dtype = torch.bfloat16,
        **hub_options,
    ) -> PreTrainedModel:
        """The drafter a DeepSeek-V4 release ships, read from the target's own checkpoint (a local folder or a Hub
        repo id; only its `mtp.*` tensors are read). FP8 and FP4 weights stay quantized where transformers' FP8
        kernels run (a CUDA device of compute capability 8.9 or more) unless `dequantize=True`; elsewhere they are
        dequantized to `dtype`. `hub_options` go to the Hub download (`revision`, `token`, ...)."""
        release = open_release(name_or_path, cls.release_tensor, **hub_options)
        config, renames = cls._release_config(release)
        config.target_name_or_path = str(name_or_path)
        return drafter_from_release(cls, config, release, renames, dequantize, dtype)
