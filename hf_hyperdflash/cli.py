"""`hyperdflash` command line: demo (the quick start), train and eval (drafters), features (the target's features
stored for training), plan (a drafter's size and expected speedup for a target, from its config), build-reference
(shipped models)."""

# Building the parser imports neither torch nor transformers (the option tables live in light modules), so
# `--help` answers at once; a command imports what it needs when it runs.

from __future__ import annotations

import argparse
import sys

from .command_errors import run_command
from .demo import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PROMPT, DEFAULT_REPEATS, expected_duration
from .evaluation import options as eval_options
from .training import options as train_options


def _demo(args: argparse.Namespace) -> int:
    print(
        f"Loading the reference pair and decoding {expected_duration(args.max_new_tokens, args.repeats)}.", flush=True
    )
    import torch

    from .demo import load_reference_pair, run_demo

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer, target, drafter, name = load_reference_pair(args.drafter)
    result = run_demo(tokenizer, target, drafter, args.prompt, args.max_new_tokens, args.repeats, args.thinking)
    print(f"prompt: {args.prompt}\n")
    print(f"--- plain decoding ({result.new_tokens} tokens, {result.plain_seconds:.2f} s) ---\n{result.plain_text}\n")
    print(f"--- speculative decoding with the {name} drafter ({result.speculative_seconds:.2f} s) ---")
    print(f"{result.speculative_text}\n")
    print(f"identical outputs: {result.identical}")
    print(f"tau (mean accepted length per verify step, incl. bonus token): {result.tau:.2f}")
    print(f"verify steps whose drafts were copied from the prompt and reply so far: {result.copied_share:.0%}")
    print(f"speedup over plain decoding (median of {args.repeats}): {result.speedup:.2f}x")
    return 0 if result.identical else 1


def _train(args: argparse.Namespace) -> int:
    from .training.command import run_train

    print(f"drafter saved to {run_train(args)}")
    return 0


def _features(args: argparse.Namespace) -> int:
    from .training.command import run_features

    print(f"feature store written to {run_features(args)}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .evaluation.command import run_eval

    return run_eval(args)


def _plan(args: argparse.Namespace) -> int:
    import json

    from .plan import expected_speedup, layer_timings, load_target_config, sizes, target_bytes_per_process

    target_config = load_target_config(args.target_config)
    overrides = {"block_size": args.block_size, "num_hidden_layers": args.num_layers}
    if args.context_window is not None:
        overrides["context_window"] = args.context_window or None
    report = {"target": args.target_config or "DeepseekV4Config() defaults (DeepSeek-V4-Flash)"}
    report |= sizes(target_config, overrides, args.dtype, args.batch_size, args.seq_len)
    report["target_weight_bytes_per_process"] = target_bytes_per_process(target_config, args.processes, args.dtype)
    if args.timing:
        timings = layer_timings(target_config, overrides)
        report["cpu_seconds"] = timings
        report["expected"] = expected_speedup(timings, target_config.num_hidden_layers, args.num_layers, args.tau)
    print(json.dumps(report, indent=2))
    return 0


def _build_reference(args: argparse.Namespace) -> int:
    from .reference import build

    build.main(args.build_args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyperdflash", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="speculative vs plain decoding on the shipped reference pair",
        description=f"Speculative vs plain decoding on the shipped reference pair; at the defaults, "
        f"{expected_duration()}.",
    )
    demo.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (default: %(default)r)")
    demo.add_argument(
        "--drafter",
        default="auto",
        choices=["auto", "hyperdflash", "vanilla_dflash", "mtp"],
        help="which shipped drafter to use (auto: HyperDFlash if shipped, else native MTP)",
    )
    demo.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="reply length in tokens")
    demo.add_argument(
        "--repeats", type=int, default=DEFAULT_REPEATS, help="timed runs of each method; the median is reported"
    )
    demo.add_argument("--thinking", action="store_true", help="thinking chat mode (open <think> section)")
    demo.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    demo.set_defaults(run=_demo)

    train = commands.add_parser(
        "train",
        help="generate the target's replies and train a drafter on them",
        description=train_options.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train_options.add_train_arguments(train).set_defaults(run=_train)

    features = commands.add_parser(
        "features",
        help="run the target once over stored replies and keep what drafter training reads (train --feature-store)",
        description=train_options.FEATURES_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train_options.add_features_arguments(features).set_defaults(run=_features)

    evaluate = commands.add_parser(
        "eval",
        help="plain decoding, native MTP, vanilla DFlash and HyperDFlash side by side on the same prompts",
        description=eval_options.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    eval_options.add_eval_arguments(evaluate).set_defaults(run=_eval)

    plan = commands.add_parser(
        "plan",
        help="drafter size, memory and expected speedup for a target, from its config alone",
        description="Drafter parameters and bytes, drafter KV bytes per context token (with and without a window), "
        "captured-feature bytes per token, training memory per process, and the speedup a tau gives, from CPU "
        "timings of one target-width decoder layer against one draft layer (see hf_hyperdflash/plan.py).",
    )
    plan.add_argument("--target-config", help="the target's config.json or its folder (default: V4-Flash)")
    plan.add_argument("--block-size", type=int, default=16, help="draft block size (default: %(default)s)")
    plan.add_argument("--num-layers", type=int, default=2, help="draft layers (default: %(default)s)")
    plan.add_argument("--context-window", type=int, help="drafter context window (default: 512; 0: whole context)")
    plan.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="weights' dtype")
    plan.add_argument("--batch-size", type=int, default=8, help="training sequences per process (default: 8)")
    plan.add_argument("--seq-len", type=int, default=4096, help="training sequence length (default: 4096)")
    plan.add_argument("--tau", type=float, default=3.69, help="tau to plan with (default: the paper's, 3.69)")
    plan.add_argument(
        "--processes",
        type=int,
        default=8,
        help="processes transformers' TP / EP plans spread the target over (torchrun; default: %(default)s)",
    )
    plan.add_argument(
        "--timing", action=argparse.BooleanOptionalAction, default=True, help="time the layers on this CPU"
    )
    plan.set_defaults(run=_plan)

    rebuild = commands.add_parser(
        "build-reference", help="retrain the shipped tokenizer, target and native MTP", add_help=False
    )
    rebuild.add_argument("build_args", nargs=argparse.REMAINDER, help="arguments of hf_hyperdflash.reference.build")
    rebuild.set_defaults(run=_build_reference)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(f"hyperdflash {args.command}", args.run, args)


if __name__ == "__main__":
    sys.exit(main())
