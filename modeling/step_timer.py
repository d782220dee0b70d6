"""Where each speculative step's time goes: drafting, verification, the cache rollback."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import Cache


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
    """Splits each decoding iteration's wall time into drafting, verification and the cache rollback.

    An iteration runs from one `get_candidates` call to the next (the last one to the end of `generate`). Verification
    runs from the candidates' return (`verify_starts`) to the rollback: the target's forward over them and their
    acceptance; what the three parts leave over (logits processors of the drafts, feature bookkeeping, the loop's
    own work) is the step's overhead. Only an iteration that drafts is split (`time_parts`): the others are timed as
    a whole, so a step that skips drafting costs what plain decoding's does, with no hook on the target and no
    synchronisation around its forward and rollback. Each closed iteration goes to `on_close` (set by the candidate
    generator, which knows what the step drafted).
    """

    def __init__(self):
        self.start: float | None = None
        self.verify_start = 0.0
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

    def close(self) -> None:
        """The running iteration ends here (an assisted stretch stopped, and the call goes on elsewhere)."""
        self._close(synchronized_clock())

    def start_iteration(self) -> None:
        now = synchronized_clock()
        self._close(now)
        self.start, self.iterations = now, self.iterations + 1
        self.parts = dict.fromkeys(self.parts, 0.0)
        self.timing_parts = False

    def time_parts(self) -> None:
        """Split the current iteration into drafting, verification and rollback (a step that drafts)."""
        self.timing_parts = True

    def verify_starts(self) -> None:
        """The candidates go to the target now."""
        if self.timing_parts:
            self.verify_start = synchronized_clock()

    @contextmanager
    def timed(self, part: str) -> Iterator[float]:
        start = synchronized_clock()
        try:
            yield start
        finally:
            self.parts[part] += synchronized_clock() - start

    @contextmanager
    def attach(self, cache: Cache) -> Iterator[None]:
        """Time verification and `cache.crop` (rollback) while this call's `generate` runs: transformers' assisted
        loop crops the target cache once per step, right after accepting."""
        crop = cache.crop

        def timed_crop(*args, **kwargs):
            if not self.timing_parts:
                return crop(*args, **kwargs)
            with self.timed("rollback") as now:
                self.parts["verify"] += now - self.verify_start
                return crop(*args, **kwargs)

        cache.crop = timed_crop
        try:
            yield
        finally:
            del cache.crop
            self.close()
