"""Reducer sizes at each supported family's flagship dimensions (transformers' default config of each), counted on
the meta device: HyperDFlash's inherited gate (the family's own collapse form) against vanilla DFlash's dense
projection of all streams, with the target's own collapse module for reference.

python benchmarks/param_counts.py
"""

import torch
from transformers import DeepseekV4Config, Glm5NextConfig, HYV4Config, Qwen4ExpTextConfig

from hf_hyperdflash import HyperDFlashForDrafting
from hf_hyperdflash.modeling.modeling_hyperdflash import drafter_config_for

FLAGSHIPS = {  # family -> (model, text config of its default flagship)
    "DeepSeek-V4": ("V4-Flash", DeepseekV4Config()),
    "HY-V4": ("HY-V4", HYV4Config()),
    "GLM-5-Next": ("GLM-5-Next", Glm5NextConfig().text_config),
    "Qwen4-Exp": ("Qwen4-Exp", Qwen4ExpTextConfig()),
}


def reducer_parameters(target_config, reducer: str) -> int:
    config = drafter_config_for(target_config, reducer=reducer)
    with torch.device("meta"):
        drafter = HyperDFlashForDrafting(config)
    return sum(p.numel() for p in drafter.reducer.parameters())


if __name__ == "__main__":
    print("reducer parameters (pre-collapse conditioning) at flagship dimensions:")
    print(f"  {'family':<12} {'streams x hidden':>16} {'inherited gate':>15} {'dense (DFlash)':>15} {'ratio':>7}")
    for family, (_, config) in FLAGSHIPS.items():
        streams = getattr(config, "hc_mult", None) or config.hc_count
        gate = reducer_parameters(config, "inherited_gate")
        dense = reducer_parameters(config, "dense")
        shape = f"{streams} x {config.hidden_size}"
        print(f"  {family:<12} {shape:>16} {gate:>15,} {dense:>15,} {dense / gate:>6,.0f}x")
