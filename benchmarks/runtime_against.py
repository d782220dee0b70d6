"""This checkout's speculative runtime against another commit's, on the shipped pair, batched, in one run.

    python benchmarks/runtime_against.py --baseline 6ac83da                  # batches 1 2 4 8 16, adaptive
    python benchmarks/runtime_against.py --baseline main --batch-sizes 4 16 --schedules constant

Each runtime runs as Hub remote code in a process of its own: a copy of the shipped drafter whose runtime files are
that commit's `modeling/` (this checkout's for "current"), loaded with `trust_remote_code=True` beside the stock
transformers target, so neither process imports this library. The two processes take turns batch by batch, so a slow
spell of the shared machine hits both; each times plain batched decoding and its speculative call interleaved
(`--repeats`, medians). Per (schedule, batch size), over `--groups` batches of held-out prompts left-padded as
tokenizers pad them, greedy, fp32, no end-of-sequence stop:

- each runtime's speed over plain batched decoding: the median over batches with its 95% bootstrap interval;
- the current runtime's speed over the baseline's, paired per batch (an interval holding 1.00 is a tie);
- tau, and whether every output was plain decoding's.

Ends with one JSON object of the same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
SIZES = {"groups": 4, "max_new_tokens": 48, "repeats": 2}


def runtime_folder(commit: str | None, out: Path) -> Path:
    """The shipped drafter saved with `commit`'s runtime files (None: this checkout's)."""
    from transformers import AutoModel

    from hf_hyperdflash import reference

    drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"))
    drafter.save_pretrained(out)
    if commit is not None:
        for stale in out.glob("*.py"):
            stale.unlink()
        names = subprocess.run(
            ["git", "ls-tree", "--name-only", f"{commit}:modeling"], cwd=REPOSITORY, check=True, capture_output=True,
            text=True,
        ).stdout.split()  # fmt: skip
        for name in (name for name in names if name.endswith(".py")):
            source = subprocess.run(
                ["git", "show", f"{commit}:modeling/{name}"], cwd=REPOSITORY, check=True, capture_output=True
            ).stdout
            (out / name).write_bytes(source)
    return out


def prepared_batches(sizes: list[int], groups: int, path: Path) -> None:
    """`groups` left-padded batches of distinct held-out prompts per size, saved for the workers."""
    import torch
    from transformers import AutoTokenizer

    from hf_hyperdflash import reference
    from hf_hyperdflash.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path(), padding_side="left")
    batches = {}
    for size in sizes:
        chats = load_prompts("sharegpt", "held_out", size * groups, max_chars=1000)
        texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
        batches[size] = [
            dict(tokenizer(texts[i : i + size], return_tensors="pt", padding=True, add_special_tokens=False))
            for i in range(0, len(texts), size)
        ]
    torch.save({"batches": batches, "pad_token_id": tokenizer.pad_token_id}, path)


def worker(drafter_dir: str, target_dir: str, batches_file: str, max_new_tokens: int, repeats: int, threads: int):
    """Answer one line of JSON per request line `schedule size index` on stdin: the group's times and outputs."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    torch.set_num_threads(threads)
    saved = torch.load(batches_file)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(drafter_dir, dtype=torch.float32, trust_remote_code=True).eval()
    settings = {"max_new_tokens": max_new_tokens, "do_sample": False, "eos_token_id": None}
    settings["pad_token_id"] = saved["pad_token_id"]
    print("ready", flush=True)
    for line in sys.stdin:
        schedule, size, index = line.split()
        inputs = saved["batches"][int(size)][int(index)]
        drafter.generation_config.num_assistant_tokens_schedule = schedule
        plain, speculative, identical = [], [], True
        for _ in range(repeats):
            start = time_now()
            expected = target.generate(**inputs, **settings)
            plain.append(time_now() - start)
            start = time_now()
            got = target.generate(**inputs, assistant_model=drafter, **settings)
            speculative.append(time_now() - start)
            identical &= bool(torch.equal(got, expected))
        stats = drafter.last_generation_stats
        tau = stats.mean_accepted_length if stats.accepted_per_step else 1.0
        print(json.dumps({"plain": plain, "speculative": speculative, "identical": identical, "tau": tau}), flush=True)


def time_now() -> float:
    import time

    return time.perf_counter()


class Worker:
    def __init__(self, name: str, drafter_dir: Path, target_dir: str, batches: Path, size: dict, threads: int):
        env = os.environ | {"HF_MODULES_CACHE": str(drafter_dir.parent / f"modules-{name}")}
        command = [sys.executable, __file__, "--worker", str(drafter_dir), "--target", target_dir]
        command += ["--batches-file", str(batches), "--max-new-tokens", str(size["max_new_tokens"])]
        command += ["--repeats", str(size["repeats"]), "--threads", str(threads)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        while (line := self.process.stdout.readline()) and line.strip() != "ready":
            if not line:
                raise RuntimeError(f"The {name} runtime's worker ended before it was ready.")

    def run(self, schedule: str, size: int, index: int) -> dict:
        self.process.stdin.write(f"{schedule} {size} {index}\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="the commit whose runtime is compared (e.g. main, a hash)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["adaptive"])
    parser.add_argument("--groups", type=int, default=SIZES["groups"])
    parser.add_argument("--max-new-tokens", type=int, default=SIZES["max_new_tokens"])
    parser.add_argument("--repeats", type=int, default=SIZES["repeats"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each worker")
    parser.add_argument("--target", help="a target directory in place of the shipped target")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--batches-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.target, args.batches_file, args.max_new_tokens, args.repeats, args.threads)
    if args.baseline is None:
        parser.error("--baseline COMMIT is required")
    from hf_hyperdflash import reference
    from hf_hyperdflash.evaluation.paired import median_with_interval

    size = {"groups": args.groups, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats}
    target_dir = args.target or str(reference.target_path())
    work = Path(tempfile.mkdtemp(prefix="runtime-against-"))
    try:
        batches = work / "batches.pt"
        prepared_batches(args.batch_sizes, args.groups, batches)
        folders = {
            "baseline": runtime_folder(args.baseline, work / "baseline"),
            "current": runtime_folder(None, work / "current"),
        }
        workers = {
            name: Worker(name, folder, target_dir, batches, size, args.threads) for name, folder in folders.items()
        }
        report = {"baseline": args.baseline, "target": target_dir, **size, "rows": []}
        columns = ["schedule", "batch", "baseline over plain (95% CI)", "current over plain (95% CI)",
                   "current over baseline (95% CI)", "tau baseline / current", "identical"]  # fmt: skip
        print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
        for schedule in args.schedules:
            for batch_size in args.batch_sizes:
                results = {name: [] for name in workers}
                for index in range(args.groups):
                    order = list(workers) if index % 2 == 0 else list(reversed(workers))
                    for name in order:
                        results[name].append(workers[name].run(schedule, batch_size, index))
                row = summary(results, median_with_interval)
                report["rows"].append({"schedule": schedule, "batch": batch_size, **row})
                print(
                    f"| {schedule} | {batch_size} | {interval(row['baseline'])} | {interval(row['current'])} "
                    f"| {interval(row['current_over_baseline'])} | {row['tau']['baseline']:.2f} / "
                    f"{row['tau']['current']:.2f} | {row['identical']} |",
                    flush=True,
                )
        for process in workers.values():
            process.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return report


def speed(group: dict) -> float:
    return statistics.median(group["plain"]) / statistics.median(group["speculative"])


def summary(results: dict[str, list[dict]], median_with_interval) -> dict:
    row = {name: list(median_with_interval([speed(group) for group in groups])) for name, groups in results.items()}
    paired = [speed(now) / speed(then) for then, now in zip(results["baseline"], results["current"], strict=True)]
    row["current_over_baseline"] = list(median_with_interval(paired))
    row["tau"] = {name: statistics.mean(group["tau"] for group in groups) for name, groups in results.items()}
    checked = [group["identical"] for groups in results.values() for group in groups]
    row["identical"] = f"{sum(checked)}/{len(checked)}"
    return row


def interval(values: list[float]) -> str:
    middle, low, high = values
    return f"{middle:.2f}x ({low:.2f}-{high:.2f})"


if __name__ == "__main__":
    main()
