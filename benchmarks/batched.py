"""Batched speculative decoding against plain batched decoding, at several batch sizes.

    python benchmarks/batched.py                          # CPU: fp32, batches 1 2 4 8 16 32
    python benchmarks/batched.py --device cuda            # a GPU: bf16, the same table
    python benchmarks/batched.py --batch-sizes 4 16 --schedules constant
    python benchmarks/batched.py --batch-sizes 4 16 --schedules adaptive --drafter-only   # with and without copies
    python benchmarks/batched.py --target DIR --drafter-dir DIR      # another pair with the shipped tokenizer

The shipped reference target and drafter on held-out ShareGPT prompts, tokenized with the chat template and
left-padded per batch; every row generates the same number of tokens (no end-of-sequence stop), greedy; every row
keeps the tokens it verified. Schedules: `adaptive` (the default) and `constant` (every step verifies the whole block).
Per (schedule, batch size), over `--groups` batches of distinct prompts:

- ratio: plain batched time over speculative time (calls interleaved `--repeats` times per batch, medians), the
  median over batches with its 95% percentile bootstrap interval (an interval holding 1.00 is a tie);
- tau: positions the batch's shared cache advanced per verify step;
- tau kept: the verify steps the batch's slowest row takes alone over the verify steps the batch takes (1.0: the
  batch is as fast as its slowest row alone, which no design that keeps one batch can beat); "padded": the same
  with each row padded as in its batch (a batch of two copies of it, in lockstep), so it separates what the design
  loses from what padding costs (a left-padded V4 row's features are not its features alone: its compressors pool
  the padding, as in plain batched decoding);
- row tau: tokens a row commits per verify step while it generates, beside the same rows' tau alone;
- identical: batches token-identical to plain batched decoding (with `--drafter-only`, both speculative calls);
- with `--drafter-only`: the share of row steps that verified a chain copied from the context, the drafter-only
  calls' speed over plain decoding, and the default's speed over the drafter-only calls (medians over batches).

Ends with one JSON object of the same numbers.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.evaluation.paired import median_with_interval
from hf_hyperdflash.modeling.draft_options import ADAPTIVE_SCHEDULE, CONSTANT_SCHEDULE
from hf_hyperdflash.modeling.generation_stats import synchronized_clock
from hf_hyperdflash.prompts import load_prompts

DRAFTERS = {"hyperdflash": reference.drafter_path("hyperdflash"), "dspark": reference.dspark_path()}
SIZES = {
    "cpu": {"groups": 4, "max_new_tokens": 48, "repeats": 2},
    "cuda": {"groups": 6, "max_new_tokens": 128, "repeats": 3},
}


def batches(tokenizer, size: int, groups: int, device: str) -> list[dict]:
    """`groups` left-padded batches of `size` distinct held-out prompts each."""
    chats = load_prompts("sharegpt", "held_out", size * groups, max_chars=1000)
    texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    return [
        dict(tokenizer(texts[i : i + size], return_tensors="pt", padding=True, add_special_tokens=False).to(device))
        for i in range(0, len(texts), size)
    ]


def rows_of(inputs: dict) -> list[dict]:
    """Each row of a left-padded batch alone, without its padding."""
    rows = []
    for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"], strict=True):
        real = mask.bool()
        rows.append({"input_ids": ids[real][None], "attention_mask": mask[real][None]})
    return rows


class Runner:
    def __init__(self, target, drafter, generation_config):
        self.target, self.drafter, self.generation_config = target, drafter, generation_config

    def plain(self, inputs: dict) -> tuple[float, torch.Tensor]:
        start = synchronized_clock()
        output = self.target.generate(**inputs, generation_config=self.generation_config)
        return synchronized_clock() - start, output

    def speculative(self, inputs: dict, schedule: str, copies: bool = True) -> tuple[float, torch.Tensor]:
        """`copies`: steps may verify chains copied from the context (`draft_from_context`, the default)."""
        self.drafter.generation_config.num_assistant_tokens_schedule = schedule
        self.drafter.generation_config.draft_from_context = copies
        start = synchronized_clock()
        output = self.target.generate(**inputs, generation_config=self.generation_config, assistant_model=self.drafter)
        return synchronized_clock() - start, output

    def alone(self, inputs: dict, schedule: str) -> list[tuple[int, float]]:
        """(verify steps, tau) of each row decoded alone."""
        results = []
        for row in rows_of(inputs):
            self.speculative(row, schedule)
            stats = self.drafter.last_generation_stats
            results.append((stats.decoding_steps, stats.mean_accepted_length))
        return results

    def padded_alone(self, inputs: dict, schedule: str) -> list[int]:
        """Verify steps of each row with its padding in the batch, decoded as a batch of two copies of it."""
        steps = []
        for row in range(inputs["input_ids"].shape[0]):
            self.speculative({name: value[[row, row]] for name, value in inputs.items()}, schedule)
            steps.append(self.drafter.last_generation_stats.decoding_steps)
        return steps


def measure(runner: Runner, inputs_list: list[dict], schedule: str, repeats: int, drafter_only: bool) -> dict:
    """Speculative batched decoding on the batches, interleaved with plain decoding (and, with `drafter_only`, with
    speculative decoding whose steps verify the drafter's drafts only: "before" the context's chains)."""
    result = {"ratios": [], "taus": [], "kept": [], "kept_padded": [], "row_taus": [], "identical": 0}
    result |= {"drafter_only_ratios": [], "over_drafter_only": [], "copied": []}
    alone_taus = []
    for inputs in inputs_list:
        alone = runner.alone(inputs, schedule)
        slowest_alone = max(steps for steps, _ in alone)
        slowest_padded = max(runner.padded_alone(inputs, schedule)) if len(alone) > 1 else slowest_alone
        alone_taus += [tau for _, tau in alone]
        times = {"plain": [], "speculative": [], "drafter_only": []}
        same = True
        for _ in range(repeats):  # interleaved: a slow spell of the machine hits every side
            seconds, plain = runner.plain(inputs)
            times["plain"].append(seconds)
            if drafter_only:
                seconds, before = runner.speculative(inputs, schedule, copies=False)
                times["drafter_only"].append(seconds)
                same = same and torch.equal(plain, before)
            seconds, speculative = runner.speculative(inputs, schedule)
            times["speculative"].append(seconds)
        stats = runner.drafter.last_generation_stats
        row_steps = len(stats.accepted_by_source["drafter"]) + stats.copied_steps
        result["copied"].append(stats.copied_steps / row_steps if row_steps else 0.0)
        if drafter_only:
            median = {side: statistics.median(seconds) for side, seconds in times.items()}
            result["drafter_only_ratios"].append(median["plain"] / median["drafter_only"])
            result["over_drafter_only"].append(median["drafter_only"] / median["speculative"])
        result["ratios"].append(statistics.median(times["plain"]) / statistics.median(times["speculative"]))
        result["taus"].append(stats.mean_accepted_length if stats.accepted_per_step else 1.0)
        result["kept"].append(slowest_alone / stats.decoding_steps)
        result["kept_padded"].append(slowest_padded / stats.decoding_steps)
        result["row_taus"].append(stats.row_tau if len(stats.row_taus) > 1 else stats.mean_accepted_length)
        result["identical"] += bool(same and torch.equal(plain, speculative))
    ratio, low, high = median_with_interval(result["ratios"])
    extra = {}
    if drafter_only:
        for name in ("drafter_only_ratios", "over_drafter_only"):
            median, low_, high_ = median_with_interval(result[name])
            extra[name] = {"ratio": median, "interval": [low_, high_]}
    return {
        **extra,
        "copied_share": statistics.mean(result["copied"]),
        "ratio": ratio,
        "interval": [low, high],
        "tau": statistics.mean(result["taus"]),
        "tau_kept": statistics.mean(result["kept"]),
        "tau_kept_padded": statistics.mean(result["kept_padded"]),
        "row_tau": statistics.mean(result["row_taus"]),
        "row_tau_alone": statistics.mean(alone_taus),
        "identical": f"{result['identical']}/{len(inputs_list)}",
    }


def _before_cells(row: dict) -> str:
    """The --drafter-only columns: copied share of row steps, drafter-only speed over plain, the default's over it."""
    cells = [f"{row['copied_share']:.0%}"]
    for name in ("drafter_only_ratios", "over_drafter_only"):
        low, high = row[name]["interval"]
        cells.append(f"{row[name]['ratio']:.2f}x ({low:.2f}-{high:.2f})")
    return " " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--drafter", choices=list(DRAFTERS), default="hyperdflash")
    parser.add_argument("--target", help="a target directory in place of the shipped target")
    parser.add_argument("--drafter-dir", help="a drafter directory in place of the shipped one `--drafter` names")
    parser.add_argument("--schedules", nargs="+", default=[ADAPTIVE_SCHEDULE, CONSTANT_SCHEDULE])
    parser.add_argument("--groups", type=int, help="batches per size (default: 4 on CPU, 6 on CUDA)")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    parser.add_argument(
        "--drafter-only",
        action="store_true",
        help="also time each batch with steps that verify the drafter's drafts only (`draft_from_context=False`), "
        "interleaved: the default's speed over it, before and after the context's chains, in one run",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA device here; run with --device cpu.")
    torch.set_num_threads(args.threads)
    overrides = {"groups": args.groups, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats}
    size = SIZES[args.device] | {name: value for name, value in overrides.items() if value is not None}
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path(), padding_side="left")
    target_dir, drafter_dir = args.target or reference.target_path(), args.drafter_dir or DRAFTERS[args.drafter]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(args.device).eval()
    drafter = AutoModel.from_pretrained(drafter_dir, dtype=dtype).to(args.device).eval()
    generation_config = copy.deepcopy(target.generation_config)
    generation_config.update(
        max_new_tokens=size["max_new_tokens"], do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id
    )
    runner = Runner(target, drafter, generation_config)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"device": device_name, "dtype": str(dtype), "target": str(target_dir), "drafter": str(drafter_dir)}
    report |= {**size, "rows": []}
    columns = ["schedule", "batch", "ratio (95% CI)", "tau", "tau kept (padded)", "row tau (alone)", "identical"]
    if args.drafter_only:
        columns += ["copied", "drafter only: ratio (95% CI)", "over drafter only (95% CI)"]
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for schedule in args.schedules:
        for batch_size in args.batch_sizes:
            inputs_list = batches(tokenizer, batch_size, size["groups"], args.device)
            row = measure(runner, inputs_list, schedule, size["repeats"], args.drafter_only)
            report["rows"].append({"schedule": schedule, "batch": batch_size, **row})
            low, high = row["interval"]
            print(
                f"| {schedule} | {batch_size} | {row['ratio']:.2f}x ({low:.2f}-{high:.2f}) "
                f"| {row['tau']:.2f} | {row['tau_kept']:.2f} ({row['tau_kept_padded']:.2f}) "
                f"| {row['row_tau']:.2f} ({row['row_tau_alone']:.2f}) | {row['identical']} |"
                + (_before_cells(row) if args.drafter_only else ""),
                flush=True,
            )
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
