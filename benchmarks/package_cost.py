"""What loading the package costs plain decoding: the same target decoding plainly with the package's process-wide
changes in place, against stock transformers.

    python benchmarks/package_cost.py [--prompts 8] [--repeats 6] [--max-new-tokens 128]
    python benchmarks/package_cost.py --instructions --prompts 2   # counts instead of clocks (about 20 minutes)

Once loaded, the package changes two things for every model in the process: `generate()` is wrapped (to recognise
our drafters), and the sparse indexers break exact score ties by position (`modeling/indexer_ties.py`), so that a
verify forward selects what a one-token forward does. Plain decoding pays for both, and "never slower than plain
decoding" is owed to the user's plain decoding without the package, not to ours. "stock" undoes both for its calls.
Prints, per prompt, stock / with-the-package by the wall clock, CPU time and per step (interleaved repeats, as in
`skip_overhead.py`), or by instructions executed, then the median over prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from unittest import mock

import torch
from skip_overhead import load_pair, measurement, median_ratio, parse_arguments, print_ratios  # this folder's
from transformers import GenerationMixin

from hf_hyperdflash import reference
from hf_hyperdflash.modeling.indexer_ties import INDEXER_CLASSES, SCORER_CLASSES
from hf_hyperdflash.prompts import encode_prompt, load_prompts


def stock(decode: Callable[[], object]) -> Callable[[], object]:
    """`decode()` with `generate()` and the indexers as transformers ships them."""

    def call():
        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(GenerationMixin, "generate", GenerationMixin.generate.__wrapped__))
            for module in (*SCORER_CLASSES, *INDEXER_CLASSES):
                stack.enter_context(mock.patch.object(module, "forward", module.forward.__wrapped__))
            return decode()

    return call


def main() -> None:
    args = parse_arguments(__doc__, prompts=8)
    measure, measures = measurement(args)
    tokenizer, target, _ = load_pair(reference.drafter_path("hyperdflash"))
    ratios: dict[str, list[float]] = {name: [] for name in measures}
    for chat in load_prompts("sharegpt", "held_out", args.prompts, max_chars=2000):
        input_ids = torch.tensor([encode_prompt(tokenizer, chat, enable_thinking=False)])

        def decode(input_ids=input_ids):  # `generate` looked up per call: `stock` swaps it
            return target.generate(input_ids, max_new_tokens=args.max_new_tokens)

        for name, ratio in median_ratio(stock(decode), decode, measure, measures, args.repeats, target).items():
            ratios[name].append(ratio)
    print_ratios("plain decoding with the package, speed over stock transformers", ratios, args.instructions)


if __name__ == "__main__":
    main()
