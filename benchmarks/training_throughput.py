"""Drafter training throughput on this machine: tokens per second through the frozen target and the drafter.

    python benchmarks/training_throughput.py [--target DIR] [--steps 24] [--seq-len 512] [--threads 2]

Runs `train_drafter` (frozen-target forward for the features, one drafter forward over all sampled blocks,
backward, AdamW) on synthetic sequences: throughput does not depend on what the tokens say. The target is
the shipped reference target when it exists, else the tiny test target. A "token" is one sequence token
through the target; the drafter's supervised block slots per second are printed too, and the frozen-target
forward alone for comparison. The first logged window (warm-up) is left out of the average.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from hf_hyperdflash import HyperDFlashForDrafting, reference
from hf_hyperdflash.testing import tiny_deepseek_v4
from hf_hyperdflash.training.curves import read_log
from hf_hyperdflash.training.loop import LoopConfig
from hf_hyperdflash.training.trainer import train_drafter


def load_benchmark_target(path: str | None) -> tuple[torch.nn.Module, str]:
    if path is None:
        try:
            path = str(reference.target_path())
        except FileNotFoundError:
            return tiny_deepseek_v4(seed=0).requires_grad_(False), "tiny test target (reference target not shipped)"
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    return target, path


def synthetic_examples(count: int, length: int, vocab: int, reply_fraction: float) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    prompt_length = int(length * (1 - reply_fraction))
    loss_mask = torch.arange(length) >= prompt_length
    return [
        {"input_ids": torch.randint(3, vocab, (length,), generator=generator), "loss_mask": loss_mask}
        for _ in range(count)
    ]


def target_forward_tokens_per_second(target: torch.nn.Module, batch: torch.LongTensor, repeats: int = 3) -> float:
    with torch.no_grad():
        target.model(input_ids=batch, use_cache=False)  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            target.model(input_ids=batch, use_cache=False)
    return batch.numel() * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target directory (default: reference, else tiny)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--reply-fraction", type=float, default=0.5, help="share of each sequence that is reply")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=2, help="draft layers")
    parser.add_argument("--anchors-per-sequence", type=int, default=16)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, name = load_benchmark_target(args.target)
    examples = synthetic_examples(4 * args.batch_size, args.seq_len, target.config.vocab_size, args.reply_fraction)
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=args.block_size, num_hidden_layers=args.num_layers)
    log_every = max(1, args.steps // 4)
    loop = LoopConfig(
        total_steps=args.steps,
        batch_size=args.batch_size,
        warmup_steps=1,
        log_every=log_every,
        checkpoint_every=args.steps,
        mixed_precision=args.mixed_precision,
    )
    with tempfile.TemporaryDirectory() as run_dir:
        train_drafter(drafter, target, examples, run_dir, loop, anchors_per_sequence=args.anchors_per_sequence)
        records = [r for r in read_log(f"{run_dir}/log.jsonl") if "tokens_per_second" in r]
    steady = [r["tokens_per_second"] for r in records[1:]] or [records[0]["tokens_per_second"]]
    tokens_per_second = statistics.mean(steady)
    slots_per_token = args.anchors_per_sequence * (args.block_size - 1) / args.seq_len
    forward_only = target_forward_tokens_per_second(target, torch.stack([e["input_ids"] for e in examples[:4]]))

    print(f"target: {name}")
    print(
        f"drafter: {args.num_layers} layers, block {args.block_size}, {args.anchors_per_sequence} anchors/sequence; "
        f"batch {args.batch_size} x {args.seq_len} tokens, {args.threads} threads, precision {args.mixed_precision}"
    )
    print(
        f"training throughput: {tokens_per_second:,.0f} tokens/s (windows: {', '.join(f'{t:,.0f}' for t in steady)})"
    )
    print(f"supervised draft slots: {tokens_per_second * slots_per_token:,.0f} /s")
    print(f"frozen-target forward alone: {forward_only:,.0f} tokens/s")


if __name__ == "__main__":
    main()
