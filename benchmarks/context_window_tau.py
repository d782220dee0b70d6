"""tau against the drafter's `context_window` on long held-out conversations, with the shipped pair.

    python benchmarks/context_window_tau.py [--prompts 8] [--min-tokens 1024] [--windows 64 128 256 512 1024]
    python benchmarks/context_window_tau.py --main-prompts    # the main table's prompts, both block drafters

Each prompt is a held-out ShareGPT conversation up to its last user turn, rendered with the chat template, between
`--min-tokens` and `--max-tokens` long (the reference target reads up to 4,096 positions). The shipped HyperDFlash
drafter drafts with each window in turn (None = the whole context); every output is checked against plain greedy
decoding, and tau is pooled over the prompts' verify steps. `--main-prompts` instead runs the main table's
prompts (the first 20 held-out ShareGPT first turns, 128 new tokens) with both shipped block drafters, whole
context against `--windows` (default there: 512), to see what a default window changes on the published figures.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.evaluation.datasets import load_prompt_set
from hf_hyperdflash.modeling.generation_stats import mean_accepted_length
from hf_hyperdflash.prompts import encode_prompt
from hf_hyperdflash.sharegpt import load_conversations


def long_prompts(tokenizer, count: int, min_tokens: int, max_tokens: int) -> list[list[int]]:
    prompts = []
    for conversation in load_conversations("held_out"):
        messages = list(conversation.messages)
        while messages and messages[-1]["role"] != "user":
            messages.pop()
        if not messages:
            continue
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if min_tokens <= len(ids) <= max_tokens:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


def pooled_tau(target, drafter, prompts: list[list[int]], window: int | None, new_tokens: int, plain=None) -> dict:
    """tau over every verify step of `prompts` with the drafter's window set to `window`; lossless count."""
    drafter.config.context_window = window
    accepted, identical = [], 0
    for index, prompt in enumerate(prompts):
        output = target.generate(
            torch.tensor([prompt]), assistant_model=drafter, max_new_tokens=new_tokens, do_sample=False
        )
        identical += int(plain is None or torch.equal(output, plain[index]))
        accepted += drafter.last_generation_stats.accepted_per_step
    return {"tau": round(mean_accepted_length(accepted), 3), "lossless": f"{identical}/{len(prompts)}"}


def main_prompts(tokenizer, target, windows: list[int]) -> dict:
    prompts = [encode_prompt(tokenizer, m, False) for m in load_prompt_set("sharegpt", limit=20, max_chars=4000)]
    report = {}
    for kind in reference.DRAFTER_KINDS:
        drafter = AutoModel.from_pretrained(reference.drafter_path(kind), dtype=torch.float32).eval()
        report[kind] = {str(w): pooled_tau(target, drafter, prompts, w, 128)["tau"] for w in [None, *windows]}
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=3500)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--windows", type=int, nargs="+")
    parser.add_argument("--main-prompts", action="store_true", help="the main table's prompts instead")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    if args.main_prompts:
        report = main_prompts(tokenizer, target, args.windows or [512])
        print(json.dumps(report, indent=2))
        return report
    args.windows = args.windows or [64, 128, 256, 512, 1024]
    drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype=torch.float32).eval()
    prompts = long_prompts(tokenizer, args.prompts, args.min_tokens, args.max_tokens)
    settings = dict(max_new_tokens=args.new_tokens, do_sample=False)
    plain = [target.generate(torch.tensor([p]), **settings) for p in prompts]
    report = {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts], "tau": {}, "lossless": {}}
    for window in [None, *args.windows]:
        result = pooled_tau(target, drafter, prompts, window, args.new_tokens, plain)
        report["tau"][str(window)], report["lossless"][str(window)] = result["tau"], result["lossless"]
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
