"""What the adaptive schedule's own bookkeeping costs a step: native MTP k=1 under "adaptive" made to draft every
step, against the fixed schedule ("constant"), on the shipped pair.

    python benchmarks/schedule_overhead.py [--prompts 6] [--repeats 6] [--max-new-tokens 128] [--instructions]

Forced to draft every step, the adaptive schedule verifies what the fixed one does (k=1: its draft, unless it cuts
it), so the ratio is the price of choosing: the confidence calibration, the step-cost fit, the window and long-run
figures it reads every step. Native MTP k=1 is the drafter where that price shows most: it gains least per step.
Prints, per prompt, the median over interleaved repeats of constant / adaptive time by the wall clock, by CPU time
and per step (the median interval between consecutive target forwards after the prefill; `skip_overhead.py` says
why), then their medians over prompts; with --instructions, the ratio of instructions executed instead
(`skip_overhead.py` says how).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from skip_overhead import (  # this folder's
    load_pair,
    measurement,
    median_ratio,
    parse_arguments,
    print_ratios,
    skipping_call,
)

from hf_hyperdflash import reference
from hf_hyperdflash.prompts import encode_prompt, load_prompts

ALWAYS_DRAFTING = {"should_draft": lambda self: True}


def main() -> None:
    args = parse_arguments(__doc__, prompts=6)
    measure, measures = measurement(args)
    tokenizer, target, drafter = load_pair(reference.mtp_path())
    drafter.generation_config.num_assistant_tokens = 1
    ratios: dict[str, list[float]] = {name: [] for name in measures}
    for chat in load_prompts("sharegpt", "held_out", args.prompts, max_chars=2000):
        input_ids = torch.tensor([encode_prompt(tokenizer, chat, enable_thinking=False)])
        decode = functools.partial(target.generate, input_ids, max_new_tokens=args.max_new_tokens)

        def under(schedule: str, decode=decode) -> Callable[[], object]:
            def call():
                drafter.generation_config.num_assistant_tokens_schedule = schedule
                return skipping_call(decode, drafter, ALWAYS_DRAFTING)()

            return call

        pair = under("constant"), under("adaptive")
        for name, ratio in median_ratio(*pair, measure, measures, args.repeats, target).items():
            ratios[name].append(ratio)
    print_ratios("adaptive drafting every step, speed over constant", ratios, args.instructions)


if __name__ == "__main__":
    main()
