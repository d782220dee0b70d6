"""The candidate generator transformers' assisted decoding calls each step, and the drafters' proposers.

`SpeculativeCandidateGenerator` turns the features captured during the last verify forward into the
drafter's context and asks a proposer for the next draft: `BlockProposer` (HyperDFlash, vanilla DFlash:
one non-causal forward per block), `MTPProposer` (native MTP: one step per drafted token) or `DSparkProposer`
(DSpark: one forward per block, then its tokens left to right).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import LogitsProcessorList

from .cache_deepseek_v4 import RewindableDeepseekV4Cache
from .draft_options import BLOCK_DRAFTER_TYPE, DSPARK_DRAFTER_TYPE
from .draft_policy import ConfidenceThreshold, DraftPolicy, StepRecord
from .feature_capture import FeatureCapture
from .generation_stats import GenerationStats
from .target_base import HyperConnectionTarget, activation_dtype
from .transformers_compat import CACHE_ARGUMENT, cached_length


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


def batch_confidence(confidences: torch.Tensor, rows: torch.Tensor | None = None) -> list[float]:
    """Per drafted position, the confidence of the batch: the product of its rows' among `rows` (a bool mask of the
    rows still generating; None: all), as if rows accepted independently. A batch keeps a position only if every such
    row accepts it; one row alone keeps its own confidence."""
    if rows is not None:
        confidences = confidences[rows.to(confidences.device)]
    return confidences.prod(dim=0).tolist()


def row_confidences(logits: torch.Tensor) -> torch.Tensor:
    """Each row's confidence at each drafted position ([B, k, V] processed logits): its top probability, [B, k].

    Not the probability of the drawn token: in sampling, a draft length that looked at the drawn token would bias
    the output (only what is known before a position is drawn may decide whether it is verified).
    """
    return logits.softmax(dim=-1).amax(dim=-1)


def draft_confidences(logits: torch.Tensor, rows: torch.Tensor | None = None) -> list[float]:
    """The drafter's confidence at each drafted position (of a batch, `batch_confidence` of `row_confidences`)."""
    return batch_confidence(row_confidences(logits), rows)


def drafted_token_probabilities(logits: torch.Tensor, tokens: torch.LongTensor) -> list[float]:
    """q of each drafted token ([1, k, V] processed logits, [1, k] tokens): what `assistant_confidence_threshold` is
    compared with, as transformers' `ConfidenceCriteria` does."""
    return logits.softmax(dim=-1).gather(-1, tokens[..., None].to(logits.device)).flatten().tolist()


class StepSchedule(Protocol):
    """What a proposer asks the step's schedule while it drafts (`SpeculativeCandidateGenerator`)."""

    def keep_drafting(self, confidences: list[float], probabilities: list[float]) -> bool:
        """A drafter that spends a forward per token: draft one more, after these drafts?"""

    def verifies(self, confidences: list[float]) -> bool:
        """Would the step verify every draft with these confidences (the last one's token not drawn yet)?"""


@dataclass
class Draft:
    """One proposal: the drafted tokens [B, k], the processed logits they were picked from [B, k, V], the drafter's
    confidence at each position (`draft_confidences`; each row's own in `row_confidences`, [B, k]), and the drafter
    forwards it took."""

    tokens: torch.LongTensor
    logits: torch.Tensor
    confidences: list[float]
    drafter_forwards: int
    row_confidences: torch.Tensor

    @property
    def token_probabilities(self) -> list[float]:
        return drafted_token_probabilities(self.logits, self.tokens)


class BlockProposer:
    """HyperDFlash / vanilla DFlash: one non-causal drafter forward proposes a whole block."""

    def __init__(self, drafter: PreTrainedModel, target: HyperConnectionTarget):
        self.drafter, self.target = drafter, target
        self.cache = drafter.make_context_cache()

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
        schedule: StepSchedule,
        context_mask: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        anchor_positions: torch.LongTensor | None = None,
    ) -> Draft:
        """The whole block in one forward; the schedule then chooses how many drafts to verify (with DSpark's heads,
        as DSparkProposer does). A batch of rows drafts in the same forward, each from the last token of its row of
        `input_ids`: `positions` and `anchor_positions` [B, 1] are each row's own (left padding makes them lag the
        column), `context_mask` marks the context each row sees, `rows` the rows whose confidence counts
        (`batch_confidence`)."""
        device, dtype = self.drafter.device, self.drafter.dtype
        anchor_embeds = self.target.embed(input_ids[:, -1:])
        if anchor_positions is None:
            anchor_positions = torch.full((input_ids.shape[0], 1), input_ids.shape[1] - 1, device=device)
        out = self.drafter(
            anchor_embeds=anchor_embeds.to(device, dtype),
            target_hidden=features.to(device, dtype),
            context_position_ids=positions.to(device),
            anchor_position_ids=anchor_positions.to(device),
            context_mask=None if context_mask is None else context_mask.to(device),
            cache=self.cache,
        )
        logits = self.target.logits(out.last_hidden_state[:, 1 : 1 + num_tokens]).float().to(input_ids.device)
        if self.drafter.config.markov_rank:  # DSpark's heads: drawn left to right, as DSpark drafts
            return draw_with_heads(self.drafter, logits, out.residual[:, 1:], input_ids, pick, schedule, rows)
        tokens, processed = _pick_sequentially(input_ids, logits, pick)
        confidences = row_confidences(processed)
        return Draft(tokens, processed, batch_confidence(confidences, rows), 1, confidences)


class MTPProposer:
    """Native MTP: one step per draft token, each reusing the module on its own pre-collapse output."""

    feature_layers = None

    def __init__(self, drafter: PreTrainedModel, target: HyperConnectionTarget, num_draft_tokens: int):
        self.drafter, self.target = drafter, target
        self.cache = RewindableDeepseekV4Cache(config=drafter.config, max_draft=num_draft_tokens)

    def _step(self, token_ids: torch.LongTensor, residual: torch.Tensor, positions: torch.LongTensor):
        # The projections' input dtype: `drafter.dtype` reports the first parameter's, a norm V4 may keep in fp32,
        # and an FP8 projection takes the activations' dtype.
        embeds = self.target.embed(token_ids)
        device = self.drafter.e_proj.weight.device
        dtype = activation_dtype(self.drafter.e_proj, embeds.dtype)
        out = self.drafter(
            token_embeds=embeds.to(device, dtype),
            previous_residual=residual.to(device, dtype),
            position_ids=positions.to(device),
            cache=self.cache,
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
        schedule: StepSchedule,
    ) -> Draft:
        """Up to `num_tokens` drafts, one step each, stopping once `schedule.keep_drafting(confidences, token
        probabilities so far)` says so."""
        # Residual at position i pairs with the token at i + 1 (the newest one is the anchor).
        logits, residual = self._step(input_ids[:, positions[0] + 1], features, positions + 1)
        candidates, all_logits, confidences, probabilities = input_ids, [], [], []
        while True:
            token, processed = pick(candidates, logits)
            candidates = torch.cat([candidates, token], dim=-1)
            all_logits.append(processed)
            confidences += draft_confidences(processed[:, None])
            probabilities += drafted_token_probabilities(processed[:, None], token)
            if len(all_logits) == num_tokens or not schedule.keep_drafting(confidences, probabilities):
                break
            next_position = torch.full((1, 1), candidates.shape[1] - 1, device=input_ids.device)
            logits, residual = self._step(token, residual, next_position)
        depth = len(all_logits)
        self.cache.crop(-(depth - 1))  # the deeper steps saw unverified tokens; keep only real context
        logits = torch.stack(all_logits, dim=1)
        return Draft(candidates[:, input_ids.shape[1] :], logits, confidences, depth, row_confidences(logits))


class DSparkProposer:
    """DSpark: one forward gives the block's hidden states; its tokens, each with its Markov bias and confidence,
    follow left to right (`draw_with_heads`)."""

    def __init__(self, drafter: PreTrainedModel, target: HyperConnectionTarget):
        self.drafter, self.target = drafter, target
        self.context = drafter.make_context()

    @property
    def feature_layers(self) -> list[int]:
        return list(self.drafter.config.dspark_target_layer_ids)

    def propose(
        self,
        features: torch.Tensor,
        positions: torch.LongTensor,
        input_ids: torch.LongTensor,
        num_tokens: int,
        pick: TokenPicker,
        schedule: StepSchedule,
    ) -> Draft:
        config, device = self.drafter.config, self.drafter.device
        anchor = input_ids[:, -1:]
        noise = anchor.new_full((1, config.dspark_block_size - 1), config.dspark_noise_token_id)
        embeds = self.target.embed(torch.cat([anchor, noise], dim=-1))
        dtype = activation_dtype(self.drafter.main_proj, embeds.dtype)
        start = input_ids.shape[1] - 1  # the anchor's position; the context ends just before it
        out = self.drafter(
            block_embeds=embeds.to(device, dtype),
            block_position_ids=torch.arange(start, start + config.dspark_block_size, device=device)[None],
            context_features=features.to(device, dtype),
            context_position_ids=positions.to(device),
            context=self.context,
        )
        logits = self.target.logits(out.last_hidden_state[:, :num_tokens]).float().to(input_ids.device)
        return draw_with_heads(self.drafter, logits, out.residual, input_ids, pick, schedule)


def draw_with_heads(
    drafter: PreTrainedModel,
    logits: torch.Tensor,
    residual: torch.Tensor,
    input_ids: torch.LongTensor,
    pick: TokenPicker,
    schedule: StepSchedule,
    rows: torch.Tensor | None = None,
) -> Draft:
    """A block's tokens drawn left to right, each with the Markov bias of the token before it (the anchor for the
    first), from the block's `logits` [B, k, V] and pre-norm hidden states `residual` [B, >= k, D]. Before a token is
    drawn the schedule decides from the confidences so far, this one's included (each depends on earlier tokens
    only), whether it is verified: what decides is known before the token is drawn, so speculative sampling stays
    exact. A batch's confidence is the product of its rows' among `rows` (`batch_confidence`)."""
    device = residual.device
    candidates, processed, confidences, previous = input_ids, [], [], input_ids[:, -1:]
    per_row = []
    for k in range(logits.shape[1]):
        bias, markov_embedding = drafter.markov(previous.to(device))
        row_confidence = drafter.confidence(residual[:, k : k + 1], markov_embedding)  # [B, 1]
        confidence = batch_confidence(row_confidence, rows)[0]
        if not schedule.verifies([*confidences, confidence]):
            break
        confidences.append(confidence)
        per_row.append(row_confidence.float())
        previous, row = pick(candidates, logits[:, k] + bias[:, 0].to(logits.device))
        candidates = torch.cat([candidates, previous], dim=-1)
        processed.append(row)
    drafted = torch.stack(processed, dim=1) if processed else logits[:, :0]
    confidences_per_row = torch.cat(per_row, dim=1) if per_row else logits.new_zeros(logits.shape[0], 0)
    return Draft(candidates[:, input_ids.shape[1] :], drafted, confidences, 1, confidences_per_row)


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


def make_proposer(
    drafter: PreTrainedModel, target: HyperConnectionTarget, max_draft: int
) -> BlockProposer | MTPProposer | DSparkProposer:
    """The proposer for the drafter's kind (`max_draft`: the deepest a native MTP drafter drafts)."""
    if drafter.config.model_type == BLOCK_DRAFTER_TYPE:
        return BlockProposer(drafter, target)
    if drafter.config.model_type == DSPARK_DRAFTER_TYPE:
        return DSparkProposer(drafter, target)
    return MTPProposer(drafter, target, max_draft)


class SpeculativeCandidateGenerator(CandidateGenerator):
    """Feeds the features of newly verified positions to the drafter and returns its proposals.

    transformers calls `get_candidates` before every target forward; the first call returns no candidates so that
    the prefill forward produces the first features, as its own MTP/DFlash generators do. A call continuing from a
    cache that already holds a prefix of the prompt prefills only the rest, as plain decoding does
    (transformers' assisted loop would feed the whole prompt again on top of the cache); the drafter's context then
    starts at the new tokens. The draft policy decides each step whether to draft and how many drafts to verify, and
    an `assistant_confidence_threshold` may end the drafts earlier; a step that skips drafting returns no
    candidates, so the target decodes one token as plain decoding would, and its features wait for the drafter's next
    forward.
    """

    requires_model_outputs = True

    def __init__(
        self,
        *,
        proposer: BlockProposer | MTPProposer | DSparkProposer,
        capture: FeatureCapture,
        prompt_length: int,
        max_length: int,
        pick: TokenPicker | None,
        policy: DraftPolicy,
        threshold: ConfidenceThreshold | None,
        stats: GenerationStats,
    ):
        self.proposer, self.capture, self.pick, self.stats = proposer, capture, pick, stats
        self.policy, self.threshold, self.max_length = policy, threshold, max_length
        self.prompt_length = prompt_length
        self.consumed = 0  # leading positions whose features were taken (fed to the drafter or pending)
        self.model_kwargs_overrides: dict = {}  # merged into the target's forward inputs by transformers
        # Verified features the drafter has not seen yet, one piece per step: joined once, when it next drafts
        self.pending: list[torch.Tensor] = []
        self._new_step()

    @property
    def num_drafting_tokens(self) -> int:
        """The most drafts a step verifies: what the target cache must be able to roll back (transformers 5.25 on)."""
        return self.policy.max_draft

    def _take_verified(self, length: int) -> None:
        """Of the last target forward's positions, those now verified (all but the newest of `length` tokens) go to
        the drafter's next forward."""
        num_new = length - 1 - self.consumed
        if num_new > 0:
            self.pending.append(self.capture.features()[:, :num_new])
            self.consumed = length - 1

    def _new_step(self, decoding: bool = True) -> None:
        self.confidences: list[float] = []
        self.token_probabilities: list[float] = []
        self.last_proposed = self.last_accepted = self.drafter_forwards = 0
        self.is_decoding_step = decoding  # the prefill is no decoding step: the policy does not learn from it

    def verifies(self, confidences: list[float]) -> bool:
        return self.policy.choose(confidences) == len(confidences)

    def keep_drafting(self, confidences: list[float], probabilities: list[float]) -> bool:
        """A sequential drafter drafts one more token while the schedule, and the confidence threshold, agree."""
        if self.threshold is not None and not self.threshold.keep_drafting(probabilities):
            return False
        return self.policy.keep_drafting(confidences)

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        self.stats.target_forwards += 1
        self._new_step(decoding=not is_first_iteration)
        self.model_kwargs_overrides = {}
        if is_first_iteration:
            self.consumed = cached_length(model_kwargs[CACHE_ARGUMENT])
            if self.consumed:
                self.model_kwargs_overrides["input_ids"] = input_ids[:, self.consumed :]
                if model_kwargs.get("position_ids") is not None:
                    self.model_kwargs_overrides["position_ids"] = model_kwargs["position_ids"][..., self.consumed :]
            return input_ids, None

        # The last target forward covered the tokens after the previous verified prefix; of those,
        # everything but the newest (bonus) token of input_ids is verified now.
        self._take_verified(input_ids.shape[1])

        num_tokens = min(self.policy.draft_length, self.max_length - input_ids.shape[1] - 1)
        if num_tokens <= 0:
            return input_ids, None
        if not self.policy.should_draft():
            self.stats.skipped_steps += 1
            return input_ids, None
        context = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending, dim=1)
        self.pending = []
        positions = torch.arange(input_ids.shape[1] - 1 - context.shape[1], input_ids.shape[1] - 1)[None]
        draft = self.proposer.propose(context, positions.to(input_ids.device), input_ids, num_tokens, self.pick, self)
        self.confidences, self.drafter_forwards = draft.confidences, draft.drafter_forwards
        self.last_proposed = min(self.policy.choose(self.confidences), draft.tokens.shape[1])
        if self.threshold is not None:
            self.token_probabilities = draft.token_probabilities[: self.last_proposed]
            self.last_proposed = self.threshold.cut(self.token_probabilities)
        if not self.last_proposed:
            return input_ids, None
        tokens, logits = draft.tokens[:, : self.last_proposed], draft.logits[:, : self.last_proposed]
        return torch.cat([input_ids, tokens.to(input_ids.device)], dim=-1), logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """After every target forward: the step's outcome for the stats, and for the policy to learn from."""
        self.last_accepted = int(num_matches)
        if self.last_proposed:
            self.stats.accepted_per_step.append(self.last_accepted)
            self.stats.proposed_per_step.append(self.last_proposed)
            if self.threshold is not None:
                self.threshold.record(self.token_probabilities[: self.last_proposed], self.last_accepted)
        self.stats.new_tokens = input_ids.shape[1] - self.prompt_length
        if self.is_decoding_step:
            step = StepRecord(self.confidences, self.last_proposed, self.last_accepted, self.drafter_forwards)
            self.policy.record(step)
