"""Greedy speculative output against plain decoding in half precision, with two controls: is it ours or the target's?

    python benchmarks/bf16_divergence.py [--prompts 8] [--prompt TEXT ...] [--max-new-tokens 256]
                                         [--dtypes bfloat16 float16 float32] [--lookup-tokens 7] [--threads 1]

The shipped pair (reference target, HyperDFlash drafter; `dtype="auto"` loads their bf16 weights) on CPU, greedy, on
examples/quickstart.py's prompt and the first `--prompts` held-out ShareGPT prompts (the lossless benchmark's, in the
chat format). A k-token verify forward matches k one-token forwards to ~3e-7 in fp32, so there every output must be
plain decoding's; in half precision it rounds differently, so a near-tied argmax can flip and the texts part. Three
ways to decode each prompt, each against plain decoding in the same dtype:

- `hyperdflash`: our drafter (its default draft schedule);
- `prompt lookup` (control): transformers' own prompt lookup (`prompt_lookup_num_tokens=--lookup-tokens`) on the
  same target under the package, so the same multi-token verify forwards through transformers' loop, another drafter;
- `two-chunk prefill` (control): plain decoding whose prompt is prefilled in two forwards (its first half, then the
  rest on that cache) instead of one: the rounding of a multi-token forward alone, no drafter at all.

If ours parts from plain decoding more often, or earlier, than the controls, that is ours to fix. Prints one row per
prompt: the first new token that differs (0-based) of the plain output's length, or "same"; then the identical
share per column.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from hf_hyperdflash import reference
from hf_hyperdflash.evaluation.prompts import chat_prompt_ids, held_out_prompts
from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT

QUICKSTART_PROMPT = "How do I make a good cup of coffee at home?"  # examples/quickstart.py's
WAYS = ("hyperdflash", "prompt lookup", "two-chunk prefill")


def first_difference(plain: list[int], other: list[int]) -> int | None:
    """Index of the first new token where the two outputs differ (a length difference counts), None if identical."""
    for index, (a, b) in enumerate(zip(plain, other, strict=False)):
        if a != b:
            return index
    return None if len(plain) == len(other) else min(len(plain), len(other))


def two_chunk_prefill(target: PreTrainedModel, ids: torch.LongTensor, settings: dict) -> torch.LongTensor:
    """Plain greedy decoding after prefilling the prompt's first half alone, then the rest on that cache."""
    half = ids.shape[1] // 2
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(ids[:, :half], **{CACHE_ARGUMENT: cache}, use_cache=True)
    return target.generate(ids, **settings, **{CACHE_ARGUMENT: cache})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts, besides the quickstart's")
    parser.add_argument("--prompt", action="append", default=[], help="a further user message (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    parser.add_argument("--lookup-tokens", type=int, default=7, help="prompt lookup's draft length (the drafter's)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    texts = {"quickstart": QUICKSTART_PROMPT}
    texts.update({f"held-out {i + 1}": prompt for i, prompt in enumerate(held_out_prompts(args.prompts))})
    texts.update({f"--prompt {i + 1}": prompt for i, prompt in enumerate(args.prompt)})
    prompts = {name: chat_prompt_ids(tokenizer, text) for name, text in texts.items()}
    settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    columns = [f"{dtype}: {way}" for dtype in args.dtypes for way in WAYS]
    table: dict[str, dict[str, tuple[int | None, int]]] = {name: {} for name in prompts}

    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=dtype).eval()
        drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype=dtype).eval()
        try:  # not every target runs in every dtype on every device
            target.generate(prompts["quickstart"], max_new_tokens=2, do_sample=False)
        except RuntimeError as error:
            print(f"  {dtype_name}: plain decoding of the target fails ({error}); left out", flush=True)
            columns = [c for c in columns if not c.startswith(f"{dtype_name}:")]
            continue
        for name, ids in prompts.items():
            plain = target.generate(ids, **settings)[0, ids.shape[1] :].tolist()
            outputs = {
                "hyperdflash": target.generate(ids, assistant_model=drafter, **settings),
                "prompt lookup": target.generate(ids, prompt_lookup_num_tokens=args.lookup_tokens, **settings),
                "two-chunk prefill": two_chunk_prefill(target, ids, settings),
            }
            for way, output in outputs.items():
                table[name][f"{dtype_name}: {way}"] = (
                    first_difference(plain, output[0, ids.shape[1] :].tolist()),
                    len(plain),
                )
            print(f"  {name}, {dtype_name}: done", flush=True)

    print(f"\nfirst differing new token (0-based) against plain decoding, greedy, {args.max_new_tokens} new tokens")
    print("| prompt | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in table.items():
        cells = ["same" if row[c][0] is None else f"{row[c][0]} of {row[c][1]}" for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    identical = [sum(row[c][0] is None for row in table.values()) for c in columns]
    print("| identical | " + " | ".join(f"{n}/{len(table)}" for n in identical) + " |")


if __name__ == "__main__":
    main()
