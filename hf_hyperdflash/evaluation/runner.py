"""Decode the same prompts with plain decoding and speculative methods, interleaved, and measure every method.

For each prompt and repeat every method decodes once, in an order rotated from one repeat to the next so that no
method always runs first (warm caches, CPU clock ramps), and all of them start from the same seed. Speed is
compared per prompt: each method's median tokens/s over the repeats, divided by plain decoding's. Greedy outputs
are compared with plain decoding token by token; sampled ones are not (a speculative run draws other random
numbers, so only the distribution can match, which `benchmarks/lossless.py` tests).

Each method runs as one chat session would: its calls in a setting follow each other with one drafter, so the
"heuristic" schedule starts the setting from the configured draft length and carries its length from call to call.
Its first call (the first prompt's first repeat) is reported apart (`FirstCall`); the speed figures are those of its
later calls.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..decoding import decoding_settings
from ..modeling.draft_options import DRAFT_FROM_CONTEXT
from ..modeling.generation_stats import (
    GenerationStats,
    acceptance_per_position,
    mean_accepted_length,
    per_decoding_step,
    synchronized_clock,
)

PLAIN_CONTROL = "plain-control"  # plain decoding timed a second time: its speed over plain's is the run's noise


@dataclass(frozen=True)
class Method:
    """A way to decode: plain (`drafter` None) or speculative with a drafter.

    `num_draft_tokens` overrides the drafter's `generation_config.num_assistant_tokens` (native MTP's depth k), and
    `schedule` its `num_assistant_tokens_schedule` (draft_options.SCHEDULES), `draft_from_context` whether steps may
    verify chains copied from the context (`draft_options.DRAFT_FROM_CONTEXT`). `generate_options` go to every
    `generate` call: transformers' own drafting (`prompt_lookup_num_tokens`) is a method without a drafter, whose
    per-step acceptance is not reported (forwards per token and speed are).
    `context`, given the prompt ids, returns a context entered around each of this method's `generate` calls
    (outside the timed region): a hook for test oracles and fault injection.
    """

    name: str
    drafter: PreTrainedModel | None = None
    num_draft_tokens: int | None = None
    schedule: str | None = None
    draft_from_context: bool | None = None  # the drafter's `generation_config.draft_from_context` (None: its own)
    generate_options: dict = field(default_factory=dict)
    context: Callable[[torch.LongTensor], AbstractContextManager] | None = None


def finite_or_none(value: float) -> float | None:
    """NaN as None: standard JSON has no NaN."""
    return None if math.isnan(value) else value


@dataclass
class FirstCall:
    """A method's first call in a setting, where a schedule that learns across calls starts from nothing."""

    tokens_per_second: float = math.nan
    speed_ratio: float = math.nan  # over plain decoding's first call (the same prompt, repeat and seed)
    tau: float = math.nan


@dataclass
class MethodResult:
    """What one method did on a list of prompts, pooled over prompts and repeats."""

    name: str
    prompts: int = 0
    compared: int = 0  # prompts whose greedy outputs were compared with plain decoding
    lossless: int = 0  # of those, token-identical to plain decoding in every repeat
    num_draft_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    decoding_steps: int = 0  # target forwards after each call's prefill
    skipped_steps: int = 0  # of those, steps that decoded plainly without a drafter forward
    copied_steps: int = 0  # verify steps (row steps) whose drafts were copied from the context
    accepted_per_step: list[int] = field(default_factory=list)
    proposed_per_step: list[int] = field(default_factory=list)
    # Per prompt with later calls: their median tokens/s over the repeats, and its ratio to plain decoding's
    tokens_per_second: list[float] = field(default_factory=list)
    speed_ratios: list[float] = field(default_factory=list)
    first_call: FirstCall = field(default_factory=FirstCall)
    runs: list[dict] = field(default_factory=list)  # per prompt: tokens, seconds, drafts accepted, identical

    def record(self, stats: GenerationStats) -> None:
        """Add the `last_generation_stats` of one `generate` call."""
        self.num_draft_tokens = stats.num_draft_tokens
        self.new_tokens += stats.new_tokens
        self.target_forwards += stats.target_forwards
        self.decoding_steps += stats.decoding_steps
        self.skipped_steps += stats.skipped_steps
        self.copied_steps += stats.copied_steps
        self.accepted_per_step += stats.accepted_per_step
        self.proposed_per_step += stats.proposed_per_step

    @property
    def tau(self) -> float:
        """Mean accepted length per verify step, counting the bonus token."""
        return mean_accepted_length(self.accepted_per_step)

    @property
    def acceptance_per_position(self) -> list[float]:
        """Share of the steps that drafted position k whose drafts were accepted up to k."""
        return acceptance_per_position(self.accepted_per_step, self.proposed_per_step)

    @property
    def drafted_per_step(self) -> float:
        """`GenerationStats.drafted_per_step`, pooled over calls."""
        return per_decoding_step(sum(self.proposed_per_step), self.decoding_steps)

    @property
    def skipped_share(self) -> float:
        """Share of decoding steps that skipped drafting."""
        return per_decoding_step(self.skipped_steps, self.decoding_steps)

    @property
    def copied_share(self) -> float:
        """Share of verify steps whose drafts were copied from the context."""
        return per_decoding_step(self.copied_steps, len(self.accepted_per_step))

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / self.new_tokens if self.new_tokens else math.nan

    @property
    def median_tokens_per_second(self) -> float:
        return statistics.median(self.tokens_per_second) if self.tokens_per_second else math.nan

    @property
    def speedup(self) -> float:
        return statistics.median(self.speed_ratios) if self.speed_ratios else math.nan

    def as_dict(self) -> dict:
        """Every summary number (NaN as None, so the JSON stays standard) and the raw per-step/prompt data."""
        return {
            "name": self.name,
            "prompts": self.prompts,
            "compared": self.compared,
            "lossless": self.lossless,
            "num_draft_tokens": self.num_draft_tokens,
            "tau": finite_or_none(self.tau),
            "acceptance_per_position": self.acceptance_per_position,
            "drafted_per_step": finite_or_none(self.drafted_per_step),
            "skipped_share": finite_or_none(self.skipped_share),
            "copied_share": finite_or_none(self.copied_share),
            "forwards_per_token": finite_or_none(self.forwards_per_token),
            "tokens_per_second": finite_or_none(self.median_tokens_per_second),
            "speedup": finite_or_none(self.speedup),
            "first_call": {name: finite_or_none(value) for name, value in dataclasses.asdict(self.first_call).items()},
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "decoding_steps": self.decoding_steps,
            "skipped_steps": self.skipped_steps,
            "accepted_per_step": self.accepted_per_step,
            "proposed_per_step": self.proposed_per_step,
            "speed_ratios": self.speed_ratios,
            "runs": self.runs,
        }


@dataclass
class Session:
    """What a method's calls carry from one to the next, apart from other methods on the same drafter: the draft
    length the "heuristic" schedule leaves."""

    draft_length: int | None = None


@contextmanager
def drafting_settings(method: Method, session: Session) -> Iterator[None]:
    """The method's draft length and schedule on its drafter for one call, the drafter's own again after it (methods
    may share a drafter)."""
    if method.drafter is None:
        yield
        return
    config = method.drafter.generation_config
    overrides = {
        "num_assistant_tokens": session.draft_length if session.draft_length is not None else method.num_draft_tokens,
        "num_assistant_tokens_schedule": method.schedule,
        DRAFT_FROM_CONTEXT: method.draft_from_context,
    }
    originals = {name: getattr(config, name, None) for name in overrides}
    for name, value in overrides.items():  # setattr: `update` skips a name the config does not hold yet
        if value is not None:
            setattr(config, name, value)
    try:
        yield
        session.draft_length = config.num_assistant_tokens
    finally:
        for name, value in originals.items():
            setattr(config, name, value)


@contextmanager
def _counting_forwards(model: PreTrainedModel) -> Iterator[list[int]]:
    """Counts `model`'s forward calls (plain decoding's target forwards)."""
    count = [0]
    handle = model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    try:
        yield count
    finally:
        handle.remove()


def _decode(
    target: PreTrainedModel,
    method: Method,
    input_ids: torch.LongTensor,
    seed: int,
    settings: dict,
    session: Session,
) -> tuple[torch.Tensor, float, GenerationStats]:
    """One timed `generate` call: (output ids, seconds, generation stats)."""
    assistant = {"assistant_model": method.drafter} if method.drafter is not None else {}
    context = method.context(input_ids) if method.context is not None else nullcontext()
    with drafting_settings(method, session), context, _counting_forwards(target) as forwards:
        torch.manual_seed(seed)
        start = synchronized_clock()
        output = target.generate(input_ids, **assistant, **method.generate_options, **settings)
        seconds = synchronized_clock() - start
    if method.drafter is not None:
        return output, seconds, method.drafter.last_generation_stats
    new_tokens = output.shape[1] - input_ids.shape[1]
    return output, seconds, _forward_counts(method.num_draft_tokens or 0, new_tokens, forwards[0])


def _forward_counts(num_draft_tokens: int, new_tokens: int, target_forwards: int) -> GenerationStats:
    """A run without a drafter (plain decoding, prompt lookup) as `last_generation_stats`: its forwards and tokens,
    no per-step record."""
    return GenerationStats(num_draft_tokens=num_draft_tokens, target_forwards=target_forwards, new_tokens=new_tokens)


def _prompt_record(prompt_tokens: int) -> dict:
    """One method's record of one prompt; drafts and verify steps sum over repeats, giving the prompt's own tau."""
    return {"prompt_tokens": prompt_tokens, "new_tokens": [], "seconds": [], "accepted_drafts": 0, "verify_steps": 0}


@torch.no_grad()
def warm_up(target: PreTrainedModel, methods: list[Method], input_ids: torch.LongTensor) -> None:
    """One short untimed run per method, so one-off costs (allocations, lazy init) stay out of the timings."""
    for method in methods:
        _decode(target, method, input_ids, seed=0, settings=decoding_settings(0, 8), session=Session())


@torch.no_grad()
def run_methods(
    target: PreTrainedModel,
    methods: list[Method],
    prompts: list[torch.LongTensor],
    temperature: float = 0.0,
    max_new_tokens: int = 128,
    repeats: int = 1,
    seed: int = 0,
    progress: tqdm | None = None,
) -> list[MethodResult]:
    """Decode every prompt with every method (`methods[0]` must be plain decoding), `repeats` times each; each
    method starts with nothing learned, as a new chat session does."""
    if methods[0].drafter is not None:
        raise ValueError(f"The first method must be plain decoding (no drafter), got {methods[0].name!r}.")
    sessions = [Session() for _ in methods]
    results = [MethodResult(name=method.name) for method in methods]
    settings = decoding_settings(temperature, max_new_tokens)
    greedy = temperature == 0
    for index, input_ids in enumerate(prompts):
        outputs: list[list[torch.Tensor]] = [[] for _ in methods]
        runs = [_prompt_record(input_ids.shape[1]) for _ in methods]
        for repeat in range(repeats):
            shift = repeat % len(methods)
            for m in [*range(shift, len(methods)), *range(shift)]:
                run_seed = seed * 1_000_003 + index * repeats + repeat  # the same for every method
                output, seconds, stats = _decode(target, methods[m], input_ids, run_seed, settings, sessions[m])
                results[m].record(stats)
                outputs[m].append(output)
                runs[m]["new_tokens"].append(stats.new_tokens)
                runs[m]["seconds"].append(seconds)
                runs[m]["accepted_drafts"] += sum(stats.accepted_per_step)
                runs[m]["verify_steps"] += len(stats.accepted_per_step)
                if index == repeat == 0:
                    results[m].first_call = FirstCall(stats.new_tokens / seconds, tau=stats.mean_accepted_length)
                if progress is not None:
                    progress.update(1)
        later = slice(1, None) if index == 0 else slice(None)  # the first prompt's first calls are reported apart
        speeds = [[n / s for n, s in zip(r["new_tokens"], r["seconds"], strict=True)][later] for r in runs]
        for m, result in enumerate(results):
            result.prompts += 1
            if speeds[m]:
                result.tokens_per_second.append(statistics.median(speeds[m]))
                result.speed_ratios.append(result.tokens_per_second[-1] / results[0].tokens_per_second[-1])
            if greedy:
                identical = all(torch.equal(output, outputs[0][0]) for output in outputs[m])
                result.compared += 1
                result.lossless += int(identical)
                runs[m]["identical_to_plain"] = identical
            result.runs.append(runs[m])
    for result in results:
        result.first_call.speed_ratio = result.first_call.tokens_per_second / results[0].first_call.tokens_per_second
    return results
