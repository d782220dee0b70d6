"""`hyperdflash eval`: plain decoding, native MTP, vanilla DFlash and HyperDFlash on the same target and prompts.

    hyperdflash eval --output-dir runs/eval --datasets humaneval sharegpt --num-prompts 10 --repeats 3
    hyperdflash eval --output-dir runs/ablation --mtp-steps 6 --no-reference-drafters --temperatures 0 \\
        --drafter hyperdflash=runs/hdf/drafter --drafter dense=runs/dense/drafter --drafter no_kl=runs/kl0/drafter

For each prompt set, chat mode (--modes) and temperature (--temperatures), every method decodes every prompt
--repeats times, interleaved per prompt; tau, acceptance per draft position, target forwards per token, tokens/s,
speedup over plain decoding (medians) and paired tau ratios with bootstrap intervals (--tau-ratio) are reported.
Greedy (T=0) outputs must be token-identical to plain decoding: the command exits with status 1 if any differs. T=1
samples with fixed seeds per prompt and repeat (losslessness in distribution is benchmarks/lossless.py's job).

Defaults: the shipped reference target, tokenizer, native MTP and drafters (with --target: only the models
named by flags); a shipped model that is not installed is skipped with a printed note. Prompt sets: humaneval,
sharegpt (held-out) and copyedit (held-out replies in copy-heavy tasks) work offline; gsm8k, math500, aime25, mbpp,
livecodebench and mtbench need `datasets` and network access, or a local JSONL file as NAME=PATH (formats in
hf_hyperdflash.evaluation.datasets).
Output: OUTPUT_DIR/report.md (also printed), results.json, acceptance.png.
"""

# This module is the command's help text (its docstring) and option table; it imports neither torch nor
# transformers (draft_options is plain constants), so `hyperdflash eval --help` answers at once. The run is in
# command.py.

from __future__ import annotations

import argparse
from pathlib import Path

from ..modeling.draft_options import DEFAULT_SCHEDULE, SCHEDULES
from .datasets import PROMPT_SETS

DRAFTER_ONLY = "-drafter-only"  # the name suffix of a method whose steps verify only its drafter's drafts
CONTEXT_DRAFTS = {"on": True, "off": False}  # --context-drafts
POOL_SEPARATOR = "+"  # "a+b": one side of a tau ratio made of several methods (paired.pool_members)
MODES = {"non-thinking": False, "thinking": True}
DTYPES = ("float32", "bfloat16")  # --dtype, torch dtype names


def _two_parts(text: str, separator: str, form: str) -> tuple[str, str]:
    """`text` split at the first `separator` into two non-empty parts; `form` names them in the error."""
    first, found, second = text.partition(separator)
    if not found or not first or not second:
        raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}")
    return first, second


def _named(text: str) -> tuple[str, str]:
    return _two_parts(text, "=", "NAME=VALUE")


def _drafter(text: str) -> tuple[str, str]:
    name, path = _named(text)
    if POOL_SEPARATOR in name or "/" in name:
        raise argparse.ArgumentTypeError(
            f"drafter name {name!r} has {POOL_SEPARATOR!r} or '/', which --tau-ratio reads; rename it"
        )
    return name, path


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _temperature(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a temperature >= 0, got {text}")
    return value


def _draft_length(text: str) -> tuple[str, int]:
    name, count = _named(text)
    return name, _positive_int(count)


def _method_pair(text: str) -> tuple[str, str]:
    return _two_parts(text, "/", "NUMERATOR/DENOMINATOR method names")


def _dataset(text: str) -> tuple[str, str | None]:
    name, _, path = text.partition("=")
    if name not in PROMPT_SETS:
        raise argparse.ArgumentTypeError(f"unknown prompt set {name!r}; choose from {sorted(PROMPT_SETS)}")
    return name, path or None


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every `hyperdflash eval` option, grouped."""
    models = parser.add_argument_group("models")
    models.add_argument(
        "--target", help="Path or Hub id of the mHC target (DeepSeek-V4 or HY-V4). Default: the shipped reference."
    )
    models.add_argument("--tokenizer", help="Tokenizer path or Hub id. Default: the reference's, or the target's.")
    models.add_argument(
        "--mtp",
        default="auto",
        help="Native MTP: a saved drafter directory, a DeepSeek-V4 release (the target's checkpoint: the MTP block it "
        "ships), or 'none'. Default (auto): the shipped one with the shipped target.",
    )
    models.add_argument(
        "--dspark",
        default="auto",
        help="DSpark: a DeepSeek-V4 release that ships it (the target's checkpoint), a saved DSpark drafter, or "
        "'none'; one more method, named dspark. Default (auto): the shipped one with the shipped target.",
    )
    models.add_argument(
        "--mtp-steps",
        type=_positive_int,
        nargs="+",
        default=[1, 2, 3, 4, 5, 6],
        help="MTP draft depths k, one method each (default: %(default)s).",
    )
    models.add_argument(
        "--drafter",
        type=_drafter,
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="A saved drafter to evaluate under NAME (repeatable): ablations are more drafters in the same table.",
    )
    models.add_argument(
        "--reference-drafters",
        action=argparse.BooleanOptionalAction,
        help="Also evaluate the shipped vanilla_dflash and hyperdflash drafters. Default: only with the shipped "
        "target.",
    )
    models.add_argument(
        "--draft-tokens",
        type=_draft_length,
        action="append",
        default=[],
        metavar="NAME=K",
        help="Draft K tokens per step with drafter NAME (default: its generation config, block_size - 1).",
    )
    models.add_argument(
        "--schedules",
        nargs="+",
        choices=list(SCHEDULES),
        default=[DEFAULT_SCHEDULE],
        help="Draft schedules, each speculative method once per schedule (named NAME-SCHEDULE unless adaptive): "
        "adaptive (the drafters' default: draft length chosen each step, drafting skipped where it does not pay), "
        "heuristic and heuristic_transient (transformers' own: +2 drafts after a fully accepted step, -1 otherwise; "
        "the first keeps its length for the next call), constant (every step drafts k) (default: adaptive).",
    )
    models.add_argument(
        "--context-drafts",
        nargs="+",
        choices=list(CONTEXT_DRAFTS),
        default=["on"],
        help="Whether each step may verify a chain copied from the context (the prompt and the reply so far) instead "
        "of the drafter's: on (the drafters' default, `draft_from_context`), off (named NAME-drafter-only); both "
        "values: each speculative method once per value (default: on).",
    )
    models.add_argument(
        "--prompt-lookup",
        type=_positive_int,
        nargs="*",
        default=[],
        metavar="K",
        help="Also evaluate transformers' own prompt lookup drafting K tokens per step (`prompt_lookup_num_tokens`), "
        "one method per K, named prompt-lookup-kK: the drafting a transformers user already has, exact on these "
        "targets once the package is loaded (default: none).",
    )
    models.add_argument(
        "--plain-control",
        action="store_true",
        help="Also time plain decoding a second time, interleaved with the others as a method named "
        "'plain-control': its speed over plain decoding's, which is 1.00x but for timing noise, shows how finely "
        "this run's speed ratios resolve (on a shared machine, repeats of one call scatter by 10%% and more).",
    )
    models.add_argument(
        "--untrained",
        action="store_true",
        help="Also evaluate an untrained HyperDFlash drafter built with `from_target` (named 'untrained'): what a "
        "user gets before training, or with a drafter far off its domain.",
    )
    models.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="dtype of every model (default: %(default)s)."
    )
    models.add_argument("--device", default=None, help="Device of every model. Default: cuda if available, else cpu.")
    models.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default).")

    prompts = parser.add_argument_group("prompts")
    prompts.add_argument(
        "--datasets",
        type=_dataset,
        nargs="+",
        default=[("humaneval", None), ("sharegpt", None)],
        metavar="NAME[=PATH]",
        help=f"Prompt sets, each optionally from a local JSONL file; choose from {sorted(PROMPT_SETS)} "
        "(default: humaneval sharegpt).",
    )
    prompts.add_argument(
        "--num-prompts", type=_positive_int, default=10, help="Prompts per set (default: %(default)s)."
    )
    prompts.add_argument(
        "--max-prompt-chars",
        type=_positive_int,
        default=4000,
        help="Cut each prompt to this many characters (default: %(default)s).",
    )
    prompts.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="Chat modes (the template's enable_thinking) (default: both).",
    )

    decoding = parser.add_argument_group("decoding")
    decoding.add_argument(
        "--temperatures",
        type=_temperature,
        nargs="+",
        default=[0.0, 1.0],
        help="0: greedy, checked lossless; > 0: sampling with fixed seeds (default: 0 1).",
    )
    decoding.add_argument(
        "--max-new-tokens", type=_positive_int, default=128, help="Tokens per reply (default: %(default)s)."
    )
    decoding.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help="Timed runs per prompt and method; medians are reported (default: %(default)s).",
    )
    decoding.add_argument("--seed", type=int, default=0, help="Base of the per-prompt/repeat sampling seeds.")

    report = parser.add_argument_group("report")
    report.add_argument(
        "--tau-ratio",
        type=_method_pair,
        action="append",
        metavar="NUM/DEN",
        help="Report tau(NUM) / tau(DEN) with a 95%% paired bootstrap interval over prompts (repeatable; method "
        "names as in the table, e.g. hyperdflash/mtp-k3). A side 'a+b' pools methods, e.g. drafters of several "
        "seeds: hdf_s0+hdf_s1/dfl_s0+dfl_s1. Default: hyperdflash over every other speculative method.",
    )
    report.add_argument(
        "--speed-ratio",
        type=_method_pair,
        action="append",
        default=[],
        metavar="NUM/DEN",
        help="Also report the speed of NUM over DEN on the same prompts (median over prompts, 95%% percentile "
        "interval), for methods a tau ratio cannot compare, e.g. hyperdflash/prompt-lookup-k7 (repeatable).",
    )
    report.add_argument(
        "--output-dir", type=Path, required=True, help="Where report.md, results.json, acceptance.png go."
    )
    return parser
