"""Adapter for stock transformers DeepSeek-V4 targets: where the mHC residual lives and how to rewind its cache."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PreTrainedModel

from .cache_deepseek_v4 import RewindableDeepseekV4Cache
from .feature_capture import FeatureCapture


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes: its weights' device, or, when accelerate offloads it (weights on the meta device
    until its forward), the device accelerate's hook runs it on."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(module.parameters()).device


class DeepseekV4Target:
    """What HyperDFlash needs from a `DeepseekV4ForCausalLM`, without forking its modeling file."""

    family = "deepseek_v4"

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.config = model.config

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def hc_mult(self) -> int:
        return self.config.hc_mult

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def collapse_head(self) -> nn.Module:
        """`model.hc_head` (DeepseekV4HyperHead): the module whose input is the final pre-collapse residual."""
        return self.model.model.hc_head

    def embed(self, token_ids: torch.LongTensor) -> torch.Tensor:
        """The target's embedding of `token_ids`, computed where the embedding runs."""
        return self.embed_tokens(token_ids.to(execution_device(self.embed_tokens)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's `lm_head` on final-normed hidden states, computed where the head runs."""
        return self.lm_head(hidden.to(execution_device(self.lm_head), self.lm_head.weight.dtype))

    @property
    def final_norm(self) -> nn.Module:
        """`model.norm`, applied after the collapse head and before `lm_head`."""
        return self.model.model.norm

    @property
    def feature_device(self) -> torch.device:
        """Where the last decoder layer (and so the captured residual) runs; the drafter runs there."""
        return execution_device(self.collapse_head)

    def make_cache(self, max_draft: int) -> RewindableDeepseekV4Cache:
        return RewindableDeepseekV4Cache(config=self.config, max_draft=max_draft)

    @contextmanager
    def capture(self, layer_ids: Sequence[int] | None = None) -> Iterator[FeatureCapture]:
        """Record the pre-collapse residual (layer_ids None) or the outputs of `layer_ids`, for every forward."""
        capture = FeatureCapture(layer_ids)
        if layer_ids is None:
            handles = [
                self.collapse_head.register_forward_pre_hook(lambda _, args: capture.record("pre_collapse", args[0]))
            ]
        else:
            bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"target_layer_ids {bad} are outside the target's {self.num_layers} layers.")
            layers = self.model.model.layers
            handles = [
                layers[i].register_forward_hook(lambda _, __, output, i=i: capture.record(i, output))
                for i in layer_ids
            ]
        try:
            yield capture
        finally:
            for handle in handles:
                handle.remove()
