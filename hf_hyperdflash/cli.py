"""`hyperdflash` command line: demo (the quick start), train and eval (drafters), build-reference (shipped models)."""

from __future__ import annotations

import argparse
import sys

import torch

from .demo import DEFAULT_PROMPT


def _demo(args: argparse.Namespace) -> int:
    from .demo import load_reference_pair, run_demo  # heavy imports only when the command runs

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
    print(f"speedup over plain decoding (median of {args.repeats}): {result.speedup:.2f}x")
    return 0 if result.identical else 1


def _train(args: argparse.Namespace) -> int:
    from .training.command import run_train

    print(f"drafter saved to {run_train(args)}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .evaluation.command import run_eval

    return run_eval(args)


def _build_reference(args: argparse.Namespace) -> int:
    from .reference import build

    build.main(args.build_args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyperdflash", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="speculative vs plain decoding on the shipped reference pair")
    demo.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (default: %(default)r)")
    demo.add_argument(
        "--drafter",
        default="auto",
        choices=["auto", "hyperdflash", "vanilla_dflash", "mtp"],
        help="which shipped drafter to use (auto: HyperDFlash if shipped, else native MTP)",
    )
    demo.add_argument("--max-new-tokens", type=int, default=128, help="reply length in tokens")
    demo.add_argument("--repeats", type=int, default=3, help="timed runs of each method; the median is reported")
    demo.add_argument("--thinking", action="store_true", help="thinking chat mode (open <think> section)")
    demo.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    demo.set_defaults(run=_demo)

    from .training.command import __doc__ as train_doc
    from .training.command import add_train_arguments

    train = commands.add_parser(
        "train",
        help="generate the target's replies and train a drafter on them",
        description=train_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(train).set_defaults(run=_train)

    from .evaluation.command import __doc__ as eval_doc
    from .evaluation.command import add_eval_arguments

    evaluate = commands.add_parser(
        "eval",
        help="plain decoding, native MTP, vanilla DFlash and HyperDFlash side by side on the same prompts",
        description=eval_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_eval_arguments(evaluate).set_defaults(run=_eval)

    rebuild = commands.add_parser(
        "build-reference", help="retrain the shipped tokenizer, target and native MTP", add_help=False
    )
    rebuild.add_argument("build_args", nargs=argparse.REMAINDER, help="arguments of hf_hyperdflash.reference.build")
    rebuild.set_defaults(run=_build_reference)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
