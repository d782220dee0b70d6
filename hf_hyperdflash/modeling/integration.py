"""`target.generate(..., assistant_model=drafter)` for HyperDFlash, vanilla-DFlash and native-MTP drafters.

`install_generate_integration()` wraps `GenerationMixin.generate` once per process. The drafter modeling files
call it when they are imported, so it runs on `import hf_hyperdflash` and equally when transformers loads a
saved drafter's remote code (`trust_remote_code=True`), with no import of the library. Several copies of this
runtime can live in one process (the library, and one per remote-code folder); they share one wrapper, and the
library's copy takes over from a remote-code one, since it may be newer.

The wrapper only acts when the assistant is one of our drafters, recognised by `config.model_type`, so a drafter
of either origin works under either copy. Then, for that call only, it installs a rewindable target cache,
hooks the target to capture the features the drafter conditions on, swaps in our candidate generator and lifts
the target's `_is_stateful` guard. Verification, acceptance (greedy prefix match or speculative sampling), logits
processors, stopping criteria and streaming stay transformers' own `_assisted_decoding`, so outputs are the
target's.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import Cache, GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode

from .candidate_generator import BlockProposer, MTPProposer, SpeculativeCandidateGenerator, TokenPicker
from .configuration_deepseek_v4_mtp import DeepseekV4MTPConfig
from .configuration_hyperdflash import HyperDFlashConfig
from .draft_policy import SCHEDULES, make_draft_policy
from .generation_stats import GenerationStats
from .indexer_ties import install_deterministic_indexer
from .output_split import outputs_split_per_token
from .step_timer import StepTimer, synchronized_clock
from .stopping import HeldBackStreamer, PerTokenStopping
from .targets import TARGET_FAMILIES, HyperConnectionTarget, get_target_adapter, target_fingerprint
from .transformers_compat import CACHE_ARGUMENT, pop_user_cache

BLOCK_DRAFTER_TYPES = frozenset({HyperDFlashConfig.model_type})
MTP_DRAFTER_TYPES = frozenset({DeepseekV4MTPConfig.model_type})
DEFAULT_MTP_DEPTH = 3
_INSTALLED_BY = "_hyperdflash_integration"  # attribute of the wrapper: the module that installed it


def is_speculative_drafter(model: object) -> bool:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in BLOCK_DRAFTER_TYPES | MTP_DRAFTER_TYPES


def check_compatible(target: HyperConnectionTarget, drafter: PreTrainedModel) -> None:
    """Refuse a drafter of another width or kind; warn when it was built for another target of the same width."""
    config = drafter.config
    if config.model_type in MTP_DRAFTER_TYPES and not target.has_native_mtp:
        raise ValueError(
            f"The native-MTP drafter is DeepSeek-V4's MTP block; a {target.family} target has none. Use a HyperDFlash "
            "drafter (`HyperDFlashForDrafting.from_target(target)`, then `hyperdflash train`)."
        )
    for name, expected in (
        ("hidden_size", target.hidden_size),
        ("hc_mult", target.hc_mult),
        ("vocab_size", target.vocab_size),
    ):
        got = getattr(config, name, None)
        if got != expected:
            raise ValueError(
                f"This drafter was built for a different target: drafter {name}={got}, target {name}={expected}. "
                "Use the drafter trained for this target, or build one with "
                "`HyperDFlashForDrafting.from_target(target)`."
            )
    layer_ids = getattr(config, "target_layer_ids", None)
    if config.model_type in BLOCK_DRAFTER_TYPES and config.conditioning == "intermediate":
        bad = [i for i in layer_ids or [] if not 0 <= i < target.num_layers]
        if bad or not layer_ids:
            raise ValueError(
                f"The drafter conditions on target layers {layer_ids}, but the target has {target.num_layers} layers. "
                "Use a drafter trained for this target."
            )
    built_for, actual = getattr(config, "target_fingerprint", None), target_fingerprint(target.config)
    if built_for is not None and built_for != actual:
        warnings.warn(
            f"This drafter was built for the target {config.target_name_or_path!r} (config fingerprint {built_for}), "
            f"but runs with {target.config.name_or_path or type(target.model).__name__!r} (fingerprint {actual}). "
            "The widths match, so outputs stay exact, but few drafts may be accepted: use the drafter trained for "
            "this target, or train one with `hyperdflash train --target ...`.",
            UserWarning,
            stacklevel=4,
        )


def num_draft_tokens(drafter: PreTrainedModel) -> int:
    """Draft length in transformers' convention, `drafter.generation_config.num_assistant_tokens`."""
    config = drafter.config
    num = getattr(getattr(drafter, "generation_config", None), "num_assistant_tokens", None)
    if num is None:
        num = config.block_size - 1 if config.model_type in BLOCK_DRAFTER_TYPES else DEFAULT_MTP_DEPTH
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(
            f"`drafter.generation_config.num_assistant_tokens` must be an integer >= 1, got {num!r}. To decode "
            "without drafting, call generate() without `assistant_model`."
        )
    if config.model_type in BLOCK_DRAFTER_TYPES and num > config.block_size - 1:
        raise ValueError(
            f"`num_assistant_tokens`={num} exceeds what one block of size {config.block_size} can draft "
            f"({config.block_size - 1}). Lower `drafter.generation_config.num_assistant_tokens`."
        )
    return num


def draft_schedule(drafter: PreTrainedModel) -> str:
    """`drafter.generation_config.num_assistant_tokens_schedule`: "adaptive" (the default) or "constant"."""
    schedule = getattr(getattr(drafter, "generation_config", None), "num_assistant_tokens_schedule", None)
    if schedule not in SCHEDULES:
        raise ValueError(
            f"`drafter.generation_config.num_assistant_tokens_schedule` is {schedule!r}; this drafter takes one of "
            f"{list(SCHEDULES)}: 'adaptive' chooses each step's draft length from the drafter's confidence and the "
            "measured costs, 'constant' always drafts `num_assistant_tokens`."
        )
    return schedule


def _refuse_incompatible_options(generation_config: GenerationConfig, drafter: PreTrainedModel) -> None:
    """Options whose result with a drafter would not be plain decoding's (docs/generate_parity.md lists them)."""
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            "Beam search cannot be combined with a speculative drafter (`assistant_model`). Use num_beams=1, or "
            "drop `assistant_model` for beam search."
        )
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError(
            "Speculative decoding returns one sequence per prompt; got num_return_sequences="
            f"{generation_config.num_return_sequences}. Call generate several times, or drop `assistant_model`."
        )
    if generation_config.use_cache is False:
        raise ValueError("Speculative decoding needs the target's cache; do not pass use_cache=False.")
    mode = generation_config.get_generation_mode(assistant_model=drafter)
    if getattr(generation_config, "dola_layers", None) is not None:  # transformers would silently drop it
        mode = GenerationMode.DOLA_GENERATION
    if mode != GenerationMode.ASSISTED_GENERATION:
        raise ValueError(
            f"These generate() options select {mode.value.replace('_', ' ')}, which cannot use a speculative drafter "
            "(only greedy decoding and sampling can). Drop `assistant_model`, or the options that select it "
            "(penalty_alpha with top_k > 1, constraints, force_words_ids, dola_layers)."
        )
    other_drafting = {
        "prompt_lookup_num_tokens": generation_config.prompt_lookup_num_tokens,
        "assistant_early_exit": generation_config.assistant_early_exit,
        "use_mtp": generation_config.use_mtp or None,
    }
    conflicting = [name for name, value in other_drafting.items() if value is not None]
    if conflicting:
        raise ValueError(
            f"`{conflicting[0]}` and a drafter (`assistant_model`) are two ways to draft; pass one of them."
        )
    if getattr(generation_config, "assistant_ensemble_weight", None) is not None:
        raise ValueError(
            "assistant_ensemble_weight mixes the drafter's distribution into the target's, so the output would not be "
            "the target's; drop it (speculative decoding with a drafter is exact without it)."
        )
    if generation_config.guidance_scale not in (None, 1, 1.0):
        raise ValueError(
            f"guidance_scale={generation_config.guidance_scale} cannot be combined with a speculative drafter: its "
            "processor keeps an unconditional context that draft verification would corrupt. Drop `assistant_model`."
        )
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"cache_implementation={generation_config.cache_implementation!r} cannot be combined with a speculative "
            "drafter, which brings its own rewindable dynamic cache. Drop `cache_implementation` (or set it to "
            "'dynamic')."
        )


def _validate_request(
    target: HyperConnectionTarget, bound: inspect.BoundArguments, kwargs: dict, cache: Cache | None, max_draft: int
) -> int:
    """Refuse what speculative decoding cannot do exactly, before any work; returns the prompt length."""
    generation_config, _ = target.model._prepare_generation_config(bound.arguments.get("generation_config"), **kwargs)
    _refuse_incompatible_options(generation_config, bound.arguments.get("assistant_model"))
    inputs = bound.arguments.get("inputs")
    input_ids = inputs if inputs is not None else kwargs.get("input_ids")
    if input_ids is None:
        raise ValueError(
            "Speculative decoding needs `input_ids` (the drafter embeds the verified tokens); "
            "pass input_ids instead of inputs_embeds."
        )
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"Speculative decoding through generate() runs one prompt at a time; got a batch of {input_ids.shape[0]}. "
            "Loop over the prompts (batch size 1 each)."
        )
    if cache is None:
        return input_ids.shape[1]
    target.check_cache(cache, max_draft)
    if cache.get_seq_length() >= input_ids.shape[1]:
        raise ValueError(
            f"The target cache passed in already holds {cache.get_seq_length()} tokens, but the prompt has "
            f"{input_ids.shape[1]}: pass the whole conversation so far plus at least one new token."
        )
    return input_ids.shape[1]


@contextmanager
def _speculative_call(target_model: PreTrainedModel, **methods: Callable) -> Iterator[None]:
    """Lift `_is_stateful` and replace `methods` on this instance, for this call only."""
    target_model._is_stateful = False
    for name, method in methods.items():
        setattr(target_model, name, method)
    try:
        yield
    finally:
        del target_model._is_stateful
        for name in methods:
            delattr(target_model, name)


def _exact_assisted_call(
    original_generate: Callable,
    target: HyperConnectionTarget,
    bound: inspect.BoundArguments,
    kwargs: dict,
    cache: Cache,
    prompt_length: int,
    **methods: Callable,
):
    """transformers' assisted loop, made to return plain decoding's result on an mHC target: a rewindable cache,
    stopping criteria per accepted token (the streamer held back one step), per-token hidden states and attentions,
    verify rows that see what one-token decoding sees. `methods` replace the target's own for this call."""
    target_model = target.model
    streamer = bound.arguments.get("streamer")
    if streamer is not None:
        streamer = bound.arguments["streamer"] = HeldBackStreamer(streamer)
    build_stopping_criteria = target_model._get_stopping_criteria
    stopping: list[PerTokenStopping] = []

    def stopping_criteria(**options):
        if stopping:  # a generate() nested in this call on the same model (a target that is its own assistant)
            return build_stopping_criteria(**options)
        stopping.append(PerTokenStopping(build_stopping_criteria(**options), prompt_length, streamer))
        return stopping[-1]

    with (
        _speculative_call(target_model, _get_stopping_criteria=stopping_criteria, **methods),
        target.verify_as_decoding(prompt_length),
        outputs_split_per_token(target.one_token_key_columns, target.prompt_key_columns, cache.get_seq_length()),
    ):
        arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
        # "dynamic" (perhaps from the target's generation_config.json) is what the rewindable cache is.
        kwargs |= {CACHE_ARGUMENT: cache, "cache_implementation": None}
        no_attentions = _asks_attentions_it_cannot_get(target_model, bound, kwargs)
        if no_attentions:  # transformers' assisted loop would index the empty attentions a non-eager model returns
            kwargs["output_attentions"] = False
        output = original_generate(target_model, **arguments, **kwargs)
    output = stopping[0].finish(output, cache, prompt_length)
    if no_attentions and not isinstance(output, torch.Tensor):
        output.attentions = tuple(() for _ in range(output.sequences.shape[1] - prompt_length))  # as plain decoding
    return output


def _asks_attentions_it_cannot_get(target_model: PreTrainedModel, bound: inspect.BoundArguments, kwargs: dict) -> bool:
    """`output_attentions` with an attention implementation that returns none (only eager does): plain decoding then
    returns an empty tuple per step."""
    generation_config, _ = target_model._prepare_generation_config(bound.arguments.get("generation_config"), **kwargs)
    implementation = target_model.config.get_text_config()._attn_implementation
    return bool(generation_config.output_attentions and generation_config.return_dict_in_generate) and (
        implementation != "eager"
    )


def speculative_generate(
    original_generate: Callable, target_model: PreTrainedModel, drafter: PreTrainedModel, bound: inspect.BoundArguments
):
    start = synchronized_clock()
    target = get_target_adapter(target_model)
    check_compatible(target, drafter)
    kwargs = bound.arguments.pop("kwargs", {})
    cache = pop_user_cache(kwargs)
    draft_length = num_draft_tokens(drafter)
    schedule = draft_schedule(drafter)
    prompt_length = _validate_request(target, bound, kwargs, cache, draft_length)
    stats = GenerationStats(num_draft_tokens=draft_length, schedule=schedule)
    if drafter.config.model_type in BLOCK_DRAFTER_TYPES:
        proposer = BlockProposer(drafter, target)
    else:
        proposer = MTPProposer(drafter, target, draft_length)

    cache = cache if cache is not None else target.make_cache(max_draft=draft_length)
    timer = StepTimer()
    with target.capture(proposer.feature_layers) as capture, timer.attach(target_model, cache):

        def candidate_generator(generation_config, logits_processor, **_) -> SpeculativeCandidateGenerator:
            pick = TokenPicker(logits_processor, bool(generation_config.do_sample))
            policy = make_draft_policy(schedule, draft_length)
            return SpeculativeCandidateGenerator(
                proposer, capture, draft_length, generation_config.max_length, pick, stats, timer, policy
            )

        methods = {"_get_candidate_generator": candidate_generator}
        output = _exact_assisted_call(original_generate, target, bound, kwargs, cache, prompt_length, **methods)
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    stats.new_tokens = sequences.shape[1] - prompt_length
    stats.seconds = synchronized_clock() - start
    drafter.last_generation_stats = stats
    return output


def uses_stock_drafting(model: PreTrainedModel, bound: inspect.BoundArguments) -> bool:
    """Prompt lookup or a stock assistant on a target of a supported family whose stock assisted decoding is refused
    (`_is_stateful`): the runtime then supplies what makes it exact."""
    if not getattr(type(model), "_is_stateful", False):
        return False
    if getattr(getattr(model, "config", None), "model_type", None) not in TARGET_FAMILIES:
        return False
    kwargs = bound.arguments.get("kwargs", {})
    config = bound.arguments.get("generation_config")
    lookup = kwargs.get("prompt_lookup_num_tokens", getattr(config, "prompt_lookup_num_tokens", None))
    return bound.arguments.get("assistant_model") is not None or lookup is not None


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


def stock_drafting_generate(original_generate: Callable, target_model: PreTrainedModel, bound: inspect.BoundArguments):
    """Prompt lookup or a stock same-family assistant (transformers' own candidate generators) on a stateful mHC
    target: the target, and the assistant, get caches that roll back exactly."""
    target = get_target_adapter(target_model)
    kwargs = bound.arguments.pop("kwargs", {})
    cache = pop_user_cache(kwargs)
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            "Prompt lookup and stock assistants cannot continue from a passed cache on this target; pass the whole "
            f"conversation without `{CACHE_ARGUMENT}`, or use a HyperDFlash drafter, which can."
        )
    generation_config, _ = target_model._prepare_generation_config(bound.arguments.get("generation_config"), **kwargs)
    inputs = bound.arguments.get("inputs")
    input_ids = inputs if inputs is not None else kwargs.get("input_ids")
    if input_ids is None or input_ids.shape[0] != 1:
        raise ValueError("Prompt lookup and assistants decode one prompt at a time: pass `input_ids` of batch size 1.")
    prompt_length = input_ids.shape[1]
    assistant = bound.arguments.get("assistant_model")
    if assistant is None:
        max_draft = generation_config.prompt_lookup_num_tokens
    else:  # a stock assistant's draft length adapts without a cap: a draft never exceeds what is left to generate
        new_tokens = generation_config.max_new_tokens
        max_draft = (new_tokens if new_tokens is not None else generation_config.max_length - prompt_length) + 1
    build_candidate_generator = target_model._get_candidate_generator

    def candidate_generator(**options):
        generator = build_candidate_generator(**options)
        _prefill_without_draft(generator)
        if assistant is not None:
            assistant_target = get_target_adapter(assistant)
            generator.assistant_kwargs[CACHE_ARGUMENT] = assistant_target.make_cache(max_draft=max_draft)
        return generator

    if cache is None:
        cache = target.make_cache(max_draft=max_draft)
    target.check_cache(cache, max_draft)
    return _exact_assisted_call(
        original_generate, target, bound, kwargs, cache, prompt_length, _get_candidate_generator=candidate_generator
    )


def _wrap_generate(original_generate: Callable) -> Callable:
    signature = inspect.signature(original_generate)

    @functools.wraps(original_generate)
    def generate(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        drafter = bound.arguments.get("assistant_model")
        if is_speculative_drafter(drafter):
            return speculative_generate(original_generate, self, drafter, bound)
        if uses_stock_drafting(self, bound):
            return stock_drafting_generate(original_generate, self, bound)
        return original_generate(self, *args, **kwargs)

    setattr(generate, _INSTALLED_BY, __name__)
    return generate


def install_generate_integration() -> None:
    """Make `generate()` understand our drafters. Idempotent: one wrapper per process, whichever copy installs it.
    Also makes V4's indexer break exact score ties by position, so verify forwards select what decoding does."""
    install_deterministic_indexer()
    current = GenerationMixin.generate
    installed_by = getattr(current, _INSTALLED_BY, None)
    is_library = __name__.startswith("hf_hyperdflash.")
    if installed_by == __name__ or (installed_by is not None and not is_library):
        return
    original = current.__wrapped__ if installed_by is not None else current
    GenerationMixin.generate = _wrap_generate(original)
