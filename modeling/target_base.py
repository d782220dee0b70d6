"""What HyperDFlash needs from an mHC target, whatever its family: the interface every target adapter implements.

An adapter names where the family keeps its embedding, LM head, stream collapse and final norm, gives the cache that
verification can roll back, and says how a verify forward relates to one-token decoding (which keys a one-token
forward attends to; what else must be made to match). Generic parts live here; `target_<family>.py` fills in the rest.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import Cache, DynamicCache, PreTrainedModel

from .call_scope import CallHooks
from .feature_capture import FeatureCapture
from .transformers_compat import CACHE_ARGUMENT


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes: its weights' device, or, when accelerate offloads it (weights on the meta device
    until its forward), the device accelerate's hook runs it on."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(module.parameters()).device


def whole_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every tensor whole on this process: a target spread by transformers' parallel plans
    holds `DTensor`s (shards, or replicas under FSDP), which a drafter's plain parameters cannot copy."""
    return {
        name: value.full_tensor() if isinstance(value, DTensor) else value
        for name, value in module.state_dict().items()
    }


def whole_copy(module: nn.Module) -> nn.Module:
    """`module` with its own class's forward and every parameter whole on this process (gathered once from a
    transformers-spread `DTensor`): it computes locally what the spread module computes with collectives."""
    copy = nn.Module.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    copy.__dict__.pop("forward", None)  # transformers' parallel wrapper of this instance
    copy._parameters = {
        name: None
        if value is None
        else nn.Parameter(value.detach().full_tensor(), requires_grad=False)
        if isinstance(value, DTensor)
        else value
        for name, value in module._parameters.items()
    }
    return copy


def activation_dtype(linear: nn.Module, fallback: torch.dtype) -> torch.dtype:
    """The dtype `linear` takes its input in: its weight's, unless that is quantized to one byte (FP8 and int8
    kernels take the model's activations), then `fallback`."""
    weight = linear.weight
    return weight.dtype if weight.element_size() > 1 else fallback


def _states(layer_output: torch.Tensor | tuple) -> torch.Tensor:
    """A decoder layer's residual streams (some families also return extras, such as HY-V4's top-k indices)."""
    return layer_output[0] if isinstance(layer_output, tuple) else layer_output


class HyperConnectionTarget:
    """A causal LM whose residual is `hc_mult` streams `[B, S, hc, D]`, collapsed by `model.hc_head` and normed by
    `model.norm` before `lm_head`. Subclasses set `family` and implement the cache methods, and override where their
    family differs (a text model inside a multimodal one, a flat stream layout, another collapse)."""

    family: str
    has_native_mtp: bool = False  # whether the native-MTP drafter (DeepSeek-V4's MTP block) fits this family
    # Whether transformers' own assisted decoding, cropping plain decoding's cache, rolls this family back exactly
    stock_cache_rolls_back: bool = False

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.config = model.config.get_text_config()

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
    def text_model(self) -> nn.Module:
        """The decoder stack (embedding, layers, collapse, final norm)."""
        return self.model.model

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.text_model.layers

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def collapse_head(self) -> nn.Module:
        """The module whose input is the final pre-collapse residual (`model.hc_head`)."""
        return self.text_model.hc_head

    @property
    def final_norm(self) -> nn.Module:
        """Applied after the collapse head and before `lm_head` (`model.norm`)."""
        return self.text_model.norm

    def as_streams(self, residual: torch.Tensor) -> torch.Tensor:
        """The family's residual in the `[B, S, hc, D]` layout the drafter reads."""
        return residual

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """The family's own collapse of `[B, S, hc, D]` streams to `[B, S, D]` (before the final norm)."""
        return self.collapse_head(streams)

    def embed(self, token_ids: torch.LongTensor) -> torch.Tensor:
        """The target's embedding of `token_ids`, computed where the embedding runs."""
        embed_tokens = self._for_drafting(self.embed_tokens)
        return embed_tokens(token_ids.to(execution_device(embed_tokens)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's `lm_head` on final-normed hidden states, computed where the head runs."""
        lm_head = self._for_drafting(self.lm_head)
        dtype = activation_dtype(lm_head, self.embed_tokens.weight.dtype)
        return lm_head(hidden.to(execution_device(lm_head), dtype))

    def draft_locally(self) -> None:
        """On a target spread by transformers' tensor-parallel plan: keep whole copies of the embedding and the head
        (once per model, a collective every rank must join), so that drafting runs no collective of the target's and
        a drafter failing on one rank leaves no other waiting in one (`rank_agreement.py`). The memory this costs is
        one embedding and one head per rank."""
        modules = (self.embed_tokens, self.lm_head)
        if not any(isinstance(module.weight, DTensor) for module in modules):
            return
        copies = getattr(self.model, "_hyperdflash_whole_copies", None)
        if copies is None or any(copies.get(id(module)) is None for module in modules):
            self.model._hyperdflash_whole_copies = {id(module): whole_copy(module) for module in modules}

    def _for_drafting(self, module: nn.Module) -> nn.Module:
        copies = getattr(self.model, "_hyperdflash_whole_copies", None)
        return module if copies is None else copies.get(id(module), module)

    @property
    def feature_device(self) -> torch.device:
        """Where the last decoder layer (and so the captured residual) runs; the drafter runs there."""
        return execution_device(self.collapse_head)

    def init_inherited_gate(self, gate: nn.Module) -> None:
        """Start a drafter's inherited gate as the target's own collapse: a copy of it (values, not storage)."""
        gate.load_state_dict(whole_state_dict(self.collapse_head))

    def check_servable(self) -> None:
        """`ValueError`, naming the config field, for a target config speculative decoding cannot serve exactly on
        this transformers; called before the target's first forward."""

    def make_cache(self, max_draft: int) -> Cache:
        """A target cache for verifying drafts: its `crop` removes up to `max_draft` trailing tokens of a forward
        exactly (a forward of one token verifies no draft and need not be undone)."""
        raise NotImplementedError

    def make_assistant_cache(self, max_draft: int) -> Cache | None:
        """A cache for this model drafting as a stock assistant: its `crop` also undoes the one-token forwards that
        drafted the tokens it removes; None where the cache transformers makes for an assistant does."""
        return None if self.stock_cache_rolls_back else self.make_cache(max_draft)

    def adopt_cache(self, cache: Cache, max_draft: int) -> Cache:
        """A cache the caller passed in (plain decoding's, a speculative call's, or one built rewindable), made to
        rewind drafts of `max_draft` tokens, in place; `ValueError` for a cache this family cannot continue from."""
        raise NotImplementedError

    def release_cache(self, cache: Cache) -> None:
        """After the call: the cache holds the family's stock classes and the state plain decoding leaves, so user
        code that inspects it by type, and a later call with or without a drafter, see plain decoding's cache (nothing
        to do where the stock cache is the rewindable one)."""

    def _is_plain_decodings_cache(self, cache: Cache) -> bool:
        """`cache` is what plain decoding makes for this target: a `DynamicCache` of the family's layer classes."""
        stock = DynamicCache(config=self.config)
        return type(cache) is DynamicCache and [type(layer) for layer in cache.layers] == [
            type(layer) for layer in stock.layers
        ]

    def _check_rewindable(self, cache: Cache, max_draft: int, cache_class: str) -> None:
        """`cache` is a `cache_class` (by name, so a cache from another copy of the runtime passes) that can rewind a
        draft of `max_draft` tokens."""
        if not any(klass.__name__ == cache_class for klass in type(cache).__mro__):
            raise ValueError(
                f"Speculative decoding needs a rewindable target cache, got {type(cache).__name__} ({self.family} "
                f"continues from plain decoding's cache, `DynamicCache(config=target.config)`, or a {cache_class}). "
                f"Omit `{CACHE_ARGUMENT}` (one is created for you)."
            )
        if cache.max_draft < max_draft:
            raise ValueError(
                f"The target cache passed in can rewind {cache.max_draft} tokens, but this drafter drafts {max_draft} "
                f"per step. Build it with {cache_class}(config, max_draft={max_draft}), or omit `{CACHE_ARGUMENT}`."
            )

    def verify_as_decoding(
        self, prompt_length: int, positions_may_lag: bool = True, cache: Cache | None = None
    ) -> AbstractContextManager:
        """For one call on `cache`: whatever makes a verify forward's rows equal one-token decoding's, and its
        rollbacks exact (nothing by default). `positions_may_lag`: the call's position ids may fall behind the cache
        indices (a padded prompt)."""
        return nullcontext()

    def keep_states_for_draft(self, cache: Cache, num_drafts: int) -> None:
        """Before a verify forward of `num_drafts` drafts on `cache`: whatever lets rollback reach all of them (nothing
        by default)."""

    def one_token_key_columns(self, layer_idx: int, cache_length: int, num_queries: int, query: int) -> torch.Tensor:
        """The key columns of a verify forward's attention row `query` that a one-token forward at that position
        has. Default: full attention, every key up to and including its own position."""
        return torch.arange(cache_length + query + 1)

    def prompt_key_columns(
        self, layer_idx: int, cache_length: int, num_queries: int, prompt_rows: int
    ) -> torch.Tensor:
        """The key columns of a forward's first `prompt_rows` rows (the prompt) that a forward of the prompt alone
        has. Default: full attention, every key up to the prompt's end."""
        return torch.arange(cache_length + prompt_rows)

    @contextmanager
    def capture(self, layer_ids: Sequence[int] | None = None) -> Iterator[FeatureCapture]:
        """Record the pre-collapse residual (layer_ids None) or the outputs of `layer_ids`, for every forward made
        in this context (a call in another thread, on the same model, is not recorded)."""
        bad = [i for i in layer_ids or [] if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} are outside the target's {self.num_layers} layers.")
        with CallHooks() as hooks:
            capture = FeatureCapture(layer_ids)
            if layer_ids is None:
                hooks.before(
                    self.collapse_head, lambda _, args: capture.record("pre_collapse", self.as_streams(args[0]))
                )
            for i in layer_ids or []:
                hooks.after(
                    self.decoder_layers[i],
                    lambda _, __, out, i=i: capture.record(i, self.as_streams(_states(out))),
                )
            yield capture
