"""What a verify forward's width costs a batch: the shipped target's forward of W positions per row over a cache,
relative to its one-position forward (a plain batched step), at several batch sizes.

    python benchmarks/verify_width_cost.py --threads 1

The adaptive schedule's batch costs (`DraftCosts.for_batch`) rest on this: the ratio at width W is about
`1 + verify_cost * (W - 1)` whatever the batch size, because every row's extra positions attend over the same cache.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from hf_hyperdflash import reference


@torch.no_grad()
def forward_seconds(target, batch: int, width: int, context: int, repeats: int) -> float:
    ids = torch.randint(10, target.config.vocab_size, (batch, context))
    prefilled = target(ids, use_cache=True).past_key_values
    times = []
    for _ in range(repeats):
        cache = copy.deepcopy(prefilled)
        new = torch.randint(10, target.config.vocab_size, (batch, width))
        start = time.perf_counter()
        target(new, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    print("| batch | plain step (ms) | " + " | ".join(f"width {w}" for w in args.widths) + " |")
    print("|---" * (2 + len(args.widths)) + "|")
    for batch in args.batch_sizes:
        plain = forward_seconds(target, batch, 1, args.context, args.repeats)
        ratios = [forward_seconds(target, batch, w, args.context, args.repeats) / plain for w in args.widths]
        print(f"| {batch} | {plain * 1000:.1f} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
