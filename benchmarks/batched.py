"""Tokens per second of plain batched decoding and of batched speculative decoding, at several batch sizes.

    python benchmarks/batched.py                                   # CPU: fp32, batches 1 2 4 8 16
    python benchmarks/batched.py --device cuda                     # a GPU: bf16, the same table
    python benchmarks/batched.py --drafters hyperdflash dspark --schedules adaptive constant

The shipped reference target and drafters on held-out ShareGPT prompts, tokenized with the chat template and
left-padded per batch. For each batch size, `--groups` batches of distinct prompts; per batch, plain and speculative
greedy calls alternate `--repeats` times and the batch's ratio is the median plain time over the median speculative
time. Printed per (drafter, schedule, batch size): tokens per second of each (median over batches; new tokens up to
each row's end of sequence), the median ratio with its 95% percentile bootstrap interval over batches (an interval
holding 1.00 is a tie), tau (the batch keeps every row's shortest accepted run) and row tau (had each row kept its own
run: what the shortest run costs), drafts verified per step, and how many batches were identical to plain decoding.
Ends with one JSON object of the same numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.evaluation.paired import median_with_interval
from hf_hyperdflash.modeling.draft_options import ADAPTIVE_SCHEDULE, SCHEDULES
from hf_hyperdflash.modeling.generation_stats import synchronized_clock
from hf_hyperdflash.prompts import load_prompts

DRAFTERS = {"hyperdflash": reference.drafter_path("hyperdflash"), "dspark": reference.dspark_path()}
SIZES = {
    "cpu": {"groups": 4, "max_new_tokens": 64, "repeats": 2},
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


def timed(target, inputs: dict, **kwargs) -> tuple[float, torch.Tensor]:
    start = synchronized_clock()
    output = target.generate(**inputs, do_sample=False, **kwargs)
    return synchronized_clock() - start, output


def new_tokens(output: torch.Tensor, width: int, eos_id: int) -> int:
    """Generated tokens of every row up to and including its first end-of-sequence token."""
    total = 0
    for row in output[:, width:].tolist():
        total += row.index(eos_id) + 1 if eos_id in row else len(row)
    return total


def measure(target, drafter, inputs_list: list[dict], max_new_tokens: int, repeats: int, eos_id: int) -> dict:
    ratios, plain_rates, spec_rates, taus, row_taus, drafted, identical = [], [], [], [], [], [], 0
    for inputs in inputs_list:
        plain_times, spec_times = [], []
        for _ in range(repeats):  # interleaved: a slow spell of the machine hits both sides
            seconds, plain = timed(target, inputs, max_new_tokens=max_new_tokens)
            plain_times.append(seconds)
            seconds, ours = timed(target, inputs, max_new_tokens=max_new_tokens, assistant_model=drafter)
            spec_times.append(seconds)
        identical += bool(torch.equal(plain, ours))
        tokens = new_tokens(plain, inputs["input_ids"].shape[1], eos_id)
        plain_rates.append(tokens / statistics.median(plain_times))
        spec_rates.append(tokens / statistics.median(spec_times))
        ratios.append(statistics.median(plain_times) / statistics.median(spec_times))
        stats = drafter.last_generation_stats
        taus.append(stats.mean_accepted_length)
        one_row = inputs["input_ids"].shape[0] == 1
        row_taus.append(stats.mean_accepted_length if one_row else stats.row_mean_accepted_length)
        drafted.append(stats.drafted_per_step)
    ratio, low, high = median_with_interval(ratios)
    finite = lambda values: [v for v in values if v == v] or [float("nan")]  # noqa: E731  (NaN: no drafted step)
    return {
        "plain_tok_s": statistics.median(plain_rates),
        "speculative_tok_s": statistics.median(spec_rates),
        "ratio": ratio,
        "interval": [low, high],
        "tau": statistics.mean(finite(taus)),
        "row_tau": statistics.mean(finite(row_taus)),
        "drafted_per_step": statistics.mean(drafted),
        "identical": f"{identical}/{len(inputs_list)}",
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--drafters", nargs="+", choices=list(DRAFTERS), default=["hyperdflash"])
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=[ADAPTIVE_SCHEDULE])
    parser.add_argument("--groups", type=int, help="batches per size (default: 4 on CPU, 6 on CUDA)")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA device here; run with --device cpu.")
    torch.set_num_threads(args.threads)
    size = SIZES[args.device] | {
        name: value
        for name, value in (
            ("groups", args.groups),
            ("max_new_tokens", args.max_new_tokens),
            ("repeats", args.repeats),
        )
        if value is not None
    }
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path(), padding_side="left")
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=dtype).to(args.device).eval()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"device": device_name, "dtype": str(dtype), **size, "rows": []}
    columns = ["drafter", "schedule", "batch", "plain tok/s", "speculative tok/s", "ratio (95% CI)", "tau", "row tau"]
    columns += ["drafted/step", "identical"]
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for batch_size in args.batch_sizes:
        inputs_list = batches(tokenizer, batch_size, size["groups"], args.device)
        for name in args.drafters:
            drafter = AutoModel.from_pretrained(DRAFTERS[name], dtype=dtype).to(args.device).eval()
            for schedule in args.schedules:
                drafter.generation_config.num_assistant_tokens_schedule = schedule
                row = measure(
                    target, drafter, inputs_list, size["max_new_tokens"], size["repeats"], tokenizer.eos_token_id
                )
                report["rows"].append({"drafter": name, "schedule": schedule, "batch": batch_size, **row})
                low, high = row["interval"]
                rates = f"{row['plain_tok_s']:.0f} | {row['speculative_tok_s']:.0f}"
                print(
                    f"| {name} | {schedule} | {batch_size} | {rates} "
                    f"| {row['ratio']:.2f}x ({low:.2f}-{high:.2f}) | {row['tau']:.2f} | {row['row_tau']:.2f} "
                    f"| {row['drafted_per_step']:.2f} | {row['identical']} |",
                    flush=True,
                )
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
