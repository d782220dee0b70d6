"""`hyperdflash eval`: the run. The options, their defaults and the help text are in `options`, which --help can
import without torch."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from .. import reference
from ..command_errors import run_command
from ..loading import check_target_path, check_tokenizer_path, load_target
from . import options
from .datasets import load_prompt_set
from .harness import (
    build_methods,
    check_drafter,
    evaluate,
    reference_drafter_dirs,
    reference_dspark_dir,
    reference_mtp_dir,
)
from .options import CONTEXT_DRAFTS, MODES, add_eval_arguments
from .paired import default_tau_ratio_pairs, pool_members, speculative_names
from .report import REPORT_FILES, machine_description, write_report

__all__ = ["add_eval_arguments", "main", "run_eval"]


def _models(args: argparse.Namespace, notes: list[str]) -> tuple[str, str, Path | None, dict[str, Path]]:
    """(target, tokenizer, MTP dir or None, named drafter dirs), with the defaults resolved: the shipped models
    go with the shipped target only (they were trained for it)."""
    shipped_target = args.target is None
    if shipped_target:
        try:
            target, tokenizer = str(reference.target_path()), str(reference.tokenizer_path())
        except FileNotFoundError as error:
            raise ValueError(f"{error} Or pass --target.") from error
    else:
        target, tokenizer = args.target, args.target
    if args.mtp == "auto" and shipped_target:
        mtp = reference_mtp_dir(notes)
    elif args.mtp in ("auto", "none"):
        mtp = None
        notes.append(
            "no native MTP (--mtp none)" if args.mtp == "none" else "no native MTP: pass --mtp DIR for --target"
        )
    else:
        mtp = Path(args.mtp)
    with_reference = shipped_target if args.reference_drafters is None else args.reference_drafters
    drafters = reference_drafter_dirs(notes) if with_reference else {}
    drafters |= {name: Path(path) for name, path in args.drafter}
    dspark = reference_dspark_dir(notes) if args.dspark == "auto" and shipped_target else None
    if args.dspark not in ("auto", "none"):
        dspark = Path(args.dspark)
    if dspark is not None:
        drafters["dspark"] = dspark
    return target, args.tokenizer or tokenizer, mtp, drafters


def _ratio_pairs(requested: list[tuple[str, str]] | None, names: list[str]) -> list[tuple[str, str]]:
    """The --tau-ratio pairs, checked against the methods; by default hyperdflash over every other one."""
    if requested is None:
        return default_tau_ratio_pairs(names)
    speculative = speculative_names(names)
    for pair in requested:
        numerator, denominator = (pool_members(side) for side in pair)
        unknown = [name for name in numerator + denominator if name not in speculative]
        if unknown:
            raise ValueError(
                f"--tau-ratio {'/'.join(pair)}: no speculative method named {unknown}; choose from {speculative}."
            )
        if len(set(numerator + denominator)) < len(numerator + denominator):
            raise ValueError(
                f"--tau-ratio {'/'.join(pair)} names a method twice (compares a method with itself); each method "
                "may appear once."
            )
    return list(dict.fromkeys(requested))  # a pair given twice is reported once


def _speed_pairs(requested: list[tuple[str, str]], names: list[str]) -> list[tuple[str, str]]:
    """The --speed-ratio pairs, checked against the methods."""
    for pair in requested:
        unknown = [name for name in pair if name not in names]
        if unknown or pair[0] == pair[1]:
            problem = f"no method named {unknown}" if unknown else "compares a method with itself"
            raise ValueError(f"--speed-ratio {'/'.join(pair)}: {problem}; choose two of {names}.")
    return list(dict.fromkeys(requested))


def run_eval(args: argparse.Namespace) -> int:
    """Run the evaluation, write and print the report; 1 if a greedy output differs from plain decoding, else 0."""
    if args.threads:
        torch.set_num_threads(args.threads)
    notes: list[str] = []
    target_path, tokenizer_path, mtp_dir, drafter_dirs = _models(args, notes)
    check_target_path(target_path)  # wrong paths fail now, in one line, not after the models and prompts load
    check_tokenizer_path(tokenizer_path)
    if mtp_dir is not None:
        check_drafter("mtp", mtp_dir)
    for name, path in drafter_dirs.items():
        check_drafter(name, path)
    for note in notes:
        print(f"note: {note}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    names = [name for name, _ in args.datasets]
    if len(set(names)) < len(names):
        raise ValueError(f"Give each prompt set once in --datasets, got {names}.")
    prompt_sets = {
        name: load_prompt_set(name, path, args.num_prompts, args.max_prompt_chars) for name, path in args.datasets
    }
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    target = load_target(target_path, device, args.dtype)
    mtp_steps = args.mtp_steps if mtp_dir else []
    methods = build_methods(
        target,
        mtp_dir,
        mtp_steps,
        drafter_dirs,
        dict(args.draft_tokens),
        dtype,
        args.schedules,
        args.untrained,
        args.prompt_lookup,
        args.plain_control,
        [CONTEXT_DRAFTS[value] for value in dict.fromkeys(args.context_drafts)],
    )
    ratio_pairs = _ratio_pairs(args.tau_ratio, [method.name for method in methods])
    speed_pairs = _speed_pairs(args.speed_ratio, [method.name for method in methods])
    results = evaluate(
        target,
        tokenizer,
        methods,
        prompt_sets,
        args.temperatures,
        [MODES[mode] for mode in args.modes],
        args.max_new_tokens,
        args.repeats,
        args.seed,
    )
    run = {
        "command": shlex.join(sys.orig_argv),
        "machine": machine_description(),
        "target": target_path,
        "tokenizer": tokenizer_path,
        "methods": [method.name for method in methods],
        "mtp": str(mtp_dir) if mtp_dir else None,
        "drafters": {name: str(path) for name, path in drafter_dirs.items()},
        "prompt_sets": {name: len(chats) for name, chats in prompt_sets.items()},
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "seed": args.seed,
        "dtype": args.dtype,
        "schedules": args.schedules,
        "device": device,
        "notes": notes,
        "tau_ratios": ratio_pairs,
        "speed_ratios": speed_pairs,
        "context_drafts": args.context_drafts,
    }
    print(write_report(results, run, args.output_dir))
    print(f"written: {', '.join(str(args.output_dir / name) for name in REPORT_FILES.values())}")
    return 1 if any(result.not_lossless for result in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hyperdflash eval", description=options.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return run_command(parser.prog, run_eval, add_eval_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
