"""Tiny DeepSeek-V4 checkpoints in DeepSeek's own release layout, for tests of the checkpoint drafters.

A release is what `from_target_checkpoint` reads: `config.json` with the release's `quantization_config` (FP8 E4M3,
E8M0 scales over 128 x 128 blocks) and top-level `expert_dtype: "fp4"`, safetensors shards with a
`model.safetensors.index.json`, and DeepSeek's original key names (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.ffn.experts.E.w1.weight`, `hc_head_fn`, ...). The target's tensors come from transformers' own
`save_pretrained`, which writes that original format; the drafter the release ships sits under `mtp.*`:

- native MTP (`mtp.0.*`): one V4 block (window attention, top-k MoE) plus `e_proj`, `h_proj`, `enorm`, `hnorm`,
  `norm` and `hc_head_{fn,base,scale}`;
- DSpark (`mtp.{0,1,2}.*`, the "0731" release): three V4 blocks, `mtp.0.main_proj` / `main_norm`, and on the last
  stage `norm`, `hc_head_*`, `markov_head.markov_w{1,2}` and `confidence_head.proj`; `dspark_*` config fields.

Dtypes as released: attention, shared-expert and projection linears FP8 E4M3 with E8M0 scales per 128 x 128 block
(a tensor smaller than a block has one scale), routed experts MXFP4 (two E2M1 values per int8 byte, the first in the
low nibble, one E8M0 scale per 32 inputs), norms and the rest BF16, hyper-connection parameters and attention sinks
F32. Layouts follow the public loaders: vLLM's `vllm/model_executor/models/deepseek_v4_mtp.py` and
`vllm/models/deepseek_v4/nvidia/dspark.py`, and transformers' `conversion_mapping.py` ("deepseek_v4").
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

FP8_BLOCK = 128
FP4_GROUP = 32
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1 codes 0-7; bit 3 is the sign
# Linears the release stores in FP8 (the ones transformers' FP8 integration replaces), by original name
FP8_LINEAR = re.compile(
    r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.(compressor|indexer)\.\w+|shared_experts\.w\d|_proj)\.weight$"
)
ROUTED_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w\d\.weight$")
# A drafter config's own fields, dropped to describe its blocks as a V4 target's layers
DRAFTER_CONFIG_FIELDS = ("model_type", "architectures", "auto_map", "target_name_or_path", "target_fingerprint")
# Top-level names as DeepSeek ships them (transformers' reverse mapping leaves these as its own)
TOP_LEVEL_NAMES = {
    "embed_tokens.weight": "embed.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


def _power_of_two_scale(amax: torch.Tensor, largest: float) -> torch.Tensor:
    """E8M0 scales: the smallest power of two that brings `amax` within `largest`."""
    return torch.pow(2.0, torch.ceil(torch.log2((amax / largest).clamp(min=2.0**-126))))


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` -> E4M3 weight and E8M0 scales `[ceil(out/128), ceil(in/128)]` (weight = value * scale)."""
    rows, cols = weight.shape
    grid = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    padded = torch.zeros(grid[0] * FP8_BLOCK, grid[1] * FP8_BLOCK)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], FP8_BLOCK, grid[1], FP8_BLOCK)
    scale = _power_of_two_scale(blocks.abs().amax(dim=(1, 3)), FP8_MAX)
    values = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    return values.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` -> packed MXFP4 int8 `[out, in/2]` and E8M0 scales `[out, in/32]` (round to nearest E2M1)."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // FP4_GROUP, FP4_GROUP)
    scale = _power_of_two_scale(groups.abs().amax(dim=-1), float(FP4_VALUES[-1]))
    scaled = (groups / scale[..., None]).view(rows, cols)
    codes = (scaled.abs()[..., None] - FP4_VALUES).abs().argmin(dim=-1) | ((scaled < 0).long() << 3)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.to(torch.uint8).view(torch.int8), scale.to(torch.float8_e8m0fnu)


def as_released(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original-named tensors in the release's dtypes: FP8 linears and MXFP4 experts with `.scale` beside them,
    hyper-connection parameters and sinks F32, the rest BF16."""
    released = {}
    for name, tensor in tensors.items():
        stem = name.removesuffix(".weight")
        if ROUTED_EXPERT.search(name):
            released[name], released[f"{stem}.scale"] = quantize_fp4(tensor)
        elif FP8_LINEAR.search(name) and tensor.dim() == 2:
            released[name], released[f"{stem}.scale"] = quantize_fp8(tensor)
        elif re.search(r"(hc_\w+_(fn|base|scale)|attn_sink|\.gate\.bias|tid2eid)$", name):
            released[name] = (
                tensor if tensor.dtype == torch.int64 or not tensor.is_floating_point() else tensor.float()
            )
        else:
            released[name] = tensor.to(torch.bfloat16)
    return released


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s tensors under DeepSeek's names: transformers' `save_pretrained` writes them (its conversion mapping
    reversed), with the top-level names and the `model.` prefix put back as DeepSeek ships them."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tensors = {}
        for shard in sorted(Path(folder).glob("*.safetensors")):
            tensors.update(load_file(shard))
    named = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm.")  # DeepSeek's `Attention.kv_norm`
        named[TOP_LEVEL_NAMES.get(name, name)] = tensor
    return named


def write_release(
    target: DeepseekV4ForCausalLM,
    folder: str | Path,
    drafter_tensors: dict[str, torch.Tensor],
    extra_config: dict | None = None,
    num_shards: int = 3,
) -> Path:
    """Write `target` and `drafter_tensors` (original `mtp.*` names, full precision) as a release: quantized,
    sharded, with the index and the config. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = as_released(original_state_dict(target) | drafter_tensors)
    names = sorted(tensors)
    shards = [names[i::num_shards] for i in range(num_shards)]
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{num_shards:05d}.safetensors"
        save_file({name: tensors[name].contiguous() for name in shard}, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = target.config.to_dict() | {"quantization_config": QUANTIZATION_CONFIG, "expert_dtype": "fp4"}
    (folder / "config.json").write_text(json.dumps(config | (extra_config or {}), indent=1))
    return folder


def blocks_by_original_name(blocks: list[torch.nn.Module], config: DeepseekV4Config) -> dict[str, torch.Tensor]:
    """Decoder blocks' tensors under DeepSeek's names, `layers.i.*` for block i: transformers' reverse mapping run
    on a V4 model that holds them as its layers (window attention, top-k MoE, as the drafters' blocks are)."""
    settings = {name: value for name, value in config.to_dict().items() if name not in DRAFTER_CONFIG_FIELDS}
    settings["num_hidden_layers"] = len(blocks)
    settings |= {"layer_types": ["sliding_attention"] * len(blocks), "mlp_layer_types": ["moe"] * len(blocks)}
    carrier = DeepseekV4ForCausalLM(DeepseekV4Config(**settings))
    for layer, block in zip(carrier.model.layers, blocks, strict=True):
        layer.load_state_dict(block.state_dict())
    return {name: tensor for name, tensor in original_state_dict(carrier).items() if name.startswith("layers.")}


def mtp_tensors(drafter) -> dict[str, torch.Tensor]:
    """A `DeepseekV4MTPForDrafting`'s weights as a release's `mtp.0.*` tensors."""
    block = blocks_by_original_name([drafter.block], drafter.config)
    tensors = {name.replace("layers.0.", "mtp.0.", 1): tensor for name, tensor in block.items()}
    for name in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
        tensors[f"mtp.0.{name}.weight"] = getattr(drafter, name).weight.detach()
    for part in ("fn", "base", "scale"):
        tensors[f"mtp.0.hc_head_{part}"] = getattr(drafter.hc_head, f"hc_{part}").detach()
    return tensors


def dspark_tensors(drafter) -> dict[str, torch.Tensor]:
    """A `DeepseekV4DSparkForDrafting`'s weights as a release's `mtp.{0,1,2}.*` tensors, and its config fields."""
    stages = blocks_by_original_name(list(drafter.layers), drafter.config)
    tensors = {re.sub(r"^layers\.(\d+)\.", r"mtp.\1.", name): tensor for name, tensor in stages.items()}
    last = f"mtp.{len(drafter.layers) - 1}"
    tensors["mtp.0.main_proj.weight"] = drafter.main_proj.weight.detach()
    tensors["mtp.0.main_norm.weight"] = drafter.main_norm.weight.detach()
    tensors[f"{last}.norm.weight"] = drafter.norm.weight.detach()
    for part in ("fn", "base", "scale"):
        tensors[f"{last}.hc_head_{part}"] = getattr(drafter.hc_head, f"hc_{part}").detach()
    tensors[f"{last}.markov_head.markov_w1.weight"] = drafter.markov_w1.weight.detach()
    tensors[f"{last}.markov_head.markov_w2.weight"] = drafter.markov_w2.weight.detach()
    tensors[f"{last}.confidence_head.proj.weight"] = drafter.confidence_head.weight.detach()
    return tensors


def dspark_config_fields(drafter) -> dict:
    """The `dspark_*` fields a release's config.json carries."""
    config = drafter.config
    fields = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")
    return {name: getattr(config, name) for name in fields}
