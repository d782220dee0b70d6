"""Where each speculative step's time goes: drafting, the target's verify forward, the cache rollback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import Cache, PreTrainedModel

from .generation_stats import GenerationStats


def synchronized_clock() -> float:
    """perf_counter once queued CUDA kernels are done, so a timed part includes its kernels."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


class StepTimer:
    """Splits each decoding iteration's wall time into drafting, the target forward and the cache rollback.

    An iteration runs from one `get_candidates` call to the next (the last one to the end of `generate`); what
    the three parts leave over (acceptance, logits processors, feature bookkeeping) is the step's overhead.
    Iterations that drafted are verify steps and land in `stats`; the first iteration is the prefill.
    """

    def __init__(self, stats: GenerationStats):
        self.stats = stats
        self.start: float | None = None
        self.forward_start = 0.0
        self.parts = {"draft": 0.0, "verify": 0.0, "rollback": 0.0}
        self.iterations = 0

    def _close(self, now: float) -> None:
        if self.start is None:
            return
        if self.parts["draft"] > 0.0:  # the iteration drafted: a verify step
            self.stats.step_seconds.append(now - self.start)
            self.stats.draft_seconds.append(self.parts["draft"])
            self.stats.verify_seconds.append(self.parts["verify"])
            self.stats.rollback_seconds.append(self.parts["rollback"])
        elif self.iterations == 1:
            self.stats.prefill_seconds = now - self.start
        self.start = None

    def start_iteration(self) -> None:
        now = synchronized_clock()
        self._close(now)
        self.start, self.iterations = now, self.iterations + 1
        self.parts = dict.fromkeys(self.parts, 0.0)

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        start = synchronized_clock()
        try:
            yield
        finally:
            self.parts[part] += synchronized_clock() - start

    def _forward_started(self, *_) -> None:
        self.forward_start = synchronized_clock()

    def _forward_done(self, *_) -> None:
        self.parts["verify"] += synchronized_clock() - self.forward_start

    @contextmanager
    def attach(self, model: PreTrainedModel, cache: Cache) -> Iterator[None]:
        """Time `model`'s forwards (verify) and `cache.crop` (rollback) while `generate` runs."""
        hooks = [model.register_forward_pre_hook(self._forward_started)]
        hooks.append(model.register_forward_hook(self._forward_done))
        crop = cache.crop

        def timed_crop(*args, **kwargs):
            with self.timed("rollback"):
                return crop(*args, **kwargs)

        cache.crop = timed_crop
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            del cache.crop
            self._close(synchronized_clock())
