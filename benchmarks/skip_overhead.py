"""What a step that skips drafting costs: speculative generate() with drafting always skipped, against plain decoding.

    python benchmarks/skip_overhead.py [--prompts 8] [--repeats 6] [--max-new-tokens 128]

The adaptive schedule decodes plainly when drafting loses, but such a step still runs inside transformers' assisted
loop, with the rewindable cache and the feature-capture hook. This forces every step to skip (the shipped
HyperDFlash drafter never drafts), so the ratio is that overhead alone: the best an adaptive run can do when no draft
pays. Prints, per prompt, the median over interleaved repeats of plain / speculative time, by the wall clock and by
the process's CPU time (one torch thread, so CPU time is the work done, without what other load on a shared machine
adds), and their medians over prompts.
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
from hf_hyperdflash.prompts import encode_prompt, load_prompts

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(call: Callable[[], object]) -> dict[str, float]:
    """Seconds `call()` took by each clock."""
    start = {name: clock() for name, clock in CLOCKS.items()}
    call()
    return {name: clock() - start[name] for name, clock in CLOCKS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype=torch.float32).eval()
    ratios: dict[str, list[float]] = {name: [] for name in CLOCKS}
    with mock.patch.object(AdaptiveDraftPolicy, "should_draft", lambda self: False):
        for chat in load_prompts("sharegpt", "held_out", args.prompts, max_chars=2000):
            input_ids = torch.tensor([encode_prompt(tokenizer, chat, enable_thinking=False)])
            per_repeat: dict[str, list[float]] = {name: [] for name in CLOCKS}
            decode = functools.partial(target.generate, input_ids, max_new_tokens=args.max_new_tokens)
            for repeat in range(args.repeats):  # alternating which runs first, so a drift favours neither
                if repeat % 2:
                    skipping, plain = timed(functools.partial(decode, assistant_model=drafter)), timed(decode)
                else:
                    plain, skipping = timed(decode), timed(functools.partial(decode, assistant_model=drafter))
                for name in CLOCKS:
                    per_repeat[name].append(plain[name] / skipping[name])
            for name in CLOCKS:
                ratios[name].append(statistics.median(per_repeat[name]))
    for name, values in ratios.items():
        print(f"always skipping, speed over plain decoding per prompt ({name} clock): ", end="")
        print(f"{', '.join(f'{r:.3f}' for r in values)}; median {statistics.median(values):.3f}x")


if __name__ == "__main__":
    main()
