"""One speculative generate() call run as consecutive generate() calls ("stretches"): assisted ones, and plain
decoding's own loop through the draft schedule's longer waits.

A step that skips drafting inside transformers' assisted loop still pays that loop's and the runtime's per-step work
(about 1.9% of a plain step's instructions on the reference pair); plain decoding's loop does not. So when the
adaptive schedule decides to wait `MIN_PLAIN_STRETCH` steps or more, the assisted stretch stops and the wait runs as
a plain stretch that continues from the target cache, then an assisted stretch resumes. Joined, they return what one
call returns: logits processors and stopping criteria are built once, by the first stretch, and shared by every
later one (so `min_new_tokens`, `max_time` and the like count from the call's start), the streamer sees the prompt
once, each token once and one `end()`, and per-step outputs (scores, logits, hidden states, attentions) are
concatenated.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .step_timer import synchronized_clock

# Waits shorter than this stay in the assisted loop: a switch there and back costs two generate() set-ups (a quarter
# of a step's instructions on the reference pair), which a plain stretch that collects features for a later probe
# (0.1%-0.8% a step against the assisted loop's 1.9%) repays from 15-25 steps on, one that ends the call from about 14.
MIN_PLAIN_STRETCH = 16
PER_STEP_OUTPUTS = ("scores", "logits", "attentions", "hidden_states")


class StretchStreamer(BaseStreamer):
    """The caller's streamer across stretches: each stretch's generate() puts its whole input first (the prompt, then
    everything decoded so far) and ends; the caller sees the prompt once and `end()` once."""

    def __init__(self, streamer: BaseStreamer):
        self.streamer = streamer
        self.skip_next_put = False

    def next_stretch(self) -> None:
        self.skip_next_put = True

    def put(self, value: torch.Tensor) -> None:
        if self.skip_next_put:
            self.skip_next_put = False
        else:
            self.streamer.put(value)

    def end(self) -> None:
        """A stretch ended; the call may go on (`finish` ends the caller's stream)."""

    def finish(self) -> None:
        self.streamer.end()


class TimedStopping(StoppingCriteriaList):
    """A plain call's stopping criteria, which also note when each target forward's iteration ended (and call
    `on_step`): plain decoding's loop asks them once per forward, so they time its steps with no hook on the target,
    whose calls then keep torch's fast path (a hooked module's cost 0.1% of a step on the reference pair)."""

    def __init__(self, criteria: StoppingCriteriaList, on_step: Callable[[], object] | None = None):
        super().__init__(criteria)
        self.on_step = on_step
        self.iteration_ends: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.iteration_ends.append(synchronized_clock())
        if self.on_step is not None:
            self.on_step()
        return super().__call__(input_ids, scores, **kwargs)

    def step_seconds(self) -> list[float]:
        """Each step after the first forward (a call's prefill, a stretch's first step): from an iteration's end to
        the next's."""
        return [later - earlier for earlier, later in pairwise(self.iteration_ends)]


class PlainStretchStopping(TimedStopping):
    """The call's stopping criteria in a plain stretch, which also ends once the sequence reaches `end_length`;
    `stopped` says whether the criteria themselves stopped (the call is over)."""

    def __init__(self, criteria: StoppingCriteriaList, end_length: int, on_step: Callable[[], object] | None):
        super().__init__(criteria, on_step)
        self.end_length = end_length
        self.done: torch.BoolTensor | None = None  # the criteria's verdict on the latest step

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        """No tensor work beyond the criteria's own before the stretch's last step: plain decoding pays none."""
        self.done = super().__call__(input_ids, scores, **kwargs)
        return torch.ones_like(self.done) if input_ids.shape[1] >= self.end_length else self.done

    @property
    def stopped(self) -> bool:
        return self.done is not None and bool(self.done.all())


class SharedBuilds:
    """What the first stretch's generate() builds for the call (logits processors, stopping criteria), handed to
    every later stretch instead of a new build: those built later would count lengths from the later stretch's input
    and restart `max_time`'s clock. `reuse(key)` is a call-scoped replacement for the builder method (called as
    `replacement(build, *args, **kwargs)`): the first call builds, every later one returns that build."""

    def __init__(self):
        self.built: dict[str, object] = {}

    def reuse(self, key: str) -> Callable:
        def build_once(build: Callable, *args, **kwargs):
            if key not in self.built:
                self.built[key] = build(*args, **kwargs)
            return self.built[key]

        return build_once


def continued_options(new_tokens_left: int) -> dict:
    """generate() options for a stretch that continues the call, over the caller's: the tokens the call has left (as
    `max_new_tokens`, `max_length` unset so that no config of the caller's or the target's competes), and nothing that
    acts at a stretch's own start (the shared processors count `min_new_tokens` from the call's start; token healing
    edits the prompt, which the first stretch did)."""
    return {
        "max_new_tokens": new_tokens_left,
        "max_length": None,
        "min_new_tokens": None,
        "min_length": 0,
        "token_healing": False,
    }


def join_outputs(earlier, later):
    """One call's result from two consecutive stretches' (`later` continued `earlier`'s sequence)."""
    if isinstance(later, torch.Tensor):
        return later
    for name in PER_STEP_OUTPUTS:
        before, after = getattr(earlier, name, None), getattr(later, name, None)
        if before is not None and after is not None:
            setattr(later, name, before + after)
    return later
