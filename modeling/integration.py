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
and, before transformers 5.25, lifts the target's `_is_stateful` guard. Verification, acceptance (greedy prefix match
or speculative sampling), logits processors, stopping criteria and streaming stay transformers' own
`_assisted_decoding`, so outputs are the target's.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import transformers
import transformers.generation.utils as generation_utils
from transformers import Cache, GenerationConfig, GenerationMixin, PreTrainedModel

from . import call_scope
from .agreed_steps import agree_on_drafts, agree_on_sequences, rank_zero_verdict
from .batched_decoding import EXTRA_VERIFY_WIDTH, batched_generate, rows_drafting
from .candidate_generator import SpeculativeCandidateGenerator, TokenPicker, make_proposer, proposer_class
from .context_copy import chain_chooser
from .draft_options import DRAFTER_TYPES
from .draft_policy import CallSchedule
from .generation_stats import GenerationStats, synchronized_clock
from .indexer_ties import install_deterministic_indexer
from .output_split import outputs_split_per_token
from .rank_agreement import RankAgreement, tensor_fingerprint, text_fingerprint, weights_fingerprint
from .request_checks import (
    check_batch,
    check_cached_prefix,
    check_compatible,
    check_confidence_threshold,
    check_prompt,
    draft_from_context,
    draft_schedule,
    is_batched,
    num_draft_tokens,
    refuse_batched_options,
    refuse_incompatible_options,
)
from .stopping import HeldBackStreamer, PerTokenStopping
from .target_base import HyperConnectionTarget
from .target_linear_attention import install_crop_of_present_states
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

    @property
    def input_ids(self) -> torch.LongTensor | None:
        inputs = self.arguments.get("inputs")
        return inputs if inputs is not None else self.kwargs.get("input_ids")

    def fingerprints(self, drafter: torch.nn.Module | str | None) -> dict[str, str]:
        """What every rank of a spread target must pass alike (`RankAgreement.open_call`): every tensor input, the
        settings, a passed cache's length, the drafter's weights and settings, and the library versions."""
        prints = {
            "prompts": tensor_fingerprint(self.input_ids),
            "generation settings": text_fingerprint(self.generation_config.to_json_string()),
            "passed cache lengths": str(None if self.cache is None else cached_length(self.cache)),
            "drafter weights": weights_fingerprint(drafter if isinstance(drafter, torch.nn.Module) else None),
            "library versions": f"transformers {transformers.__version__}, torch {torch.__version__}",
        }
        if getattr(drafter, "generation_config", None) is not None:
            prints["drafter settings"] = text_fingerprint(drafter.generation_config.to_json_string())
        for name, value in sorted(self.kwargs.items()):
            if isinstance(value, torch.Tensor):
                prints[f"`{name}`"] = tensor_fingerprint(value)
        return prints

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
    def attention_mask(self) -> torch.Tensor:
        """The mask generate() decodes with: the one passed in, else the one it infers from padding tokens in the
        prompt, else all ones."""
        mask = self.kwargs.get("attention_mask")
        if mask is not None:
            return mask
        if masks_padding(self.input_ids, self.generation_config):
            return (self.input_ids != self.generation_config.pad_token_id).long()
        return torch.ones_like(self.input_ids)

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
    max_draft: int,
    build_candidate_generator: Callable,
    agreement: RankAgreement,
):
    """transformers' assisted loop, made to return plain decoding's result on an mHC target: a rewindable cache,
    stopping criteria per accepted token (the streamer held back one step), per-token hidden states and attentions,
    verify rows that see what one-token decoding sees; on a spread target, every step as rank 0 decides it
    (`agreed_steps.py`). `max_draft`: the most drafts a step verifies. `build_candidate_generator(original,
    **options)` stands in for the target's `_get_candidate_generator` in this call."""
    sampling = bool(request.generation_config.do_sample)
    prompt_length = request.input_ids.shape[1]
    arguments = dict(request.arguments)
    if arguments.get("streamer") is not None:
        arguments["streamer"] = HeldBackStreamer(arguments["streamer"])
    stopping: list[PerTokenStopping] = []

    def stopping_criteria(build: Callable, **options) -> PerTokenStopping:
        if stopping:  # a generate() nested in this call on the same model (a target that is its own assistant)
            return build(**options)
        stopping.append(PerTokenStopping(build(**options), prompt_length, arguments.get("streamer"), agreement))
        return stopping[-1]

    candidate_generator = _assisted_generator(build_candidate_generator, target, cache, max_draft, agreement, sampling)
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
                _get_candidate_generator=candidate_generator,
            ),
            target.verify_as_decoding(prompt_length, request.positions_may_lag_cache, cache),
            outputs_split_per_token(target.one_token_key_columns, target.prompt_key_columns, cached_length(cache)),
            call_scope.functions(generation_utils, _speculative_sampling=rank_zero_verdict(agreement, max_draft))
            if agreement.spread and sampling
            else nullcontext(),
        ):
            output = original_generate(target.model, **arguments, **kwargs)
        output = stopping[0].finish(output, cache, prompt_length)
        if agreement.spread:
            agree_on_sequences(agreement, output if isinstance(output, torch.Tensor) else output.sequences)
    finally:
        target.release_cache(cache)  # the returned (or passed-in) cache is plain decoding's, by type and state
    if no_attentions and not isinstance(output, torch.Tensor):
        output.attentions = tuple(() for _ in range(output.sequences.shape[1] - prompt_length))  # as plain decoding
    return output


def _assisted_generator(
    build: Callable,
    target: HyperConnectionTarget,
    cache: Cache,
    max_draft: int,
    agreement: RankAgreement,
    sampling: bool,
) -> Callable:
    """The call's `_get_candidate_generator`: `build`'s generator, keeping the target states each draft may need to
    roll back, and on a spread target taking rank 0's drafts."""

    def candidate_generator(original: Callable, **options):
        generator = build(original, **options)
        if agreement.spread:
            agree_on_drafts(generator, agreement, max_draft, sampling)
        _keep_states_for_each_draft(generator, target, cache)
        return generator

    return candidate_generator


@dataclass
class CallPlan:
    """What a speculative call's checks settle: the target's adapter, the draft schedule, whether rows are batched;
    and the agreement of its ranks, on a spread target."""

    target: HyperConnectionTarget
    schedule: CallSchedule
    batched: bool
    agreement: RankAgreement
    copies: bool  # steps may verify a chain copied from the context (`draft_from_context`)


def _plan_call(request: GenerateRequest, drafter: PreTrainedModel, agreement: RankAgreement) -> CallPlan:
    """Check the call (bad input raises a `ValueError` naming it) and settle its plan."""
    check_internals()
    target = get_target_adapter(request.model)
    target.check_servable()
    check_compatible(target, drafter)
    draft_length = num_draft_tokens(drafter)
    schedule_name = draft_schedule(drafter)
    check_confidence_threshold(drafter)
    copies = draft_from_context(drafter)
    refuse_incompatible_options(request.generation_config, drafter)
    check_prompt(request.input_ids)
    batched = is_batched(request.input_ids, request.generation_config.num_return_sequences)
    if batched:
        refuse_batched_options(request.arguments, request.generation_config, drafter)
        check_batch(request.input_ids, request.kwargs.get("attention_mask"), request.kwargs)
    if request.cache is not None:
        check_cached_prefix(request.cache, request.input_ids.shape[1])
    rows = request.input_ids.shape[0] * (request.generation_config.num_return_sequences or 1)
    rows_together = proposer_class(drafter).drafts_rows_together
    schedule = CallSchedule(schedule_name, drafter, request.model, draft_length, (rows, not rows_together))
    return CallPlan(target, schedule, batched, agreement, copies)


def speculative_generate(original_generate: Callable, request: GenerateRequest, drafter: PreTrainedModel):
    agreement = RankAgreement.of(request.model)
    # Before any collective of the target's: on a spread target a rank must not raise alone
    plan = agreement.open_call(lambda: _plan_call(request, drafter, agreement), lambda: request.fingerprints(drafter))
    start = synchronized_clock()
    target, schedule = plan.target, plan.schedule
    if agreement.spread:  # drafting runs no collective, so a drafter failing on one rank fails every rank together
        target.draft_locally()
    max_draft = schedule.policy.max_draft  # "heuristic" may grow past `draft_length`
    stats = GenerationStats(num_draft_tokens=max_draft, schedule=schedule.name)
    batched = plan.batched
    if batched:
        proposer = rows_drafting(drafter, target, request, max_draft)
    else:
        proposer = make_proposer(drafter, target, max_draft)
    generator = SpeculativeCandidateGenerator(
        proposer=proposer,
        capture=None,
        prompt_length=request.input_ids.shape[1],
        max_length=request.max_length,
        pick=None,
        policy=schedule.policy,
        threshold=None if batched else schedule.threshold,  # refused with several rows (`request_checks.py`)
        stats=stats,
        whole_blocks=batched,
        chooser=chain_chooser(schedule.policy) if plan.copies else None,
    )
    if batched:
        cache = _call_cache(target, request.cache, max_draft + EXTRA_VERIFY_WIDTH)  # a batch's forward reaches past
        output = batched_generate(original_generate, request, target, cache, generator, agreement)
        return _finish(output, request, drafter, plan, stats, start)
    cache = _call_cache(target, request.cache, max_draft)
    with target.capture(generator.proposer.feature_layers) as capture:
        generator.capture = capture

        def candidate_generator(_original, generation_config, logits_processor, **_) -> SpeculativeCandidateGenerator:
            generator.pick = TokenPicker(logits_processor, bool(generation_config.do_sample))
            return generator

        output = _exact_assisted_call(
            original_generate, target, request, cache, max_draft, candidate_generator, agreement
        )
    return _finish(output, request, drafter, plan, stats, start)


def _finish(output, request: GenerateRequest, drafter, plan: CallPlan, stats: GenerationStats, start: float):
    """The call's result, its stats left on the drafter."""
    plan.schedule.finish()
    agreement = plan.agreement
    stats.rank_collectives, stats.rank_agreement_seconds = agreement.collectives, agreement.seconds
    stats.new_tokens = _sequences(output).shape[1] - request.input_ids.shape[1]
    stats.seconds = synchronized_clock() - start
    drafter.last_generation_stats = stats  # with concurrent calls on one drafter: the call that finished last
    return output


def _sequences(output) -> torch.LongTensor:
    """The token ids of a generate() result, a tensor or a dict of outputs."""
    return output if isinstance(output, torch.Tensor) else output.sequences


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
    the draft changes the pools; measured with a padded mask). A stock assistant then drafts first after that
    forward's token: its attention mask and position ids, made for the prompt, get that token's columns (the assistant
    otherwise feeds one token more than they cover, which HY-V4's rotary embedding refuses)."""
    get_candidates = generator.get_candidates
    prefilled = []

    def candidates(input_ids: torch.LongTensor, *args, **kwargs):
        if not prefilled:
            prefilled.append(True)
            return input_ids, None
        assistant_kwargs = getattr(generator, "assistant_kwargs", {})
        mask, positions = assistant_kwargs.get("attention_mask"), assistant_kwargs.get("position_ids")
        if mask is not None and mask.shape[-1] < input_ids.shape[1]:
            added = mask.new_ones(mask.shape[0], input_ids.shape[1] - mask.shape[-1])
            assistant_kwargs["attention_mask"] = torch.cat([mask, added], dim=-1)
        if positions is not None and positions.shape[-1] < input_ids.shape[1]:
            added = torch.arange(1, input_ids.shape[1] - positions.shape[-1] + 1, device=positions.device)
            assistant_kwargs["position_ids"] = torch.cat([positions, positions[..., -1:] + added], dim=-1)
        return get_candidates(input_ids, *args, **kwargs)

    generator.get_candidates = candidates


def _keep_states_for_each_draft(generator, target: HyperConnectionTarget, cache: Cache) -> None:
    """Each step's verify forward can roll back every draft of that step, however the draft length has grown."""
    get_candidates = generator.get_candidates

    def candidates(input_ids: torch.LongTensor, *args, **kwargs):
        candidate_ids, candidate_logits = get_candidates(input_ids, *args, **kwargs)
        target.keep_states_for_draft(cache, candidate_ids.shape[1] - input_ids.shape[1])
        return candidate_ids, candidate_logits

    generator.get_candidates = candidates


def stock_drafting_generate(original_generate: Callable, request: GenerateRequest):
    """Prompt lookup or a stock assistant (transformers' own candidate generators) on an mHC target: the target, and
    a stateful assistant, get caches that roll back exactly."""
    assistant = request.arguments.get("assistant_model")
    agreement = RankAgreement.of(request.model)
    target, max_draft = agreement.open_call(
        lambda: _plan_stock_call(request, assistant), lambda: request.fingerprints(assistant)
    )

    def candidate_generator(original: Callable, **options):
        generator = original(**options)
        _prefill_without_draft(generator)
        # An mHC assistant whose stock cache does not roll back gets one that does (another model keeps its own)
        family = TARGET_FAMILIES.get(getattr(getattr(assistant, "config", None), "model_type", None))
        assistant_cache = None if family is None else family(assistant).make_assistant_cache(max_draft)
        if assistant_cache is not None:
            generator.assistant_kwargs[CACHE_ARGUMENT] = assistant_cache
        return generator

    cache = _call_cache(target, request.cache, max_draft)
    return _exact_assisted_call(original_generate, target, request, cache, max_draft, candidate_generator, agreement)


def _plan_stock_call(request: GenerateRequest, assistant) -> tuple[HyperConnectionTarget, int]:
    """Check a prompt-lookup or stock-assistant call; its target's adapter and the most drafts a step verifies."""
    check_internals()
    target = get_target_adapter(request.model)
    target.check_servable()
    if request.cache is not None and cached_length(request.cache) > 0:
        raise ValueError(
            "Prompt lookup and stock assistants cannot continue from a passed cache on this target; pass the whole "
            f"conversation without `{CACHE_ARGUMENT}`, or use a HyperDFlash drafter, which can."
        )
    input_ids = request.input_ids
    if input_ids is None or input_ids.shape[0] != 1:
        raise ValueError("Prompt lookup and assistants decode one prompt at a time: pass `input_ids` of batch size 1.")
    if assistant is None:
        return target, request.generation_config.prompt_lookup_num_tokens
    # a stock assistant's draft length adapts without a cap: a draft never exceeds what is left to generate
    return target, request.new_token_budget + 1


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
    makes linear-attention crops skip the states a layer never filled (from 5.25), and warns once if this
    transformers is newer than the tested range."""
    warn_if_untested()
    install_deterministic_indexer()
    install_crop_of_present_states()
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
