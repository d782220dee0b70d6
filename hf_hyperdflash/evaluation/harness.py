"""The evaluation grid: every method on the same target and prompts, per prompt set, temperature and chat mode.

Methods come from directories: native MTP at several depths k (one module, reused with
`num_assistant_tokens = k`) and any number of named drafter directories, so ablations (reducer, conditioning,
KL, teacher, block size) are just more rows. The shipped reference drafters are used when present; a missing
one is reported in `notes`, never dropped silently.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModel, PreTrainedModel, PreTrainedTokenizerBase

from .. import reference
from ..modeling.draft_options import DEFAULT_SCHEDULE
from ..modeling.integration import check_compatible
from ..modeling.modeling_deepseek_v4_dspark import DeepseekV4DSparkForDrafting
from ..modeling.modeling_deepseek_v4_mtp import DeepseekV4MTPForDrafting
from ..modeling.modeling_hyperdflash import HyperDFlashForDrafting
from ..modeling.release_weights import DSPARK_TENSOR, MTP_TENSOR, is_deepseek_v4_release, open_release
from ..modeling.strict_loading import check_drafter_path, unreachable_hub_id
from ..modeling.targets import get_target_adapter
from ..prompts import Messages
from ..reference import DRAFTER_KINDS
from .options import DRAFTER_ONLY
from .prompts import chat_ids
from .runner import PLAIN_CONTROL, Method, MethodResult, run_methods, warm_up


@dataclass(frozen=True)
class Setting:
    """One cell of the grid: a prompt set at one temperature in one chat mode."""

    dataset: str
    temperature: float
    thinking: bool

    @property
    def label(self) -> str:
        return f"{self.dataset}, T={self.temperature:g}, {'thinking' if self.thinking else 'non-thinking'}"


@dataclass
class SettingResult:
    setting: Setting
    methods: list[MethodResult]  # plain decoding first

    @property
    def not_lossless(self) -> list[str]:
        return [result.name for result in self.methods if result.lossless < result.compared]


def _shipped(name: str, locate: Callable[[], Path], notes: list[str]) -> Path | None:
    try:
        return locate()
    except FileNotFoundError:
        notes.append(f"skipped {name}: the shipped reference {name} is not installed")
        return None


def reference_mtp_dir(notes: list[str]) -> Path | None:
    """The shipped native MTP module, or None with a note in `notes`."""
    return _shipped("mtp", reference.mtp_path, notes)


def reference_dspark_dir(notes: list[str]) -> Path | None:
    """The shipped DSpark drafter, or None with a note in `notes`."""
    return _shipped("dspark", reference.dspark_path, notes)


def reference_drafter_dirs(notes: list[str]) -> dict[str, Path]:
    """The shipped drafters that exist, by kind; a note in `notes` for each missing one."""
    paths = {kind: _shipped(kind, lambda kind=kind: reference.drafter_path(kind), notes) for kind in DRAFTER_KINDS}
    return {kind: path for kind, path in paths.items() if path is not None}


# Methods that may come from a DeepSeek-V4 release (the target's checkpoint): the drafter's marking tensor, its class
RELEASE_DRAFTERS = {
    "mtp": (MTP_TENSOR, DeepseekV4MTPForDrafting),
    "dspark": (DSPARK_TENSOR, DeepseekV4DSparkForDrafting),
}


def _from_release(name: str, path: str | Path) -> bool:
    return name in RELEASE_DRAFTERS and is_deepseek_v4_release(path)


def check_drafter(name: str, path: str | Path) -> None:
    """A one-line ValueError naming the drafter for a path that holds no loadable drafter (check_drafter_path), or,
    for native MTP and DSpark, a DeepSeek-V4 release that ships none."""
    try:
        if _from_release(name, path):
            open_release(path, RELEASE_DRAFTERS[name][0])
        else:
            check_drafter_path(path)
    except ValueError as error:
        raise ValueError(f"Drafter {name!r}: {error}") from error


def load_drafter(name: str, path: str | Path, target: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A saved drafter (HyperDFlash, vanilla DFlash, native MTP or DSpark), or the native MTP or DSpark drafter a
    DeepSeek-V4 release ships (`path` the target's own checkpoint), next to the target's head, checked against it."""
    device = target.get_output_embeddings().weight.device
    check_drafter(name, path)
    if _from_release(name, path):
        drafter = RELEASE_DRAFTERS[name][1].from_target_checkpoint(path, dtype=dtype).to(device)
    else:
        try:
            drafter = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=dtype).to(device).eval()
        except OSError as error:  # a Hub id (or a relative path shaped like one) that could not be fetched
            raise ValueError(f"Drafter {name!r}: {unreachable_hub_id(path, error)}") from error
    try:
        check_compatible(get_target_adapter(target), drafter)
    except ValueError as error:
        raise ValueError(f"Drafter {name!r} ({path}): {error}") from error
    return drafter


def build_methods(
    target: PreTrainedModel,
    mtp_dir: str | Path | None,
    mtp_steps: list[int],
    drafter_dirs: dict[str, Path],
    draft_tokens: dict[str, int] | None = None,
    dtype: torch.dtype = torch.float32,
    schedules: Sequence[str] = (DEFAULT_SCHEDULE,),
    untrained: bool = False,
    prompt_lookup: Sequence[int] = (),
    plain_control: bool = False,
    context_drafts: Sequence[bool] = (True,),
) -> list[Method]:
    """Plain decoding (and, with `plain_control`, plain decoding again as `PLAIN_CONTROL`, whose speed over the
    first shows the run's timing noise), native MTP at each depth in `mtp_steps`, the named drafters (in the given
    order), then an untrained `from_target` HyperDFlash drafter if asked; every speculative method once per draft
    schedule; then transformers' prompt lookup drafting k tokens per step for each k in `prompt_lookup` (it has no
    schedule).

    `draft_tokens` overrides the number of drafted tokens per step of named drafters (default: their own
    generation config, for block drafters `block_size - 1`). A "constant" method is named NAME-constant. Each
    speculative method runs once per value of `context_drafts` (whether its steps may verify chains copied from the
    context, the default; one without is named NAME-drafter-only).
    """
    draft_tokens = draft_tokens or {}
    unknown = sorted(set(draft_tokens) - set(drafter_dirs))
    if unknown:
        raise ValueError(f"Draft lengths given for unknown drafters {unknown}; drafters: {sorted(drafter_dirs)}.")
    speculative = []
    if mtp_dir is not None and mtp_steps:
        mtp = load_drafter("mtp", mtp_dir, target, dtype)
        speculative += [Method(f"mtp-k{k}", mtp, num_draft_tokens=k) for k in mtp_steps]
    for name, path in drafter_dirs.items():
        speculative.append(Method(name, load_drafter(name, path, target, dtype), draft_tokens.get(name)))
    if untrained:
        with torch.random.fork_rng(devices=[]):  # the same untrained weights in every run
            torch.manual_seed(0)
            drafter = HyperDFlashForDrafting.from_target(target).to(dtype).eval()
        speculative.append(Method("untrained", drafter))
    methods = [Method("plain")] + ([Method(PLAIN_CONTROL)] if plain_control else [])
    for schedule, copies in itertools.product(schedules, context_drafts):
        suffix = ("" if schedule == DEFAULT_SCHEDULE else f"-{schedule}") + ("" if copies else DRAFTER_ONLY)
        methods += [
            dataclasses.replace(m, name=m.name + suffix, schedule=schedule, draft_from_context=copies)
            for m in speculative
        ]
    for k in prompt_lookup:
        methods.append(
            Method(f"prompt-lookup-k{k}", num_draft_tokens=k, generate_options={"prompt_lookup_num_tokens": k})
        )
    names = [method.name for method in methods]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"Method names must be unique; {duplicates} appear more than once.")
    return methods


def evaluate(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    methods: list[Method],
    prompt_sets: dict[str, list[Messages]],
    temperatures: list[float],
    thinking_modes: list[bool],
    max_new_tokens: int = 128,
    repeats: int = 1,
    seed: int = 0,
) -> list[SettingResult]:
    """Run `methods` on every prompt set x chat mode x temperature; one progress bar over all decodes."""
    device = target.get_input_embeddings().weight.device
    encoded = {
        (name, thinking): [chat_ids(tokenizer, messages, thinking).to(device) for messages in chats]
        for name, chats in prompt_sets.items()
        for thinking in thinking_modes
    }
    total = sum(len(ids) for ids in encoded.values()) * len(temperatures) * repeats * len(methods)
    warm_up(target, methods, next(iter(encoded.values()))[0])
    results = []
    with tqdm(total=total, desc="evaluation", unit="decode") as progress:
        for (name, thinking), prompts in encoded.items():
            for temperature in temperatures:
                setting = Setting(name, temperature, thinking)
                progress.set_postfix_str(setting.label)
                methods_results = run_methods(
                    target, methods, prompts, temperature, max_new_tokens, repeats, seed, progress
                )
                results.append(SettingResult(setting, methods_results))
    return results
