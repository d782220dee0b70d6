"""`target.generate(..., assistant_model=drafter)` for HyperDFlash, vanilla-DFlash and native-MTP drafters.

`install_generate_integration()` wraps `GenerationMixin.generate` once per process; `drafting.py` calls it when a
drafter class loads, so it runs on `import hf_hyperdflash` and equally when transformers loads a saved drafter's
remote code (`trust_remote_code=True`), with no import of the library. Several copies of this runtime can live in
one process (the library, and one per remote-code folder); they share one wrapper, and the library's copy takes
over from a remote-code one, since it may be newer.

The wrapper only acts when the assistant is one of our drafters, recognised by `config.model_type` (so a drafter of
either origin works under either copy), or when transformers' own drafting meets a stateful mHC target. Then, for
that call only (`call_scope`: concurrent calls on one target do not see each other's), it brings a rewindable
target cache, hooks the target to capture the features the drafter conditions on, swaps in our candidate generator
and lifts the target's `_is_stateful` guard. Verification, acceptance (greedy prefix match or speculative sampling),
logits processors, stopping criteria and streaming stay transformers' own `_assisted_decoding`, so outputs are the
target's. Where the adaptive schedule waits 16 steps or more, the call runs the wait in plain decoding's own loop
and resumes the assisted one after it (`_StretchedCall`, `stretches.py`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from transformers import Cache, GenerationConfig, GenerationMixin, PreTrainedModel

from . import call_scope
from .candidate_generator import BlockProposer, MTPProposer, SpeculativeCandidateGenerator, TokenPicker
from .draft_options import BLOCK_DRAFTER_TYPE, DRAFTER_TYPES
from .draft_policy import CallSchedule
from .generation_stats import GenerationStats
from .indexer_ties import install_deterministic_indexer
from .output_split import outputs_split_per_token
from .request_checks import (
    check_cached_prefix,
    check_compatible,
    check_confidence_threshold,
    check_prompt,
    draft_schedule,
    num_draft_tokens,
    refuse_images,
    refuse_incompatible_options,
)
from .step_timer import StepTimer, synchronized_clock
from .stopping import HeldBackStreamer, PerTokenStopping
from .stretches import (
    PlainStretchStopping,
    SharedBuilds,
    StretchStreamer,
    TimedStopping,
    continued_options,
    join_outputs,
)
from .target_base import HyperConnectionTarget
from .targets import TARGET_FAMILIES, get_target_adapter
from .transformers_compat import (
    CACHE_ARGUMENT,
    CACHE_ARGUMENTS,
    cached_length,
    check_internals,
    pop_user_cache,
    warn_if_untested,
)

_INSTALLED_BY = "_hyperdflash_integration"  # attribute of the wrapper: the module that installed it


def is_speculative_drafter(model: object) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) in DRAFTER_TYPES


@dataclass
class GenerateRequest:
    """One generate() call as the wrapper received it, with the generation config merged once."""

    model: PreTrainedModel
    arguments: dict  # generate()'s named arguments, without `self` and `kwargs`
    kwargs: dict  # its other keyword arguments (model inputs, generation options), the cache taken out
    cache: Cache | None  # the cache the caller passed in, under either name
    generation_config: GenerationConfig

    @classmethod
    def from_arguments(cls, model: PreTrainedModel, bound: dict) -> GenerateRequest:
        """From generate()'s bound arguments (`inspect.BoundArguments.arguments`)."""
        arguments = {name: value for name, value in bound.items() if name not in ("self", "kwargs")}
        extra = dict(bound.get("kwargs", {}))
        cache = pop_user_cache(extra)
        generation_config, _ = model._prepare_generation_config(arguments.get("generation_config"), **extra)
        return cls(model, arguments, extra, cache, generation_config)

    def continued(self, sequences: torch.LongTensor, streamer: StretchStreamer | None) -> GenerateRequest:
        """This call as a later stretch that continues from `sequences` (the target cache holds all but the newest
        token): the same options for the tokens left, and a mask of ones over everything so far, as plain decoding's
        stays (a stretched call's prompt has no padding; a mask inferred from padding tokens would hide generated
        ones)."""
        options = continued_options(self.max_length - sequences.shape[1])
        config = copy.deepcopy(self.generation_config)
        config.update(**options)
        kwargs = {name: value for name, value in self.kwargs.items() if name != "input_ids"}
        kwargs |= options | {"attention_mask": torch.ones_like(sequences)}
        arguments = self.arguments | {"inputs": sequences, "streamer": streamer}
        return replace(self, arguments=arguments, kwargs=kwargs, generation_config=config)

    @property
    def input_ids(self) -> torch.LongTensor | None:
        inputs = self.arguments.get("inputs")
        return inputs if inputs is not None else self.kwargs.get("input_ids")

    @property
    def new_token_budget(self) -> int:
        """The most tokens the call may add (`max_new_tokens`, else what `max_length` leaves)."""
        config = self.generation_config
        if config.max_new_tokens is not None:
            return config.max_new_tokens
        return config.max_length - self.input_ids.shape[1]

    @property
    def max_length(self) -> int:
        """The longest sequence the call may return."""
        return self.input_ids.shape[1] + self.new_token_budget

    @property
    def positions_may_lag_cache(self) -> bool:
        """Position ids may fall behind cache indices: they are passed in, or generate() derives them from an
        `attention_mask` with zeros, passed in or inferred from padding tokens in the prompt."""
        if "position_ids" in self.kwargs:
            return True
        mask = self.kwargs.get("attention_mask")
        if mask is None:
            return masks_padding(self.input_ids, self.generation_config)
        return not bool(mask.all())

    @property
    def asks_attentions_it_cannot_get(self) -> bool:
        """`output_attentions` with an attention implementation that returns none (only eager does): plain decoding
        then returns an empty tuple per step."""
        implementation = self.model.config.get_text_config()._attn_implementation
        config = self.generation_config
        return bool(config.output_attentions and config.return_dict_in_generate) and implementation != "eager"


def masks_padding(input_ids: torch.LongTensor, generation_config: GenerationConfig) -> bool:
    """Whether generate(), given no attention mask, infers one with zeros for this prompt: it holds the padding
    token, which is no end-of-sequence token (transformers' `_prepare_attention_mask_for_generation`; without a
    padding token generate() pads with the first end-of-sequence token, and infers nothing)."""
    pad, eos = generation_config.pad_token_id, generation_config.eos_token_id
    if pad is None:
        return False
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return pad not in eos_ids and bool((input_ids == pad).any())


def _call_cache(target: HyperConnectionTarget, cache: Cache | None, max_draft: int) -> Cache:
    """The target cache of this call: a new rewindable one, or the caller's, made rewindable in place (and made
    stock again when the call ends, `_exact_assisted_call`)."""
    return target.make_cache(max_draft) if cache is None else target.adopt_cache(cache, max_draft)


def _exact_assisted_call(
    original_generate: Callable,
    target: HyperConnectionTarget,
    request: GenerateRequest,
    cache: Cache,
    build_candidate_generator: Callable,
    shared: SharedBuilds | None = None,
    hand_over: Callable[[int], bool] | None = None,
):
    """transformers' assisted loop, made to return plain decoding's result on an mHC target: a rewindable cache,
    stopping criteria per accepted token (the streamer held back one step), per-token hidden states and attentions,
    verify rows that see what one-token decoding sees. `build_candidate_generator(original, **options)` stands in
    for the target's `_get_candidate_generator` in this call. In a stretched call, the stopping criteria are the
    call's `shared` ones, and the loop also stops once `hand_over(sequence length)` says so."""
    prompt_length = request.input_ids.shape[1]
    arguments = dict(request.arguments)
    if arguments.get("streamer") is not None:
        arguments["streamer"] = HeldBackStreamer(arguments["streamer"])
    stopping: list[PerTokenStopping] = []

    def stopping_criteria(build: Callable, **options) -> PerTokenStopping:
        if stopping:  # a generate() nested in this call on the same model (a target that is its own assistant)
            return build(**options)
        criteria = shared.reuse("stopping_criteria")(build, **options) if shared is not None else build(**options)
        stopping.append(PerTokenStopping(criteria, prompt_length, arguments.get("streamer"), hand_over))
        return stopping[-1]

    # "dynamic" (perhaps from the target's generation_config.json) is what the rewindable cache is.
    kwargs = request.kwargs | {CACHE_ARGUMENT: cache, "cache_implementation": None}
    no_attentions = request.asks_attentions_it_cannot_get
    if no_attentions:  # transformers' assisted loop would index the empty attentions a non-eager model returns
        kwargs["output_attentions"] = False
    stateful = getattr(type(target.model), "_is_stateful", False)
    try:
        with (
            call_scope.lifted_stateful_guard(target.model) if stateful else nullcontext(),
            call_scope.methods(
                target.model,
                _get_stopping_criteria=stopping_criteria,
                _get_candidate_generator=build_candidate_generator,
            ),
            target.verify_as_decoding(prompt_length, request.positions_may_lag_cache, cache),
            outputs_split_per_token(target.one_token_key_columns, target.prompt_key_columns, cached_length(cache)),
        ):
            output = original_generate(target.model, **arguments, **kwargs)
        output = stopping[0].finish(output, cache, prompt_length)
    finally:
        target.release_cache(cache)  # the returned (or passed-in) cache is plain decoding's, by type and state
    if no_attentions and not isinstance(output, torch.Tensor):
        output.attentions = tuple(() for _ in range(output.sequences.shape[1] - prompt_length))  # as plain decoding
    return output


def speculative_generate(original_generate: Callable, request: GenerateRequest, drafter: PreTrainedModel):
    start = synchronized_clock()
    check_internals()
    target = get_target_adapter(request.model)
    check_compatible(target, drafter)
    draft_length = num_draft_tokens(drafter)
    schedule_name = draft_schedule(drafter)
    check_confidence_threshold(drafter)
    refuse_incompatible_options(request.generation_config, drafter)
    check_prompt(request.input_ids)
    refuse_images(request.kwargs)
    if request.cache is not None:
        check_cached_prefix(request.cache, request.input_ids.shape[1])
    schedule = CallSchedule(schedule_name, drafter, request.model, request.generation_config, draft_length)
    max_draft = schedule.policy.max_draft  # "heuristic" may grow past `draft_length`
    if drafter.config.model_type == BLOCK_DRAFTER_TYPE:
        proposer = BlockProposer(drafter, target)
    else:
        proposer = MTPProposer(drafter, target, max_draft)
    stats = GenerationStats(num_draft_tokens=max_draft, schedule=schedule_name)
    budget = request.new_token_budget
    if budget > 0 and schedule.decodes_plainly(budget):
        return _plain_call(original_generate, request, target, max_draft, schedule, drafter, start)
    cache = _call_cache(target, request.cache, max_draft)
    timer = StepTimer()
    with target.capture(proposer.feature_layers) as capture, timer.attach(cache):
        generator = SpeculativeCandidateGenerator(
            proposer=proposer,
            capture=capture,
            prompt_length=request.input_ids.shape[1],
            max_length=request.max_length,
            pick=None,
            policy=schedule.policy,
            threshold=schedule.threshold,
            stats=stats,
            timer=timer,
        )

        def candidate_generator(_original, generation_config, logits_processor, **_) -> SpeculativeCandidateGenerator:
            generator.pick = TokenPicker(logits_processor, bool(generation_config.do_sample))
            return generator

        # A padded prompt's positions lag the cache: its stretches would need position ids carried over
        if schedule.may_wait and not request.positions_may_lag_cache:
            call = _StretchedCall(original_generate, target, request, cache, schedule, generator, candidate_generator)
            output = call.run()
        else:
            output = _exact_assisted_call(original_generate, target, request, cache, candidate_generator)
    schedule.finish()  # after the timer closed the last step, which the schedule learns from too
    _record_call(stats, output, request, drafter, start)
    return output


class _StretchedCall:
    """A call whose schedule may wait: assisted stretches, and plain decoding's own loop through each wait of
    `MIN_PLAIN_STRETCH` steps or more (`stretches.py`), joined into one call's result."""

    def __init__(
        self,
        original_generate: Callable,
        target: HyperConnectionTarget,
        request: GenerateRequest,
        cache: Cache,
        schedule: CallSchedule,
        generator: SpeculativeCandidateGenerator,
        build_candidate_generator: Callable,
    ):
        self.original_generate, self.target, self.request, self.cache = original_generate, target, request, cache
        self.schedule, self.generator, self.build_candidate_generator = schedule, generator, build_candidate_generator
        self.shared = SharedBuilds()

    def run(self):
        """Stretch after stretch until the call's stopping criteria stop one, or its budget is spent."""
        request, output = self.request, None
        streamer = request.arguments.get("streamer")
        stream = StretchStreamer(streamer) if streamer is not None else None
        stretch = replace(request, arguments=request.arguments | {"streamer": stream}) if stream else request
        with call_scope.methods(request.model, _get_logits_processor=self.shared.reuse("logits_processor")):
            while True:
                plain_steps = self._plain_steps(stretch.input_ids.shape[1])
                result, stopped = self._plain(stretch, plain_steps) if plain_steps else self._assisted(stretch)
                output = result if output is None else join_outputs(output, result)
                sequences = _sequences(result)
                if stopped or sequences.shape[1] >= request.max_length:
                    break
                if stream is not None:
                    stream.next_stretch()
                stretch = request.continued(sequences, stream)
        if stream is not None:
            stream.finish()
        return output

    def _plain_steps(self, length: int) -> int:
        return self.schedule.plain_stretch(self.request.max_length - length)

    def _assisted(self, stretch: GenerateRequest) -> tuple[object, bool]:
        """An assisted stretch, until the schedule waits long enough for plain decoding's loop to pay."""
        handed_over = False

        def hand_over(length: int) -> bool:
            nonlocal handed_over
            handed_over = self._plain_steps(length) > 0
            return handed_over

        cache = self.target.adopt_cache(self.cache, self.schedule.policy.max_draft)
        output = _exact_assisted_call(
            self.original_generate,
            self.target,
            stretch,
            cache,
            self.build_candidate_generator,
            self.shared,
            hand_over,
        )
        self.generator.timer.close()  # its last step, which the schedule learns from before deciding what follows
        self.generator.take_verified(_sequences(output).shape[1])
        return output, not handed_over

    def _plain(self, stretch: GenerateRequest, steps: int) -> tuple[object, bool]:
        """`steps` steps of the schedule's wait in plain decoding's loop, from the call's stock cache; the drafter
        gets their features when it next drafts. A stretch that ends the call records none: their capture cost
        0.1%-0.8% of a step by instruction count (a hooked collapse head, and a record per step), and a losing
        drafter's wait often runs from a failed probe to the call's end."""
        self.target.release_cache(self.cache)
        end_length = stretch.input_ids.shape[1] + steps
        features = []
        capture = self.generator.capture
        drafts_after = end_length < self.request.max_length
        record = (lambda: features.append(capture.features())) if drafts_after else None

        def stopping_criteria(build: Callable, *args, **kwargs) -> PlainStretchStopping:
            criteria = self.shared.reuse("stopping_criteria")(build, *args, **kwargs)
            return PlainStretchStopping(criteria, end_length, on_step=record)

        with nullcontext() if drafts_after else capture.paused():
            output, first_seconds, stopping = _timed_plain_generate(
                self.original_generate, stretch, self.cache, stopping_criteria
            )
        forwards = len(stopping.iteration_ends)
        self.generator.decoded_plainly(forwards, first_seconds, features)
        self.schedule.policy.skip(forwards, stopping.step_seconds())
        return output, stopping.stopped


def _sequences(output) -> torch.LongTensor:
    """The token ids of a generate() result, a tensor or a dict of outputs."""
    return output if isinstance(output, torch.Tensor) else output.sequences


def _record_call(
    stats: GenerationStats, output, request: GenerateRequest, drafter: PreTrainedModel, start: float
) -> None:
    """The call's new tokens and wall time in `stats`, which become `drafter.last_generation_stats` (with concurrent
    calls on one drafter: the call that finished last)."""
    stats.new_tokens = _sequences(output).shape[1] - request.input_ids.shape[1]
    stats.seconds = synchronized_clock() - start
    drafter.last_generation_stats = stats


def _timed_plain_generate(
    original_generate: Callable,
    request: GenerateRequest,
    cache: Cache | None,
    stopping_criteria: Callable[..., TimedStopping] | None = None,
) -> tuple[object, float, TimedStopping]:
    """Plain decoding of `request` (from `cache`, if given); the seconds from generate()'s start to its first target
    forward's iteration's end (a call's prefill, when the decoding starts the call); and its stopping criteria, which
    timed its steps. `stopping_criteria(build, *args, **kwargs)` builds them (default: `TimedStopping` of the built
    ones)."""
    arguments = {name: value for name, value in request.arguments.items() if name != "assistant_model"}
    # "dynamic" (perhaps from the target's generation_config.json) is what a passed cache is
    cache_argument = {CACHE_ARGUMENT: cache, "cache_implementation": None} if cache is not None else {}
    built: list[TimedStopping] = []

    def timed_criteria(build: Callable, *args, **kwargs) -> TimedStopping:
        built.append(
            stopping_criteria(build, *args, **kwargs) if stopping_criteria else TimedStopping(build(*args, **kwargs))
        )
        return built[-1]

    start = synchronized_clock()
    with call_scope.methods(request.model, _get_stopping_criteria=timed_criteria):
        output = original_generate(request.model, **arguments, **request.kwargs, **cache_argument)
    stopping = built[0] if built else TimedStopping([])
    first_seconds = stopping.iteration_ends[0] - start if stopping.iteration_ends else 0.0
    return output, first_seconds, stopping


def _plain_call(
    original_generate: Callable,
    request: GenerateRequest,
    target: HyperConnectionTarget,
    max_draft: int,
    schedule: CallSchedule,
    drafter: PreTrainedModel,
    start: float,
):
    """A call the learned schedule would decode plainly from its first step to its last: plain decoding's own loop
    and cache, without the assisted loop's per-step work, and the schedule counts its steps as decoded plainly and
    learns what they took (most plain steps of a session run here or in a call's plain stretches). A cache the
    caller passed is checked as a drafting call checks it, and left as plain decoding's, as one leaves it."""
    if request.cache is not None:
        target.release_cache(_call_cache(target, request.cache, max_draft))
    output, prefill_seconds, stopping = _timed_plain_generate(original_generate, request, request.cache)
    stats = GenerationStats(num_draft_tokens=schedule.policy.max_draft, schedule=schedule.name)
    stats.prefill_seconds = prefill_seconds
    _record_call(stats, output, request, drafter, start)
    stats.target_forwards, stats.skipped_steps = stats.new_tokens, max(stats.new_tokens - 1, 0)
    schedule.policy.skip(stats.new_tokens, stopping.step_seconds())
    schedule.finish()
    return output


def uses_stock_drafting(model: PreTrainedModel, arguments: dict) -> bool:
    """Prompt lookup or a stock assistant on a target of a supported family: the runtime supplies what makes it
    exact (caches that roll back where the family is stateful; for every family, per-token outputs in plain
    decoding's shapes). A family whose stock cache rolls back, continuing from a passed cache, keeps transformers' own
    path."""
    if getattr(getattr(model, "config", None), "model_type", None) not in TARGET_FAMILIES:
        return False
    cache = next((arguments.get("kwargs", {}).get(name) for name in CACHE_ARGUMENTS), None)
    if get_target_adapter(model).stock_cache_rolls_back and cache is not None and cached_length(cache) > 0:
        return False
    from_config = getattr(arguments.get("generation_config"), "prompt_lookup_num_tokens", None)
    lookup = arguments.get("kwargs", {}).get("prompt_lookup_num_tokens", from_config)
    return arguments.get("assistant_model") is not None or lookup is not None


def _prefill_without_draft(generator) -> None:
    """The first forward is the prompt alone, as plain decoding's prefill. Stock generators draft already there, and
    a forward of prompt and draft can differ in its prompt rows (GLM-5-Next's indexer pools tokens by position, so
    the draft changes the pools; measured with a padded mask)."""
    get_candidates = generator.get_candidates
    prefilled = []

    def candidates(input_ids: torch.LongTensor, *args, **kwargs):
        if not prefilled:
            prefilled.append(True)
            return input_ids, None
        return get_candidates(input_ids, *args, **kwargs)

    generator.get_candidates = candidates


def stock_drafting_generate(original_generate: Callable, request: GenerateRequest):
    """Prompt lookup or a stock assistant (transformers' own candidate generators) on an mHC target: the target, and
    a stateful assistant, get caches that roll back exactly."""
    check_internals()
    target = get_target_adapter(request.model)
    if request.cache is not None and cached_length(request.cache) > 0:
        raise ValueError(
            "Prompt lookup and stock assistants cannot continue from a passed cache on this target; pass the whole "
            f"conversation without `{CACHE_ARGUMENT}`, or use a HyperDFlash drafter, which can."
        )
    input_ids = request.input_ids
    if input_ids is None or input_ids.shape[0] != 1:
        raise ValueError("Prompt lookup and assistants decode one prompt at a time: pass `input_ids` of batch size 1.")
    assistant = request.arguments.get("assistant_model")
    config = request.generation_config
    if assistant is None:
        max_draft = config.prompt_lookup_num_tokens
    else:  # a stock assistant's draft length adapts without a cap: a draft never exceeds what is left to generate
        max_draft = request.new_token_budget + 1

    def candidate_generator(original: Callable, **options):
        generator = original(**options)
        _prefill_without_draft(generator)
        # An mHC assistant whose stock cache does not roll back gets one that does (another model keeps its own)
        family = TARGET_FAMILIES.get(getattr(getattr(assistant, "config", None), "model_type", None))
        if family is not None and not family.stock_cache_rolls_back:
            generator.assistant_kwargs[CACHE_ARGUMENT] = family(assistant).make_assistant_cache(max_draft)
        return generator

    cache = _call_cache(target, request.cache, max_draft)
    return _exact_assisted_call(original_generate, target, request, cache, candidate_generator)


def _wrap_generate(original_generate: Callable) -> Callable:
    signature = inspect.signature(original_generate)

    @functools.wraps(original_generate)
    def generate(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        drafter = bound.get("assistant_model")
        if isinstance(drafter, str | os.PathLike):
            raise ValueError(
                f"`assistant_model` must be a loaded model, got the path {str(drafter)!r}: load the drafter with "
                "`AutoModel.from_pretrained(path, trust_remote_code=True)` and pass it."
            )
        if is_speculative_drafter(drafter):
            return speculative_generate(original_generate, GenerateRequest.from_arguments(self, bound), drafter)
        if uses_stock_drafting(self, bound):
            return stock_drafting_generate(original_generate, GenerateRequest.from_arguments(self, bound))
        return original_generate(self, *args, **kwargs)

    setattr(generate, _INSTALLED_BY, __name__)
    return generate


def install_generate_integration() -> None:
    """Make `generate()` understand our drafters. Idempotent: one wrapper per process, whichever copy installs it.
    Also makes the sparse indexers break exact score ties by position, so verify forwards select what decoding does,
    and warns once if this transformers is newer than the tested range."""
    warn_if_untested()
    install_deterministic_indexer()
    current = GenerationMixin.generate
    installed_by = getattr(current, _INSTALLED_BY, None)
    is_library = __name__.startswith("hf_hyperdflash.")
    if installed_by == __name__ or (installed_by is not None and not is_library):
        return
    original = current.__wrapped__ if installed_by is not None else current
    # The library's stand-in that loads it on the first generate() (`import hf_hyperdflash` before transformers):
    # wrapping it would run that generate() through the integration twice, nested
    original = getattr(original, "_hyperdflash_stock_generate", original)
    GenerationMixin.generate = _wrap_generate(original)
