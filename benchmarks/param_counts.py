"""Reducer sizes at DeepSeek-V4-Flash dimensions (hc_mult 4, hidden 4096), counted on the meta device.

python benchmarks/param_counts.py
"""

import torch

from hf_hyperdflash import HyperDFlashConfig, HyperDFlashForDrafting


def reducer_parameters(**settings) -> int:
    config = HyperDFlashConfig(hidden_size=4096, hc_mult=4, vocab_size=129280, **settings)
    with torch.device("meta"):
        drafter = HyperDFlashForDrafting(config)
    return sum(p.numel() for p in drafter.reducer.parameters())


if __name__ == "__main__":
    gate = reducer_parameters(reducer="inherited_gate")
    dense = reducer_parameters(reducer="dense")
    print("reducer parameters at V4-Flash dimensions (hc_mult 4, hidden 4096), pre-collapse conditioning:")
    print(f"  inherited_gate (HyperDFlash):    {gate:>12,}")
    print(f"  dense 16384 -> 4096 (DFlash):    {dense:>12,}")
    print(f"  ratio: {dense / gate:,.0f}x")
