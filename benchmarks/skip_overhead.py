"""What a step that skips drafting costs: speculative generate() with drafting always skipped, against plain decoding.

    python benchmarks/skip_overhead.py [--prompts 8] [--repeats 6] [--max-new-tokens 128]

The adaptive schedule decodes plainly when drafting loses. A wait shorter than 16 steps runs in transformers' assisted
loop, with the rewindable cache and the feature-capture hook: "in the assisted loop" forces every step to skip there
(the shipped HyperDFlash drafter never drafts), so its ratio is that overhead alone. A longer wait inside a call runs
as a plain stretch, in plain decoding's own loop (`modeling/stretches.py`): "in 64-step waits inside a call" forces
a 64-step wait after every step the assisted loop runs (each wait ends, as a probe would, with a step of the assisted
loop, here one that skips drafting too), so its ratio is plain stretches' overhead, switching loops included. A call
whose every step falls in the schedule's wait runs plain decoding's loop from its start: "whole call". Prints, per
prompt, the median over interleaved repeats of plain / speculative time, by the wall clock, by the process's CPU
time (one torch thread), and per step: the median interval between consecutive target forwards after the prefill,
which a burst of load on a shared machine moves far less than a whole call's time (calls here scatter by 10-20%
from one repeat to the next, and whole-call medians over 8 prompts by 2%: too coarse for a 1% question), and the
fastest plain call over the fastest other one; then their medians over prompts. Plain decoding timed a second time,
interleaved like the others, is the control: its ratios are 1.00x but for this run's noise, so a way's ratio
within the control's distance of 1.00x is no measured cost.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.modeling.draft_policy import AdaptiveDraftPolicy
from hf_hyperdflash.modeling.step_timer import decode_step_seconds
from hf_hyperdflash.prompts import encode_prompt, load_prompts

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
MEASURES = (*CLOCKS, "per step")
WAIT = 64  # steps of each wait "in waits inside a call"


def _wait_after_each_step(self, step) -> None:
    """After each step the assisted loop runs, a wait of `WAIT` steps (which plain stretches run)."""
    self.plain_steps_left = WAIT


SKIPPING = {  # how the schedule is forced to skip every step
    "in the assisted loop": {"should_draft": lambda self: False},
    f"in {WAIT}-step waits inside a call": {
        "decodes_plainly": lambda self, steps: False,
        "should_draft": lambda self: False,
        "record": _wait_after_each_step,
    },
    "whole call": {"decodes_plainly": lambda self, steps: True},
}


# The fastest of each call's repeats, plain's over the other's: on a shared machine whose speed drifts by 10% within
# minutes (a repeat's ratio then scatters by as much), the fastest run of deterministic CPU work is the one least
# slowed by others, and its ratio the steadiest.
BEST = "best of repeats, wall clock"
CONTROL = "plain decoding again, the control"  # 1.00x but for noise: how finely this run resolves the others


def timed(call: Callable[[], object], target: torch.nn.Module) -> dict[str, float]:
    """Seconds `call()` took by each clock, and its median step: from one target forward's start to the next's."""
    forward_starts: list[float] = []
    hook = target.register_forward_pre_hook(lambda *_: forward_starts.append(time.perf_counter()))
    start = {name: clock() for name, clock in CLOCKS.items()}
    try:
        call()
    finally:
        hook.remove()
    seconds = {name: clock() - start[name] for name, clock in CLOCKS.items()}
    seconds["per step"] = statistics.median(decode_step_seconds(forward_starts))
    return seconds


def skipping_call(decode: Callable, drafter, patches: dict[str, Callable]) -> Callable[[], object]:
    def call():
        with mock.patch.multiple(AdaptiveDraftPolicy, **patches):
            return decode(assistant_model=drafter)

    return call


def parse_arguments(description: str, prompts: int) -> argparse.Namespace:
    """This folder's timing benchmarks' options: how many held-out prompts, repeats and new tokens."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    return parser.parse_args()


def load_pair(drafter_path) -> tuple:
    """The shipped tokenizer and target with the drafter at `drafter_path`, in float32 on one torch thread."""
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(drafter_path, dtype=torch.float32).eval()
    return tokenizer, target, drafter


def main() -> None:
    args = parse_arguments(__doc__, prompts=8)
    tokenizer, target, drafter = load_pair(reference.drafter_path("hyperdflash"))
    ways = [CONTROL, *SKIPPING]
    ratios = {(way, name): [] for way in ways for name in (*MEASURES, BEST)}
    for chat in load_prompts("sharegpt", "held_out", args.prompts, max_chars=2000):
        input_ids = torch.tensor([encode_prompt(tokenizer, chat, enable_thinking=False)])
        decode = functools.partial(target.generate, input_ids, max_new_tokens=args.max_new_tokens)
        runs = {"plain": decode, CONTROL: decode}
        runs |= {way: skipping_call(decode, drafter, patches) for way, patches in SKIPPING.items()}
        per_repeat = {(way, name): [] for way in ways for name in MEASURES}
        wall = {name: [] for name in runs}
        for repeat in range(args.repeats):  # the order rotates, so a drift favours none
            order = list(runs)[repeat % len(runs) :] + list(runs)[: repeat % len(runs)]
            seconds = {name: timed(runs[name], target) for name in order}
            for way, name in per_repeat:
                per_repeat[way, name].append(seconds["plain"][name] / seconds[way][name])
            for name in runs:
                wall[name].append(seconds[name]["wall"])
        for key, values in per_repeat.items():
            ratios[key].append(statistics.median(values))
        for way in ways:
            ratios[way, BEST].append(min(wall["plain"]) / min(wall[way]))
    for (way, name), values in ratios.items():
        measure = name if name in ("per step", BEST) else f"{name} clock"
        print(f"{way if way == CONTROL else f'always skipping ({way})'}, ", end="")
        print(f"speed over plain decoding per prompt ({measure}): ", end="")
        print(f"{', '.join(f'{r:.3f}' for r in values)}; median {statistics.median(values):.3f}x")


if __name__ == "__main__":
    main()
