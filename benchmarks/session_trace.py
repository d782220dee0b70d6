"""Where one chat session's steps go under the adaptive schedule: one drafter, held-out prompts, one call each, in
order, so that every call after the first starts from what the earlier ones learned.

    python benchmarks/session_trace.py [--prompts 20] [--max-new-tokens 256] [--temperature 1] [--drafter PATH]

Prints, per call, its new tokens, its drafted steps (probes, for a drafter that loses), the steps it skipped inside
transformers' assisted loop, and its plain stretches: each one's steps, marked `captured` when a drafted step
followed it in the call (the stretch then collected the target's features for it, 0.6% of a step each by
instruction count; "Counting instructions" in docs/results.md), `whole call` when the call never entered the
assisted loop. Then the same totals over the later calls. The schedule decides from timings, so a rerun on a busy
machine can trace a different session; sampling is seeded.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
from collections.abc import Iterator
from unittest import mock

import torch
from skip_overhead import load_pair  # this folder's

from hf_hyperdflash import reference
from hf_hyperdflash.modeling.candidate_generator import SpeculativeCandidateGenerator
from hf_hyperdflash.modeling.draft_policy import AdaptiveDraftPolicy
from hf_hyperdflash.prompts import encode_prompt, load_prompts


class CallTrace:
    """What the schedule did in the running call, noted by wrappers around its methods."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """A new call starts."""
        self.counts: collections.Counter[str] = collections.Counter()
        self.stretches: list[str] = []
        self._captured = False

    def drafted_or_skipped(self, step) -> None:
        self.counts["drafted" if step.drafter_forwards else "skipped in the assisted loop"] += 1

    def decoded_plainly(self, forward_features) -> None:
        self._captured = bool(forward_features)

    def plain_stretch(self, steps: int) -> None:
        kind = "captured" if self._captured else ("end" if self.counts else "whole call")
        self.counts[f"plain ({kind})"] += steps
        self.stretches.append(f"{steps} {kind}")
        self._captured = False


@contextlib.contextmanager
def traced(trace: CallTrace) -> Iterator[None]:
    """Inside, the schedule notes each step and stretch of the running call in `trace`."""
    record, skip = AdaptiveDraftPolicy.record, AdaptiveDraftPolicy.skip
    decoded_plainly = SpeculativeCandidateGenerator.decoded_plainly

    @functools.wraps(record)
    def noting_record(self, step):
        trace.drafted_or_skipped(step)
        return record(self, step)

    @functools.wraps(skip)
    def noting_skip(self, steps, step_seconds):
        trace.plain_stretch(steps)
        return skip(self, steps, step_seconds)

    @functools.wraps(decoded_plainly)
    def noting_decoded_plainly(self, forwards, first_forward_seconds, forward_features=()):
        trace.decoded_plainly(forward_features)
        return decoded_plainly(self, forwards, first_forward_seconds, forward_features)

    with (
        mock.patch.object(AdaptiveDraftPolicy, "record", noting_record),
        mock.patch.object(AdaptiveDraftPolicy, "skip", noting_skip),
        mock.patch.object(SpeculativeCandidateGenerator, "decoded_plainly", noting_decoded_plainly),
    ):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--drafter", default=str(reference.drafter_path("hyperdflash")))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer, target, drafter = load_pair(args.drafter)
    drafter.generation_config.num_assistant_tokens_schedule = "adaptive"
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    torch.manual_seed(args.seed)
    trace, later = CallTrace(), collections.Counter()
    with traced(trace):
        for call, chat in enumerate(load_prompts("sharegpt", "held_out", args.prompts, max_chars=2000)):
            input_ids = torch.tensor([encode_prompt(tokenizer, chat, enable_thinking=False)])
            trace.reset()
            output = target.generate(
                input_ids, assistant_model=drafter, max_new_tokens=args.max_new_tokens, **sampling
            )
            new_tokens = output.shape[1] - input_ids.shape[1]
            counts = dict(trace.counts)
            print(f"call {call}: {new_tokens} new tokens, {counts}, stretches: {', '.join(trace.stretches) or '-'}")
            if call > 0:
                later.update({"calls": 1, "new tokens": new_tokens, **counts})
    print(f"later calls: {dict(later)}")


if __name__ == "__main__":
    main()
