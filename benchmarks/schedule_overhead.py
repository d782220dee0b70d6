"""What the adaptive schedule's own bookkeeping costs a step: native MTP k=1 under "adaptive" made to draft every
step, against the fixed schedule ("constant"), on the shipped pair.

    python benchmarks/schedule_overhead.py [--prompts 6] [--repeats 6] [--max-new-tokens 128]

Forced to draft every step, the adaptive schedule verifies what the fixed one does (k=1: its draft, unless it cuts
it), so the ratio is the price of choosing: the confidence calibration, the step-cost fit, the window and long-run
figures it reads every step. Native MTP k=1 is the drafter where that price shows most: it gains least per step.
Prints, per prompt, the median over interleaved repeats of constant / adaptive time by the wall clock, by CPU time
and per step (the median interval between consecutive target forwards after the prefill; `skip_overhead.py` says
why), then their medians over prompts.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from unittest import mock

import torch
from skip_overhead import MEASURES, timed  # this folder's: what it times, and how
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.modeling.draft_policy import AdaptiveDraftPolicy
from hf_hyperdflash.prompts import encode_prompt, load_prompts

SCHEDULES = ("constant", "adaptive")


def under(schedule: str, decode, drafter):
    """A call of `decode` under `schedule`, drafting every step."""

    def call():
        drafter.generation_config.num_assistant_tokens_schedule = schedule
        with mock.patch.object(AdaptiveDraftPolicy, "should_draft", lambda self: True):
            return decode(assistant_model=drafter)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(reference.mtp_path(), dtype=torch.float32).eval()
    drafter.generation_config.num_assistant_tokens = 1
    ratios: dict[str, list[float]] = {name: [] for name in MEASURES}
    for chat in load_prompts("sharegpt", "held_out", args.prompts, max_chars=2000):
        input_ids = torch.tensor([encode_prompt(tokenizer, chat, enable_thinking=False)])
        decode = functools.partial(target.generate, input_ids, max_new_tokens=args.max_new_tokens)
        per_repeat: dict[str, list[float]] = {name: [] for name in ratios}
        for repeat in range(args.repeats):  # the order alternates, so a drift favours neither
            order = SCHEDULES if repeat % 2 else SCHEDULES[::-1]
            seconds = {schedule: timed(under(schedule, decode, drafter), target) for schedule in order}
            for name in ratios:
                per_repeat[name].append(seconds["constant"][name] / seconds["adaptive"][name])
        for name, values in per_repeat.items():
            ratios[name].append(statistics.median(values))
    for name, values in ratios.items():
        measure = name if name == "per step" else f"{name} clock"
        print(f"adaptive drafting every step, speed over constant per prompt ({measure}): ", end="")
        print(f"{', '.join(f'{r:.3f}' for r in values)}; median {statistics.median(values):.3f}x")


if __name__ == "__main__":
    main()
