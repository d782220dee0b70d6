"""The candidate generator transformers' assisted decoding calls each step, and the drafters' proposers.

`SpeculativeCandidateGenerator` turns the features captured during the last verify forward into the
drafter's context and asks a proposer for the next draft: `BlockProposer` (HyperDFlash, vanilla DFlash:
one non-causal forward per block), `MTPProposer` (native MTP: one step per drafted token) or `DSparkProposer`
(DSpark: one forward per block, then its tokens left to right).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import LogitsProcessorList

from .cache_deepseek_v4 import RewindableDeepseekV4Cache
from .context_copy import ChainChooser, SuffixIndex
from .draft_options import BLOCK_DRAFTER_TYPE, DSPARK_DRAFTER_TYPE
from .draft_policy import BatchStepRecord, ConfidenceThreshold, DraftPolicy, StepRecord
from .feature_capture import FeatureCapture
from .generation_stats import GenerationStats
from .target_base import HyperConnectionTarget, activation_dtype
from .target_features import TargetFeatures
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


def draft_confidences(logits: torch.Tensor) -> torch.Tensor:
    """Each row's confidence at each drafted position ([B, k, V] processed logits): its top probability, [B, k].

    Not the probability of the drawn token: in sampling, a draft length that looked at the drawn token would bias
    the output (only what is known before a position is drawn may decide whether it is verified).
    """
    return logits.softmax(dim=-1).amax(dim=-1)


def drafted_token_probabilities(logits: torch.Tensor, tokens: torch.LongTensor) -> list[float]:
    """q of each drafted token ([1, k, V] processed logits, [1, k] tokens): what `assistant_confidence_threshold` is
    compared with, as transformers' `ConfidenceCriteria` does."""
    return logits.softmax(dim=-1).gather(-1, tokens[..., None].to(logits.device)).flatten().tolist()


class StepSchedule:
    """What a proposer asks the call's draft policy while it drafts. One row: whether the step would verify every
    draft so far (`verifies`), and for a drafter that spends a forward per token whether to draft one more (with the
    confidence threshold, if any). A batch (`whole_blocks`) draws its blocks whole: how much of them is verified is
    chosen afterwards, from every row's confidences (`DraftPolicy.choose_width`)."""

    def __init__(self, policy: DraftPolicy, threshold: ConfidenceThreshold | None = None, whole_blocks: bool = False):
        self.policy, self.threshold, self.whole_blocks = policy, threshold, whole_blocks

    def verifies(self, confidences: torch.Tensor) -> bool:
        """Would the step verify every draft with these confidences ([B, k], the last one's token not drawn yet)?"""
        if self.whole_blocks:
            return True
        return self.policy.choose(confidences[0].tolist()) == confidences.shape[1]

    def keep_drafting(self, confidences: list[float], probabilities: list[float]) -> bool:
        """A sequential drafter drafts one more token while the policy, and the confidence threshold, agree."""
        if self.threshold is not None and not self.threshold.keep_drafting(probabilities):
            return False
        return self.policy.keep_drafting(confidences)


@dataclass
class Draft:
    """One proposal: the drafted tokens [B, k], the processed logits they were picked from [B, k, V], each row's
    confidence at each position [B, k] (`draft_confidences`), and the drafter forwards it took."""

    tokens: torch.LongTensor
    logits: torch.Tensor
    confidences: torch.Tensor
    drafter_forwards: int

    @property
    def token_probabilities(self) -> list[float]:
        return drafted_token_probabilities(self.logits, self.tokens)


@dataclass
class DraftRequest:
    """A batch's step (`batched_drafting.py`), as its rows' drafting gets it: target features for columns
    [first_column, first_column + n) [B, n, ..], each row's
    anchor column (its newest committed token; its features are valid before it), the committed tokens, the rows to
    draft for and how many drafts each may propose, and the cache length the target rolls back to after this step."""

    features: torch.Tensor
    first_column: int
    anchors: list[int]
    ids: torch.LongTensor  # [B, columns]: each row's committed tokens, padding after them
    drafting: list[bool]
    num_tokens: int
    cache_length: int
    pick: TokenPicker
    schedule: StepSchedule
    pad_id: int


@dataclass
class RowDrafts:
    """Drafts of some rows: tokens [B, k], the processed logits they were picked from [B, k, V], per-row lengths (0
    for a row that did not draft) and per-row confidences [B, k], and the drafter forwards spent."""

    tokens: torch.LongTensor
    logits: torch.Tensor
    lengths: list[int]
    confidences: torch.Tensor
    drafter_forwards: int


class BlockProposer:
    """HyperDFlash / vanilla DFlash: one non-causal drafter forward proposes a whole block."""

    drafts_rows_together = True  # takes a padding mask: every row of a batch drafts in one forward

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
        anchor_positions: torch.LongTensor | None = None,
    ) -> Draft:
        """The whole block in one forward; the schedule then chooses how many drafts to verify (with DSpark's heads,
        as DSparkProposer does). A batch of rows drafts in the same forward, each from the last token of its row of
        `input_ids`: `positions` and `anchor_positions` [B, 1] are each row's own (left padding makes them lag the
        column), and `context_mask` marks the context each row sees."""
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
            return draw_with_heads(self.drafter, logits, out.residual[:, 1:], input_ids, pick, schedule)
        tokens, processed = _pick_sequentially(input_ids, logits, pick)
        return Draft(tokens, processed, draft_confidences(processed), 1)


class MTPProposer:
    """Native MTP: one step per draft token, each reusing the module on its own pre-collapse output."""

    feature_layers = None
    drafts_rows_together = False  # no padding mask: a batch drafts row by row

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
            confidences += draft_confidences(processed[:, None])[0].tolist()
            probabilities += drafted_token_probabilities(processed[:, None], token)
            if len(all_logits) == num_tokens or not schedule.keep_drafting(confidences, probabilities):
                break
            next_position = torch.full((1, 1), candidates.shape[1] - 1, device=input_ids.device)
            logits, residual = self._step(token, residual, next_position)
        depth = len(all_logits)
        self.cache.crop(-(depth - 1))  # the deeper steps saw unverified tokens; keep only real context
        logits = torch.stack(all_logits, dim=1)
        return Draft(candidates[:, input_ids.shape[1] :], logits, draft_confidences(logits), depth)


class DSparkProposer:
    """DSpark: one forward gives the block's hidden states; its tokens, each with its Markov bias and confidence,
    follow left to right (`draw_with_heads`)."""

    drafts_rows_together = False  # no padding mask: a batch drafts row by row

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
) -> Draft:
    """A block's tokens drawn left to right, each with the Markov bias of the token before it (the anchor for the
    first), from the block's `logits` [B, k, V] and pre-norm hidden states `residual` [B, >= k, D]. Before a token is
    drawn the schedule decides from the confidences so far, this one's included (each depends on earlier tokens
    only), whether it is verified: what decides is known before the token is drawn, so speculative sampling stays
    exact."""
    device = residual.device
    candidates, processed, previous = input_ids, [], input_ids[:, -1:]
    confidences = logits.new_zeros(logits.shape[0], 0)
    for k in range(logits.shape[1]):
        bias, markov_embedding = drafter.markov(previous.to(device))
        confidence = drafter.confidence(residual[:, k : k + 1], markov_embedding).float().to(logits.device)  # [B, 1]
        if not schedule.verifies(torch.cat([confidences, confidence], dim=1)):
            break
        confidences = torch.cat([confidences, confidence], dim=1)
        previous, row = pick(candidates, logits[:, k] + bias[:, 0].to(logits.device))
        candidates = torch.cat([candidates, previous], dim=-1)
        processed.append(row)
    drafted = torch.stack(processed, dim=1) if processed else logits[:, :0]
    return Draft(candidates[:, input_ids.shape[1] :], drafted, confidences, 1)


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


Proposer = BlockProposer | MTPProposer | DSparkProposer


def proposer_class(drafter: PreTrainedModel) -> type[Proposer]:
    """The proposer for the drafter's kind: the one place that tells drafter kinds apart at run time."""
    if drafter.config.model_type == BLOCK_DRAFTER_TYPE:
        return BlockProposer
    if drafter.config.model_type == DSPARK_DRAFTER_TYPE:
        return DSparkProposer
    return MTPProposer


def make_proposer(drafter: PreTrainedModel, target: HyperConnectionTarget, max_draft: int) -> Proposer:
    """A proposer for the drafter (`max_draft`: the deepest a native MTP drafter drafts, which sizes its cache)."""
    cls = proposer_class(drafter)
    return cls(drafter, target, max_draft) if cls is MTPProposer else cls(drafter, target)


class SpeculativeCandidateGenerator(CandidateGenerator):
    """The call's candidate logic, for one row and for a batch: the proposer, the target features the drafter has not
    read yet (`features`), how many tokens a step drafts or whether it skips drafting (`draft_budget`), the
    proposers' schedule, and the stats of every verify step (`record_verified`).

    For one row it is what transformers' assisted loop calls each step. The first call returns no candidates so that
    the prefill forward produces the first features, as transformers' own MTP/DFlash generators do. A call that
    continues from a cache already holding a prefix of the prompt prefills only the rest, as plain decoding does
    (transformers' assisted loop would feed the whole prompt again on top of the cache); the drafter's context then
    starts at the new tokens. The draft policy decides each step whether to draft and how many drafts to verify, and
    an `assistant_confidence_threshold` may end the drafts earlier; a step that skips drafting returns no
    candidates, so the target decodes one token as plain decoding would, and its features wait for the drafter's next
    forward. A batch's loop (`batched_decoding.py`) asks the same object for the same pieces, row by row where they
    are per row.
    """

    requires_model_outputs = True

    def __init__(
        self,
        *,
        proposer,
        capture: FeatureCapture,
        prompt_length: int,
        max_length: int,
        pick: TokenPicker | None,
        policy: DraftPolicy,
        threshold: ConfidenceThreshold | None,
        stats: GenerationStats,
        whole_blocks: bool = False,
        chooser: ChainChooser | None = None,
    ):
        """`proposer`: a `Proposer`, or for a batch its rows' drafting (`batched_drafting.py`); `whole_blocks`: a
        batch's blocks are drawn whole and cut for the batch afterwards (`StepSchedule`); `chooser`: steps may verify
        a chain copied from the context instead of the drafter's (`context_copy.py`; None: the drafter's only)."""
        self.proposer, self.capture, self.pick, self.stats = proposer, capture, pick, stats
        self.policy, self.threshold, self.max_length = policy, threshold, max_length
        self.schedule = StepSchedule(policy, threshold, whole_blocks)
        self.chooser = chooser
        self.index = SuffixIndex()  # one row's tokens (a batch keeps one per row)
        self.prompt_length = prompt_length
        self.features = TargetFeatures(0)
        self.forward_start = 0  # the first column the latest target forward fed
        self.model_kwargs_overrides: dict = {}  # merged into the target's forward inputs by transformers
        self._new_step()

    @property
    def num_drafting_tokens(self) -> int:
        """The most drafts a step verifies: what the target cache must be able to roll back (transformers 5.25 on)."""
        return self.policy.max_draft

    def start(self, column: int) -> None:
        """The call's first target forward feeds the columns from `column` on (a cached prefix comes before it)."""
        self.features = TargetFeatures(column)
        self.forward_start = column

    def keep_forward_features(self) -> None:
        """After a target forward: its features, from the column it started at."""
        self.features.write(self.forward_start, self.capture.features())

    def draft_budget(self, room: int) -> tuple[int, bool]:
        """How many drafts the next step may verify, with `room` tokens left before the length limit, and whether the
        policy runs the drafter for it. A step it does not may still verify tokens copied from the context; one that
        verifies none though it had room is counted as skipped (`skip`)."""
        most = min(self.policy.draft_length, room)
        return most, most > 0 and self.policy.should_draft()

    def skip(self) -> None:
        """The step decodes plainly where the policy chose not to draft."""
        self.stats.skipped_steps += 1

    def draft_rows(
        self,
        anchors: list[int],
        ids: torch.LongTensor,
        drafting: list[bool],
        num_tokens: int,
        cache_length: int,
        pad_id: int,
    ) -> RowDrafts:
        """A batch's step: the rows in `drafting` draft (at most `num_tokens` each) from their `anchors`, with the
        target features kept so far; those the rows' drafting no longer needs are let go."""
        features = self.features
        request = DraftRequest(
            features=features.read(),
            first_column=features.start,
            anchors=anchors,
            ids=ids,
            drafting=drafting,
            num_tokens=num_tokens,
            cache_length=cache_length,
            pick=self.pick,
            schedule=self.schedule,
            pad_id=pad_id,
        )
        drafted = self.proposer.propose(request)
        features.drop_before(self.proposer.first_needed_column(cache_length))
        return drafted

    def record_rows(self, proposed: int, accepted: int, step: BatchStepRecord | None) -> None:
        """A batch's verify step: `proposed` drafted positions, `accepted` of them in every row (the shared cache's
        advance, less the bonus token), and what the policy learns from the step (None: nothing)."""
        if proposed:
            self.record_verified(proposed, accepted)
        if step is not None:
            self.policy.record_batch(step)

    def record_verified(self, proposed: int, accepted: int) -> None:
        """A verify step's drafts: how many the target saw and how many it accepted."""
        self.stats.proposed_per_step.append(proposed)
        self.stats.accepted_per_step.append(accepted)

    def _new_step(self, decoding: bool = True) -> None:
        self.confidences: list[float] = []
        self.token_probabilities: list[float] = []
        self.last_proposed = self.last_accepted = self.drafter_forwards = 0
        self.copied = False  # the step verifies a chain copied from the context
        self.policy_learns = True  # the policy learns from the step (it ran, or chose not to run, the drafter)
        self.drafted: list[int] = []  # the drafter's chain, verified or not
        self.context_chain: tuple[list[int], int] = ([], 0)  # what the context offered, and the suffix it matched
        self.is_decoding_step = decoding  # the prefill is no decoding step: the policy does not learn from it

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
            cached = cached_length(model_kwargs[CACHE_ARGUMENT])
            self.start(cached)
            if cached:
                self.model_kwargs_overrides["input_ids"] = input_ids[:, cached:]
                if model_kwargs.get("position_ids") is not None:
                    self.model_kwargs_overrides["position_ids"] = model_kwargs["position_ids"][..., cached:]
            return input_ids, None

        # The last target forward fed the columns from `forward_start`; of its features, those before the newest
        # (bonus) token of input_ids are verified now. The next forward starts at that token.
        self.keep_forward_features()
        anchor = self.forward_start = input_ids.shape[1] - 1
        most, drafts = self.draft_budget(self.max_length - input_ids.shape[1] - 1)
        self.policy_learns = drafts  # a step copied while the policy waits is no drafted step of its
        chooser = self.chooser
        if chooser is not None and most > 0:
            self.context_chain = chain, suffix = self.index.continuation(most)
            copied = chooser.copies_first(len(chain), suffix, most if drafts else 0)
            if copied:
                return self._copy(input_ids, copied)
        if not drafts:
            if most > 0:
                self.skip()
            return input_ids, None
        context = self.features.read(anchor)
        positions = torch.arange(self.features.start, anchor, device=input_ids.device)[None]
        self.features.drop_before(anchor)
        draft = self.proposer.propose(context, positions, input_ids, most, self.pick, self.schedule)
        self.confidences, self.drafter_forwards = draft.confidences[0].tolist(), draft.drafter_forwards
        if chooser is not None:
            self.drafted = draft.tokens[0].tolist()
            first = self.confidences[0] if self.confidences else None
            copied = chooser.copies_after(first, most, len(chain), suffix)
            if copied:
                return self._copy(input_ids, copied)
        self.last_proposed = min(self.policy.choose(self.confidences), draft.tokens.shape[1])
        if self.threshold is not None:
            self.token_probabilities = draft.token_probabilities[: self.last_proposed]
            self.last_proposed = self.threshold.cut(self.token_probabilities)
        if not self.last_proposed:
            return input_ids, None
        tokens, logits = draft.tokens[:, : self.last_proposed], draft.logits[:, : self.last_proposed]
        return torch.cat([input_ids, tokens.to(input_ids.device)], dim=-1), logits

    def _copy(self, input_ids: torch.LongTensor, length: int) -> tuple[torch.LongTensor, None]:
        """The step verifies the context's chain's first `length` tokens. No drafter logits: transformers then checks
        them against the target's own choice at each position (sampled when sampling), which is speculative sampling
        with q one-hot at the copied tokens."""
        self.copied, self.last_proposed = True, length
        tokens = torch.tensor([self.context_chain[0][:length]], device=input_ids.device)
        return torch.cat([input_ids, tokens], dim=-1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """After every target forward: the step's outcome for the stats, and for the policy and chooser to learn."""
        self.last_accepted = int(num_matches)
        if self.last_proposed:
            self.record_verified(self.last_proposed, self.last_accepted)
            self.stats.accepted_by_source["context" if self.copied else "drafter"].append(self.last_accepted)
            if self.threshold is not None and not self.copied:
                self.threshold.record(self.token_probabilities[: self.last_proposed], self.last_accepted)
        self.stats.new_tokens = input_ids.shape[1] - self.prompt_length
        if self.chooser is not None:
            self._learn_chains(input_ids)
        if self.is_decoding_step and self.policy_learns:
            confidences = [] if self.copied else self.confidences  # a copied chain says nothing of them
            step = StepRecord(confidences, self.last_proposed, self.last_accepted, self.drafter_forwards)
            self.policy.record(step)

    def _learn_chains(self, input_ids: torch.LongTensor) -> None:
        """The row's new tokens into its index; what they tell the chooser of each chain the step had."""
        known = input_ids[0, len(self.index.tokens) :].tolist()
        if self.is_decoding_step:
            chain, suffix = self.context_chain
            self.chooser.learn_copy(chain, suffix, known)
            if self.drafted and self.confidences:  # (on a spread target the confidences are rank 0's)
                self.chooser.learn_drafter(self.confidences[0], self.drafted, known)
        self.index.extend(known)
