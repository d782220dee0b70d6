"""Native MTP as a drafter for the reference target: lossless and tau at k = 1..3 on held-out prompts, T=0.

python benchmarks/mtp.py [--prompts 20] [--max-new-tokens 128] [--depths 1 2 3]
"""

from __future__ import annotations

import argparse

import torch
from tqdm.auto import tqdm
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import hf_hyperdflash  # noqa: F401  (generate() integration)
from hf_hyperdflash import reference
from hf_hyperdflash.evaluation.prompts import chat_prompt_ids, held_out_prompts
from hf_hyperdflash.evaluation.runner import compare_with_plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    mtp = AutoModel.from_pretrained(reference.mtp_path(), trust_remote_code=True, dtype=torch.float32).eval()
    prompts = [chat_prompt_ids(tokenizer, p) for p in held_out_prompts(args.prompts)]
    print(f"{args.prompts} held-out prompts, greedy, {args.max_new_tokens} new tokens")
    print("| k | lossless | tau | acceptance per position | speedup |")
    print("|---|---|---|---|---|")
    for depth in args.depths:
        mtp.generation_config.num_assistant_tokens = depth
        with tqdm(total=len(prompts), desc=f"MTP k={depth}", leave=False) as progress:
            result = compare_with_plain(f"mtp-{depth}", target, mtp, prompts, args.max_new_tokens, progress=progress)
        acceptance = ", ".join(f"{rate:.2f}" for rate in result.acceptance_per_position)
        row = [str(depth), f"{result.lossless}/{result.prompts}", f"{result.tau:.2f}", acceptance]
        print("| " + " | ".join(row) + f" | {result.speedup:.2f}x |")


if __name__ == "__main__":
    main()
