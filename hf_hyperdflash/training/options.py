"""`hyperdflash train`: generate the target's replies, then train a drafter on them with the frozen target.

    hyperdflash train --output-dir runs/drafter --total-steps 2000
    accelerate launch --multi_gpu --num_processes 2 -m hf_hyperdflash.training.command --output-dir runs/drafter

Several processes split the reply generation and train data-parallel. Without a GPU, the `--multi_gpu` launch
above runs the processes on CPU over gloo (as does `torchrun --nproc_per_node 2 -m ...`); note that
`accelerate launch --cpu --num_processes 2` starts a single process (accelerate's multi-CPU mode needs MPI).

Settings come from flags, or from `--config file.json` (keys are the option names with underscores, e.g.
{"block_size": 8}); flags given on the command line override the file. Re-running the same command resumes
both the data generation and the training. Output: OUTPUT_DIR/data (replies), OUTPUT_DIR/run (checkpoint,
log.jsonl, curves.png, and with --report-to the trackers' logs), OUTPUT_DIR/drafter (the trained drafter, loads with
`AutoModel.from_pretrained(dir, trust_remote_code=True)`). Live metrics: `--report-to tensorboard`, then
`tensorboard --logdir OUTPUT_DIR/run`.
"""

# This module is the command's help text (its docstring) and option table; it imports neither torch nor
# transformers, so `hyperdflash --help` and `hyperdflash train --help` answer at once. The run is in command.py.

from __future__ import annotations

import argparse
import json
from pathlib import Path

QUANTIZATIONS = ("none", "8bit", "4bit")  # --target-quantization (trainer.load_target)
TARGET_PARALLEL = ("none", "tp", "ep", "tp+ep")  # --target-parallel (hf_hyperdflash.distributed.PARALLEL_PLANS)
TEACHERS = ("mean_pool", "gated")  # --teacher (losses.teacher_logits)
CE_LABELS = ("reply", "argmax")  # --ce-label (losses.LossConfig)
REPORT_TO = ("none", "tensorboard", "wandb", "all")  # --report-to (telemetry.trackers)

DRAFTER_KINDS = {  # kind -> (reducer, conditioning)
    "hyperdflash": ("inherited_gate", "pre_collapse"),
    "vanilla_dflash": ("dense", "intermediate"),
}
DSPARK = "dspark"  # DeepSeek's block drafter (DeepseekV4DSparkForDrafting), a kind of its own

# What a HyperDFlash or vanilla DFlash drafter trains with where the options themselves are left out (--recipe).
# "hybrid", HyperDFlash's default, is the best recipe measured against DSpark (docs/results.md, "On the previous
# reference pair"):
# DSpark's Markov and confidence heads (`heads`: rank hidden size / 16, set once the target is loaded), the
# acceptance-aligned L1 term weighted 4, and greedy and T=1 replies, the greedy ones seen six times per epoch.
# "paper", vanilla DFlash's default, trains as the paper does: CE and KL on greedy replies, no heads.
RECIPES = {
    "hybrid": {"heads": True, "l1_weight": 4.0, "temperature": [0.0, 1.0], "reply_weights": [6, 1]},
    "paper": {"heads": False, "l1_weight": 0.0, "temperature": [0.0], "reply_weights": [1]},
}
DEFAULT_RECIPES = {"hyperdflash": "hybrid", "vanilla_dflash": "paper"}


def deepseek_markov_rank(hidden_size: int) -> int:
    """DeepSeek's Markov-head rank for a hidden size: hidden size / 16 (256 at 4096), at least 1."""
    return max(hidden_size // 16, 1)


def _int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


# Every option's default. argparse itself defaults everything to None, so `resolve_settings` can tell a flag given
# on the command line (it wins) from one left out (then the config file, then this table).
DEFAULTS = {
    # models
    "target": None,
    "tokenizer": None,
    "target_dtype": "auto",
    "target_quantization": "none",
    "target_device_map": None,
    "target_max_memory": None,
    "target_offload_folder": None,
    "target_parallel": "none",
    "target_parallel_size": None,
    "collective_timeout": 1800,
    # drafter (None: the drafter config's own default, or unset for --init-from)
    "drafter_kind": None,
    "reducer": None,
    "conditioning": None,
    "block_size": None,
    "num_layers": None,
    "context_window": None,
    "target_layer_ids": None,
    "markov_rank": None,
    "recipe": None,
    "init_from": None,
    "lora_rank": 0,
    "lora_alpha": 16.0,
    "lora_dropout": 0.0,
    # data
    "data": "sharegpt",
    "data_split": "train",
    "num_prompts": None,
    "max_prompt_chars": None,
    "data_dir": None,
    "replies": None,
    "feature_store": None,
    "max_new_tokens": 256,
    "temperature": None,
    "reply_weights": None,
    "thinking": False,
    "generation_batch_size": 8,
    "mixed_length_batches": False,
    "max_length": 2048,
    # loss
    "anchors_per_sequence": 16,
    "left_padding_share": 0.0,
    "max_left_padding": 256,
    "gamma": None,
    "kl_weight": 0.1,
    "kl_positions": 2,
    "teacher": "mean_pool",
    "ce_label": "reply",
    "l1_weight": None,
    "confidence_weight": 1.0,
    "markov_bias": True,
    # loop
    "total_steps": 2000,
    "batch_size": 4,
    "gradient_accumulation_steps": 1,
    "learning_rate": 6e-4,
    "warmup_steps": 100,
    "cycle_steps": 0,
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "mixed_precision": "no",
    "optimizer": "adamw",
    "checkpoint_every": 200,
    "log_every": 10,
    "seed": 0,
    # evaluation
    "eval_every": 200,
    "eval_prompts": 8,
    "eval_data": "sharegpt",
    "eval_split": "held_out",
    "eval_max_new_tokens": 64,
    # output
    "output_dir": None,
    "report_to": "none",
}


def _option(group: argparse._ArgumentGroup, flag: str, text: str, **extra) -> None:
    default = DEFAULTS[flag[2:].replace("-", "_")]
    shown = "" if default is None else f" (default: {default})"
    group.add_argument(flag, default=None, help=text + shown, **extra)


def device_map_option(text: str) -> str | dict:
    """'auto' and the other accelerate strategies as they are; a JSON object as a {module: device} map."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not a strategy name nor a JSON object: {error}") from error


def max_memory_option(text: str) -> dict:
    """JSON {device: size}, e.g. {"0": "70GiB", "cpu": "200GiB"}."""
    try:
        sizes = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not a JSON object: {error}") from error
    if not isinstance(sizes, dict):
        raise argparse.ArgumentTypeError('a JSON object {device: size} is expected, e.g. \'{"0": "70GiB"}\'')
    return sizes


def add_target_arguments(models: argparse._ArgumentGroup) -> None:
    """The options that load the frozen target (`command._load_target`), shared by `train` and `features`."""
    _option(
        models,
        "--target",
        "Path or Hub id of the mHC target (DeepSeek-V4, HY-V4, GLM-5-Next or Qwen4-Exp). Default: the shipped "
        "reference target.",
    )
    _option(models, "--target-dtype", "dtype of the frozen target.", choices=["auto", "float32", "bfloat16"])
    _option(
        models,
        "--target-quantization",
        "Load the frozen target in 8 or 4 bits (bitsandbytes: CUDA and the `quantization` extra).",
        choices=list(QUANTIZATIONS),
    )
    _option(
        models,
        "--target-device-map",
        "Spread the target over the devices this process sees: 'auto', 'balanced', 'sequential', or a JSON "
        "{module: device} map. Default: the whole target on the process's device. For 8 GPUs: one process with "
        "'auto' over all eight (plus --gradient-accumulation-steps), or one process per GPU group, each launched "
        "with its own CUDA_VISIBLE_DEVICES.",
        type=device_map_option,
    )
    _option(
        models,
        "--target-max-memory",
        'With --target-device-map: memory per device as JSON, e.g. \'{"0": "70GiB", "cpu": "200GiB"}\'; what '
        "does not fit goes to CPU, then to --target-offload-folder on disk.",
        type=max_memory_option,
    )
    _option(models, "--target-offload-folder", "With --target-device-map: where target weights offloaded to disk go.")
    _option(
        models,
        "--target-parallel",
        "Under torchrun: spread the target over processes by transformers' own plans, tp (tensor parallel), ep "
        "(expert parallel) or tp+ep, in groups of --target-parallel-size; each group sees its own batches and the "
        "drafter's gradients are averaged over the groups (docs/distributed.md).",
        choices=list(TARGET_PARALLEL),
    )
    _option(
        models,
        "--target-parallel-size",
        "Processes per copy of the target with --target-parallel. Default: all of them (one copy).",
        type=int,
    )
    _option(
        models,
        "--collective-timeout",
        "Under torchrun: seconds a process waits in a collective at most (a process that died inside the target's "
        "own collectives), then every process stops. Default: 1800.",
        type=float,
    )


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every `hyperdflash train` option, grouped, plus `--config`."""
    parser.add_argument("--config", type=Path, help="JSON file of option values (underscore keys); flags win.")
    flag = argparse.BooleanOptionalAction

    models = parser.add_argument_group("models")
    add_target_arguments(models)
    _option(models, "--tokenizer", "Tokenizer path or Hub id. Default: the reference's, or the target's.")

    drafter = parser.add_argument_group("drafter")
    _option(
        drafter,
        "--drafter-kind",
        "hyperdflash (default): inherited HC-gate reducer on the final pre-collapse residual; "
        "vanilla_dflash: dense reducer on intermediate target layers; dspark: DeepSeek's block drafter (DeepSeek-V4 "
        "targets), trained with DeepSpec's objective, its stages as --num-layers.",
        choices=[*DRAFTER_KINDS, DSPARK],
    )
    _option(drafter, "--reducer", "Override the kind's reducer.", choices=["inherited_gate", "dense"])
    _option(
        drafter,
        "--conditioning",
        "Override the kind's conditioning. DSpark with pre_collapse: the target's final pre-collapse residual through "
        "a gate inherited from its hc_head, in place of the stream-mean of its last three layers.",
        choices=["pre_collapse", "intermediate"],
    )
    _option(
        drafter,
        "--block-size",
        "Tokens per draft block, anchor included, so block - 1 drafts per step (DSpark's rows; DeepSeek ships 5 "
        "rows: 6 here). Default: 16 (DSpark: 6).",
        type=int,
    )
    _option(drafter, "--num-layers", "Number of draft layers. Default: 2.", type=int)
    _option(
        drafter,
        "--context-window",
        "Attend to only the last N target positions before each anchor, in training and in generation, so the "
        "drafter's cost stays bounded at long context; 0: the whole context. Default: 512 (measured on the "
        "reference pair, docs/results.md).",
        type=int,
    )
    _option(
        drafter,
        "--target-layer-ids",
        "Comma-separated target layers for intermediate conditioning. Default: a DFlash-style spread (DSpark: the "
        "last three).",
        type=_int_list,
    )
    _option(
        drafter,
        "--markov-rank",
        "Rank of DSpark's Markov head (the bias from the previous token). DSpark's default: hidden size / 16, "
        "DeepSeek's ratio (256 at 4096). > 0 on a HyperDFlash or vanilla DFlash drafter adds DSpark's Markov and "
        "confidence heads. Default: the --recipe's (hybrid: hidden size / 16; paper: none).",
        type=int,
    )
    _option(
        drafter,
        "--recipe",
        "How a HyperDFlash or vanilla DFlash drafter trains where --markov-rank, --l1-weight, --temperature and "
        "--reply-weights are left out. hybrid: DSpark's heads, L1 weight 4, greedy and T=1 replies weighted 6:1 "
        "(the best measured, docs/results.md); paper: the paper's HyperDFlash (CE and KL, greedy replies). "
        "Default: hybrid for HyperDFlash, paper for vanilla DFlash; DSpark trains with DeepSpec's objective.",
        choices=list(RECIPES),
    )
    _option(
        drafter,
        "--init-from",
        "Fine-tune this saved drafter directory instead of training a new one (its config is kept, so the "
        "drafter options above must stay unset).",
    )
    _option(
        drafter,
        "--lora-rank",
        "> 0: fine-tune --init-from with LoRA adapters of this rank on the draft layers' projections; the "
        "saved drafter has them merged.",
        type=int,
    )
    _option(drafter, "--lora-alpha", "LoRA scaling numerator.", type=float)
    _option(drafter, "--lora-dropout", "Dropout on the LoRA path.", type=float)

    data = parser.add_argument_group("data (the target's own replies)")
    _option(
        data,
        "--data",
        "Prompts: 'sharegpt' (first user turn of the packaged ShareGPT), a JSONL file of {'messages': [...]} "
        "or {'prompt': ...} records, or a Hugging Face dataset name (needs `datasets`).",
    )
    _option(data, "--data-split", "ShareGPT side (train / held_out) or Hub dataset split of --data.")
    _option(data, "--num-prompts", "Use only the first N prompts. Default: all.", type=int)
    _option(data, "--max-prompt-chars", "Skip prompts longer than this many characters. Default: keep all.", type=int)
    _option(data, "--data-dir", "Where replies are stored (resumable). Default: OUTPUT_DIR/data.")
    _option(
        data,
        "--replies",
        "Train on replies generated elsewhere (e.g. by vLLM) instead of generating them: a JSONL file of "
        "{'messages': [...], 'reply': TEXT} or {'messages': [...], 'reply_ids': [...], 'prompt_ids': [...]} records, "
        "checked against the target's tokenizer and chat template. --data and the generation options are then unused.",
    )
    _option(
        data,
        "--feature-store",
        "Read the target's features from this store (`hyperdflash features`, built from the same replies and "
        "--max-length) instead of running the target's forward at every step; the losses are those of online "
        "training. Needs --left-padding-share 0.",
    )
    _option(data, "--max-new-tokens", "Longest reply per prompt.", type=int)
    _option(
        data,
        "--temperature",
        "Sampling temperature of the replies; 0 = greedy (no top-k/top-p). Several (e.g. 0 1): every prompt is "
        "answered once at each, stored in DATA_DIR/temperature-T, and the drafter trains on all of them. Default: "
        "the --recipe's (hybrid: 0 1; paper and DSpark: 0).",
        type=float,
        nargs="+",
    )
    _option(
        data,
        "--reply-weights",
        "With several --temperature values: how many times each temperature's replies are seen per epoch, one "
        "whole number per temperature (e.g. 2 1 trains on the greedy replies twice as often). Default: the "
        "--recipe's with its temperatures (hybrid: 6 1), else 1 each.",
        type=int,
        nargs="+",
    )
    _option(data, "--thinking", "Chat template in thinking mode (enable_thinking).", action=flag)
    _option(data, "--generation-batch-size", "Prompts per target.generate call.", type=int)
    _option(
        data,
        "--mixed-length-batches",
        "Batch prompts of different lengths with left padding: faster, but V4's compressors then see the "
        "padding, so replies differ from unbatched ones. Off: a batch holds prompts of one length.",
        action=flag,
    )
    _option(data, "--max-length", "Cut training sequences (prompt + reply) to this many tokens.", type=int)

    loss = parser.add_argument_group("loss")
    _option(loss, "--anchors-per-sequence", "Draft blocks sampled per sequence, anew every epoch.", type=int)
    _option(
        loss,
        "--left-padding-share",
        "Share of sequences left-padded as batched generate() pads prompts (a padded V4 row's features differ).",
        type=float,
    )
    _option(loss, "--max-left-padding", "Most pad tokens before a left-padded sequence.", type=int)
    _option(loss, "--gamma", "CE weight of slot k is exp(-(k-1)/gamma). Default: 7*(B-1)/15 (7 at B=16).", type=float)
    _option(loss, "--kl-weight", "alpha of the KL term (0: KL only logged).", type=float)
    _option(loss, "--kl-positions", "First block slots that get the KL term.", type=int)
    _option(
        loss,
        "--teacher",
        "KL teacher: mean_pool = lm_head(norm(mean of mHC streams)) (paper); gated = lm_head(norm(hc_head(.))), "
        "the target's real logits.",
        choices=list(TEACHERS),
    )
    _option(
        loss,
        "--ce-label",
        "Label of the cross-entropy at each block slot: the reply's token, or argmax, the target's most likely token "
        "after the reply so far (what greedy verification accepts; on sampled replies it keeps the CE greedy).",
        choices=list(CE_LABELS),
    )
    _option(
        loss,
        "--l1-weight",
        "Weight of the acceptance-aligned term: at every slot, the L1 distance between the draft's and the target's "
        "next-token distributions (1 - L1/2 is a sampled draft's acceptance), with the CE's slot decay. DSpark "
        "trains with DeepSpec's fixed weights instead. Default: the --recipe's (hybrid: 4; paper: 0).",
        type=float,
    )
    _option(
        loss,
        "--confidence-weight",
        "Weight of the confidence head's loss (with --markov-rank > 0; 0 leaves the head untrained).",
        type=float,
    )
    _option(
        loss,
        "--markov-bias",
        "With --markov-rank > 0: --no-markov-bias keeps the Markov head's bias at zero (frozen), leaving the "
        "confidence head alone; an ablation.",
        action=flag,
    )

    loop = parser.add_argument_group("loop")
    _option(loop, "--total-steps", "Optimizer steps.", type=int)
    _option(loop, "--batch-size", "Sequences per process per micro-batch.", type=int)
    _option(loop, "--gradient-accumulation-steps", "Micro-batches per optimizer step.", type=int)
    _option(loop, "--learning-rate", "Peak learning rate (linear warmup, then cosine decay).", type=float)
    _option(loop, "--warmup-steps", "Warmup steps.", type=int)
    _option(
        loop,
        "--cycle-steps",
        "Warm restarts: warmup and cosine decay repeat every N steps, and the end of each cycle but the last saves "
        "its drafter as OUTPUT_DIR/drafter-step-STEP, so one run gives drafters of several training lengths "
        "(0: one cycle over the run).",
        type=int,
    )
    _option(loop, "--weight-decay", "AdamW weight decay.", type=float)
    _option(loop, "--max-grad-norm", "Gradient clipping norm.", type=float)
    _option(loop, "--mixed-precision", "bf16 autocast, or fp32 throughout.", choices=["no", "bf16"])
    _option(loop, "--optimizer", "adamw (torch) or adamw_8bit (bitsandbytes, CUDA).", choices=["adamw", "adamw_8bit"])
    _option(loop, "--checkpoint-every", "Steps between checkpoints; rerunning the command resumes.", type=int)
    _option(loop, "--log-every", "Steps between log.jsonl records.", type=int)
    _option(loop, "--seed", "Seed of the drafter init, batch order, anchors and sampled replies.", type=int)

    evaluation = parser.add_argument_group("evaluation (tau through target.generate)")
    _option(evaluation, "--eval-every", "Steps between tau measurements, and at the end (0: never).", type=int)
    _option(evaluation, "--eval-prompts", "Number of prompts for tau (0: no evaluation).", type=int)
    _option(evaluation, "--eval-data", "Prompt source for tau, as --data.")
    _option(evaluation, "--eval-split", "Split of --eval-data (ShareGPT's held-out side by default).")
    _option(evaluation, "--eval-max-new-tokens", "Tokens generated per tau prompt (greedy).", type=int)

    output = parser.add_argument_group("output")
    _option(
        output,
        "--output-dir",
        "Holds data/, run/ (checkpoint, log.jsonl, curves.png, tracker logs), drafter/. Required here or as "
        "'output_dir' in --config.",
    )
    _option(
        output,
        "--report-to",
        "Live metrics through accelerate's trackers (every loss term, lr, grad norm, tokens/s, tau at each "
        "evaluation): TensorBoard logs in OUTPUT_DIR/run, Weights & Biases (offline with WANDB_MODE=offline), both "
        "(all), or none. Needs the tracker's package (the `telemetry` extra).",
        choices=list(REPORT_TO),
    )
    return parser


FEATURES_DESCRIPTION = """Run the frozen target once over stored replies and keep what drafter training reads from it.

    hyperdflash features --data-dir runs/drafter/data --output-dir runs/features
    hyperdflash train --output-dir runs/drafter --feature-store runs/features
    torchrun --nproc_per_node 8 -m hf_hyperdflash.cli features --target PATH --target-parallel tp+ep ...

The store holds, per token sequence, the target's final pre-collapse residual (HyperDFlash's conditioning, and what
the KL and L1 teachers are derived from) and, with --layers, those layers' outputs (vanilla DFlash, DSpark), in
safetensors shards with an index. Rerunning the command adds the replies not stored yet. Under torchrun the target is
spread over the processes as `hyperdflash train` spreads it (--target-parallel), and the first process writes.
"""


def add_features_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every `hyperdflash features` option: the replies, the store, and the target as `train` loads it."""
    store = parser.add_argument_group("store")
    store.add_argument(
        "--data-dir",
        nargs="+",
        required=True,
        help="Folders of the target's replies as `hyperdflash train` writes them: OUTPUT_DIR/data, or with several "
        "--temperature values each of its temperature-T folders.",
    )
    store.add_argument(
        "--output-dir", required=True, help="The store's folder (shards and index.json); a rerun adds what is missing."
    )
    store.add_argument(
        "--layers",
        type=_int_list,
        help="Also store these target layers' outputs (comma-separated), for drafters conditioned on intermediate "
        "layers (vanilla DFlash's --target-layer-ids, DSpark's last three). Default: the residual only (HyperDFlash).",
    )
    _option(
        store, "--max-length", "Cut sequences (prompt + reply) as training cuts them: pass the same value.", type=int
    )
    store.add_argument(
        "--batch-size", type=int, default=8, help="Sequences per target forward (default: %(default)s)."
    )
    store.add_argument(
        "--shard-megabytes", type=float, default=1024, help="Size of a shard file in MiB (default: %(default)s)."
    )
    add_target_arguments(parser.add_argument_group("target"))
    return parser


def _apply_recipe(settings: dict) -> None:
    """Fill the loss and data options the run left out from its recipe (RECIPES); the heads come later, once the
    target's hidden size is known (`recipe_markov_rank`)."""
    kind = settings["drafter_kind"] or "hyperdflash"
    if kind == DSPARK:
        if settings["recipe"] is not None:
            raise ValueError(
                "--recipe sets how HyperDFlash and vanilla DFlash drafters train; DSpark trains with "
                "DeepSpec's objective: drop --recipe."
            )
        recipe = RECIPES["paper"]  # DSpark: the target's greedy replies, as DeepSpec trains it
    else:
        settings["recipe"] = settings["recipe"] or DEFAULT_RECIPES[kind]
        recipe = RECIPES[settings["recipe"]]
    if settings["l1_weight"] is None:
        settings["l1_weight"] = recipe["l1_weight"]
    if settings["temperature"] is None:
        from_recipe = settings["replies"] is None  # replies generated elsewhere have no temperature to weigh
        settings["temperature"] = list(recipe["temperature"]) if from_recipe else [0.0]
        if settings["reply_weights"] is None and from_recipe:
            settings["reply_weights"] = list(recipe["reply_weights"])


def recipe_markov_rank(settings: dict, hidden_size: int) -> int | None:
    """--markov-rank as given, else the recipe's: DeepSeek's ratio to the hidden size where the recipe has the heads
    (a new HyperDFlash or vanilla DFlash drafter only: a saved one keeps its own)."""
    if settings["markov_rank"] is not None or settings["init_from"] is not None or settings["recipe"] is None:
        return settings["markov_rank"]
    return deepseek_markov_rank(hidden_size) if RECIPES[settings["recipe"]]["heads"] else None


def _check_reply_weights(settings: dict) -> None:
    weights = settings["reply_weights"]
    if weights is None:
        settings["reply_weights"] = [1] * len(settings["temperature"])
        return
    if len(weights) != len(settings["temperature"]) or any(
        not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in weights
    ):
        raise ValueError(
            f"reply_weights {weights} must give one whole number >= 1 per temperature {settings['temperature']}."
        )
    if settings["replies"] is not None and weights != [1]:
        raise ValueError("reply_weights weigh generated replies by temperature; --replies takes none.")


def resolve_settings(args: argparse.Namespace) -> dict:
    """Command-line flags, else the `--config` file, else the defaults; unknown config keys are an error."""
    try:
        from_file = json.loads(Path(args.config).read_text()) if args.config else {}
    except FileNotFoundError:
        raise ValueError(f"No config file at {args.config}; check the --config path.") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"The config file {args.config} is not valid JSON ({error}); fix it.") from None
    unknown = sorted(set(from_file) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"Unknown keys {unknown} in {args.config}; valid keys: {sorted(DEFAULTS)}.")
    settings = {**DEFAULTS, **from_file}
    settings.update({name: value for name, value in vars(args).items() if name in DEFAULTS and value is not None})
    _apply_recipe(settings)
    if not isinstance(settings["temperature"], list):  # a config file may give one number
        settings["temperature"] = [settings["temperature"]]
    if not settings["temperature"] or any(
        not isinstance(t, int | float) or isinstance(t, bool) or t < 0 for t in settings["temperature"]
    ):
        raise ValueError(f"temperature must be one or more numbers >= 0, not {settings['temperature']}.")
    if len(set(settings["temperature"])) != len(settings["temperature"]):
        raise ValueError(f"temperature lists {settings['temperature']} with a repeat; give each temperature once.")
    _check_reply_weights(settings)
    if settings["output_dir"] is None:
        raise ValueError("Pass --output-dir (or 'output_dir' in the config file).")
    return settings
