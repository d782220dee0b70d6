"""Native MTP as a drafter for the reference target: lossless and tau at k = 1..3 on held-out prompts, T=0.

python benchmarks/mtp.py [--prompts 20] [--max-new-tokens 128] [--depths 1 2 3] [--output-dir runs/benchmarks/mtp]

A preset of `hyperdflash eval` (hf_hyperdflash.evaluation.command): plain decoding against native MTP only, greedy,
non-thinking chat, held-out ShareGPT prompts, every step drafting k tokens (the constant schedule). Exits with status 1
if an output differs from plain decoding.
"""

from __future__ import annotations

import argparse
import sys

from hf_hyperdflash.evaluation import command


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-dir", default="runs/benchmarks/mtp")
    args = parser.parse_args()
    return command.main(
        [
            "--no-reference-drafters",
            "--dspark", "none",
            "--schedules", "constant",
            "--mtp-steps", *map(str, args.depths),
            "--datasets", "sharegpt",
            "--num-prompts", str(args.prompts),
            "--max-prompt-chars", "2000",
            "--temperatures", "0",
            "--modes", "non-thinking",
            "--max-new-tokens", str(args.max_new_tokens),
            "--repeats", str(args.repeats),
            "--threads", str(args.threads),
            "--output-dir", args.output_dir,
        ]
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
