"""A real two-process CPU training run of the train command under accelerate (gloo backend).

    python benchmarks/two_process_training.py [--work-dir DIR] [--steps 8]

The launch line is `accelerate launch --multi_gpu --num_processes 2 -m hf_hyperdflash.training.command ...`
with no GPU visible: accelerate then starts 2 processes through torch.distributed and `Accelerator(cpu=True)`
joins them over gloo (DistributedType.MULTI_CPU). Note that `accelerate launch --cpu --num_processes 2`
starts a single process in accelerate 1.15 (its multi-CPU mode needs `--mpirun_hostfile` and an MPI);
`torchrun --nproc_per_node 2 -m hf_hyperdflash.training.command ...` works as well.

Builds a tiny DeepSeek-V4 target with the reference tokenizer's vocabulary and two small prompt files, then
runs `python -m hf_hyperdflash.training.command` under accelerate in two processes: each answers its half of
the prompts (shard-000 / shard-001, at each temperature of the default recipe), DDP averages the drafter's gradients
over gloo, the main process measures tau through `target.generate` and saves the drafter. Prints the wall time and
the checks; exits non-zero when one fails. Run it twice with the same --work-dir: the second run resumes and has
nothing to do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoModel, AutoTokenizer

from hf_hyperdflash import HyperDFlashConfig, reference
from hf_hyperdflash.testing import tiny_deepseek_v4
from hf_hyperdflash.training.data import reply_directories

PROMPTS = [
    {"prompt": "Name three primary colours."},
    {"prompt": "What is the capital of France?"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Define entropy."}]},
    {"prompt": "Write a haiku about the sea."},
    {"prompt": "How do vaccines work?"},
    {"prompt": "Sort these numbers: 5, 2, 9, 1."},
    {"messages": [{"role": "user", "content": "Translate 'good morning' into German."}]},
    {"prompt": "Explain recursion to a child."},
]
EVAL_PROMPTS = [{"prompt": "Why is the sky blue?"}, {"prompt": "Give me a synonym for happy."}]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def prepare(work_dir: Path) -> tuple[Path, Path, Path]:
    """A saved tiny target matching the reference tokenizer, and the train / eval prompt files."""
    target_dir = work_dir / "target"
    if not (target_dir / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        tiny_deepseek_v4(
            seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids
        ).save_pretrained(target_dir)
    return (
        target_dir,
        write_jsonl(work_dir / "prompts.jsonl", PROMPTS),
        write_jsonl(work_dir / "eval.jsonl", EVAL_PROMPTS),
    )


def launch_command(work_dir: Path, steps: int) -> list[str]:
    target_dir, prompts, eval_prompts = prepare(work_dir)
    return [
        *(sys.executable, "-m", "accelerate.commands.launch"),
        *("--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port", "0"),
        *("--mixed_precision", "no", "--dynamo_backend", "no"),
        *("-m", "hf_hyperdflash.training.command"),
        *("--target", str(target_dir), "--tokenizer", str(reference.tokenizer_path())),
        *("--data", str(prompts), "--max-new-tokens", "24", "--generation-batch-size", "4"),
        *("--block-size", "4", "--num-layers", "1", "--anchors-per-sequence", "8", "--max-length", "128"),
        *("--total-steps", str(steps), "--batch-size", "2", "--learning-rate", "3e-3", "--warmup-steps", "2"),
        *("--log-every", "2", "--checkpoint-every", str(steps), "--eval-every", str(steps)),
        *("--eval-data", str(eval_prompts), "--eval-prompts", "2", "--eval-max-new-tokens", "16"),
        *("--output-dir", str(work_dir / "out")),
    ]


def check(work_dir: Path) -> list[str]:
    """Problems with the finished run (empty when it is what a two-process run must produce)."""
    out = work_dir / "out"
    problems = []
    settings = json.loads((out / "train_settings.json").read_text())
    for reply_dir in reply_directories(out / "data", settings["temperature"]).values():  # the recipe's: T=0 and T=1
        shards = {path.name: len(path.read_text().splitlines()) for path in sorted(reply_dir.glob("shard-*.jsonl"))}
        if sorted(shards) != ["shard-000.jsonl", "shard-001.jsonl"] or sum(shards.values()) != len(PROMPTS):
            problems.append(f"expected both ranks to answer half of {len(PROMPTS)} prompts in {reply_dir}: {shards}")
    if settings["num_processes"] != 2:
        problems.append("the training did not run in 2 processes")
    records = [json.loads(line) for line in (out / "run" / "log.jsonl").read_text().splitlines()]
    if not any("tau" in record for record in records) or not any("loss" in record for record in records):
        problems.append("log.jsonl lacks loss or tau records")
    learning_rates = [record["lr"] for record in records if "lr" in record]
    if learning_rates[-1] > 1e-12 or learning_rates != sorted(learning_rates, reverse=True):
        problems.append(f"the cosine schedule does not decay to 0 over the run: {learning_rates}")
    if not (out / "run" / "curves.png").exists():
        problems.append("curves.png missing")
    drafter = AutoModel.from_pretrained(out / "drafter", trust_remote_code=True)
    if drafter.config.model_type != HyperDFlashConfig.model_type:
        problems.append(f"the saved drafter loads as {drafter.config.model_type}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a fresh temporary directory")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    args = parser.parse_args()
    work_dir = (args.work_dir or Path(tempfile.mkdtemp(prefix="two_process_"))).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    command = launch_command(work_dir, args.steps)
    start = time.perf_counter()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    # `-m` puts the working directory first on sys.path; run from the work dir so a source checkout's
    # `hf_hyperdflash/` (whose `modeling` is mapped in only at install time) cannot shadow the installed package.
    launch = subprocess.run(command, env=env, cwd=work_dir)
    if launch.returncode != 0:
        sys.exit(f"two-process launch failed (exit code {launch.returncode}); see the failing rank's traceback above")
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in (work_dir / "out" / "run" / "log.jsonl").read_text().splitlines()]
    print(f"two-process run: {seconds:.1f} s wall (process start-up included), work dir {work_dir}")
    for record in records:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}))
    problems = check(work_dir)
    print("checks:", "all passed" if not problems else "; ".join(problems))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
