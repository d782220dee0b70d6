"""Drafter training data: prompts answered by the target itself, stored as token ids plus a reply mask.

A drafter should imitate what the *target* says, so every prompt is re-answered by the target
(`target.generate`, no assistant). Replies are appended to `shard-<rank>.jsonl` files in a data directory,
one record per prompt (`{"index", "input_ids", "loss_mask"}`, loss_mask 1 on reply tokens), so an
interrupted run resumes where it stopped and several processes can answer disjoint prompts at once.

The prompts come from `hf_hyperdflash.prompts` (ShareGPT, a JSONL file or a Hugging Face dataset). Replies are
generated for every prompt of the list (its hash guards resuming), and training leaves out those to prompts that repeat
a held-out ShareGPT prompt (`held_out_repeats`, `load_examples(skip_indices=...)`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from itertools import groupby
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..decoding import decoding_settings
from ..modeling.rank_agreement import RankAgreement
from ..prompts import Messages, encode_prompt
from ..sharegpt import repeats_held_out_prompt

SETTINGS_FILE = "settings.json"


def _read_shard(path: Path) -> list[dict]:
    """Records of one shard; an unparsable *last* line is an interrupted append and is left out."""
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines) - 1:
                raise ValueError(f"{path} is corrupt at line {number + 1}; delete the data directory.") from None
    return records


def read_records(data_dir: Path) -> list[dict]:
    """Every record of a reply folder's shards, in shard order (`load_examples` gives them as training examples)."""
    return [record for shard in sorted(data_dir.glob("shard-*.jsonl")) for record in _read_shard(shard)]


def _check_settings(data_dir: Path, settings: dict, write: bool) -> None:
    """Refuse to mix replies generated with other prompts or sampling settings in one directory."""
    path = data_dir / SETTINGS_FILE
    if path.exists():
        stored = json.loads(path.read_text())
        if not stored.get("temperature"):  # older versions recorded the seed for greedy replies too
            stored.pop("seed", None)
        if stored != settings:
            changed = sorted(k for k in settings.keys() | stored.keys() if stored.get(k) != settings.get(k))
            raise ValueError(
                f"{data_dir} holds replies generated with other settings ({', '.join(changed)} differ). "
                "Use another data directory, or delete this one to regenerate."
            )
    elif write:  # atomically: other ranks may be reading it
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(settings, indent=1))
        partial.replace(path)


def _batches(pending: list[tuple[int, list[int]]], batch_size: int, mixed_lengths: bool):
    """Prompts sorted by length, cut into batches; unless `mixed_lengths`, a batch holds one prompt length only.

    DeepSeek-V4's compressors cut windows by sequence index and do not mask padding, so a left-padded prompt
    is not answered exactly as it would be alone: equal-length batches need no padding and stay exact.
    """
    ordered = sorted(pending, key=lambda item: (len(item[1]), item[0]))
    groups = [ordered] if mixed_lengths else [list(g) for _, g in groupby(ordered, key=lambda item: len(item[1]))]
    for group in groups:
        for start in range(0, len(group), batch_size):
            yield group[start : start + batch_size]


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row)
        attention_mask[i, width - len(row) :] = 1
    return input_ids, attention_mask


def _cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """The reply up to and including its first end-of-sequence token (the rest is generate's padding)."""
    for position, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: position + 1]
    return tokens


def reply_directories(data_dir: Path, temperatures: Sequence[float]) -> dict[float, Path]:
    """Where the replies at each temperature live: `data_dir` itself for one temperature, else one
    `temperature-T` folder per temperature inside it."""
    if len(temperatures) == 1:
        return {temperatures[0]: data_dir}
    return {t: data_dir / f"temperature-{t:g}" for t in temperatures}


def generate_replies(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Messages],
    data_dir: str | Path,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    enable_thinking: bool = False,
    batch_size: int = 8,
    mixed_lengths: bool = False,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> None:
    """Answer every prompt not answered yet in `data_dir` with the target; this process takes every
    `world_size`-th prompt starting at `rank` and appends to its own shard. The processes of a target spread over
    several (tensor or expert parallel) share one `rank`: they answer the same prompts together, and the first of
    them writes.

    `temperature` 0 decodes greedily; otherwise it samples at that temperature with no top-k/top-p (the
    distribution `hyperdflash eval` samples at the same T). A batch is seeded by `seed` and its first prompt index.
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    encoded = [encode_prompt(tokenizer, messages, enable_thinking) for messages in prompts]
    settings = {
        "prompts_sha256": hashlib.sha256(json.dumps(encoded).encode()).hexdigest(),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "enable_thinking": enable_thinking,
    }
    # Only sampled replies depend on the seed (greedy data serves drafters of any seed), and replies sampled
    # before top-k/top-p were switched off must not be mixed in.
    if temperature > 0:
        settings |= {"seed": seed, "truncation": "none"}
    shard = data_dir / f"shard-{rank:03d}.jsonl"
    answer = partial(_answer, target, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature)
    answer = partial(answer, batch_size=batch_size, mixed_lengths=mixed_lengths, seed=seed, rank=rank)
    # A target spread over processes: its group answers one shard together; the group's first process reads what
    # is done and writes, and an error there (other settings in the directory) reaches every process of the group.
    agreement = RankAgreement.of(target)

    def pending_prompts() -> list[tuple[int, list[int]]]:
        _check_settings(data_dir, settings, write=rank == 0)
        if shard.exists():  # rewrite without an interrupted last line, so appends start on a fresh line
            shard.write_text("".join(json.dumps(record) + "\n" for record in _read_shard(shard)))
        done = {record["index"] for record in read_records(data_dir)}
        return [(i, ids) for i, ids in enumerate(encoded) if i % world_size == rank and i not in done]

    # One writer per shard: a second job on the same data dir waits, then resumes from what the first wrote.
    with _exclusive(data_dir / f".shard-{rank:03d}.lock") if agreement.decides else nullcontext():
        pending = agreement.first_decides("Reading the replies written so far", pending_prompts)
        answer(pending, shard if agreement.decides else None)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _answer(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pending: list[tuple[int, list[int]]],
    shard: Path | None,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    mixed_lengths: bool,
    seed: int,
    rank: int,
) -> None:
    """Generate the replies of `pending` (index, prompt ids) in batches and append them to `shard` (None: another
    process of a spread target's group writes them)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = target.generation_config.eos_token_id if target.generation_config.eos_token_id is not None else []
    eos_ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    decoding = decoding_settings(temperature, max_new_tokens)
    device = target.get_input_embeddings().weight.device
    progress = tqdm(total=len(pending), desc=f"target replies (rank {rank})", disable=not pending)
    for batch in _batches(pending, batch_size, mixed_lengths):
        input_ids, attention_mask = _left_pad([ids for _, ids in batch], pad_id)
        torch.manual_seed(seed * 1_000_003 + batch[0][0])
        with torch.no_grad():
            output = target.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                pad_token_id=pad_id,
                **decoding,
            )
        if shard is None:
            progress.update(len(batch))
            continue
        with shard.open("a") as handle:
            for (index, prompt_ids), row in zip(batch, output[:, input_ids.shape[1] :].tolist(), strict=True):
                reply = _cut_at_eos(row, eos_ids)
                record = {
                    "index": index,
                    "input_ids": prompt_ids + reply,
                    "loss_mask": [0] * len(prompt_ids) + [1] * len(reply),
                }
                handle.write(json.dumps(record) + "\n")
        progress.update(len(batch))
    progress.close()


def held_out_repeats(prompts: Sequence[Messages]) -> frozenset[int]:
    """Indices of the prompts whose user turn repeats the first prompt of a held-out ShareGPT conversation
    (`sharegpt.repeats_held_out_prompt`): training on their replies would leak ShareGPT evaluation prompts."""
    indices = set()
    for index, messages in enumerate(prompts):
        if not messages or messages[-1].get("role") != "user":
            raise ValueError(f"Prompt {index} does not end with a user turn; prompts come from `load_prompts`.")
        if repeats_held_out_prompt(messages[-1]["content"]):
            indices.add(index)
    return frozenset(indices)


def load_examples(
    data_dir: str | Path, max_length: int | None = None, skip_indices: Collection[int] = frozenset()
) -> list[dict[str, torch.Tensor]]:
    """Training examples in prompt order: `input_ids` (long) and `loss_mask` (bool), cut to `max_length`.

    The replies to the prompts in `skip_indices` (e.g. `held_out_repeats`) are left out, and so are examples left
    with no reply token after the cut (they would give no draft block).
    """
    records = sorted(read_records(Path(data_dir)), key=lambda record: record["index"])
    if not records:
        raise ValueError(f"No generated replies in {data_dir}; run the data generation first.")
    examples = []
    for record in records:
        if record["index"] in skip_indices:
            continue
        input_ids = torch.tensor(record["input_ids"][:max_length], dtype=torch.long)
        loss_mask = torch.tensor(record["loss_mask"][:max_length], dtype=torch.bool)
        if loss_mask[1:].any():
            examples.append({"input_ids": input_ids, "loss_mask": loss_mask})
    return examples


def load_weighted_examples(
    reply_dirs: Sequence[str | Path],
    weights: Sequence[int],
    max_length: int | None = None,
    skip_indices: Collection[int] = frozenset(),
) -> list[dict[str, torch.Tensor]]:
    """The examples of each folder (less the replies to `skip_indices`), listed `weight` times over, so that an
    epoch sees each reply that often."""
    return [
        example
        for reply_dir, weight in zip(reply_dirs, weights, strict=True)
        for example in load_examples(reply_dir, max_length, skip_indices) * weight
    ]
