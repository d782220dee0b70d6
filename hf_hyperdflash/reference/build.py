"""Build the reference model set from scratch: tokenizer, the teacher's replies, a DeepSeek-V4 target trained on
ShareGPT and then on the teacher's replies, its native MTP.

    python -m hf_hyperdflash.reference.build --work-dir runs/reference   # needs `pip install ".[reference]"`
    python -m hf_hyperdflash.reference.build --stages drafters   # after the three `hyperdflash train` runs
    python -m hf_hyperdflash.reference.build --stages drafters --drafters hyperdflash   # one of them

Every stage is seeded and skips itself when its output exists; training stages checkpoint and resume,
so re-running the same command after an interruption continues where it stopped. The result is
exported as bf16 safetensors into `hf_hyperdflash/reference/assets/` (or `--out`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, DeepseekV4ForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from ..chat_format import synthetic_reasoning, train_chat_tokenizer
from ..modeling.modeling_deepseek_v4_dspark import DeepseekV4DSparkForDrafting
from ..modeling.modeling_deepseek_v4_mtp import DeepseekV4MTPForDrafting
from ..modeling.modeling_hyperdflash import HyperDFlashForDrafting
from ..modeling.target_deepseek_v4 import DeepseekV4Target
from ..sharegpt import Conversation, load_conversations
from ..testing import randomize_hash_table
from ..training.curves import plot_curves
from ..training.loop import LoopConfig, run_training
from . import DRAFTER_KINDS, teacher
from .config import SEQUENCE_LENGTH, reference_target_config
from .distil import DISTIL_TEMPERATURES, distil_target, reply_losses

ASSETS = Path(__file__).parent / "assets"
# How a drafter trained against the shipped target names it: its place in the source tree
SHIPPED_TARGET_NAME = "hf_hyperdflash/reference/assets/target"
# teacher: a real chat model's greedy replies (`teacher.py`); target: next-token training on ShareGPT; distil: the
# target learns the teacher's replies (`distil.py`), and that is the target shipped and drafted for
STAGES = ("tokenizer", "teacher", "target", "distil", "mtp", "drafters")
THINKING_PERCENT = 25  # share of training conversations rendered in thinking mode
# Two warm-restart cycles of 2000 steps: the first cycle alone left the greedy replies looping (docs/reference.md).
TARGET_LOOP = LoopConfig(
    total_steps=4000, cycle_steps=2000, batch_size=4, learning_rate=2e-3, warmup_steps=100, checkpoint_every=100
)
MTP_LOOP = LoopConfig(total_steps=800, batch_size=4, learning_rate=2e-3, warmup_steps=50, checkpoint_every=100, seed=1)


def _uses_thinking(conversation: Conversation) -> bool:
    return int(hashlib.sha256(conversation.id.encode()).hexdigest()[:8], 16) % 100 < THINKING_PERCENT


def render_for_training(conversation: Conversation, tokenizer: PreTrainedTokenizerFast) -> str:
    """The conversation in the chat format; some get a synthetic thinking section on each assistant turn."""
    messages, last_prompt = [], ""
    for message in conversation.messages:
        message = dict(message)
        if message["role"] == "user":
            last_prompt = message["content"]
        elif message["role"] == "assistant" and _uses_thinking(conversation):
            message["reasoning"] = synthetic_reasoning(last_prompt, message["content"])
        messages.append(message)
    return tokenizer.apply_chat_template(messages, tokenize=False)


def build_tokenizer(out_dir: Path, vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    if (out_dir / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(out_dir)
    texts = [m["content"] for c in load_conversations("train") for m in c.messages]
    tokenizer = train_chat_tokenizer(texts, vocab_size)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def packed_chunks(tokenizer: PreTrainedTokenizerFast, cache_path: Path, length: int = SEQUENCE_LENGTH) -> torch.Tensor:
    """All train conversations rendered, tokenized, concatenated and cut into `length`-token rows."""
    if cache_path.exists():
        return torch.load(cache_path)
    conversations = load_conversations("train")
    texts = [render_for_training(c, tokenizer) for c in tqdm(conversations, desc="rendering")]
    ids: list[int] = []
    for start in tqdm(range(0, len(texts), 512), desc="tokenizing"):
        for row in tokenizer(texts[start : start + 512], add_special_tokens=False).input_ids:
            ids.extend(row)
    usable = len(ids) // length * length
    chunks = torch.tensor(ids[:usable], dtype=torch.int32).view(-1, length)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(chunks, cache_path)
    return chunks


def _collate_tokens(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    input_ids = torch.stack([r["input_ids"] for r in rows]).long()
    return {"input_ids": input_ids, "num_tokens": torch.tensor(input_ids.numel())}


def _target_losses(model: DeepseekV4ForCausalLM, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return reply_losses(model, {**batch, "labels": batch["input_ids"]})  # every token is a label


def train_language_model(
    model: DeepseekV4ForCausalLM, chunks: torch.Tensor, run_dir: Path, loop: LoopConfig, title: str
) -> DeepseekV4ForCausalLM:
    """Next-token training on the packed rows (resumes from `run_dir`), with a loss plot next to the log."""
    examples = [{"input_ids": row} for row in chunks]
    model = run_training(model, examples, _collate_tokens, _target_losses, run_dir, loop, description=title)
    plot_curves({title: run_dir / "log.jsonl"}, run_dir / "loss.png", title=title)
    return model


def train_target(tokenizer: PreTrainedTokenizerFast, work_dir: Path, loop: LoopConfig = TARGET_LOOP) -> Path:
    final = work_dir / "target"
    if (final / "config.json").exists():
        return final
    config = reference_target_config(
        len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    torch.manual_seed(loop.seed)
    model = DeepseekV4ForCausalLM(config).float()
    randomize_hash_table(model, seed=loop.seed)
    chunks = packed_chunks(tokenizer, work_dir / "target_chunks.pt")
    model = train_language_model(model, chunks, work_dir / "target_run", loop, title="reference target")
    model.save_pretrained(final)
    return final


class MTPWithFrozenTarget(torch.nn.Module):
    """Trains the MTP module on the frozen target: only `mtp` holds trainable parameters."""

    def __init__(self, target: DeepseekV4ForCausalLM, mtp: DeepseekV4MTPForDrafting):
        super().__init__()
        self.mtp = mtp
        self.target = [target]  # a list keeps the frozen target out of the optimiser and the checkpoint

    def forward(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Mean cross-entropy of predicting token i+2 from (target residual at i, token i+1)."""
        target = self.target[0]
        adapter = DeepseekV4Target(target)
        with torch.no_grad(), adapter.capture() as capture:
            target.model(input_ids=input_ids)
            residual = capture.features()
            token_embeds = adapter.embed_tokens(input_ids[:, 1:-1])
        positions = torch.arange(1, input_ids.shape[1] - 1, device=input_ids.device)[None]
        hidden = self.mtp(token_embeds, residual[:, :-2], positions).last_hidden_state
        logits = adapter.lm_head(hidden).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), input_ids[:, 2:].flatten())


def _mtp_losses(model: MTPWithFrozenTarget, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"loss": model(batch["input_ids"])}


def train_mtp(
    tokenizer: PreTrainedTokenizerFast, work_dir: Path, target_dir: Path, loop: LoopConfig = MTP_LOOP
) -> Path:
    final = work_dir / "mtp"
    if (final / "config.json").exists():
        return final
    target = DeepseekV4ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    chunks = packed_chunks(tokenizer, work_dir / "target_chunks.pt")
    examples = [{"input_ids": row} for row in chunks]
    torch.manual_seed(loop.seed)
    wrapper = MTPWithFrozenTarget(target, DeepseekV4MTPForDrafting.from_target(target))
    run_dir = work_dir / "mtp_run"
    wrapper = run_training(wrapper, examples, _collate_tokens, _mtp_losses, run_dir, loop, description="mtp")
    plot_curves({"mtp": run_dir / "log.jsonl"}, run_dir / "loss.png", title="native MTP (frozen target)")
    wrapper.mtp.save_pretrained(final)
    return final


def export_bf16(model_class: type[PreTrainedModel], source: Path, destination: Path) -> None:
    """Re-save a trained model as bf16 safetensors (the shipped form): weights and config only.

    A drafter's remote code, model card and draft settings (the defaults) are left out, so the package holds one
    copy of its runtime; the library loads the shipped folder through its registered classes, and `save_pretrained`
    from there writes a complete, publishable folder (tests/test_hub_path.py loads one in a process without the
    library).
    """
    model = model_class.from_pretrained(source, dtype=torch.float32).to(torch.bfloat16)
    if destination.exists():
        shutil.rmtree(destination)
    model.save_pretrained(destination, safe_serialization=True)
    generated = [*destination.glob("*.py"), destination / "README.md"]
    if not model.can_generate():  # a drafter: its draft settings are the class defaults
        generated.append(destination / "generation_config.json")
    for path in generated:
        path.unlink(missing_ok=True)
    config_file = destination / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("auto_map", None)
    target = config.get("target_name_or_path")
    if target and Path(target).resolve() == (ASSETS / "target").resolve():  # no machine's own path in a shipped file
        config["target_name_or_path"] = SHIPPED_TARGET_NAME
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# Each shipped drafter's kind (its `drafters_dir/<kind>` run), class and asset folder
SHIPPED_DRAFTERS: dict[str, tuple[type[PreTrainedModel], str]] = {
    **{kind: (HyperDFlashForDrafting, f"drafter_{kind}") for kind in DRAFTER_KINDS},
    "dspark": (DeepseekV4DSparkForDrafting, "dspark"),
}


def export_drafters(drafters_dir: Path, out: Path, kinds: Sequence[str] = tuple(SHIPPED_DRAFTERS)) -> None:
    """Export `drafters_dir/<kind>/drafter`, as trained by `configs/reference_drafter_<kind>.json`, to `out`:
    HyperDFlash and vanilla DFlash as `drafter_<kind>`, DSpark as `dspark`. Only `kinds` are exported, so one
    retrained drafter replaces its shipped copy without the others' runs."""
    unknown = set(kinds) - set(SHIPPED_DRAFTERS)
    if unknown:
        raise ValueError(f"Unknown drafters {sorted(unknown)}; choose from {','.join(SHIPPED_DRAFTERS)}.")
    for kind in kinds:
        model_class, name = SHIPPED_DRAFTERS[kind]
        source = drafters_dir / kind / "drafter"
        if not (source / "config.json").exists():
            raise ValueError(
                f"No trained {kind} drafter at {source}; run "
                f"`hyperdflash train --config configs/reference_drafter_{kind}.json` first."
            )
        export_bf16(model_class, source, out / name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/reference"), help="checkpoints, logs, caches")
    parser.add_argument("--out", type=Path, default=ASSETS, help="where the bf16 model set is exported")
    parser.add_argument(
        "--stages",
        default="tokenizer,teacher,target,distil,mtp",
        help=f"comma-separated subset of: {','.join(STAGES)}",
    )
    parser.add_argument(
        "--teacher-dir", type=Path, default=None, help="the teacher's file and replies (default: <work-dir>/teacher)"
    )
    parser.add_argument(
        "--drafters-dir", type=Path, default=Path("runs/reference_drafters"), help="trained drafters (drafters stage)"
    )
    parser.add_argument(
        "--drafters",
        default=",".join(SHIPPED_DRAFTERS),
        help=f"comma-separated drafters the drafters stage exports (default: all of {','.join(SHIPPED_DRAFTERS)})",
    )
    args = parser.parse_args(argv)
    stages = set(args.stages.split(","))
    unknown = stages - set(STAGES)
    if unknown:
        raise ValueError(f"Unknown stages {sorted(unknown)}; choose from {','.join(STAGES)}.")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    teacher_dir = args.teacher_dir or args.work_dir / "teacher"
    if stages & {"tokenizer", "target", "distil", "mtp"}:
        tokenizer = build_tokenizer(args.work_dir / "tokenizer")
    if "tokenizer" in stages:
        tokenizer.save_pretrained(args.out / "tokenizer")
    if "teacher" in stages:
        temperatures = [str(t) for t in DISTIL_TEMPERATURES]
        teacher.main(
            [
                "--out",
                str(teacher_dir),
                "--cache-dir",
                str(args.work_dir / "teacher_model"),
                "--temperatures",
                *temperatures,
            ]
        )
    if "target" in stages:
        train_target(tokenizer, args.work_dir)
    if stages & {"distil", "mtp"}:
        target_dir = distil_target(tokenizer, args.work_dir, teacher_dir)  # the MTP drafts for the distilled target
    if "distil" in stages:
        export_bf16(DeepseekV4ForCausalLM, target_dir, args.out / "target")
    if "mtp" in stages:
        export_bf16(DeepseekV4MTPForDrafting, train_mtp(tokenizer, args.work_dir, target_dir), args.out / "mtp")
    if "drafters" in stages:
        export_drafters(args.drafters_dir, args.out, args.drafters.split(","))


if __name__ == "__main__":
    main()
