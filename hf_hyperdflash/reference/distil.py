"""The reference target learns a real chat model's replies (sequence-level distillation).

The teacher (`teacher.py`) answered train-side ShareGPT prompts; each (prompt, reply) pair is rendered in the
target's own chat format (thinking off) and the pairs are packed into rows; the target, starting from its
language-model stage, learns to predict the replies' tokens (prompts are context only). Teacher and target share no
vocabulary, so the target learns from the reply text, not the teacher's logits. A reply the teacher ended closes with
the end-of-turn token; one cut at the teacher's token budget does not, so the target never learns to end there.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV4ForCausalLM, PreTrainedTokenizerFast

from ..training.curves import plot_curves
from ..training.loop import LoopConfig, run_training
from .config import SEQUENCE_LENGTH
from .teacher import read_replies

Example = dict[str, torch.Tensor]

IGNORE_INDEX = -100  # transformers' causal LM loss skips these labels
MAX_PROMPT_TOKENS = 256  # target tokens; longer prompts keep their end, as the teacher saw them
MAX_REPLY_TOKENS = 255
# Greedy replies: a student of sampled replies learns the teacher's own spread, which is flat at T=1
# (docs/reference.md); its greedy replies teach the mode.
DISTIL_TEMPERATURES = (0.0,)
# About six passes over the packed replies (about 1,800 rows of 512 tokens), 4 rows a step as in the language-model
# stage, in warm-restart cycles of about two passes
DISTIL_LOOP = LoopConfig(
    total_steps=2580, cycle_steps=860, batch_size=4, learning_rate=5e-4, warmup_steps=50, checkpoint_every=100, seed=2
)
# Learned from hard labels, the small student stays less sure than its teacher on the same kind of text. Its output
# head is scaled so that along its own greedy replies it is as confident as the teacher along the teacher's (mean
# entropy about 1.5 nats); the measured scales are in docs/reference.md, "Calibration". The argmax, and so greedy
# text, is unchanged up to the bf16 rounding of the shipped head; sampling at T=1 draws from the unscaled student's
# distribution at T=1/HEAD_SCALE.
HEAD_SCALE = 1.2


def reply_example(tokenizer: PreTrainedTokenizerFast, prompt: str, reply: str, ended: bool) -> Example:
    """The prompt in the chat format (thinking off), then the reply; labels on the reply only."""
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    prompt_ids = list(prompt_ids)[-MAX_PROMPT_TOKENS:]
    reply_ids = tokenizer(reply, add_special_tokens=False).input_ids[:MAX_REPLY_TOKENS]
    if ended and len(reply_ids) < MAX_REPLY_TOKENS:
        reply_ids.append(tokenizer.eos_token_id)
    input_ids = torch.tensor(prompt_ids + reply_ids)
    labels = torch.tensor([IGNORE_INDEX] * len(prompt_ids) + reply_ids)
    return {"input_ids": input_ids, "labels": labels}


def teacher_examples(
    tokenizer: PreTrainedTokenizerFast, teacher_dir: Path, temperatures: tuple[float, ...] = DISTIL_TEMPERATURES
) -> list[Example]:
    """Every finished teacher reply at `temperatures`, in prompt order (empty replies left out)."""
    records = [r for t in temperatures for r in read_replies(teacher_dir, t) if r["reply"]]
    if not records:
        raise ValueError(
            f"No teacher replies in {teacher_dir}; run "
            f"`python -m hf_hyperdflash.reference.teacher --out {teacher_dir}` first."
        )
    return [reply_example(tokenizer, r["prompt"], r["reply"], r["ended"]) for r in records]


def packed_rows(examples: list[Example], length: int = SEQUENCE_LENGTH) -> list[Example]:
    """The examples concatenated in order and cut into `length`-token rows, as the language-model stage packs its
    text (a row's later conversations see its earlier ones, each opening with the begin token); the tail that does
    not fill a row is dropped."""
    input_ids = torch.cat([e["input_ids"] for e in examples])
    labels = torch.cat([e["labels"] for e in examples])
    usable = len(input_ids) // length * length
    rows = zip(input_ids[:usable].view(-1, length), labels[:usable].view(-1, length), strict=True)
    return [{"input_ids": ids, "labels": row_labels} for ids, row_labels in rows]


def collate_rows(rows: list[Example]) -> dict[str, torch.Tensor]:
    labels = torch.stack([r["labels"] for r in rows])
    return {
        "input_ids": torch.stack([r["input_ids"] for r in rows]),
        "labels": labels,
        "num_tokens": (labels[:, 1:] != IGNORE_INDEX).sum(),
    }


def reply_losses(model: DeepseekV4ForCausalLM, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = model(input_ids=batch["input_ids"], labels=batch["labels"], output_router_logits=True)
    return {"loss": out.loss, "lm_loss": out.loss - model.router_aux_loss_coef * out.aux_loss}


@torch.no_grad()
def calibrate_head(model: DeepseekV4ForCausalLM, scale: float = HEAD_SCALE) -> DeepseekV4ForCausalLM:
    """Multiply every logit by `scale` (the output head's weight; V4's head has no bias)."""
    model.get_output_embeddings().weight.mul_(scale)
    return model


def distil_target(
    tokenizer: PreTrainedTokenizerFast, work_dir: Path, teacher_dir: Path, loop: LoopConfig = DISTIL_LOOP
) -> Path:
    """Train `work_dir/target` (the language-model stage) on the teacher's replies (resuming from
    `work_dir/distil_run`), calibrate its head, and save it as `work_dir/target_distilled`."""
    final = work_dir / "target_distilled"
    if (final / "config.json").exists():
        return final
    rows = packed_rows(teacher_examples(tokenizer, teacher_dir))
    torch.manual_seed(loop.seed)
    model = DeepseekV4ForCausalLM.from_pretrained(work_dir / "target", dtype=torch.float32)
    run_dir = work_dir / "distil_run"
    title = "target on teacher replies"
    model = run_training(model, rows, collate_rows, reply_losses, run_dir, loop, description=title)
    plot_curves({title: run_dir / "log.jsonl"}, run_dir / "loss.png", title=title)
    calibrate_head(model).save_pretrained(final)
    return final
