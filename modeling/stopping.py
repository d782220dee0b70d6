"""Stopping criteria checked after every accepted token, so a speculative call stops where plain decoding stops.

transformers' assisted loop appends all accepted tokens of a step, then asks the stopping criteria once about the
whole sequence; it crops only for EOS and `max_length`. A `stop_strings` match or a custom criterion that fires on
the second of five accepted tokens would let the other three through. Here the criteria see every prefix the step
added, in order; the first prefix they stop at ends the loop, and `finish` cuts the output (and the returned
cache) back to it. The streamer is held back one step so that it never receives a token past the stop.
Criteria are called once per new token, as in plain decoding; stateful ones see the same calls they would there.
"""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .rank_agreement import RankAgreement, stops_alike


class HeldBackStreamer(BaseStreamer):
    """Passes the prompt on at once, and each step's tokens only once the stopping check has vetted them."""

    def __init__(self, streamer: BaseStreamer):
        self.streamer = streamer
        self.prompt_seen = False
        self.pending: list[torch.Tensor] = []

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.pending.append(value.reshape(1, -1))
        else:
            self.prompt_seen = True
            self.streamer.put(value)

    def release(self, count: int) -> None:
        """Send the first `count` held tokens on and drop the rest."""
        if self.pending and count > 0:
            self.streamer.put(torch.cat(self.pending, dim=-1)[:, :count])
        self.pending = []

    def end(self) -> None:
        self.streamer.end()


class PerTokenStopping(StoppingCriteriaList):
    """The generation's own criteria, evaluated on each prefix a step added; records where they first stop. On a
    spread target whose criteria can differ per rank (`max_time`, a custom one), rank 0's criteria decide for every
    rank (`agreement`)."""

    def __init__(
        self,
        criteria: StoppingCriteriaList,
        prompt_length: int,
        streamer: HeldBackStreamer | None,
        agreement: RankAgreement | None = None,
    ):
        super().__init__(criteria)
        self.checked_length = prompt_length
        self.streamer = streamer
        self.stop_at: int | None = None
        self.agreement = agreement if agreement is not None and not stops_alike(criteria) else None

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        end = input_ids.shape[1]
        if self.agreement is None:
            kept, done = self._first_stop(input_ids, scores, **kwargs)
        else:

            def decided() -> torch.Tensor:
                kept, done = self._first_stop(input_ids, scores, **kwargs)
                return torch.cat([torch.tensor([kept]), done.cpu().long()])

            decision = self.agreement.decide(
                "Checking the stopping criteria", decided, 1 + input_ids.shape[0], everyone_computes=False
            )
            kept, done = int(decision[0]), decision[1:].bool().to(input_ids.device)
        if kept < end:
            self.stop_at = kept
        if self.streamer is not None:
            self.streamer.release(kept - self.checked_length)
        self.checked_length = end
        return done

    def _first_stop(self, input_ids: torch.LongTensor, scores, **kwargs) -> tuple[int, torch.BoolTensor]:
        """The criteria's verdict on each new prefix in order: the length kept (the first they stop at, else all)
        and their verdict there."""
        end = input_ids.shape[1]
        if end == self.checked_length + 1:  # one new token (a step that verified no draft): as plain decoding asks
            return end, super().__call__(input_ids, scores, **kwargs)
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for length in range(self.checked_length + 1, end + 1):
            prefix_scores = scores[: len(scores) - (end - length)] if scores else scores
            done = super().__call__(input_ids[:, :length], prefix_scores, **kwargs)
            if bool(done.all()):
                return length, done
        return end, done

    def finish(self, output, cache: Cache, prompt_length: int):
        """Cut `generate`'s output and the target cache back to where the criteria stopped (no-op if at the end)."""
        if self.stop_at is None:
            return output
        cache.crop(self.stop_at - 1)  # the cache holds every token but the newest
        if isinstance(output, torch.Tensor):
            return output[:, : self.stop_at]
        output.sequences = output.sequences[:, : self.stop_at]
        kept = self.stop_at - prompt_length
        for name in ("scores", "logits", "attentions", "hidden_states"):
            if getattr(output, name, None) is not None:
                setattr(output, name, getattr(output, name)[:kept])
        return output
