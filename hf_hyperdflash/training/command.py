"""`hyperdflash train`: the run, also a module entry point for multi-process launches (`accelerate launch
--multi_gpu --num_processes 2 -m hf_hyperdflash.training.command ...`). The options, their defaults and the help
text are in `options`, which --help can import without torch."""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from transformers import AutoTokenizer

from .. import reference
from ..command_errors import run_command
from ..distributed import load_spread_target
from ..loading import check_target_path, check_tokenizer_path, load_target
from ..modeling.strict_loading import check_drafter_path
from ..prompts import Messages, encode_prompt, load_prompts
from . import options
from .curves import read_log
from .data import generate_replies, held_out_repeats, load_examples, load_weighted_examples, reply_directories
from .feature_store import build_feature_store
from .loop import DataShards, LoopConfig
from .losses import LossConfig
from .options import DEFAULTS, DRAFTER_KINDS, DSPARK, add_train_arguments, recipe_markov_rank, resolve_settings
from .replies import load_replies
from .telemetry import PROJECT, tracker_config, trackers
from .trainer import build_drafter, optimizer_factory, train_drafter, without_markov_bias

__all__ = ["DEFAULTS", "DRAFTER_KINDS", "add_train_arguments", "main", "resolve_settings", "run_features", "run_train"]


def _drafter_overrides(settings: dict) -> dict:
    """Config overrides for a new drafter. With --init-from only the options actually set are returned, so
    `build_drafter` can refuse them."""
    names = {"reducer": "reducer", "conditioning": "conditioning", "block_size": "block_size"}
    names |= {"num_hidden_layers": "num_layers", "target_layer_ids": "target_layer_ids", "kind": "drafter_kind"}
    names |= {"context_window": "context_window", "markov_rank": "markov_rank"}
    given = {field: settings[name] for field, name in names.items() if settings[name] is not None}
    if given.get("kind") == DSPARK:
        return _dspark_overrides(given)
    if given.get("context_window") == 0:
        given["context_window"] = None  # 0 asks for the whole context
    if settings["init_from"] is not None:
        return given
    reducer, conditioning = DRAFTER_KINDS[given.pop("kind", "hyperdflash")]
    return {"reducer": reducer, "conditioning": conditioning, **given}


def _dspark_overrides(given: dict) -> dict:
    """The options of a new DSpark drafter as its config fields (`DeepseekV4DSparkConfig`)."""
    fields = {"kind": "kind", "num_hidden_layers": "num_hidden_layers", "target_layer_ids": "dspark_target_layer_ids"}
    fields |= {"markov_rank": "dspark_markov_rank", "context_window": "sliding_window"}
    fields |= {"conditioning": "dspark_conditioning"}
    refused = sorted(set(given) - set(fields) - {"block_size"})
    if refused:
        raise ValueError(f"{refused} do not apply to --drafter-kind dspark; drop them.")
    if given.get("conditioning", "pre_collapse") != "pre_collapse":
        raise ValueError("DSpark conditions on the stream-mean of target layers, or with --conditioning pre_collapse.")
    if given.get("context_window") == 0:
        raise ValueError("DSpark attends to a window of the context; pass a positive --context-window.")
    overrides = {fields[name]: value for name, value in given.items() if name in fields}
    if "block_size" in given:
        if given["block_size"] < 2:
            raise ValueError(f"--block-size {given['block_size']} leaves no draft; pass 2 or more (anchor included).")
        overrides["dspark_block_size"] = given["block_size"] - 1  # rows: one draft each
    return overrides


def _loop_config(settings: dict) -> LoopConfig:
    names = ("total_steps", "batch_size", "gradient_accumulation_steps", "learning_rate", "warmup_steps")
    names += ("weight_decay", "max_grad_norm", "checkpoint_every", "log_every", "seed", "mixed_precision")
    names += ("cycle_steps",)
    cycle_steps = settings["cycle_steps"]
    if cycle_steps < 0 or 0 < cycle_steps <= settings["warmup_steps"]:
        raise ValueError(
            f"--cycle-steps {cycle_steps} leaves no decay after the {settings['warmup_steps']} warmup steps; pass 0 "
            "(one cycle) or more steps than --warmup-steps."
        )
    eval_every = settings["eval_every"] if settings["eval_prompts"] else 0
    return LoopConfig(**{name: settings[name] for name in names}, eval_every=eval_every)


def _reference_target() -> Path:
    try:
        return reference.target_path()
    except FileNotFoundError as error:
        raise ValueError(f"{error} Or pass --target.") from error


def _load_target(settings: dict, target_path: str | Path, accelerator: Accelerator) -> tuple:
    """The frozen target, whole on this process's device or spread over a group of processes by transformers'
    parallel plans (`--target-parallel`), and the share of the data this process trains on."""
    parallel = settings["target_parallel"]
    if parallel == "none":
        target = load_target(
            target_path,
            accelerator.device,
            settings["target_dtype"],
            settings["target_quantization"],
            device_map=settings["target_device_map"],
            max_memory=settings["target_max_memory"],
            offload_folder=settings["target_offload_folder"],
        )
        return target, DataShards(accelerator.process_index, accelerator.num_processes)
    placement = ("target_device_map", "target_offload_folder")
    clashing = [f"--{name.replace('_', '-')}" for name in placement if settings[name]]
    if settings["target_quantization"] != "none":
        clashing.append("--target-quantization")
    if clashing:
        raise ValueError(f"--target-parallel spreads the target by transformers' plans; drop {', '.join(clashing)}.")
    group = settings["target_parallel_size"] or accelerator.num_processes
    target = load_spread_target(target_path, parallel, settings["target_dtype"], group).requires_grad_(False)
    return target, DataShards(accelerator.process_index // group, accelerator.num_processes // group)


def _accelerator(settings: dict, **extra) -> Accelerator:
    """This run's accelerator; under torchrun a collective waits at most `--collective-timeout` seconds."""
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=settings["collective_timeout"]))
    return Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[timeout], **extra)


def _prompts_not_to_train_on(settings: dict, prompts: list[Messages], accelerator: Accelerator) -> frozenset[int]:
    """Indices of the ShareGPT train prompts that repeat a held-out prompt (`data.held_out_repeats`), whose replies
    are generated (the prompt list stays as it is, so reply generation resumes) but not trained on. Reported in one
    line and as `held_out_repeats_left_out` in the saved settings; other prompt sources are used whole."""
    if settings["data"] != "sharegpt" or settings["data_split"] != "train":
        return frozenset()
    skipped = held_out_repeats(prompts)
    settings["held_out_repeats_left_out"] = len(skipped)
    if accelerator.is_main_process:
        print(
            f"Training leaves out the replies to {len(skipped)} of {len(prompts)} ShareGPT train prompts whose text "
            "repeats a held-out prompt (ShareGPT evaluation prompts with those)."
        )
    return skipped


def run_features(args: argparse.Namespace) -> Path:
    """Build (or extend) the feature store of `hyperdflash features`; returns its folder."""
    given = vars(args)
    settings = given | {name: DEFAULTS[name] for name, value in given.items() if value is None and name in DEFAULTS}
    target_path = settings["target"] or _reference_target()
    check_target_path(target_path)
    accelerator = _accelerator(settings)
    target, shards = _load_target(settings, target_path, accelerator)
    if shards.count > 1:
        raise ValueError(
            f"{shards.count} copies of the target would write one store: run one process, or spread one copy over "
            "all of them (--target-parallel without --target-parallel-size)."
        )
    examples = [
        example for data_dir in settings["data_dir"] for example in load_examples(data_dir, settings["max_length"])
    ]
    store = Path(settings["output_dir"])
    shard_bytes = int(settings["shard_megabytes"] * 2**20)
    build_feature_store(target, examples, store, settings["layers"], settings["batch_size"], shard_bytes)
    accelerator.wait_for_everyone()
    return store


def run_train(args: argparse.Namespace) -> Path:
    """Generate (or resume) the reply data, train (or resume) the drafter, save it; returns the drafter dir."""
    settings = resolve_settings(args)
    out = Path(settings["output_dir"])
    run_dir = out / "run"
    loop = _loop_config(settings)
    losses = LossConfig(
        gamma=settings["gamma"],
        kl_weight=settings["kl_weight"],
        kl_positions=settings["kl_positions"],
        teacher=settings["teacher"],
        l1_weight=settings["l1_weight"],
        confidence_weight=settings["confidence_weight"],
        ce_label=settings["ce_label"],
    )
    make_optimizer = optimizer_factory(settings["optimizer"])
    target_path = settings["target"] or _reference_target()
    tokenizer_path = settings["tokenizer"] or (target_path if settings["target"] else reference.tokenizer_path())
    check_target_path(target_path)  # wrong paths fail now, in one line, not after minutes of loading
    check_tokenizer_path(tokenizer_path)
    if settings["init_from"] is not None:
        check_drafter_path(settings["init_from"])
    accelerator = _accelerator(
        settings,
        mixed_precision=loop.mixed_precision,
        log_with=trackers(settings["report_to"]) or None,  # accelerate warns of "no trackers installed" at []
        project_dir=run_dir,  # TensorBoard writes to run_dir/PROJECT
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    target, shards = _load_target(settings, target_path, accelerator)

    settings["markov_rank"] = recipe_markov_rank(settings, target.config.get_text_config().hidden_size)
    torch.manual_seed(loop.seed)
    drafter = build_drafter(
        target,
        settings["init_from"],
        settings["lora_rank"],
        settings["lora_alpha"],
        settings["lora_dropout"],
        **_drafter_overrides(settings),
    )
    if not settings["markov_bias"]:
        drafter = without_markov_bias(drafter)
    if settings["replies"] is not None:  # generated elsewhere, e.g. by a serving engine
        examples = load_replies(settings["replies"], tokenizer, settings["thinking"], settings["max_length"])
    else:
        data_dir = Path(settings["data_dir"] or out / "data")
        prompts = load_prompts(
            settings["data"], settings["data_split"], settings["num_prompts"], settings["max_prompt_chars"]
        )
        reply_dirs = reply_directories(data_dir, settings["temperature"])
        for temperature, reply_dir in reply_dirs.items():
            generate_replies(
                target,
                tokenizer,
                prompts,
                reply_dir,
                max_new_tokens=settings["max_new_tokens"],
                temperature=temperature,
                enable_thinking=settings["thinking"],
                batch_size=settings["generation_batch_size"],
                mixed_lengths=settings["mixed_length_batches"],
                seed=loop.seed,
                rank=shards.index,
                world_size=shards.count,
            )
        accelerator.wait_for_everyone()
        skipped = _prompts_not_to_train_on(settings, prompts, accelerator)
        examples = load_weighted_examples(
            list(reply_dirs.values()), settings["reply_weights"], settings["max_length"], skip_indices=skipped
        )
    eval_prompts = []
    if settings["eval_prompts"]:
        messages = load_prompts(settings["eval_data"], settings["eval_split"], settings["eval_prompts"])
        eval_prompts = [encode_prompt(tokenizer, m, settings["thinking"]) for m in messages]

    run_dir.mkdir(parents=True, exist_ok=True)
    wandb_run = {"dir": str(run_dir), "name": out.name}  # W&B files next to the others, not in the working directory
    accelerator.init_trackers(PROJECT, config=tracker_config(settings), init_kwargs={"wandb": wandb_run})
    drafter = train_drafter(
        drafter,
        target,
        examples,
        run_dir,
        loop,
        losses,
        anchors_per_sequence=settings["anchors_per_sequence"],
        left_padding=(settings["left_padding_share"], settings["max_left_padding"]),
        eval_prompts=eval_prompts,
        eval_max_new_tokens=settings["eval_max_new_tokens"],
        make_optimizer=make_optimizer,
        accelerator=accelerator,
        shards=shards,
        feature_store=settings["feature_store"],
        on_cycle_end=lambda snapshot, step: snapshot.save_pretrained(out / f"drafter-step-{step}"),
    )
    if accelerator.is_main_process:
        measured = [record["tau"] for record in read_log(run_dir / "log.jsonl") if "tau" in record]
        drafter.measured_tau = measured[-1] if measured else None  # the last greedy eval, for the model card
        drafter.save_pretrained(out / "drafter")
        provenance = {**settings, "num_processes": accelerator.num_processes}
        (out / "train_settings.json").write_text(json.dumps(provenance, indent=1, default=str))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # closes the trackers' runs (and the process group)
    return out / "drafter"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="hyperdflash train", description=options.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    run_command(parser.prog, run_train, add_train_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    main()
