"""The adaptive schedule's cost model on this machine: what a drafted step costs, in plain decoding steps.

    python benchmarks/draft_costs.py [--prompts 6] [--repeats 3] [--max-new-tokens 96] [--device cpu]

The schedule takes a step that runs the drafter `f` times and verifies `k` drafts to cost `1 + draft_cost * f +
verify_cost * k` plain steps (`modeling/draft_policy.py`). This script times, on the shipped reference pair at T=0
and interleaved with plain decoding, calls whose every step drafts and verifies exactly k drafts ("constant"
schedule): HyperDFlash for k = 1, 3, 5, 7, native MTP for k = 1, 2, 3, and DSpark for k = 1, 3, 5 (untrained, three
stages built on the reference target: its cost does not depend on its weights). A step's cost is the call's seconds
per target forward over plain decoding's seconds per token (medians over repeats, per prompt, then over prompts); the
least-squares lines through them give `verify_cost` (the HyperDFlash line's slope), HyperDFlash's `draft_cost` (its
intercept less 1), native MTP's (its slope less `verify_cost`) and DSpark's (its line's intercept less 1). Prints
the costs per k and the fitted values, which `DRAFT_COSTS_BY_DEVICE` in `modeling/draft_options.py` holds for this
device kind (`docs/results.md`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import DeepseekV4DSparkForDrafting, reference
from hf_hyperdflash.prompts import encode_prompt, load_prompts

DRAFTS = {"hyperdflash": (1, 3, 5, 7), "mtp": (1, 2, 3), "dspark": (1, 3, 5)}


def line(points: dict[int, float]) -> tuple[float, float]:
    """Intercept and slope of the least-squares line through `points` (k -> cost)."""
    slope, intercept = statistics.linear_regression(list(points), list(points.values()))
    return intercept, slope


def seconds(target, prompt: torch.Tensor, **options) -> float:
    """Wall time of one `target.generate(prompt, **options)`."""
    start = time.perf_counter()
    target.generate(prompt, **options)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).to(args.device).eval()
    paths = {"hyperdflash": reference.drafter_path("hyperdflash"), "mtp": reference.mtp_path()}
    drafters = {kind: AutoModel.from_pretrained(path, dtype=torch.float32).eval() for kind, path in paths.items()}
    drafters["dspark"] = DeepseekV4DSparkForDrafting.from_target(target, dspark_noise_token_id=tokenizer.pad_token_id)
    for drafter in drafters.values():
        drafter.to(args.device)
        drafter.generation_config.num_assistant_tokens_schedule = "constant"
    options = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
    costs: dict[tuple[str, int], list[float]] = {}
    for chat in load_prompts("sharegpt", "held_out", args.prompts, max_chars=2000):
        prompt = torch.tensor([encode_prompt(tokenizer, chat, enable_thinking=False)], device=args.device)
        per_step: dict[tuple[str, int] | str, list[float]] = {}
        target.generate(prompt, **options)  # warm-up
        for _ in range(args.repeats):
            per_step.setdefault("plain", []).append(seconds(target, prompt, **options) / args.max_new_tokens)
            for kind, drafter in drafters.items():
                for k in DRAFTS[kind]:
                    drafter.generation_config.num_assistant_tokens = k
                    elapsed = seconds(target, prompt, assistant_model=drafter, **options)
                    per_step.setdefault((kind, k), []).append(elapsed / drafter.last_generation_stats.target_forwards)
        plain = statistics.median(per_step.pop("plain"))
        for key, times in per_step.items():
            costs.setdefault(key, []).append(statistics.median(times) / plain)
    medians = {key: statistics.median(values) for key, values in costs.items()}
    for (kind, k), cost in medians.items():
        print(f"{kind} k={k}: a step costs {cost:.3f} plain steps")
    intercept, verify_cost = line({k: medians["hyperdflash", k] for k in DRAFTS["hyperdflash"]})
    _, mtp_slope = line({k: medians["mtp", k] for k in DRAFTS["mtp"]})
    mtp_draft_cost = mtp_slope - verify_cost
    dspark_intercept, _ = line({k: medians["dspark", k] for k in DRAFTS["dspark"]})
    print(
        f"verify_cost {verify_cost:.3f}; draft_cost: hyperdflash {intercept - 1:.3f}, mtp {mtp_draft_cost:.3f}, "
        f"dspark {dspark_intercept - 1:.3f}"
    )


if __name__ == "__main__":
    main()
