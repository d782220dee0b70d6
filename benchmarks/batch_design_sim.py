"""How a batch shares its verify width: a simulation of the batch designs `benchmarks/batched.py` measures for real.

    python benchmarks/batch_design_sim.py

Each row is a text whose drafter, drafting from the anchor at column c, would have its first `a(c)` drafts accepted
(geometric with acceptance `p` per draft, drawn once per column, so a row alone and in a batch meet the same text).
A block holds `block - 1` drafts. One cache length for all rows; a row feeds its committed tokens past the cache, then
its drafts; the cache advances by the shortest run of committed inputs. Designs:

- shortest: every row keeps only the batch's shortest run (the design before);
- fixed: the forward is `block` wide; a row with u tokens past the cache drafts `block - u`;
- wide: the forward is as wide as the widest row needs (its tokens past the cache plus a whole block), at most
  `block + lead`; a row further ahead waits, fed only what it committed.

Printed per design and batch size: tau kept (the steps the batch's slowest row takes alone over the batch's steps),
token rows per verify forward relative to a whole-block forward of the batch (CPU cost grows with them), and tokens per
step per row over that relative width (the CPU's view of speed, up to the drafter's cost).
"""

from __future__ import annotations

import argparse
import random
import statistics


def row_text(rng: random.Random, length: int, p: float) -> list[int]:
    """a(c) for every anchor column c."""
    accepted = []
    for _ in range(length):
        a = 0
        while rng.random() < p:
            a += 1
        accepted.append(a)
    return accepted


def alone_steps(text: list[int], tokens: int, drafts: int) -> int:
    committed, steps = 0, 0
    while committed < tokens:
        committed += min(text[committed], drafts) + 1
        steps += 1
    return steps


def batch_steps(texts: list[list[int]], tokens: int, block: int, design: str, lead: int) -> tuple[int, float]:
    """(verify steps, mean forward width) of a batch until every row holds `tokens` tokens."""
    committed = [1] * len(texts)  # the first token comes from the prefill: one past the cache
    cache, steps, widths = 0, 0, []
    while min(committed) < tokens + 1:
        ahead = [c - cache for c in committed]
        width = block if design in ("fixed", "shortest") else min(max(ahead) + block - 1, block + lead)
        reach = []
        for row, text in enumerate(texts):
            u = ahead[row]
            if u > width:
                reach.append(width)
                continue
            drafts = min(width - u, block - 1)
            a = min(text[committed[row] - 1], drafts)
            committed[row] += a + 1
            reach.append(u + a)
        cache += min(reach)
        if design == "shortest":
            committed = [min(c, cache + 1) for c in committed]
        steps += 1
        widths.append(width)
    return steps, statistics.mean(widths)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--p", type=float, default=0.85, help="acceptance per draft (0.85: tau about 5 alone)")
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--trials", type=int, default=400)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    args = parser.parse_args(argv)
    designs = [("shortest", 0), ("fixed", 0), ("wide", 4), ("wide", 8), ("wide", 16)]
    print("| batch | design | tau kept | relative width | tokens per step per row / relative width |")
    print("|---|---|---|---|---|")
    for batch in args.batch_sizes:
        rng = random.Random(batch)
        texts_per_trial = [
            [row_text(rng, args.tokens + args.block + 64, args.p) for _ in range(batch)] for _ in range(args.trials)
        ]
        for design, lead in designs:
            kept, widths, rates = [], [], []
            for texts in texts_per_trial:
                slowest = max(alone_steps(text, args.tokens, args.block - 1) for text in texts)
                steps, width = batch_steps(texts, args.tokens, args.block, design, lead)
                kept.append(slowest / steps)
                widths.append(width / args.block)
                rates.append(args.tokens / steps / (width / args.block))
            name = design if design != "wide" else f"wide, lead <= {lead}"
            print(
                f"| {batch} | {name} | {statistics.mean(kept):.2f} | {statistics.mean(widths):.2f} "
                f"| {statistics.mean(rates):.2f} |"
            )


if __name__ == "__main__":
    main()
