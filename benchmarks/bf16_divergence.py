"""Greedy speculative output against plain decoding, in bf16 and in fp32: where do the texts part?

    python benchmarks/bf16_divergence.py [--prompts 8] [--prompt TEXT ...] [--max-new-tokens 256]
                                         [--dtypes bfloat16 float32] [--schedules adaptive constant] [--threads 1]

The README's usage snippet with the shipped pair (reference target, HyperDFlash drafter; `dtype="auto"` loads their
bf16 weights) on CPU, greedy, on examples/quickstart.py's prompt and the first `--prompts` held-out ShareGPT prompts
(chat format, non-thinking). Each prompt is decoded plainly and with the drafter, both in the same dtype. A k-token
verify forward matches k one-token forwards to ~3e-7 in fp32, so there the outputs must be identical; in bf16 it
rounds differently, so a near-tied argmax can flip and the texts part from there on. Prints one row per prompt: the
first new token that differs (counted from 0) of the plain output's length, or "same"; then the share of identical
prompts per column.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.evaluation.prompts import chat_prompt_ids, held_out_prompts

QUICKSTART_PROMPT = "How do I make a good cup of coffee at home?"  # examples/quickstart.py's


def first_difference(plain: list[int], speculative: list[int]) -> int | None:
    """Index of the first new token where the two outputs differ (a length difference counts), None if identical."""
    for index, (a, b) in enumerate(zip(plain, speculative, strict=False)):
        if a != b:
            return index
    return None if len(plain) == len(speculative) else min(len(plain), len(speculative))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts, besides the quickstart's")
    parser.add_argument("--prompt", action="append", default=[], help="a further user message (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--schedules", nargs="+", default=["adaptive"], choices=["adaptive", "constant"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    texts = {"quickstart": QUICKSTART_PROMPT}
    texts.update({f"held-out {i + 1}": prompt for i, prompt in enumerate(held_out_prompts(args.prompts))})
    texts.update({f"--prompt {i + 1}": prompt for i, prompt in enumerate(args.prompt)})
    prompts = {name: chat_prompt_ids(tokenizer, text) for name, text in texts.items()}
    settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    columns = [f"{dtype}/{schedule}" for dtype in args.dtypes for schedule in args.schedules]
    table = {name: {} for name in prompts}

    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=dtype).eval()
        drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype=dtype).eval()
        for name, ids in prompts.items():
            plain = target.generate(ids, **settings)[0, ids.shape[1] :].tolist()
            for schedule in args.schedules:
                drafter.generation_config.num_assistant_tokens_schedule = schedule
                fast = target.generate(ids, assistant_model=drafter, **settings)[0, ids.shape[1] :].tolist()
                table[name][f"{dtype_name}/{schedule}"] = (first_difference(plain, fast), len(plain))
                print(f"  {name}, {dtype_name}, {schedule}: done", flush=True)

    print(f"\nfirst differing new token (0-based) of greedy speculative vs plain, {args.max_new_tokens} new tokens")
    print("| prompt | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in table.items():
        cells = ["same" if row[c][0] is None else f"token {row[c][0]} of {row[c][1]}" for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    identical = [sum(row[c][0] is None for row in table.values()) for c in columns]
    print("| identical | " + " | ".join(f"{n}/{len(table)}" for n in identical) + " |")


if __name__ == "__main__":
    main()
