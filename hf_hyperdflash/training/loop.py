"""A small, resumable training loop on accelerate, shared by the reference-model build and drafter training.

Batches are indexed by step (a seeded permutation per epoch, sharded across processes), so a run that
resumes from a checkpoint sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

LossFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass
class LoopConfig:
    total_steps: int
    batch_size: int = 8  # per process, per micro-batch
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    gradient_accumulation_steps: int = 1
    checkpoint_every: int = 200
    log_every: int = 10
    seed: int = 0
    mixed_precision: str = "no"  # "no" | "bf16"


@lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, num_examples: int) -> list[int]:
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def batch_indices(step: int, micro: int, num_examples: int, config: LoopConfig, rank: int, world: int) -> list[int]:
    """Example indices of one micro-batch: a fixed function of (seed, step), so resumed runs replay exactly."""
    global_batch = config.batch_size * world * config.gradient_accumulation_steps
    if global_batch > num_examples:
        raise ValueError(f"A global batch of {global_batch} exceeds the {num_examples} training examples; lower it.")
    start = (step * config.gradient_accumulation_steps + micro) * config.batch_size * world
    indices = []
    for offset in range(start + rank * config.batch_size, start + (rank + 1) * config.batch_size):
        epoch, position = divmod(offset, num_examples)
        indices.append(_epoch_order(config.seed, epoch, num_examples)[position])
    return indices


def _save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int, config: LoopConfig) -> None:
    accelerator.wait_for_everyone()
    tmp, final = run_dir / "checkpoint.tmp", run_dir / "checkpoint"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "loop_state.json").write_text(json.dumps({"step": step, "config": asdict(config)}))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    accelerator.wait_for_everyone()


def _resume_step(accelerator: Accelerator, run_dir: Path) -> int:
    checkpoint = run_dir / "checkpoint"
    if not (checkpoint / "loop_state.json").exists():
        return 0
    accelerator.load_state(str(checkpoint))
    return json.loads((checkpoint / "loop_state.json").read_text())["step"]


def _truncate_log(log_path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint we resume from, so the curve has no duplicates."""
    if not log_path.exists():
        return
    kept = [line for line in log_path.read_text().splitlines() if json.loads(line)["step"] <= step]
    log_path.write_text("".join(line + "\n" for line in kept))


def run_training(
    model: torch.nn.Module,
    examples: Sequence[dict[str, torch.Tensor]],
    collate: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
    compute_losses: LossFn,
    run_dir: str | Path,
    config: LoopConfig,
    accelerator: Accelerator | None = None,
    description: str = "training",
    on_checkpoint: Callable[[int], None] | None = None,
) -> torch.nn.Module:
    """Train `model` (only its parameters with requires_grad) and return it unwrapped.

    `compute_losses(model, batch)` returns named loss terms; "loss" is optimised, every term is logged to
    `run_dir/log.jsonl`. A checkpoint in `run_dir/checkpoint` is resumed automatically.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=config.mixed_precision)
    set_seed(config.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, config.total_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    start_step = _resume_step(accelerator, run_dir)
    log_path = run_dir / "log.jsonl"
    if accelerator.is_main_process:
        _truncate_log(log_path, start_step)

    model.train()
    progress = tqdm(
        range(start_step, config.total_steps),
        initial=start_step,
        total=config.total_steps,
        desc=description,
        disable=not accelerator.is_main_process,
    )
    window: dict[str, float] = {}
    tokens_in_window, window_start = 0, time.perf_counter()
    for step in progress:
        for micro in range(config.gradient_accumulation_steps):
            picked = batch_indices(
                step, micro, len(examples), config, accelerator.process_index, accelerator.num_processes
            )
            batch = {k: v.to(accelerator.device) for k, v in collate([examples[i] for i in picked]).items()}
            with accelerator.autocast():
                losses = compute_losses(model, batch)
            accelerator.backward(losses["loss"] / config.gradient_accumulation_steps)
            for name, value in losses.items():
                window[name] = window.get(name, 0.0) + float(value.detach()) / config.gradient_accumulation_steps
            tokens_in_window += int(batch.get("num_tokens", torch.tensor(0)).sum())
        grad_norm = accelerator.clip_grad_norm_(trainable, config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        done = step + 1
        if done % config.log_every == 0 or done == config.total_steps:
            elapsed = time.perf_counter() - window_start
            steps_in_window = done - max(start_step, done - config.log_every) or 1
            record = {name: total / steps_in_window for name, total in window.items()}
            record = {name: accelerator.reduce(torch.tensor(v), reduction="mean").item() for name, v in record.items()}
            tokens = accelerator.reduce(torch.tensor(tokens_in_window), reduction="sum").item()
            record.update(
                step=done,
                lr=scheduler.get_last_lr()[0],
                grad_norm=float(grad_norm),
                tokens_per_second=tokens / elapsed if elapsed > 0 else math.nan,
            )
            if accelerator.is_main_process:
                with log_path.open("a") as handle:
                    handle.write(json.dumps(record) + "\n")
                progress.set_postfix(loss=f"{record['loss']:.3f}")
            window, tokens_in_window, window_start = {}, 0, time.perf_counter()
        if done % config.checkpoint_every == 0 or done == config.total_steps:
            _save_checkpoint(accelerator, run_dir, done, config)
            if on_checkpoint is not None and accelerator.is_main_process:
                on_checkpoint(done)
    return accelerator.unwrap_model(model)
