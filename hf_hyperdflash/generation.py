"""`target.generate(..., assistant_model=drafter)` for HyperDFlash, vanilla-DFlash and native-MTP drafters.

Importing `hf_hyperdflash` wraps `GenerationMixin.generate` once. The wrapper only acts when the
assistant is one of our drafters (recognised by `config.model_type`, so a drafter loaded through
`trust_remote_code` works too); then, for that call only, it installs a rewindable target cache,
hooks the target to capture the features the drafter conditions on, swaps in our candidate
generator and lifts the target's `_is_stateful` guard. Verification, acceptance (greedy prefix
match or speculative sampling), logits processors, stopping criteria and streaming stay
transformers' own `_assisted_decoding`, so outputs are the target's.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import LogitsProcessorList

from .cache import RewindableDeepseekV4Cache
from .targets import DeepseekV4Target, FeatureCapture, get_target_adapter

BLOCK_DRAFTER_TYPES = {"hyperdflash"}
MTP_DRAFTER_TYPES = {"deepseek_v4_mtp"}


def is_speculative_drafter(model: object) -> bool:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in BLOCK_DRAFTER_TYPES | MTP_DRAFTER_TYPES


@dataclass
class GenerationStats:
    """What one speculative `generate` call did; tau counts the bonus token of every verify step."""

    num_draft_tokens: int
    target_forwards: int = 0
    new_tokens: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    proposed_per_step: list[int] = field(default_factory=list)
    # Wall time of each verify step (aligned with accepted_per_step) and of its parts; see StepTimer.
    step_seconds: list[float] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    rollback_seconds: list[float] = field(default_factory=list)
    prefill_seconds: float = 0.0

    def as_dict(self) -> dict:
        steps = len(self.accepted_per_step)
        outcomes = list(zip(self.accepted_per_step, self.proposed_per_step, strict=True))
        per_position = []
        for k in range(1, self.num_draft_tokens + 1):
            proposed = sum(1 for _, p in outcomes if p >= k)
            accepted = sum(1 for a, p in outcomes if p >= k and a >= k)
            per_position.append(accepted / proposed if proposed else float("nan"))
        return {
            "mean_accepted_length": (sum(self.accepted_per_step) + steps) / steps if steps else float("nan"),
            "acceptance_per_position": per_position,
            "target_forwards": self.target_forwards,
            "new_tokens": self.new_tokens,
            "num_draft_tokens": self.num_draft_tokens,
            "accepted_per_step": list(self.accepted_per_step),
            "proposed_per_step": list(self.proposed_per_step),
            "step_seconds": list(self.step_seconds),
            "draft_seconds": list(self.draft_seconds),
            "verify_seconds": list(self.verify_seconds),
            "rollback_seconds": list(self.rollback_seconds),
            "prefill_seconds": self.prefill_seconds,
        }


def synchronized_clock() -> float:
    """perf_counter once queued CUDA kernels are done, so a timed part includes its kernels."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


class StepTimer:
    """Splits each decoding iteration's wall time into drafting, the target forward and the cache rollback.

    An iteration runs from one `get_candidates` call to the next (the last one to the end of `generate`); what
    the three parts leave over (acceptance, logits processors, feature bookkeeping) is the step's overhead.
    Iterations that drafted are verify steps and land in `stats`; the first iteration is the prefill.
    """

    def __init__(self, stats: GenerationStats):
        self.stats = stats
        self.start: float | None = None
        self.forward_start = 0.0
        self.parts = {"draft": 0.0, "verify": 0.0, "rollback": 0.0}
        self.iterations = 0

    def _close(self, now: float) -> None:
        if self.start is None:
            return
        if self.parts["draft"] > 0.0:  # the iteration drafted: a verify step
            self.stats.step_seconds.append(now - self.start)
            self.stats.draft_seconds.append(self.parts["draft"])
            self.stats.verify_seconds.append(self.parts["verify"])
            self.stats.rollback_seconds.append(self.parts["rollback"])
        elif self.iterations == 1:
            self.stats.prefill_seconds = now - self.start
        self.start = None

    def start_iteration(self) -> None:
        now = synchronized_clock()
        self._close(now)
        self.start, self.iterations = now, self.iterations + 1
        self.parts = dict.fromkeys(self.parts, 0.0)

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        start = synchronized_clock()
        try:
            yield
        finally:
            self.parts[part] += synchronized_clock() - start

    def _forward_started(self, *_) -> None:
        self.forward_start = synchronized_clock()

    def _forward_done(self, *_) -> None:
        self.parts["verify"] += synchronized_clock() - self.forward_start

    @contextmanager
    def attach(self, model: PreTrainedModel, cache: RewindableDeepseekV4Cache) -> Iterator[None]:
        """Time `model`'s forwards (verify) and `cache.crop` (rollback) while `generate` runs."""
        hooks = [model.register_forward_pre_hook(self._forward_started)]
        hooks.append(model.register_forward_hook(self._forward_done))
        crop = cache.crop

        def timed_crop(*args, **kwargs):
            with self.timed("rollback"):
                return crop(*args, **kwargs)

        cache.crop = timed_crop
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            del cache.crop
            self._close(synchronized_clock())


class TokenPicker:
    """Applies the generation's logits processors to draft logits and picks (greedy) or samples a token.

    The returned processed logits are exactly the distribution a token was drawn from, which is the
    `q` that speculative sampling needs.
    """

    def __init__(self, logits_processor: LogitsProcessorList | None, do_sample: bool):
        self.logits_processor = logits_processor
        self.do_sample = do_sample

    def __call__(self, prefix_ids: torch.LongTensor, logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
        logits = logits.float()
        if self.logits_processor:
            logits = self.logits_processor(prefix_ids, logits)
        if self.do_sample:
            token = torch.multinomial(logits.softmax(dim=-1), num_samples=1)
        else:
            token = logits.argmax(dim=-1, keepdim=True)
        return token, logits


class BlockProposer:
    """HyperDFlash / vanilla DFlash: one non-causal drafter forward proposes a whole block."""

    def __init__(self, drafter: PreTrainedModel, target: DeepseekV4Target):
        self.drafter, self.target = drafter, target
        self.cache = DynamicCache()

    @property
    def feature_layers(self) -> list[int] | None:
        config = self.drafter.config
        return list(config.target_layer_ids) if config.conditioning == "intermediate" else None

    def propose(
        self,
        features: torch.Tensor,
        positions: torch.LongTensor,
        input_ids: torch.LongTensor,
        num_tokens: int,
        pick: TokenPicker,
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        device, dtype = self.drafter.device, self.drafter.dtype
        anchor_embeds = self.target.embed(input_ids[:, -1:])
        anchor_position = torch.full((1, 1), input_ids.shape[1] - 1, device=device)
        hidden = self.drafter(
            anchor_embeds=anchor_embeds.to(device, dtype),
            target_hidden=features.to(device, dtype),
            context_position_ids=positions.to(device),
            anchor_position_ids=anchor_position,
            past_key_values=self.cache,
        ).last_hidden_state
        logits = self.target.logits(hidden[:, 1 : 1 + num_tokens])
        return _pick_sequentially(input_ids, logits.to(input_ids.device), pick)


class MTPProposer:
    """Native MTP: one step per draft token, each reusing the module on its own pre-collapse output."""

    feature_layers = None

    def __init__(self, drafter: PreTrainedModel, target: DeepseekV4Target, num_draft_tokens: int):
        self.drafter, self.target = drafter, target
        self.cache = RewindableDeepseekV4Cache(config=drafter.config, max_draft=num_draft_tokens)

    def _step(self, token_ids: torch.LongTensor, residual: torch.Tensor, positions: torch.LongTensor):
        device, dtype = self.drafter.device, self.drafter.dtype
        embeds = self.target.embed(token_ids)
        out = self.drafter(
            token_embeds=embeds.to(device, dtype),
            previous_residual=residual.to(device, dtype),
            position_ids=positions.to(device),
            past_key_values=self.cache,
        )
        logits = self.target.logits(out.last_hidden_state[:, -1:])
        return logits[:, 0].to(token_ids.device), out.residual[:, -1:]

    def propose(
        self,
        features: torch.Tensor,
        positions: torch.LongTensor,
        input_ids: torch.LongTensor,
        num_tokens: int,
        pick: TokenPicker,
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        # Residual at position i pairs with the token at i + 1 (the newest one is the anchor).
        logits, residual = self._step(input_ids[:, positions[0] + 1], features, positions + 1)
        candidates, all_logits = input_ids, []
        for depth in range(num_tokens):
            token, processed = pick(candidates, logits)
            candidates = torch.cat([candidates, token], dim=-1)
            all_logits.append(processed)
            if depth + 1 < num_tokens:
                next_position = torch.full((1, 1), candidates.shape[1] - 1, device=input_ids.device)
                logits, residual = self._step(token, residual, next_position)
        self.cache.crop(-(num_tokens - 1))  # the deeper steps saw unverified tokens; keep only real context
        return candidates[:, input_ids.shape[1] :], torch.stack(all_logits, dim=1)


def _pick_sequentially(
    input_ids: torch.LongTensor, logits: torch.Tensor, pick: TokenPicker
) -> tuple[torch.LongTensor, torch.Tensor]:
    """Pick block tokens left to right so processors (e.g. repetition penalty) see the drafted prefix."""
    candidates, processed = input_ids, []
    for k in range(logits.shape[1]):
        token, row = pick(candidates, logits[:, k])
        candidates = torch.cat([candidates, token], dim=-1)
        processed.append(row)
    return candidates[:, input_ids.shape[1] :], torch.stack(processed, dim=1)


class SpeculativeCandidateGenerator(CandidateGenerator):
    """Feeds the features of newly verified positions to the drafter and returns its proposals.

    transformers calls `get_candidates` before every target forward; the first call returns no
    candidates so that the prefill forward produces the first features, as its own MTP/DFlash
    generators do.
    """

    requires_model_outputs = True
    model_kwargs_overrides: dict = {}

    def __init__(
        self,
        proposer: BlockProposer | MTPProposer,
        capture: FeatureCapture,
        num_draft_tokens: int,
        max_length: int,
        pick: TokenPicker,
        stats: GenerationStats,
        timer: StepTimer,
    ):
        self.proposer, self.capture, self.pick, self.stats, self.timer = proposer, capture, pick, stats, timer
        self.num_draft_tokens, self.max_length = num_draft_tokens, max_length
        self.prompt_length: int | None = None
        self.consumed = 0  # leading positions whose features were taken (fed to the drafter or pending)
        self.pending: torch.Tensor | None = None  # verified features the drafter has not seen yet
        self.last_proposed = 0

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        self.timer.start_iteration()
        self.stats.target_forwards += 1
        self.last_proposed = 0
        if is_first_iteration:
            self.prompt_length = input_ids.shape[1]
            return input_ids, None

        # The last target forward covered the tokens after the previous verified prefix; of those,
        # everything but the newest (bonus) token of input_ids is verified now.
        num_new = input_ids.shape[1] - 1 - self.consumed
        features = self.capture.features()[:, :num_new]
        self.pending = features if self.pending is None else torch.cat([self.pending, features], dim=1)
        self.consumed = input_ids.shape[1] - 1

        num_tokens = min(self.num_draft_tokens, self.max_length - input_ids.shape[1] - 1)
        if num_tokens <= 0:
            return input_ids, None
        context = self.pending
        self.pending = None
        positions = torch.arange(input_ids.shape[1] - 1 - context.shape[1], input_ids.shape[1] - 1)[None]
        with self.timer.timed("draft"):
            tokens, logits = self.proposer.propose(
                context, positions.to(input_ids.device), input_ids, num_tokens, self.pick
            )
        self.last_proposed = num_tokens
        return torch.cat([input_ids, tokens.to(input_ids.device)], dim=-1), logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        if self.last_proposed:
            self.stats.accepted_per_step.append(int(num_matches))
            self.stats.proposed_per_step.append(self.last_proposed)
        self.stats.new_tokens = input_ids.shape[1] - self.prompt_length


def check_compatible(target: DeepseekV4Target, drafter: PreTrainedModel) -> None:
    config = drafter.config
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


def _num_draft_tokens(drafter: PreTrainedModel) -> int:
    generation_config = getattr(drafter, "generation_config", None)
    config = drafter.config
    default = config.block_size - 1 if config.model_type in BLOCK_DRAFTER_TYPES else 3
    num = getattr(generation_config, "num_assistant_tokens", None) or default
    if num < 1:
        raise ValueError(f"`num_assistant_tokens` must be >= 1, got {num}.")
    if config.model_type in BLOCK_DRAFTER_TYPES and num > config.block_size - 1:
        raise ValueError(
            f"`num_assistant_tokens`={num} exceeds what one block of size {config.block_size} can draft "
            f"({config.block_size - 1}). Lower `drafter.generation_config.num_assistant_tokens`."
        )
    return int(num)


def _validate_request(target_model: PreTrainedModel, bound: inspect.BoundArguments) -> None:
    kwargs = dict(bound.arguments.get("kwargs", {}))
    generation_config, _ = target_model._prepare_generation_config(bound.arguments.get("generation_config"), **kwargs)
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
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("The prompt's attention_mask has padding; pass the unpadded prompt (batch size 1).")
    cache = kwargs.get("past_key_values")
    if cache is not None and not isinstance(cache, RewindableDeepseekV4Cache):
        raise ValueError(
            f"Speculative decoding needs a rewindable target cache, got {type(cache).__name__}. "
            "Omit `past_key_values` (one is created for you)."
        )


@contextmanager
def _speculative_call(target_model: PreTrainedModel, factory: Callable) -> Iterator[None]:
    """Lift `_is_stateful` and swap the candidate generator on this instance, for this call only."""
    target_model._is_stateful = False
    target_model._get_candidate_generator = factory
    try:
        yield
    finally:
        del target_model._is_stateful
        del target_model._get_candidate_generator


_ORIGINAL_GENERATE = GenerationMixin.generate
_GENERATE_SIGNATURE = inspect.signature(_ORIGINAL_GENERATE)


def speculative_generate(target_model: PreTrainedModel, drafter: PreTrainedModel, bound: inspect.BoundArguments):
    target = get_target_adapter(target_model)
    check_compatible(target, drafter)
    _validate_request(target_model, bound)
    num_draft_tokens = _num_draft_tokens(drafter)
    stats = GenerationStats(num_draft_tokens=num_draft_tokens)
    if drafter.config.model_type in BLOCK_DRAFTER_TYPES:
        proposer = BlockProposer(drafter, target)
    else:
        proposer = MTPProposer(drafter, target, num_draft_tokens)

    kwargs = bound.arguments.pop("kwargs", {})
    if kwargs.get("past_key_values") is None:
        kwargs["past_key_values"] = target.make_cache(max_draft=num_draft_tokens)
    cache = kwargs["past_key_values"]
    timer = StepTimer(stats)
    with target.capture(proposer.feature_layers) as capture:

        def factory(generation_config, logits_processor, **_) -> SpeculativeCandidateGenerator:
            pick = TokenPicker(logits_processor, bool(generation_config.do_sample))
            return SpeculativeCandidateGenerator(
                proposer, capture, num_draft_tokens, generation_config.max_length, pick, stats, timer
            )

        with _speculative_call(target_model, factory), timer.attach(target_model, cache):
            arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
            output = _ORIGINAL_GENERATE(target_model, **arguments, **kwargs)
    drafter.last_generation_stats = stats.as_dict()
    return output


@functools.wraps(_ORIGINAL_GENERATE)
def generate(self, *args, **kwargs):
    bound = _GENERATE_SIGNATURE.bind(self, *args, **kwargs)
    drafter = bound.arguments.get("assistant_model")
    if not is_speculative_drafter(drafter):
        return _ORIGINAL_GENERATE(self, *args, **kwargs)
    return speculative_generate(self, drafter, bound)


def install() -> None:
    """Make `generate()` understand our drafters; idempotent."""
    GenerationMixin.generate = generate
