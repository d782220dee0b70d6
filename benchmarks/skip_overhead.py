"""What a step that skips drafting costs: speculative generate() with drafting always skipped, against plain decoding.

    python benchmarks/skip_overhead.py [--prompts 8] [--repeats 6] [--max-new-tokens 128]

The adaptive schedule decodes without the drafter while drafting does not pay; those steps run in transformers'
assisted loop, with the rewindable cache and the feature-capture hook. Here every step skips (the shipped HyperDFlash
drafter never drafts), so the ratio is that overhead alone. Prints, per prompt, the median over interleaved repeats
of plain / speculative time, by the wall clock, by the process's CPU time (one torch thread), and per step: the median
interval between consecutive target forwards after the prefill, which a burst of load on a shared machine moves far
less than a whole call's time; and the fastest plain call over the fastest other one; then their medians over
prompts. Plain decoding timed a second time, interleaved like the others, is the control: its ratios are 1.00x but
for this run's noise, so a ratio within the control's distance of 1.00x is no measured cost.

    python benchmarks/skip_overhead.py --instructions --prompts 2   # counts instead of clocks

`--instructions` counts what each call executes under valgrind's callgrind (`callgrind.py`): one warm call, then one
counted, per way and prompt. Counts repeat to 0.01% (the control's row), so the overhead reads as it is.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from itertools import pairwise, product
from unittest import mock

import callgrind  # this folder's
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.modeling.draft_policy import AdaptiveDraftPolicy
from hf_hyperdflash.prompts import encode_prompt, load_prompts

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
MEASURES = (*CLOCKS, "per step")
INSTRUCTIONS = "instructions"
SKIPPING = {"in the assisted loop": {"should_draft": lambda self: False}}  # how the schedule is forced to skip


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
    steps = pairwise(forward_starts[1:])  # the prefill's forward is no step
    seconds["per step"] = statistics.median(later - earlier for earlier, later in steps)
    return seconds


def counted(call: Callable[[], object], target: torch.nn.Module) -> dict[str, float]:
    """Instructions `call()` executes, run once uncounted first (lazy set-ups, the allocator's caches)."""
    call()
    return {INSTRUCTIONS: callgrind.count(call)}


def measurement(args: argparse.Namespace) -> tuple[Callable, tuple[str, ...]]:
    """How each call is measured, and the names of what that gives: `timed`, or with --instructions `counted` (in
    this script run again under callgrind; this process then exits with that run's status)."""
    if not args.instructions:
        return timed, MEASURES
    if not callgrind.running_under_callgrind():
        sys.exit(callgrind.rerun_under_callgrind())
    return counted, (INSTRUCTIONS,)


def median_ratio(
    reference: Callable[[], object],
    other: Callable[[], object],
    measure: Callable,
    measures: Sequence[str],
    repeats: int,
    target: torch.nn.Module,
) -> dict[str, float]:
    """Per measure, the median over repeats of `reference`'s cost over `other`'s (`other`'s speed over it); the order
    alternates, so a drift favours neither."""
    per_repeat: dict[str, list[float]] = {name: [] for name in measures}
    for repeat in range(repeats):
        costs = {call: measure(call, target) for call in ((reference, other) if repeat % 2 else (other, reference))}
        for name in measures:
            per_repeat[name].append(costs[reference][name] / costs[other][name])
    return {name: statistics.median(values) for name, values in per_repeat.items()}


def print_ratios(label: str, ratios: dict[str, list[float]], instructions: bool) -> None:
    """A line per measure: `label`'s ratio per prompt and their median (counts to 4 digits: they resolve 0.01%)."""
    digits = 4 if instructions else 3
    for name, values in ratios.items():
        unit = name if name in ("per step", BEST, INSTRUCTIONS) else f"{name} clock"
        per_prompt = ", ".join(f"{ratio:.{digits}f}" for ratio in values)
        print(f"{label} per prompt ({unit}): {per_prompt}; median {statistics.median(values):.{digits}f}x")


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
    parser.add_argument(
        "--instructions", action="store_true", help="count instructions under valgrind instead of timing (1 repeat)"
    )
    args = parser.parse_args()
    if args.instructions:
        args.repeats = 1  # a count repeats itself
    return args


def load_pair(drafter_path) -> tuple:
    """The shipped tokenizer and target with the drafter at `drafter_path`, in float32 on one torch thread."""
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(drafter_path, dtype=torch.float32).eval()
    return tokenizer, target, drafter


def main() -> None:
    args = parse_arguments(__doc__, prompts=8)
    measure, measures = measurement(args)
    tokenizer, target, drafter = load_pair(reference.drafter_path("hyperdflash"))
    ways = [CONTROL, *SKIPPING]
    best = () if args.instructions else (BEST,)
    ratios = {(way, name): [] for way in ways for name in (*measures, *best)}
    for chat in load_prompts("sharegpt", "held_out", args.prompts, max_chars=2000):
        input_ids = torch.tensor([encode_prompt(tokenizer, chat, enable_thinking=False)])
        decode = functools.partial(target.generate, input_ids, max_new_tokens=args.max_new_tokens)
        runs = {"plain": decode, CONTROL: decode}
        runs |= {way: skipping_call(decode, drafter, patches) for way, patches in SKIPPING.items()}
        costs = {name: [] for name in runs}  # a dict of measures per repeat
        for repeat in range(args.repeats):  # the order rotates, so a drift favours none
            for name in list(runs)[repeat % len(runs) :] + list(runs)[: repeat % len(runs)]:
                costs[name].append(measure(runs[name], target))
        for way, name in product(ways, measures):
            pairs = zip(costs["plain"], costs[way], strict=True)
            ratios[way, name].append(statistics.median(plain[name] / other[name] for plain, other in pairs))
        for way, _ in product(ways, best):
            fastest = {name: min(repeat["wall"] for repeat in costs[name]) for name in ("plain", way)}
            ratios[way, BEST].append(fastest["plain"] / fastest[way])
    for way in ways:
        label = way if way == CONTROL else f"always skipping ({way})"
        by_measure = {name: values for (of, name), values in ratios.items() if of == way}
        print_ratios(f"{label}, speed over plain decoding", by_measure, args.instructions)


if __name__ == "__main__":
    main()
