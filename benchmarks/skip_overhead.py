"""What a step that skips drafting costs: speculative generate() with drafting always skipped, against plain decoding.

    python benchmarks/skip_overhead.py [--prompts 4] [--repeats 5] [--max-new-tokens 128]

The adaptive schedule decodes plainly when drafting loses, but such a step still runs inside transformers' assisted
loop, with the rewindable cache and the feature-capture hook. This forces every step to skip (the shipped
HyperDFlash drafter never drafts), so the ratio is that overhead alone: the best an adaptive run can do when no draft
pays. Prints the per-prompt medians of plain / speculative time over interleaved repeats, and their median.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.modeling.draft_policy import AdaptiveDraftPolicy
from hf_hyperdflash.prompts import encode_prompt, load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype=torch.float32).eval()
    ratios = []
    with mock.patch.object(AdaptiveDraftPolicy, "should_draft", lambda self: False):
        for chat in load_prompts("sharegpt", "held_out", args.prompts, max_chars=2000):
            input_ids = torch.tensor([encode_prompt(tokenizer, chat, enable_thinking=False)])
            per_repeat = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                target.generate(input_ids, max_new_tokens=args.max_new_tokens)
                plain = time.perf_counter() - start
                start = time.perf_counter()
                target.generate(input_ids, assistant_model=drafter, max_new_tokens=args.max_new_tokens)
                per_repeat.append(plain / (time.perf_counter() - start))
            ratios.append(statistics.median(per_repeat))
    print(f"always skipping, speed over plain decoding per prompt: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"median: {statistics.median(ratios):.3f}x")


if __name__ == "__main__":
    main()
