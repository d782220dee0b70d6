"""Batched speculative decoding: `target.generate(**batch, assistant_model=drafter)` with several rows.

transformers' assisted loop serves one row. This one runs inside generate() as its decoding method (the target's
`_sample`, replaced for the call), so the batch arrives prepared as for plain batched decoding: rows repeated for
`num_return_sequences`, the logits processors and stopping criteria built, the cache and attention mask in place.

Design: every row advances by the batch's shortest accepted run. Each step the rows draft together, one verify
forward scores every row's drafts, each row's acceptance is judged on its own (greedy match or speculative
sampling), and every generating row keeps its first `m + 1` tokens, `m` the fewest drafts a generating row
accepted. The rows' tokens are all the target's: a row that accepted more keeps a prefix of its verified tokens, and
in sampling a prefix of a speculative-sampling result cut where another row's independent verdict says is still a
sample of the target's distribution. So the cache stays one length for all rows and rolls back with one crop, every
row holds the tokens plain batched decoding holds at the same cache index, and a left-padded row's position ids lag
its cache index the same way in both (`verify_as_decoding` makes V4's verify rows see the compressed entries one-token
decoding sees). The alternatives keep every row's own run: rows then end at different lengths, so a row needs holes in
its mask or its own cache length, which V4's compressors (they pool windows without the mask, one counter for the
batch) and linear-attention layers (a hole still decays the state) cannot take. What the shortest run costs is
measured per call: `stats.row_mean_accepted_length` is tau had every row kept its own run.

Rows that stopped (EOS, a stop string) keep taking the padding token, as in plain decoding; they neither draft nor
limit the others' runs. The draft schedule decides per step for the whole batch, from the product of the generating
rows' confidences at each position (every row must accept a position for the batch to keep it), on costs scaled to the
batch (`DraftCosts.for_batch`), so it drafts less as the batch grows and stops drafting where drafting loses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import Cache, PreTrainedModel
from transformers.generation.candidate_generator import (
    _prepare_attention_mask,
    _prepare_position_ids,
    _prepare_token_type_ids,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import call_scope
from .candidate_generator import BlockProposer, DSparkProposer, MTPProposer, TokenPicker, batch_confidence
from .draft_options import BLOCK_DRAFTER_TYPE, DSPARK_DRAFTER_TYPE
from .draft_policy import DraftPolicy, StepRecord
from .feature_capture import FeatureCapture
from .generation_stats import GenerationStats
from .rank_agreement import broadcast_from_rank_zero, spread_group
from .target_base import HyperConnectionTarget
from .transformers_compat import CACHE_ARGUMENT, STOCK_LINEAR_ATTENTION_ROLLBACK, cached_length

_OUTPUT_CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


def is_batched(input_ids: torch.LongTensor, num_return_sequences: int | None) -> bool:
    return input_ids.shape[0] > 1 or (num_return_sequences or 1) > 1


def left_padding(attention_mask: torch.Tensor) -> torch.LongTensor:
    """Padding tokens at the start of each row of a left-padded `attention_mask` [B, L]."""
    return (attention_mask == 0).sum(dim=1)


def check_batch(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, tensors: dict) -> None:
    """A batch speculative decoding can serve: every row left-padded (its mask zeros, then ones), and the prompt, mask
    and other tensor inputs on one device."""
    devices = {name: value.device for name, value in tensors.items() if isinstance(value, torch.Tensor)}
    if len(set(devices.values()) | {input_ids.device}) > 1:
        where = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(
            f"The batch's inputs are on different devices (input_ids on {input_ids.device}, {where}); move them to "
            "one device, e.g. `inputs.to(target.device)`."
        )
    if attention_mask is None:
        return
    mask = attention_mask.bool()
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"Rows {empty} of the attention mask are all padding; drop them from the batch.")
    unpadded_after = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1)  # a real token followed by padding
    right = (unpadded_after & ~mask[:, -1]).nonzero().flatten().tolist()
    if right:
        raise ValueError(
            f"Rows {right} are padded on the right. Batched generation needs left padding: set "
            "`tokenizer.padding_side = 'left'` before tokenizing the prompts."
        )
    holes = unpadded_after.nonzero().flatten().tolist()
    if holes:
        raise ValueError(
            f"Rows {holes} of the attention mask have padding between real tokens; speculative decoding takes "
            "left-padded rows only (zeros, then ones). Tokenize the prompts with `padding_side='left'`."
        )


@dataclass
class BatchDraft:
    """One step's drafts for every row: tokens [B, k] (padding past a row's own `lengths`), the processed logits
    they were picked from [B, k, V], the batch's confidence per position, and the drafter forwards spent."""

    tokens: torch.LongTensor
    logits: torch.Tensor
    lengths: torch.LongTensor
    confidences: list[float]
    drafter_forwards: int


class BlockDrafting:
    """HyperDFlash and vanilla DFlash drafters (heads or not): every row's block in one drafter forward, padding
    masked out of the context, each row at its own positions."""

    row_by_row = False

    def __init__(self, drafter: PreTrainedModel, target: HyperConnectionTarget, padding: torch.LongTensor):
        self.proposer = BlockProposer(drafter, target)
        self.padding = padding
        self.context_start: int | None = None  # cache index of the first position the drafter saw

    @property
    def feature_layers(self) -> list[int] | None:
        return self.proposer.feature_layers

    def propose(self, step: DraftRequest) -> BatchDraft:
        if self.context_start is None:
            self.context_start = step.first_index
        end = step.first_index + step.features.shape[1]
        indices = torch.arange(step.first_index, end, device=self.padding.device)
        positions = (indices[None] - self.padding[:, None]).clamp(min=0)
        draft = self.proposer.propose(
            step.features,
            positions,
            step.input_ids,
            step.num_tokens,
            step.pick,
            step.schedule,
            context_mask=step.attention_mask[:, self.context_start : end],
            rows=step.rows,
        )
        k = draft.tokens.shape[1]
        lengths = torch.where(step.rows, k, 0).to(draft.tokens.device)
        return BatchDraft(draft.tokens, draft.logits, lengths, draft.confidences, draft.drafter_forwards)


class RowPick:
    """The call's token picker for one row drafted alone. Logits processors may keep state per row (a prompt length
    per row), so they see the whole batch, with this row's padded prefix in its place; the row's token and processed
    logits come back."""

    def __init__(self, pick: TokenPicker, batch_ids: torch.LongTensor, row: int, padding: int):
        self.pick, self.batch_ids, self.row, self.padding = pick, batch_ids, row, padding

    def __call__(self, prefix_ids: torch.LongTensor, logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
        batch, width = self.batch_ids.shape[0], self.padding + prefix_ids.shape[1]
        ids = self.batch_ids.new_zeros(batch, width)
        ids[:, : self.batch_ids.shape[1]] = self.batch_ids
        ids[self.row, self.padding :] = prefix_ids[0]
        scores = logits.new_zeros(batch, logits.shape[-1])
        scores[self.row] = logits[0]
        token, processed = self.pick(ids, scores)
        return token[self.row : self.row + 1], processed[self.row : self.row + 1]


class RowByRowDrafting:
    """Native MTP and DSpark, whose drafters take no padding mask: one proposer per row, fed that row's context
    without its padding, at its own positions."""

    row_by_row = True

    def __init__(self, drafter: PreTrainedModel, target: HyperConnectionTarget, padding: torch.LongTensor, max_draft):
        def proposer() -> MTPProposer | DSparkProposer:
            if drafter.config.model_type == DSPARK_DRAFTER_TYPE:
                return DSparkProposer(drafter, target)
            return MTPProposer(drafter, target, max_draft)

        self.proposers = [proposer() for _ in range(padding.shape[0])]
        self.padding = padding
        self.feature_layers = self.proposers[0].feature_layers

    def propose(self, step: DraftRequest) -> BatchDraft:
        batch, end = step.input_ids.shape[0], step.first_index + step.features.shape[1]
        indices = torch.arange(step.first_index, end, device=step.input_ids.device)
        drafts = {}
        for row in step.rows.nonzero().flatten().tolist():
            real = step.attention_mask[row, step.first_index : end].bool().to(indices.device)
            pad = int(self.padding[row])
            draft = self.proposers[row].propose(
                step.features[row : row + 1, real.to(step.features.device)],
                (indices[real] - pad)[None],
                step.input_ids[row : row + 1, pad:],
                step.num_tokens,
                RowPick(step.pick, step.input_ids, row, pad),
                step.schedule,
            )
            drafts[row] = draft, min(step.schedule.policy.choose(draft.confidences), draft.tokens.shape[1])
        k = max((length for _, length in drafts.values()), default=0)
        vocab = next(iter(drafts.values()))[0].logits.shape[-1] if drafts else 1
        tokens = step.input_ids.new_full((batch, k), step.pad_token_id)
        logits = torch.zeros(batch, k, vocab, device=step.input_ids.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=step.input_ids.device)
        confidences = torch.ones(batch, k)
        for row, (draft, length) in drafts.items():
            tokens[row, :length] = draft.tokens[0, :length]
            logits[row, :length] = draft.logits[0, :length]
            lengths[row] = length
            confidences[row, :length] = torch.tensor(draft.confidences[:length])
        forwards = max((draft.drafter_forwards for draft, _ in drafts.values()), default=0)
        return BatchDraft(tokens, logits, lengths, batch_confidence(confidences), forwards)


@dataclass
class DraftRequest:
    """What the drafters get each step: the features of the positions verified since they last drafted [B, n, ..],
    the cache index of the first, the tokens and mask so far, and how to draft."""

    features: torch.Tensor
    first_index: int
    input_ids: torch.LongTensor
    attention_mask: torch.Tensor
    rows: torch.Tensor  # bool [B]: rows still generating
    num_tokens: int
    pick: TokenPicker
    schedule: BatchSchedule
    pad_token_id: int


class BatchSchedule:
    """The proposers' view of the call's draft policy (`candidate_generator.StepSchedule`), one for the batch."""

    def __init__(self, policy: DraftPolicy):
        self.policy = policy

    def verifies(self, confidences: list[float]) -> bool:
        return self.policy.choose(confidences) == len(confidences)

    def keep_drafting(self, confidences: list[float], probabilities: list[float]) -> bool:
        return self.policy.keep_drafting(confidences)


def drafts_row_by_row(drafter: PreTrainedModel) -> bool:
    """Native MTP and DSpark draft a batch row by row; block drafters all rows in one forward."""
    return drafter.config.model_type != BLOCK_DRAFTER_TYPE


def make_drafting(
    drafter: PreTrainedModel, target: HyperConnectionTarget, padding: torch.LongTensor, max_draft: int
) -> BlockDrafting | RowByRowDrafting:
    if not drafts_row_by_row(drafter):
        return BlockDrafting(drafter, target, padding)
    return RowByRowDrafting(drafter, target, padding, max_draft)


def judge_greedy(processed: torch.Tensor, draft: BatchDraft) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Each row's verified tokens [B, k + 1] (the target's choice at every position) and accepted drafts [B]."""
    chosen = processed.argmax(dim=-1)
    k = draft.tokens.shape[1]
    drafted = torch.arange(k, device=chosen.device)[None] < draft.lengths[:, None]
    matches = (draft.tokens.to(chosen.device) == chosen[:, :k]) & drafted
    return chosen, matches.long().cumprod(dim=1).sum(dim=1)


def judge_sampled(processed: torch.Tensor, draft: BatchDraft) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Speculative sampling per row: draft j is kept with probability min(1, p/q) while the ones before it were;
    the first rejected one is replaced by a draw from max(p - q, 0), and a row that kept all its drafts draws its
    bonus token from p. Returns each row's tokens [B, k + 1] (valid up to its accepted drafts + 1) and accepted [B]."""
    k = draft.tokens.shape[1]
    p = processed.softmax(dim=-1)
    q = draft.logits.to(p.device).softmax(dim=-1)
    tokens = draft.tokens.to(p.device)
    p_drafted = p[:, :k].gather(-1, tokens[..., None]).squeeze(-1)
    q_drafted = q.gather(-1, tokens[..., None]).squeeze(-1)
    drafted = torch.arange(k, device=p.device)[None] < draft.lengths[:, None]
    kept = (torch.rand_like(p_drafted) <= p_drafted / q_drafted) & drafted
    accepted = kept.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(p.shape[0], device=p.device)
    target_next = p[rows, accepted]
    rejected = accepted < draft.lengths
    residual = (target_next - q[rows, accepted.clamp(max=k - 1)]).clamp(min=0)  # k >= 1: a step with drafts
    residual = torch.where(rejected[:, None] & (residual.sum(dim=-1, keepdim=True) > 0), residual, target_next)
    next_tokens = torch.multinomial(residual / residual.sum(dim=-1, keepdim=True), num_samples=1).squeeze(1)
    verified = torch.cat([tokens, tokens.new_zeros(p.shape[0], 1)], dim=1)
    verified[rows, accepted] = next_tokens
    return verified, accepted


def _mask_so_far(model_kwargs: dict, input_ids: torch.LongTensor) -> torch.Tensor:
    """The attention mask of the tokens so far (generate() keeps none for a prompt without padding)."""
    mask = model_kwargs.get("attention_mask")
    return torch.ones_like(input_ids) if mask is None else mask


class BatchedSpeculativeLoop:
    """generate()'s decoding method for a batch with a drafter, in place of the target's `_sample` for the call."""

    def __init__(
        self,
        target: HyperConnectionTarget,
        drafting: BlockDrafting | RowByRowDrafting,
        capture: FeatureCapture,
        policy: DraftPolicy,
        stats: GenerationStats,
    ):
        self.target, self.drafting, self.capture, self.policy, self.stats = target, drafting, capture, policy, stats
        self.schedule = BatchSchedule(policy)
        self.group = spread_group(target.model)

    def __call__(
        self,
        _plain_sample: Callable,
        input_ids: torch.LongTensor,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus: bool = False,
        streamer=None,
        **model_kwargs,
    ):
        model = self.target.model
        cache: Cache = model_kwargs[CACHE_ARGUMENT]
        # As the version's assisted decoding does: from 5.25 linear-attention layers keep states to roll back to
        if STOCK_LINEAR_ATTENTION_ROLLBACK:
            cache.activate_past_recording(recurrent_states_to_keep=self.policy.max_draft)
        else:
            cache.activate_past_recording()
        config = generation_config
        pad = config._pad_token_tensor
        pad_id = int(pad) if pad is not None else 0
        has_eos = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        pick = TokenPicker(logits_processor, bool(config.do_sample))
        keep_scores = config.return_dict_in_generate and config.output_scores
        keep_logits = config.return_dict_in_generate and config.output_logits
        scores = [] if keep_scores else None
        raw_logits = [] if keep_logits else None
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        first_index = cached_length(cache)

        outputs = model._prefill(input_ids, config, model_kwargs)
        self.stats.target_forwards += 1
        model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
        logits = outputs.logits[:, -1:].to(torch.float32, copy=True).to(input_ids.device)
        processed = logits_processor(input_ids, logits[:, 0])[:, None]
        chosen = torch.multinomial(processed[:, 0].softmax(-1), 1) if config.do_sample else processed.argmax(-1)
        chosen = self._agreed(chosen)
        features = self.capture.features()
        del outputs
        input_ids, unfinished, appended = self._append(
            input_ids, chosen, 1, unfinished, stopping_criteria, has_eos, pad, processed, logits, scores, raw_logits
        )
        pending = [features]
        max_length = config.max_length
        while bool(unfinished.any()):
            cur_len = input_ids.shape[1]
            num_tokens = min(self.policy.draft_length, max_length - cur_len - 1)
            draft = None
            if num_tokens > 0 and self.policy.should_draft():
                context = pending[0] if len(pending) == 1 else torch.cat(pending, dim=1)
                request = DraftRequest(
                    context,
                    first_index,
                    input_ids,
                    _mask_so_far(model_kwargs, input_ids),
                    unfinished,
                    num_tokens,
                    pick,
                    self.schedule,
                    pad_id,
                )
                draft = self.drafting.propose(request)
                first_index += context.shape[1]
                pending = []
                if not self.drafting.row_by_row:
                    k = min(self.policy.choose(draft.confidences), draft.tokens.shape[1])
                    draft = BatchDraft(
                        draft.tokens[:, :k],
                        draft.logits[:, :k],
                        draft.lengths.clamp(max=k),
                        draft.confidences,
                        draft.drafter_forwards,
                    )
            elif num_tokens > 0:
                self.stats.skipped_steps += 1
            k = 0 if draft is None else draft.tokens.shape[1]
            drafts = input_ids.new_zeros(input_ids.shape[0], 0) if not k else draft.tokens.to(input_ids.device)
            drafts = torch.where(unfinished[:, None], drafts, pad_id)  # a stopped row feeds padding, as plainly
            candidates = torch.cat([input_ids, drafts], dim=-1)
            outputs = self._verify(model, candidates, k, model_kwargs)
            logits = outputs.logits[:, -(k + 1) :].to(torch.float32, copy=True).to(input_ids.device)
            processed = logits.clone()
            if len(logits_processor):
                for i in range(k + 1):
                    processed[:, i] = logits_processor(candidates[:, : cur_len + i], processed[:, i])
            if not k:
                row_tokens = (
                    torch.multinomial(processed[:, 0].softmax(-1), 1) if config.do_sample else processed.argmax(-1)
                )
                accepted = torch.zeros_like(unfinished, dtype=torch.long)
            else:
                judge = judge_sampled if config.do_sample else judge_greedy
                row_tokens, accepted = judge(processed, draft)
            row_tokens, accepted = self._agreed(row_tokens), self._agreed(accepted)
            keep = int(accepted[unfinished].min()) + 1
            generating = unfinished
            input_ids, unfinished, appended = self._append(
                input_ids,
                row_tokens,
                keep,
                unfinished,
                stopping_criteria,
                has_eos,
                pad,
                processed,
                logits,
                scores,
                raw_logits,
            )
            if k + 1 > appended:
                cache.crop(-(k + 1 - appended))
            features = self.capture.features()
            pending.append(features[:, :appended])
            model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, num_new_tokens=appended)
            del outputs
            if draft is not None:  # the drafter ran, whether or not the schedule verified any of its drafts
                self._record(draft, keep - 1, accepted, generating)
        if not config.return_dict_in_generate:
            return input_ids
        return GenerateDecoderOnlyOutput(
            sequences=input_ids,
            scores=None if scores is None else tuple(scores),
            logits=None if raw_logits is None else tuple(raw_logits),
            **{_OUTPUT_CACHE_FIELD: cache},
        )

    def _verify(self, model: PreTrainedModel, candidates: torch.LongTensor, k: int, model_kwargs: dict):
        """One target forward over each row's newest token and its `k` drafts, as assisted decoding makes it."""
        kwargs = _prepare_attention_mask(dict(model_kwargs), candidates.shape[1], False)
        kwargs = _prepare_token_type_ids(kwargs, candidates.shape[1])
        if (position_ids := kwargs.get("position_ids")) is not None and k:
            kwargs = _prepare_position_ids(kwargs, position_ids.shape[-1] + k, False)
        self.target.keep_states_for_draft(model_kwargs[CACHE_ARGUMENT], k)
        inputs = model.prepare_inputs_for_generation(
            candidates, next_sequence_length=k + 1, is_first_iteration=False, **kwargs
        )
        if "logits_to_keep" in inputs:
            inputs["logits_to_keep"] = k + 1
        self.stats.target_forwards += 1
        return model(**inputs, return_dict=True)

    def _append(
        self, input_ids, row_tokens, keep, unfinished, criteria, has_eos, pad, processed, logits, scores, raw_logits
    ):
        """Append each row's first `keep` tokens one position at a time, asking the stopping criteria after each as
        plain decoding does; stops early once every row has stopped. Returns the ids, the rows still generating and
        the positions appended."""
        appended = 0
        for j in range(keep):
            tokens = row_tokens[:, j]
            if has_eos:
                tokens = torch.where(unfinished, tokens, pad)
            input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
            if scores is not None:
                scores.append(processed[:, j])
            if raw_logits is not None:
                raw_logits.append(logits[:, j])
            stop = criteria(input_ids, None if scores is None else tuple(scores))
            unfinished = unfinished & ~stop.to(unfinished.device)
            appended += 1
            if not bool(unfinished.any()):
                break
        return input_ids, unfinished, appended

    def _agreed(self, tensor: torch.Tensor) -> torch.Tensor:
        """On a spread target: rank 0's value, so every rank keeps the same tokens whatever it drew."""
        if self.group is None:
            return tensor
        return broadcast_from_rank_zero(self.group, tensor.cpu()).to(tensor.device)

    def _record(self, draft: BatchDraft, kept: int, accepted: torch.LongTensor, rows: torch.Tensor) -> None:
        proposed = int(draft.lengths.max()) if draft.tokens.shape[1] else 0
        if proposed:
            self.stats.accepted_per_step.append(kept)
            self.stats.proposed_per_step.append(proposed)
            self.stats.row_accepted_per_step.append(float(accepted[rows].float().mean()))
        self.policy.record(StepRecord(draft.confidences, proposed, kept, draft.drafter_forwards))


def batched_generate(original_generate, request, target: HyperConnectionTarget, cache: Cache, drafter, policy, stats):
    """Run `request` (a `GenerateRequest` of several rows) through generate() with the batched loop as its decoding
    method, on `cache`; the cache is the family's stock one again afterwards."""
    mask = request.attention_mask
    padding = left_padding(mask).repeat_interleave(request.generation_config.num_return_sequences or 1)
    drafting = make_drafting(drafter, target, padding, policy.max_draft)
    arguments = request.arguments | {"assistant_model": None}
    kwargs = request.kwargs | {CACHE_ARGUMENT: cache, "cache_implementation": None}
    try:
        with (
            target.capture(drafting.feature_layers) as capture,
            target.verify_as_decoding(request.input_ids.shape[1], request.positions_may_lag_cache, cache),
            call_scope.methods(target.model, _sample=BatchedSpeculativeLoop(target, drafting, capture, policy, stats)),
        ):
            return original_generate(target.model, **arguments, **kwargs)
    finally:
        target.release_cache(cache)
