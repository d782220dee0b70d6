"""Linear-attention cache layers whose `crop` rolls back exactly (GLM-5-Next's KDA, Qwen4-Exp's GatedDeltaNet and
its PLE states), for hybrid caches that verification can rewind, on transformers before 5.25 (from 5.25 transformers
rolls these layers back itself, `target_linear_attention.py`; this module goes once the oldest supported version is
5.25).

Before 5.25 the stock `LinearAttentionLayer` keeps only the latest conv windows and recurrent state; with past
recording on, its `crop` restores the conv windows but leaves the recurrent state where the rejected tokens put it
(measured on tiny GLM-5-Next and Qwen4-Exp targets: off by 2-3e-3, next-token logits off by 5e-2). The layer here
keeps, for the
forwards a rollback can reach (at most `max_draft` tokens back), each forward's starting state (conv windows and
recurrent state) and its inputs: the conv columns it appended and the delta-rule kernel's inputs. Rolling back into
a forward re-runs the family's own kernel over the tokens kept, from that forward's starting state, and rebuilds the
conv windows from the kept columns. Verify forwards run at full speed; only a rejection pays, and only for the
accepted part of one block, replayed token by token with the one-token kernel decoding uses
(`benchmarks/linear_rollback.py` measures the alternatives).

The delta-rule kernels return only their final state, so `recording_kernels` wraps them (module functions of the
family's modeling file, for one call and in that call only) to hand each call's inputs to the cache layer that stores
its state next.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import LinearAttentionLayer

from . import call_scope

KERNEL_INPUTS = ("query", "key", "value", "g", "beta")
STEPWISE_REPLAY_MAX = 64  # longer replays (trimming a prefill) use the chunked kernel
_NOT_REPLAYED = ("initial_state", "output_final_state", "cu_seqlens")
_PENDING_KERNEL_CALLS = "linear_attention.pending_kernel_calls"  # call-scope entry: recorded, not yet stored


@dataclass
class KernelCall:
    """One delta-rule kernel call: the unwrapped kernel, its per-token inputs `[B, S, ...]` and its other options."""

    kernel: Callable
    step_kernel: Callable  # the family's one-token kernel, which decoding uses
    inputs: dict[str, torch.Tensor]
    options: dict

    @property
    def num_tokens(self) -> int:
        return self.inputs["query"].shape[1]

    def final_state(self, num_tokens: int, initial_state: torch.Tensor | None) -> torch.Tensor:
        """The recurrent state after the first `num_tokens` tokens, from `initial_state`: token by token with the
        one-token kernel, as decoding computes it (and on CPU far cheaper than the chunked kernel for a few tokens),
        or chunked for a long stretch (trimming a prefill)."""
        inputs = {name: tensor[:, :num_tokens] for name, tensor in self.inputs.items()}
        if num_tokens > STEPWISE_REPLAY_MAX:
            return self.kernel(**inputs, initial_state=initial_state, output_final_state=True, **self.options)[1]
        accepted = set(inspect.signature(self.step_kernel).parameters)
        options = {name: value for name, value in self.options.items() if name in accepted}
        state = initial_state
        for i in range(num_tokens):
            token = {name: tensor[:, i : i + 1] for name, tensor in inputs.items()}
            state = self.step_kernel(**token, initial_state=state, output_final_state=True, **options)[1]
        return state

    def slice(self, start: int, stop: int) -> KernelCall:
        inputs = {name: t[:, start:stop] for name, t in self.inputs.items()}
        return KernelCall(self.kernel, self.step_kernel, inputs, self.options)


@contextmanager
def recording_kernels(module: ModuleType, chunked: str, one_token: str) -> Iterator[None]:
    """For one call: every call of the family's chunked and one-token delta-rule kernels (`module.<name>`) hands its
    inputs to the rewindable layer that stores its state next (within a call, forwards run one at a time)."""
    step_kernel = call_scope.unwrapped(getattr(module, one_token))
    pending: list[KernelCall] = []

    def recorded(kernel: Callable, *args, **kwargs):
        arguments = dict(_signature(kernel).bind(*args, **kwargs).arguments)
        arguments |= arguments.pop("kwargs", {})
        inputs = {name: arguments.pop(name) for name in KERNEL_INPUTS}
        options = {name: value for name, value in arguments.items() if name not in _NOT_REPLAYED}
        pending.append(KernelCall(kernel, step_kernel, inputs, options))
        return kernel(*args, **kwargs)

    with (
        call_scope.scoped({_PENDING_KERNEL_CALLS: pending}),
        call_scope.functions(module, **{chunked: recorded, one_token: recorded}),
    ):
        yield


@functools.cache
def _signature(kernel: Callable) -> inspect.Signature:
    return inspect.signature(kernel)


@dataclass
class _Forward:
    """What a rollback into one forward needs: where it starts, its starting state, and what it appended."""

    start: int
    windows_before: dict[int, torch.Tensor]  # conv windows (last `conv_kernel_size` columns) before it
    recurrent_before: torch.Tensor | None  # None: the zero state of the first forward
    call: KernelCall
    columns: dict[int, torch.Tensor] = field(default_factory=dict)  # conv columns it appended, per conv state

    @property
    def num_tokens(self) -> int:
        return self.call.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def state_after(self, num_tokens: int, kernel_sizes: dict[int, int]) -> tuple[dict, torch.Tensor | None]:
        """Conv windows and recurrent state after its first `num_tokens` tokens."""
        dropped = self.num_tokens - num_tokens
        windows = {}
        for i, before in self.windows_before.items():
            columns = self.columns[i]
            kept = torch.cat([before, columns[..., : columns.shape[-1] - dropped]], dim=-1)
            windows[i] = kept[..., -kernel_sizes[i] :]
        if num_tokens == 0:
            return windows, self.recurrent_before
        return windows, self.call.final_state(num_tokens, self.recurrent_before)

    def drop_first(self, num_tokens: int, kernel_sizes: dict[int, int]) -> None:
        """Start this record `num_tokens` later, so it no longer holds inputs a rollback cannot reach."""
        self.windows_before, self.recurrent_before = self.state_after(num_tokens, kernel_sizes)
        kept = self.num_tokens - num_tokens  # the last columns are the tokens' (a first forward may pad before them)
        self.columns = {i: c[..., c.shape[-1] - kept :] for i, c in self.columns.items()}
        self.call = self.call.slice(num_tokens, self.num_tokens)
        self.start += num_tokens

    def keep_first(self, num_tokens: int) -> None:
        dropped = self.num_tokens - num_tokens
        self.columns = {i: c[..., : c.shape[-1] - dropped] for i, c in self.columns.items()}
        self.call = self.call.slice(0, num_tokens)


class RewindableLinearAttentionLayer(LinearAttentionLayer):
    """A stock `LinearAttentionLayer` (the modeling code reads and writes its states as usual) whose `crop` removes
    up to `max_draft` of the latest tokens exactly, without past recording."""

    def __init__(self, number_of_states: int = 1, max_draft: int = 16, **kwargs):
        super().__init__(number_of_states=number_of_states)
        self.max_draft = max_draft
        self._init_history()

    _history = ("max_draft", "length", "min_length", "forwards", "_appended", "_windows", "_recurrent")

    def _init_history(self) -> None:
        self.length = 0
        self.min_length = 0  # the shortest length `crop` can restore
        self.forwards: list[_Forward] = []
        self._appended: dict[int, torch.Tensor] = {}  # conv columns appended during the current forward
        self._windows: dict[int, torch.Tensor] = {}  # copies of the conv windows after the latest forward
        self._recurrent: torch.Tensor | None = None  # copy of the recurrent state after the latest forward

    @property
    def is_croppable(self) -> bool:
        return True

    def activate_past_recording(self, **kwargs) -> None:
        """No-op: the history `crop` needs is always kept (bounded by `max_draft`)."""

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self._appended[state_idx] = conv_states
        return super().update_conv_state(conv_states, state_idx=state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Stored last in every linear-attention forward: the forward is complete, record it."""
        result = super().update_recurrent_state(recurrent_states, state_idx=state_idx, **kwargs)
        pending = call_scope.current(_PENDING_KERNEL_CALLS)
        if not pending:
            raise RuntimeError(
                "A linear-attention state was stored without a recorded kernel call, so this cache cannot roll it "
                "back. Run the forward inside the target adapter's `verify_as_decoding` (generate() does)."
            )
        forward = _Forward(self.length, self._windows, self._recurrent, pending.pop())
        for i in self._conv_indices():
            # A one-token decode step may update the window in place (no `update_conv_state` call): its new column
            # is the window's last one (copied: the next step shifts the window in place)
            forward.columns[i] = self._appended[i] if i in self._appended else self.conv_states[i][..., -1:].clone()
            forward.windows_before.setdefault(i, self.conv_states[i].new_zeros(self.conv_states[i].shape))
        self.forwards.append(forward)
        self.length = forward.end
        self._snapshot()
        self.min_length = max(self.min_length, self.length - self.max_draft)
        self._forget_unreachable()
        return result

    def _conv_indices(self) -> list[int]:
        return [i for i in range(self.number_of_states) if self.is_conv_states_initialized[i]]

    def _kernel_sizes(self) -> dict[int, int]:
        return {i: self.conv_kernel_size[i] for i in self._conv_indices()}

    def _snapshot(self) -> None:
        self._appended = {}
        self._windows = {i: self.conv_states[i].clone() for i in self._conv_indices()}
        self._recurrent = self.recurrent_states[0].clone()

    def _forget_unreachable(self) -> None:
        """Drop forwards that end before `min_length`; trim a long one (a prefill) to what a rollback can reach."""
        while self.forwards and self.forwards[0].end <= self.min_length:
            self.forwards.pop(0)
        oldest = self.forwards[0] if self.forwards else None
        if oldest is not None and oldest.num_tokens > 2 * self.max_draft + 1:
            oldest.drop_first(self.min_length - oldest.start, self._kernel_sizes())

    def check_rewind(self, length: int) -> None:
        if length < self.min_length:
            raise ValueError(
                f"Cannot roll the linear-attention cache back to {length} tokens: it keeps history to undo at most "
                f"max_draft={self.max_draft} tokens, so the shortest reachable length is {self.min_length}. Build "
                "the cache with a larger `max_draft`."
            )

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (the stock sign convention: 0 removes nothing)."""
        if tokens_to_remove > 0:
            raise ValueError(f"`tokens_to_remove` must be <= 0 (minus the tokens to drop), got {tokens_to_remove}.")
        length = self.length + tokens_to_remove
        self.check_rewind(length)
        if tokens_to_remove == 0:
            return
        while self.forwards and self.forwards[-1].start >= length:
            removed = self.forwards.pop()
            windows, recurrent = removed.windows_before, removed.recurrent_before
        if self.forwards and self.forwards[-1].end > length:  # the rollback lands inside the latest kept forward
            last = self.forwards[-1]
            windows, recurrent = last.state_after(length - last.start, self._kernel_sizes())
            last.keep_first(length - last.start)
        for i, window in windows.items():
            self.conv_states[i] = window.clone()
        if recurrent is None:
            self.recurrent_states[0].zero_()
        else:
            self.recurrent_states[0].copy_(recurrent)
        self.length = length
        self._snapshot()

    def reset(self) -> None:
        super().reset()
        self._init_history()


class RewindableHybridCache(DynamicCache):
    """The stock dynamic cache of a hybrid model (linear-attention layers and indexed attention layers, such as
    GLM-5-Next's or Qwen4-Exp's), with every linear-attention layer rewindable. Indexed layers crop exactly as they
    are. `crop` follows transformers' convention (negative: remove that many; 0: none; positive: keep that many) and
    checks every layer before changing any."""

    def __init__(self, config: PretrainedConfig, max_draft: int = 16):
        if max_draft < 0:
            raise ValueError(f"`max_draft` must be >= 0, got {max_draft}.")
        super().__init__(config=config)
        states = getattr(config, "number_of_conv_states", 1)
        for i, layer_type in enumerate(config.layer_types):
            if layer_type == "linear_attention":
                self.layers[i] = RewindableLinearAttentionLayer(number_of_states=states, max_draft=max_draft)
        self.max_draft = max_draft

    def crop(self, max_length: int) -> None:
        current = self.get_seq_length()
        length = current + max_length if max_length <= 0 else min(max_length, current)
        rewindable = [layer for layer in self.layers if isinstance(layer, RewindableLinearAttentionLayer)]
        for layer in rewindable:
            layer.check_rewind(length)
        for layer in self.layers:
            layer.crop(length - current)


def make_rewindable(cache: DynamicCache, max_draft: int) -> RewindableHybridCache:
    """Turn a hybrid model's stock cache (plain decoding's, or one a speculative call returned) into a rewindable
    one, in place: linear-attention layers keep their state and start their history there."""
    length = cache.get_seq_length()
    for layer in cache.layers:
        if type(layer) is LinearAttentionLayer:
            layer.__class__ = RewindableLinearAttentionLayer
            layer.max_draft = max_draft
            layer._init_history()
            layer.length = layer.min_length = length
            if layer.is_recurrent_states_initialized[0]:
                layer._snapshot()
    cache.__class__ = RewindableHybridCache
    cache.max_draft = max_draft
    return cache


def make_stock(cache: RewindableHybridCache) -> DynamicCache:
    """The reverse, in place: stock `LinearAttentionLayer`s with the state plain decoding leaves, history dropped."""
    for layer in cache.layers:
        if isinstance(layer, RewindableLinearAttentionLayer):
            for name in RewindableLinearAttentionLayer._history:
                delattr(layer, name)
            layer.__class__ = LinearAttentionLayer
    del cache.max_draft
    cache.__class__ = DynamicCache
    return cache
