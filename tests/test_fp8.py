"""Drafting against FP8 weights laid out as transformers' fine-grained FP8 quantizer leaves them, on CPU.

transformers refuses to quantize without a GPU (`FineGrainedFP8Config` raises "No GPU or XPU found"), and its
`FP8Linear` multiplies through a Triton kernel. So the modules here are transformers' own `FP8Linear` (one-byte
`float8_e4m3fn` weight, per-block `weight_scale_inv`) with only that kernel replaced by the matmul it computes: the
dequantized weight times activations in the model's dtype. Like the kernel, it takes activations, never FP8 input.
fp32 activations keep verify forwards exact (bf16 can part at near-ties), so greedy outputs must be identical.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.finegrained_fp8 import FP8Linear

import hf_hyperdflash  # noqa: F401  (installs the generate() integration)
from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.modeling.draft_options import CONSTANT_SCHEDULE
from hf_hyperdflash.testing import tiny_deepseek_v4

BLOCK = (16, 16)  # DeepSeek's checkpoints use 128 x 128; the tiny target's matrices are 16 to 512 wide
# What the quantizer leaves unconverted on V4: the LM head (by default) and the compressor and indexer projections
# (DeepseekV4PreTrainedModel._keep_in_fp32_modules, shipped in bf16 by DeepSeek).
DEFAULT_SKIP = r"^lm_head$|\.compressor\.(kv_proj|gate_proj|indexer\.)"


class FP8LinearOnCPU(FP8Linear):
    """transformers' FP8Linear with its kernel replaced by the dequantized matmul, which runs on CPU."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.element_size() == 1:
            raise TypeError(f"FP8Linear takes activations (bf16 / fp32), got {input.dtype} input")
        rows, columns = self.weight.shape
        scale = self.weight_scale_inv.repeat_interleave(self.block_size[0], 0).repeat_interleave(self.block_size[1], 1)
        return F.linear(input, self.weight.to(input.dtype) * scale[:rows, :columns].to(input.dtype), self.bias)


def fp8(linear: nn.Linear) -> FP8LinearOnCPU:
    """`linear` quantized per block to float8_e4m3fn, each block scaled so its largest entry maps to 448."""
    rows, columns = linear.weight.shape
    module = FP8LinearOnCPU(columns, rows, block_size=BLOCK, has_bias=linear.bias is not None)
    blocks = F.pad(linear.weight.detach().abs(), (0, -columns % BLOCK[1], 0, -rows % BLOCK[0]))
    blocks = blocks.unflatten(0, (-1, BLOCK[0])).unflatten(2, (-1, BLOCK[1]))
    scale = blocks.amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:rows, :columns]
    module.weight = nn.Parameter((linear.weight.detach() / full).to(torch.float8_e4m3fn), requires_grad=False)
    module.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
    if linear.bias is not None:
        module.bias = nn.Parameter(linear.bias.detach().clone())
    return module


def quantize(model: nn.Module, skip: str = DEFAULT_SKIP) -> nn.Module:
    """Every plain `nn.Linear` of `model` whose name `skip` does not match, as FP8 (the quantizer's selection)."""
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear and not re.search(skip, name)]
    for name in names:
        model.set_submodule(name, fp8(model.get_submodule(name)))
    return model


def _prompt(length: int, seed: int) -> torch.LongTensor:
    return torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(seed))


def assert_lossless(target: nn.Module, drafter: nn.Module) -> None:
    """Greedy speculative output equals plain decoding's, every step drafting (so the FP8 path runs each time)."""
    drafter.generation_config.num_assistant_tokens_schedule = CONSTANT_SCHEDULE
    for length in (11, 37):  # inside and beyond the sliding window and several compression windows
        prompt = _prompt(length, seed=length)
        plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
        speculative = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=drafter)
        assert torch.equal(speculative, plain), f"diverged for a prompt of {length} tokens"


@pytest.fixture(scope="module")
def fp8_target():
    return quantize(tiny_deepseek_v4(seed=0))


def test_quantized_layout(fp8_target):
    """The attention and shared-expert projections are FP8; the head and the compressor projections are not."""
    converted = {name for name, module in fp8_target.named_modules() if isinstance(module, FP8LinearOnCPU)}
    assert (
        "model.layers.0.self_attn.q_a_proj" in converted and "model.layers.0.mlp.shared_experts.down_proj" in converted
    )
    assert "lm_head" not in converted and not any(".compressor." in name for name in converted)
    assert fp8_target.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    prompt = _prompt(11, seed=0)
    with torch.no_grad():
        assert not torch.equal(fp8_target(prompt).logits, tiny_deepseek_v4(seed=0)(prompt).logits)  # FP8 rounding


@pytest.mark.parametrize("kind", ["hyperdflash", "vanilla_dflash", "mtp"])
def test_drafting_on_an_fp8_target_is_lossless(fp8_target, kind):
    """The default FP8 layout: drafters in the activations' dtype, the captured residual and the gate's start from
    the target's collapse head as in a plain target."""
    torch.manual_seed(1)
    drafters = {
        "hyperdflash": lambda: HyperDFlashForDrafting.from_target(fp8_target, block_size=8),
        "vanilla_dflash": lambda: HyperDFlashForDrafting.from_target(
            fp8_target, block_size=8, reducer="dense", conditioning="intermediate"
        ),
        "mtp": lambda: DeepseekV4MTPForDrafting.from_target(fp8_target),
    }
    drafter = drafters[kind]().eval()
    assert_lossless(fp8_target, drafter)
    assert drafter.last_generation_stats.mean_accepted_length >= 1.0


def test_fp8_mtp_projections(fp8_target):
    """DeepSeek's FP8 checkpoints quantize the MTP block too; its projections must still get activations."""
    torch.manual_seed(1)
    drafter = quantize(DeepseekV4MTPForDrafting.from_target(fp8_target), skip=r"\.compressor\.").eval()
    assert drafter.e_proj.weight.dtype == torch.float8_e4m3fn
    assert_lossless(fp8_target, drafter)


def test_fp8_lm_head():
    """With `modules_to_not_convert=[]` the quantizer converts the LM head as well; drafting must still feed it
    activations."""
    target = quantize(tiny_deepseek_v4(seed=0), skip=r"\.compressor\.(kv_proj|gate_proj|indexer\.)")
    assert target.lm_head.weight.dtype == torch.float8_e4m3fn
    torch.manual_seed(1)
    assert_lossless(target, HyperDFlashForDrafting.from_target(target, block_size=8).eval())
