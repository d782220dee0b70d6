"""Where the reference target's distillation starts: today's language-model weights, or afresh?

    python benchmarks/distil_init.py --steps 250

Both runs train on the same packed teacher replies in the same order, with the same schedule, for `--steps` steps
of 4 rows (`hf_hyperdflash/reference/distil.py`). While `--steps` x 4 stays under one pass over the rows, every
step's loss is on rows the model has not seen, so the mean reply-token loss over the last `--window` steps is a
held-out loss. Prints that loss for each start. Needs the teacher's replies (`--teacher-dir`) and the language-model
stage's weights (`--target`, default: the shipped target).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoTokenizer, DeepseekV4ForCausalLM

from hf_hyperdflash import reference
from hf_hyperdflash.reference.distil import DISTIL_LOOP, collate_rows, packed_rows, reply_losses, teacher_examples
from hf_hyperdflash.testing import randomize_hash_table
from hf_hyperdflash.training.loop import run_training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher-dir", type=Path, default=Path("runs/reference/teacher"))
    parser.add_argument("--target", type=Path, default=None, help="the language-model stage (default: shipped)")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--window", type=int, default=50, help="last steps whose loss is averaged")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    rows = packed_rows(teacher_examples(tokenizer, args.teacher_dir))
    if args.steps * DISTIL_LOOP.batch_size > len(rows):
        raise ValueError(f"--steps {args.steps} passes over the {len(rows)} rows more than once; lower it.")
    loop = replace(DISTIL_LOOP, total_steps=args.steps, log_every=1, checkpoint_every=args.steps)
    trained = DeepseekV4ForCausalLM.from_pretrained(args.target or reference.target_path(), dtype=torch.float32)
    torch.manual_seed(loop.seed)
    fresh = DeepseekV4ForCausalLM(trained.config).float()
    randomize_hash_table(fresh, seed=loop.seed)
    losses = {}
    for name, model in (("from today's weights", trained), ("afresh", fresh)):
        with tempfile.TemporaryDirectory() as run_dir:
            run_training(model, rows, collate_rows, reply_losses, run_dir, loop, description=name)
            log = [json.loads(line) for line in (Path(run_dir) / "log.jsonl").open()]
        losses[name] = statistics.mean(r["lm_loss"] for r in log[-args.window :])
    print(f"{len(rows)} rows of 512 tokens; {args.steps} steps of {loop.batch_size} rows, none seen twice")
    for name, loss in losses.items():
        print(f"starting {name}: reply-token loss over the last {args.window} steps {loss:.3f}")


if __name__ == "__main__":
    main()
