"""`hyperdflash plan`: what a drafter for a given target costs, from the target's config alone.

Sizes come from models built on the meta device (no weights, no memory). Speed comes from timing, on this
machine's CPU at batch 1, one decoder layer of the target's width (a V4 block as the native MTP builds it, with
only the experts one token routes to, so it fits in memory) against one draft layer and the LM head:

    speedup ~ tau * t_step / (t_verify(k + 1) + t_draft)

with t_step = L * t_layer(1) + t_head(1), t_verify(k+1) = L * t_layer(k+1) + t_head(k+1) and
t_draft = n_draft * t_draft_layer + t_head(k). On a GPU a longer verify costs little more than one step, so
the CPU figure is a floor for what the same tau gives there.

Spread over processes by transformers' own plans (`docs/distributed.md`), a target weight that the model's tensor
parallel plan (`_tp_plan`: the family's `base_model_tp_plan`, the embedding and LM head) or expert parallel plan
(`_ep_plan`) names is split over the processes; every other weight, and the drafter, is whole on each.
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig, DeepseekV4Config, DeepseekV4ForCausalLM, PretrainedConfig

from .modeling import DeepseekV4MTPConfig, DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from .modeling.modeling_hyperdflash import drafter_config_for

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CONTEXTS = (8_192, 131_072, 1_048_576)


def load_target_config(path: str | None) -> PretrainedConfig:
    """A target `config.json` (file or folder); None: transformers' DeepseekV4Config defaults (V4-Flash)."""
    if path is None:
        return DeepseekV4Config()
    source = Path(path)
    if not source.exists():
        raise ValueError(f"No target config at {path}; pass a config.json or the folder that holds it.")
    return AutoConfig.from_pretrained(source.parent if source.is_file() else source)


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def sizes(target_config: PretrainedConfig, drafter_overrides: dict, dtype: str, batch: int, seq_len: int) -> dict:
    """Parameters and bytes of target and drafter, per-token KV and feature bytes, training memory per process."""
    width = BYTES[dtype]
    config = drafter_config_for(target_config, **drafter_overrides)
    with torch.device("meta"):
        drafter = HyperDFlashForDrafting(config)
        target_params = _count(DeepseekV4ForCausalLM(target_config))
    drafter_params, reducer_params = _count(drafter), _count(drafter.reducer)
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * width
    window = config.context_window
    features_per_token = config.num_conditioning_layers * config.hc_mult * config.hidden_size * width
    anchors = 16  # per sequence, as `hyperdflash train` samples by default
    draft_logits = batch * anchors * (config.block_size - 1) * config.vocab_size * 4  # fp32 for the losses
    training = {
        "target_weights": target_params * width,
        "drafter_weights_grads_adam_fp32": drafter_params * 16,
        "captured_features": batch * seq_len * features_per_token,
        "draft_logits_fp32": draft_logits,
    }
    training["total"] = sum(training.values())
    return {
        "target_parameters": target_params,
        "drafter": {
            "parameters": drafter_params,
            "reducer_parameters": reducer_params,
            "bytes": drafter_params * width,
            "block_size": config.block_size,
            "layers": config.num_hidden_layers,
            "context_window": window,
        },
        "drafter_kv_bytes_per_context_token": kv_per_token,
        "drafter_kv_bytes_at_context": {
            str(n): {"full": n * kv_per_token, "windowed": min(n, window or n) * kv_per_token} for n in CONTEXTS
        },
        "captured_feature_bytes_per_token": features_per_token,
        "training_bytes_per_process": {"batch": batch, "seq_len": seq_len, **training},
    }


def _planned(plan: dict[str, str]) -> re.Pattern:
    """Parameter names under any module a parallel plan names (`model.layers.*.mlp.experts`, `*` a layer index)."""
    modules = [re.escape(name).replace(r"\*", r"\d+") for name in plan]
    return re.compile(rf"(?:{'|'.join(modules)})(?:\..+)?" if modules else r"(?!)")


def target_bytes_per_process(target_config: PretrainedConfig, processes: int, dtype: str) -> dict:
    """Target weight bytes on each of `processes` ranks when transformers spreads it by its TP plan, its EP plan, or
    both (`hf_hyperdflash.distributed.PARALLEL_PLANS`)."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(target_config)
    plans = {"tp": _planned(model._tp_plan or {}), "ep": _planned(model._ep_plan or {})}
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    per_process = {}
    for parallel in ("tp", "ep", "tp+ep"):
        split = [plans[part] for part in parallel.split("+")]
        elements = sum(n / processes if any(p.fullmatch(name) for p in split) else n for name, n in sizes.items())
        per_process[parallel] = int(elements * BYTES[dtype])
    return {"processes": processes, **per_process}


def _median_seconds(fn, repeats: int = 9) -> float:
    fn()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


@torch.no_grad()
def layer_timings(target_config: PretrainedConfig, drafter_overrides: dict, context: int = 512) -> dict:
    """Seconds, on this CPU in fp32 at batch 1: one target-width decoder layer on 1 and on k+1 tokens, one draft
    layer's step against `context` cached positions, and the LM head on 1 and on k tokens."""
    config = drafter_config_for(target_config, **{**drafter_overrides, "num_hidden_layers": 1})
    k = config.block_size - 1
    layer_config = DeepseekV4MTPConfig.from_target_config(target_config)
    layer_config.n_routed_experts = layer_config.num_experts_per_tok  # one token's experts: same compute, fits
    layer = DeepseekV4MTPForDrafting(layer_config).float().eval()
    hidden, streams = config.hidden_size, config.hc_mult

    def target_layer(tokens: int) -> float:
        embeds, residual = torch.randn(1, tokens, hidden), torch.randn(1, tokens, streams, hidden)
        return _median_seconds(lambda: layer(embeds, residual, torch.arange(tokens)[None]))

    drafter = HyperDFlashForDrafting(config).float().eval()
    cache = drafter.make_context_cache()
    drafter(torch.randn(1, 1, hidden), torch.randn(1, context, streams, hidden), torch.arange(context)[None],
            torch.tensor([[context]]), cache=cache)  # fmt: skip
    position = torch.tensor([[context]])

    def draft_step() -> None:
        drafter(torch.randn(1, 1, hidden), torch.randn(1, 1, streams, hidden), position, position + 1, cache=cache)
        if config.context_window is None:  # keep the context at `context` positions from one repeat to the next
            cache.crop(-1)

    head = torch.nn.Linear(hidden, config.vocab_size, bias=False)
    timings = {"k": k, "target_layer_1": target_layer(1), f"target_layer_{k + 1}": target_layer(k + 1)}
    timings["draft_layer_step"] = _median_seconds(draft_step)
    for tokens in (1, k, k + 1):
        timings[f"lm_head_{tokens}"] = _median_seconds(lambda tokens=tokens: head(torch.randn(1, tokens, hidden)))
    return timings


def expected_speedup(timings: dict, num_target_layers: int, num_draft_layers: int, tau: float) -> dict:
    k = timings["k"]
    step = num_target_layers * timings["target_layer_1"] + timings["lm_head_1"]
    verify = num_target_layers * timings[f"target_layer_{k + 1}"] + timings[f"lm_head_{k + 1}"]
    draft = num_draft_layers * timings["draft_layer_step"] + timings[f"lm_head_{k}"]
    return {
        "tau": tau,
        "verify_over_step": verify / step,
        "draft_over_step": draft / step,
        "speedup": tau * step / (verify + draft),
    }
