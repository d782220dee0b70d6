"""Per-step drafting cost against context length, with and without `context_window`; lossless at the longest.

    python benchmarks/drafter_context.py [--contexts 512 2048 8192] [--window 512] [--steps 20]

A drafter with wide attention (16 heads of 64, the case where full-context cost grows fastest) on a tiny stock
V4 target. For each context length the drafter's context cache is filled with that many positions, then one
drafting step (a block forward on one new verified position, as in generation) is timed `--steps` times;
the median is reported, with its ratio to the shortest context. The windowed drafter is then checked lossless
through `generate()` on a prompt of the longest context length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hf_hyperdflash import HyperDFlashForDrafting
from hf_hyperdflash.testing import tiny_deepseek_v4

WIDE_ATTENTION = {"num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "block_size": 8}


def median_step_seconds(drafter: HyperDFlashForDrafting, context: int, steps: int) -> float:
    hidden = drafter.config.hidden_size
    generator = torch.Generator().manual_seed(context)
    cache = drafter.make_context_cache()
    with torch.no_grad():
        for start in range(0, context, 1024):  # fill the cache as a long prefill would
            end = min(context, start + 1024)
            features = torch.randn(1, end - start, drafter.config.hc_mult, hidden, generator=generator)
            positions = torch.arange(start, end)[None]
            drafter(
                torch.randn(1, 1, hidden, generator=generator), features, positions, torch.tensor([[end]]), cache=cache
            )
        seconds = []
        for step in range(steps):
            position = context + step
            features = torch.randn(1, 1, drafter.config.hc_mult, hidden, generator=generator)
            anchor = torch.randn(1, 1, hidden, generator=generator)
            start = time.perf_counter()
            drafter(anchor, features, torch.tensor([[position]]), torch.tensor([[position + 1]]), cache=cache)
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    target = tiny_deepseek_v4(seed=0, max_position_embeddings=4 * max(args.contexts))
    torch.manual_seed(0)
    drafters = {
        "full context": HyperDFlashForDrafting.from_target(target, context_window=None, **WIDE_ATTENTION).eval(),
        f"window {args.window}": HyperDFlashForDrafting.from_target(
            target, context_window=args.window, **WIDE_ATTENTION
        ).eval(),
    }
    report: dict = {"draft_ms": {}, "ratio_to_shortest": {}}
    for name, drafter in drafters.items():
        median_step_seconds(drafter, args.contexts[0], 3)  # warm-up
        milliseconds = {n: 1000 * median_step_seconds(drafter, n, args.steps) for n in args.contexts}
        report["draft_ms"][name] = {n: round(ms, 2) for n, ms in milliseconds.items()}
        shortest = milliseconds[args.contexts[0]]
        report["ratio_to_shortest"][name] = {n: round(ms / shortest, 2) for n, ms in milliseconds.items()}

    windowed = drafters[f"window {args.window}"]
    prompt = torch.randint(
        3, target.config.vocab_size, (1, max(args.contexts)), generator=torch.Generator().manual_seed(0)
    )
    plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
    speculative = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=windowed)
    report["lossless_at_longest_context"] = bool(torch.equal(plain, speculative))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
