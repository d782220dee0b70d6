"""A small, resumable training loop on accelerate, shared by the reference-model build and drafter training.

Batches are indexed by step (a seeded permutation per epoch, sharded across processes), so a run that
resumes from a checkpoint sees exactly the batches an uninterrupted run would have seen. Each example reaches
`collate` tagged with its `epoch` and `index`, so per-example randomness (e.g. anchor sampling) can be seeded
by them and replays exactly too.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache, partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

LossFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
EvalFn = Callable[[torch.nn.Module], dict[str, float]]
OptimizerFactory = Callable[[list[torch.nn.Parameter], "LoopConfig"], torch.optim.Optimizer]


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
    eval_every: int = 0  # steps between `evaluate` calls (and at the last step); 0 = never
    cycle_steps: int = 0  # warm restarts: warmup + cosine repeat every `cycle_steps`; 0 = one cycle over the run


@dataclass(frozen=True)
class DataShards:
    """The share of each global batch this process trains on: `index` of `count`. The processes that run one copy
    of a spread target together (tensor or expert parallel) share an index: they see the same batch, and their
    drafter gradients are equal, so averaging over every process averages over the copies."""

    index: int
    count: int


@lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, num_examples: int) -> list[int]:
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def batch_samples(
    step: int, micro: int, num_examples: int, config: LoopConfig, rank: int, world: int
) -> list[tuple[int, int]]:
    """(epoch, example index) of each example of one micro-batch: a fixed function of (seed, step), so resumed
    runs replay exactly."""
    global_batch = config.batch_size * world * config.gradient_accumulation_steps
    if global_batch > num_examples:
        raise ValueError(f"A global batch of {global_batch} exceeds the {num_examples} training examples; lower it.")
    start = (step * config.gradient_accumulation_steps + micro) * config.batch_size * world
    samples = []
    for offset in range(start + rank * config.batch_size, start + (rank + 1) * config.batch_size):
        epoch, position = divmod(offset, num_examples)
        samples.append((epoch, _epoch_order(config.seed, epoch, num_examples)[position]))
    return samples


def cosine_cycles_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, cycle_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup then cosine decay to zero, repeated every `cycle_steps` (warm restarts).

    With one cycle this is transformers' `get_cosine_schedule_with_warmup`; more cycles let a finished run be
    extended by resuming it, and a fresh run of the same length retraces it exactly.
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(_cycle_factor, warmup_steps, cycle_steps))


def _cycle_factor(warmup_steps: int, cycle_steps: int, step: int) -> float:
    step %= cycle_steps
    if step < warmup_steps:
        return step / warmup_steps
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / max(1, cycle_steps - warmup_steps)))


def adamw(parameters: list[torch.nn.Parameter], config: LoopConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=config.learning_rate, weight_decay=config.weight_decay)


def _save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int, config: LoopConfig) -> None:
    """Every process writes its part into checkpoint.tmp, which replaces checkpoint only once all are done.

    A leftover checkpoint.tmp (an interrupted save) is cleared *before* the barrier: after it, other processes
    may already be writing their random states into the fresh one.
    """
    tmp, final = run_dir / "checkpoint.tmp", run_dir / "checkpoint"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
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


def _due(done: int, every: int, total: int) -> bool:
    return done % every == 0 or done == total


def _write_log(log_path: Path, record: dict) -> None:
    with log_path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")


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
    evaluate: EvalFn | None = None,
    make_optimizer: OptimizerFactory = adamw,
    shards: DataShards | None = None,
    evaluate_on_every_rank: bool = False,
    on_cycle_end: Callable[[torch.nn.Module, int], None] | None = None,
) -> torch.nn.Module:
    """Train `model` (only its parameters with requires_grad) and return it unwrapped.

    `compute_losses(model, batch)` returns named loss terms; "loss" is optimised, every term is logged to
    `run_dir/log.jsonl` and to the accelerator's trackers (as `train/<term>`, if `init_trackers` started any). A
    checkpoint in `run_dir/checkpoint` is resumed automatically. With `config.eval_every`, the main process logs
    `evaluate(unwrapped model)` (in eval mode, no grad; to the trackers as `eval/<name>`) every `eval_every` steps
    and at the last one, and prints it as one line (`step 200: tau 3.12`), while the other processes wait. The
    progress bar shows the time left and the last logged loss and tokens/s. `shards` (default: one per process)
    splits each batch; `evaluate_on_every_rank` runs `evaluate` on every process (a spread target decodes with all of
    its processes), the main one logging. With warm restarts (`config.cycle_steps`), the main process calls
    `on_cycle_end(unwrapped model, step)` at the end of every cycle but the run's last, where the learning rate is
    back at zero: one run then gives a model per training length.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=config.mixed_precision)
    shards = shards or DataShards(accelerator.process_index, accelerator.num_processes)
    set_seed(config.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable, config)
    # A prepared scheduler advances once per process per optimizer step (accelerate assumes each process's
    # dataloader shrank by the process count); our step count does not shrink, so stretch the schedule to match.
    stretch = (
        accelerator.num_processes if accelerator.step_scheduler_with_optimizer and not accelerator.split_batches else 1
    )
    cycle_steps = config.cycle_steps or config.total_steps
    scheduler = cosine_cycles_schedule(optimizer, config.warmup_steps * stretch, cycle_steps * stretch)
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
    tokens_in_window, window_start, logged_at = 0, time.perf_counter(), start_step
    for step in progress:
        for micro in range(config.gradient_accumulation_steps):
            picked = batch_samples(step, micro, len(examples), config, shards.index, shards.count)
            rows = [{**examples[index], "epoch": epoch, "index": index} for epoch, index in picked]
            batch = {k: v.to(accelerator.device) for k, v in collate(rows).items()}
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
        if _due(done, config.log_every, config.total_steps):
            elapsed = time.perf_counter() - window_start
            steps_in_window, logged_at = done - logged_at, done
            record = {name: total / steps_in_window for name, total in window.items()}
            record = {name: accelerator.reduce(torch.tensor(v), reduction="mean").item() for name, v in record.items()}
            copies = accelerator.num_processes // shards.count  # the processes of a group count one batch
            tokens = accelerator.reduce(torch.tensor(tokens_in_window), reduction="sum").item() / copies
            record.update(
                step=done,
                lr=scheduler.get_last_lr()[0],
                grad_norm=float(grad_norm),
                tokens_per_second=tokens / elapsed if elapsed > 0 else math.nan,
            )
            if accelerator.is_main_process:
                _write_log(log_path, record)
                accelerator.log({f"train/{name}": value for name, value in record.items() if name != "step"}, done)
                progress.set_postfix({"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_second']:.0f}"})
            window, tokens_in_window, window_start = {}, 0, time.perf_counter()
        pause_start = time.perf_counter()  # evaluation and checkpoints do not count against throughput
        if evaluate is not None and config.eval_every and _due(done, config.eval_every, config.total_steps):
            if accelerator.is_main_process or evaluate_on_every_rank:
                model.eval()
                with torch.no_grad():
                    metrics = evaluate(accelerator.unwrap_model(model))
                model.train()
            if accelerator.is_main_process:
                _write_log(log_path, {"step": done, **metrics})
                accelerator.log({f"eval/{name}": value for name, value in metrics.items()}, done)
                # e.g. "step 200: tau 3.12", above the progress bar rather than through it
                tqdm.write(f"step {done}: " + ", ".join(f"{name} {value:.2f}" for name, value in metrics.items()))
            accelerator.wait_for_everyone()
        cycle_ended = config.cycle_steps > 0 and done % config.cycle_steps == 0 and done < config.total_steps
        if on_cycle_end is not None and cycle_ended and accelerator.is_main_process:
            on_cycle_end(accelerator.unwrap_model(model), done)
        if _due(done, config.checkpoint_every, config.total_steps):
            _save_checkpoint(accelerator, run_dir, done, config)
            if on_checkpoint is not None and accelerator.is_main_process:
                on_checkpoint(done)
        window_start += time.perf_counter() - pause_start
    return accelerator.unwrap_model(model)
