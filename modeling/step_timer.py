"""Where each speculative step's time goes: drafting, the target's verify forward, the cache rollback."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import Cache, PreTrainedModel

from .call_scope import CallHooks


def synchronized_clock() -> float:
    """perf_counter once queued CUDA kernels are done, so a timed part includes its kernels."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


@dataclass
class IterationTiming:
    """One decoding iteration's wall time and its timed parts, in seconds."""

    index: int  # 1: the prefill
    seconds: float
    draft: float
    verify: float
    rollback: float


class StepTimer:
    """Splits each decoding iteration's wall time into drafting, the target forward and the cache rollback.

    An iteration runs from one `get_candidates` call to the next (the last one to the end of `generate`); what
    the three parts leave over (acceptance, logits processors, feature bookkeeping) is the step's overhead. Only an
    iteration that drafts is split (`time_parts`): the others are timed as a whole, so a step that skips drafting
    costs what plain decoding's does, with no synchronisation around its forward and rollback. Each closed iteration
    goes to `on_close` (set by the candidate generator, which knows what the step drafted).
    """

    def __init__(self):
        self.start: float | None = None
        self.forward_start = 0.0
        self.parts = {"draft": 0.0, "verify": 0.0, "rollback": 0.0}
        self.iterations = 0
        self.timing_parts = False
        self.on_close: Callable[[IterationTiming], None] | None = None

    def _close(self, now: float) -> None:
        if self.start is None:
            return
        if self.on_close is not None:
            self.on_close(IterationTiming(self.iterations, now - self.start, **self.parts))
        self.start = None

    def start_iteration(self) -> None:
        now = synchronized_clock()
        self._close(now)
        self.start, self.iterations = now, self.iterations + 1
        self.parts = dict.fromkeys(self.parts, 0.0)
        self.timing_parts = False

    def time_parts(self) -> None:
        """Split the current iteration into drafting, verify forward and rollback (a step that drafts)."""
        self.timing_parts = True

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        start = synchronized_clock()
        try:
            yield
        finally:
            self.parts[part] += synchronized_clock() - start

    def _forward_started(self, *_) -> None:
        if self.timing_parts:
            self.forward_start = synchronized_clock()

    def _forward_done(self, *_) -> None:
        if self.timing_parts:
            self.parts["verify"] += synchronized_clock() - self.forward_start

    @contextmanager
    def attach(self, model: PreTrainedModel, cache: Cache) -> Iterator[None]:
        """Time `model`'s forwards (verify) and `cache.crop` (rollback) while this call's `generate` runs."""
        crop = cache.crop

        def timed_crop(*args, **kwargs):
            if not self.timing_parts:
                return crop(*args, **kwargs)
            with self.timed("rollback"):
                return crop(*args, **kwargs)

        cache.crop = timed_crop
        try:
            with CallHooks() as hooks:
                hooks.before(model, self._forward_started)
                hooks.after(model, self._forward_done)
                yield
        finally:
            del cache.crop
            self._close(synchronized_clock())
