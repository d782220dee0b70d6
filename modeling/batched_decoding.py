"""Batched speculative decoding: `target.generate(**batch, assistant_model=drafter)` with several rows.

transformers' assisted loop serves one row. This one runs inside generate() as its decoding method (the target's
`_sample`, replaced for the call), so the batch arrives prepared as for plain batched decoding: rows repeated for
`num_return_sequences`, the logits processors and stopping criteria built, the cache and attention mask in place.

Design: every row keeps the tokens it verified. The cache has one length for all rows and holds, at every index, the
token plain batched decoding holds there (`batch_rows.py`). A row whose verified run went past the batch's shortest
keeps those tokens as committed: each verify forward feeds every row its committed tokens past the cache first,
exactly as prompt tokens are fed (they are never judged again), then its drafts from its own anchor. Each row's
drafts are judged on their own (greedy match or speculative sampling), the cache advances by the shortest run of
positions whose inputs a row committed, and rolls back with one crop. So the row that was behind drafts a whole block
again at the next step, and a row ahead spends its width on what it already has: the batch's pace is set by rows
drafting at full width, not by the minimum of independent runs. V4's compressors and indexer (one window counter for
the batch, pooling without the mask) and linear-attention states see what plain decoding feeds them; a left-padded
row's position ids lag its cache index as in plain decoding (`verify_as_decoding`).

A step is four parts: draft (rows whose anchor moved draft again; `BatchDrafts.cut` chooses the verify width for the
batch), verify (one target forward), judge (each row's drafts after its fed tokens), advance (commit, show the
stopping criteria each length once, crop, keep the features the drafter needs). Rows that stopped keep taking
padding when the generation has an end-of-sequence id, from their stop on, in their tokens, cache and logits;
without one they go on with their own tokens, as plain decoding lets them.
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
from .batch_rows import BatchRows
from .batched_drafting import BatchDrafts, BatchSchedule, DraftRequest, make_drafting
from .candidate_generator import TokenPicker
from .draft_policy import BatchStepRecord, DraftPolicy, RowStep
from .feature_capture import FeatureCapture
from .generation_stats import GenerationStats
from .rank_agreement import RankAgreement, sequence_state, stops_alike
from .request_checks import left_padding
from .target_base import HyperConnectionTarget
from .transformers_compat import CACHE_ARGUMENT, STOCK_LINEAR_ATTENTION_ROLLBACK, cached_length

# How far past a whole block a verify forward may reach so that rows ahead verify theirs too (a row further ahead
# waits, fed what it committed): benchmarks/batch_design_sim.py and docs/batched.md weigh the choice.
MAX_LEAD = 4
_OUTPUT_CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


def judge_greedy(
    processed: torch.Tensor, tokens: torch.LongTensor, lengths: torch.LongTensor
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Each row's verified tokens [B, k + 1] (the target's choice after each draft; `processed` [B, k + 1, V] starts
    at the row's anchor) and accepted drafts [B] (of its first `lengths[r]`)."""
    chosen = processed.argmax(dim=-1)
    k = tokens.shape[1]
    drafted = torch.arange(k, device=chosen.device)[None] < lengths[:, None]
    matches = (tokens.to(chosen.device) == chosen[:, :k]) & drafted
    return chosen, matches.long().cumprod(dim=1).sum(dim=1)


def judge_sampled(
    processed: torch.Tensor, tokens: torch.LongTensor, logits: torch.Tensor, lengths: torch.LongTensor
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Speculative sampling per row: draft j is kept with probability min(1, p/q) while the ones before it were;
    the first rejected one is replaced by a draw from max(p - q, 0), and a row that kept all its drafts draws its
    bonus token from p. Returns each row's tokens [B, k + 1] (valid up to its accepted drafts + 1) and accepted [B]."""
    k = tokens.shape[1]
    p = processed.softmax(dim=-1)
    q = logits.to(p.device).softmax(dim=-1)
    tokens = tokens.to(p.device)
    p_drafted = p[:, :k].gather(-1, tokens[..., None]).squeeze(-1)
    q_drafted = q.gather(-1, tokens[..., None]).squeeze(-1)
    drafted = torch.arange(k, device=p.device)[None] < lengths[:, None]
    kept = (torch.rand_like(p_drafted) <= p_drafted / q_drafted) & drafted
    accepted = kept.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(p.shape[0], device=p.device)
    target_next = p[rows, accepted]
    rejected = accepted < lengths
    residual = (target_next - q[rows, accepted.clamp(max=k - 1)]).clamp(min=0)  # k >= 1: a step with drafts
    residual = torch.where(rejected[:, None] & (residual.sum(dim=-1, keepdim=True) > 0), residual, target_next)
    next_tokens = torch.multinomial(residual / residual.sum(dim=-1, keepdim=True), num_samples=1).squeeze(1)
    verified = torch.cat([tokens, tokens.new_zeros(p.shape[0], 1)], dim=1)
    verified[rows, accepted] = next_tokens
    return verified, accepted


@dataclass
class Step:
    """One verify step: its width, what each row fed before its drafts, and the drafter forwards spent for it."""

    width: int
    ahead: list[int]  # per row: committed tokens past the cache when the step began
    anchors: list[int]
    drafter_forwards: int

    def fed(self, row: int) -> int:
        return min(self.ahead[row], self.width)

    def fresh(self, row: int) -> bool:
        """The row's newest token is in the forward, so the step judges its drafts and commits new tokens."""
        return self.ahead[row] <= self.width


def _pick(processed: torch.Tensor, do_sample: bool) -> torch.LongTensor:
    return torch.multinomial(processed.softmax(-1), 1) if do_sample else processed.argmax(-1, keepdim=True)


class BatchedSpeculativeLoop:
    """generate()'s decoding method for a batch with a drafter, in place of the target's `_sample` for the call.

    `max_lead`: how many committed tokens past the batch's shortest run a row keeps (None: all it verified; 0: every
    row advances by the shortest run, the design this one replaced, kept to measure against). `cache_passed`: the
    caller passed the cache in, so it sees it afterwards. On a spread target (`agreement`) every step is rank 0's:
    its drafts and width (one collective a step), its sampled tokens, and its stops when a criterion can differ per
    rank."""

    def __init__(
        self,
        target: HyperConnectionTarget,
        drafting,
        capture: FeatureCapture,
        policy: DraftPolicy,
        stats: GenerationStats,
        max_lead: int | None = None,
        cache_passed: bool = False,
        agreement: RankAgreement | None = None,
    ):
        self.target, self.drafting, self.capture, self.policy, self.stats = target, drafting, capture, policy, stats
        self.schedule = BatchSchedule(policy)
        self.agreement = agreement or RankAgreement(None)
        self.max_lead, self.cache_passed = max_lead, cache_passed

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
            cache.activate_past_recording(recurrent_states_to_keep=self.policy.max_draft + MAX_LEAD)
        else:
            cache.activate_past_recording()
        config = generation_config
        self.config, self.logits_processor, self.criteria = config, logits_processor, stopping_criteria
        pad = config._pad_token_tensor
        self.pad_id = int(pad) if pad is not None else 0
        has_eos = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        returned = config.return_dict_in_generate
        keep = (bool(returned and config.output_scores), bool(returned and config.output_logits))
        self.rows = rows = BatchRows(input_ids, config.max_length, self.pad_id, has_eos, keep)
        self.pick = TokenPicker(logits_processor, bool(config.do_sample))
        self.drafts = BatchDrafts(rows.batch, self.policy.max_draft, input_ids.device, self.pad_id)

        self.features_start = cached_length(cache)
        outputs = model._prefill(input_ids, config, model_kwargs)
        self.stats.target_forwards += 1
        model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
        logits = outputs.logits[:, -1].to(torch.float32, copy=True).to(input_ids.device)
        processed = logits_processor(input_ids, logits)
        tokens = self._sampled(lambda: _pick(processed, bool(config.do_sample)), (rows.batch, 1))
        self.features = [self.capture.features()]  # pieces of the features from `features_start` on, joined to draft
        del outputs
        for row in range(rows.batch):
            rows.commit(row, tokens[row].tolist())
            rows.record(row, processed[row : row + 1], logits[row : row + 1])
        self._check_stops()
        cache_length = input_ids.shape[1]
        self.context_end = [cache_length] * rows.batch  # per row: its target features are valid before this column

        with model._optimize_model_for_decode():  # as transformers' decoding loops (batched_mm on CUDA MoE)
            # Once every row holds its output, one more forward fills the cache (and the last scores) as plain decoding
            # leaves them, only where the caller sees them
            cache_seen = self.cache_passed or bool(config.return_dict_in_generate)
            while not rows.complete(cache_length, cache_seen):
                step = self._draft(cache_length)
                outputs, candidates = self._verify(model, step, cache_length, model_kwargs)
                logits = outputs.logits[:, -step.width :].to(torch.float32, copy=True).to(input_ids.device)
                processed = self._process(logits, candidates, cache_length)
                verified, accepted = self._judge(step, processed)
                cache_length, model_kwargs = self._advance(
                    model, step, cache_length, verified, accepted, processed, logits, outputs, model_kwargs
                )
                del outputs
        self.stats.row_taus = rows.row_taus()
        final = rows.final_length
        sequences = rows.sequences(final)
        if not config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=rows.stacked(rows.scores, final) if keep[0] else None,
            logits=rows.stacked(rows.raw_logits, final) if keep[1] else None,
            **{_OUTPUT_CACHE_FIELD: cache},
        )

    def _draft(self, cache_length: int) -> Step:
        """The step's drafts and width: this process's (`_draft_here`), or on a spread target rank 0's."""
        if not self.agreement.spread:
            return self._draft_here(cache_length)
        rows, drafts = self.rows, self.drafts
        mine: list[Step] = []

        def drafted() -> torch.Tensor:
            mine.append(step := self._draft_here(cache_length))
            usable = [drafts.usable(r, step.anchors[r]) for r in range(rows.batch)]
            return torch.cat([torch.tensor([step.width, *usable]), drafts.tokens.cpu().reshape(-1)])

        size = 1 + rows.batch + drafts.tokens.numel()
        state = sequence_state(rows.ids, rows.committed)
        decision = self.agreement.decide("Drafting", drafted, size, state=state)
        step = mine[0]
        step.width = int(decision[0])
        usable = decision[1 : 1 + rows.batch].tolist()
        drafts.adopt(decision[1 + rows.batch :].reshape(drafts.tokens.shape), usable, step.anchors)
        return step

    def _draft_here(self, cache_length: int) -> Step:
        """Redraft the rows whose anchor moved, and choose the verify width."""
        rows = self.rows
        ahead = rows.ahead(cache_length)
        anchors = [cache_length if rows.ended(r) else rows.committed[r] - 1 for r in range(rows.batch)]
        final = rows.final_length
        if final is not None and min(rows.committed) >= final:  # every column is known: feed the rest, no drafts
            return Step(final - 1 - cache_length, ahead, anchors, 0)
        room = self.config.max_length - 2 - cache_length  # no row may commit past max_length
        most = min(self.policy.draft_length, room)
        if most <= 0:
            return Step(1, ahead, anchors, 0)
        if not self.policy.should_draft():
            self.stats.skipped_steps += 1
            return Step(1, ahead, anchors, 0)
        drafting = [
            not rows.ended(r) and self.context_end[r] == anchors[r] and self.drafts.stale(r, anchors[r])
            for r in range(rows.batch)
        ]
        forwards = 0
        if any(drafting):
            request = DraftRequest(
                features=self._joined_features(),
                first_column=self.features_start,
                anchors=anchors,
                ids=rows.ids,
                drafting=drafting,
                num_tokens=[most] * rows.batch,
                cache_length=cache_length,
                pick=self.pick,
                schedule=self.schedule,
                pad_id=self.pad_id,
            )
            drafted = self.drafting.propose(request)
            self.drafts.store(drafted, anchors)
            forwards = drafted.drafter_forwards
            keep_from = self.drafting.first_needed_column(cache_length)
            self.features = [self.features[0][:, keep_from - self.features_start :]]
            self.features_start = keep_from
        limiting = [not rows.ended(r) for r in range(rows.batch)]
        width = 1 + self.drafts.cut(self.policy, ahead, anchors, limiting, min(most + MAX_LEAD, room))
        return Step(width, ahead, anchors, forwards)

    def _verify(self, model: PreTrainedModel, step: Step, cache_length: int, model_kwargs: dict):
        """One target forward over each row's committed tokens past the cache, then its drafts; and the ids it saw."""
        ids = self.rows.ids
        block = ids[:, cache_length : cache_length + step.width].clone()
        usable = [self.drafts.usable(r, step.anchors[r]) for r in range(self.rows.batch)]
        if max(usable):
            offsets = (
                torch.arange(step.width, device=ids.device)[None]
                - torch.tensor([step.fed(r) for r in range(self.rows.batch)], device=ids.device)[:, None]
            )
            in_draft = (offsets >= 0) & (offsets < torch.tensor(usable, device=ids.device)[:, None])
            drafted = self.drafts.tokens.gather(1, offsets.clamp(0, self.drafts.tokens.shape[1] - 1))
            block = torch.where(in_draft, drafted, block)
        candidates = torch.cat([ids[:, :cache_length], block], dim=-1)
        k = step.width - 1
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
        return model(**inputs, return_dict=True), candidates

    def _process(self, logits: torch.Tensor, candidates: torch.LongTensor, cache_length: int) -> torch.Tensor:
        """The logits processors at every position, each seeing the batch's tokens before it."""
        processed = logits.clone()
        if len(self.logits_processor):
            for i in range(logits.shape[1]):
                processed[:, i] = self.logits_processor(candidates[:, : cache_length + 1 + i], processed[:, i])
        return processed

    def _judge(self, step: Step, processed: torch.Tensor) -> tuple[torch.LongTensor, torch.LongTensor]:
        """Each fresh row's verified tokens from its anchor on [B, k + 1] and accepted drafts [B]."""
        batch, device = self.rows.batch, processed.device
        fed = torch.tensor([step.fed(r) for r in range(batch)], device=device)
        lengths = [
            min(step.width - step.fed(r), self.drafts.usable(r, step.anchors[r])) if step.fresh(r) else 0
            for r in range(batch)
        ]
        k = max(lengths)
        columns = (fed[:, None] - 1 + torch.arange(k + 1, device=device)[None]).clamp(max=step.width - 1)
        from_anchor = processed.gather(1, columns[..., None].expand(-1, -1, processed.shape[-1]))

        def judged() -> torch.LongTensor:
            if k:
                lengths_tensor = torch.tensor(lengths, device=device)
                if self.config.do_sample:
                    logits = self.drafts.logits[:, :k]
                    verified, accepted = judge_sampled(from_anchor, self.drafts.tokens[:, :k], logits, lengths_tensor)
                else:
                    verified, accepted = judge_greedy(from_anchor, self.drafts.tokens[:, :k], lengths_tensor)
            else:
                verified = _pick(from_anchor[:, 0], bool(self.config.do_sample))
                accepted = torch.zeros(batch, dtype=torch.long, device=device)
            return torch.cat([accepted[:, None], verified], dim=1)

        both = self._sampled(judged, (batch, k + 2))
        return both[:, 1:], both[:, 0]

    def _advance(self, model, step, cache_length, verified, accepted, processed, logits, outputs, model_kwargs):
        """Commit each fresh row's verified tokens, show the criteria the new lengths, roll the cache back to the
        shortest run of committed inputs, record scores, and keep the features the drafter needs next."""
        rows, width = self.rows, step.width
        accepted_list, verified_list = accepted.tolist(), verified.tolist()
        learns = width > 1 or step.drafter_forwards  # the policy learns from every step it drafted or verified for
        generating = [row for row in range(rows.batch) if not rows.stopped(row)] if learns else []
        slowest = rows.slowest(generating) if generating else None  # the batch's pace is its slowest row's
        reach = []  # per row: positions of this forward whose inputs (and all before) the row committed
        for row in range(rows.batch):
            if step.fresh(row) and not rows.ended(row):
                a = accepted_list[row]
                rows.commit(row, verified_list[row][: a + 1])
                reach.append(step.fed(row) + a)
            else:
                reach.append(width)
            self._record(row, cache_length + reach[row], processed, logits, cache_length)
        for row, stop in self._check_stops().items():
            if rows.ended(row):  # padding from `stop` on: inputs past its stop token are not the row's
                reach[row] = min(reach[row], stop - cache_length)
        shortest = min(reach)
        new_length = cache_length + shortest
        final = rows.final_length
        if final is not None and min(rows.committed) >= final:
            new_length = min(new_length, final - 1)
        if self.max_lead is not None:
            self._truncate_leads(new_length + 1 + self.max_lead)
        for row in range(rows.batch):
            self.context_end[row] = min(cache_length + reach[row], rows.committed[row] - 1)
        if new_length < cache_length + width:
            model_kwargs[CACHE_ARGUMENT].crop(new_length - cache_length - width)
        self._keep_features(cache_length, self.capture.features()[:, :width])
        model_kwargs = model._update_model_kwargs_for_generation(
            outputs, model_kwargs, num_new_tokens=new_length - cache_length
        )
        rows.history.append(list(rows.committed))
        if width > 1:
            self.stats.accepted_per_step.append(shortest - 1)
            self.stats.proposed_per_step.append(width - 1)
        if learns:
            advanced = shortest if slowest is None else rows.slowest(generating) - slowest
            self.policy.record_batch(self._step_record(step, accepted_list, advanced))
        return new_length, model_kwargs

    def _joined_features(self) -> torch.Tensor:
        """The features from `features_start` on, as one tensor (joined once, when the drafter next reads them)."""
        if len(self.features) > 1:
            self.features = [torch.cat(self.features, dim=1)]
        return self.features[0]

    def _keep_features(self, cache_length: int, new: torch.Tensor) -> None:
        """After a verify forward at `cache_length`: what was kept up to that column, then the forward's features
        (the columns past it come again from the forward that feeds them again)."""
        kept, column = [], self.features_start
        for piece in self.features:
            if column >= cache_length:
                break
            kept.append(piece[:, : cache_length - column])
            column += piece.shape[1]
        self.features = [*kept, new]

    def _step_record(self, step: Step, accepted: list[int], advanced: int) -> BatchStepRecord:
        """Per row still drafting: the confidences the width was chosen from, its drafts verified and accepted; and
        how far the batch's slowest row advanced (`advanced`: the batch ends with that row, so a row's lead counts
        only once the others catch up)."""
        records = []
        for row, confidences in enumerate(self.drafts.row_confidences):
            if self.rows.ended(row) or not step.fresh(row):
                continue
            verified = min(len(confidences), step.width - step.ahead[row])
            if verified:
                records.append(RowStep(confidences, verified, accepted[row]))
        return BatchStepRecord(records, advanced, step.width - 1, step.drafter_forwards)

    def _record(self, row: int, reach: int, processed: torch.Tensor, logits: torch.Tensor, cache_length: int) -> None:
        """Scores of the row's new columns up to `reach`, from positions whose inputs it committed."""
        rows = self.rows
        last = min(reach, rows.committed[row] - 1)
        first = rows.recorded(row) + 1
        if (rows.keep_scores or rows.keep_logits) and first <= last:
            span = slice(first - 1 - cache_length, last - cache_length)
            rows.record(row, processed[row, span], logits[row, span])

    def _truncate_leads(self, most: int) -> None:
        """Drop what rows committed past `most` columns, with its scores (the shortest-run design keeps none past the
        batch's run)."""
        rows = self.rows
        for row in range(rows.batch):
            if not rows.ended(row) and rows.committed[row] > most:
                rows.ids[row, most:] = self.pad_id
                rows.committed[row] = most
                del rows.scores[row][most - rows.prompt_width :], rows.raw_logits[row][most - rows.prompt_width :]

    def _sampled(self, draw: Callable[[], torch.LongTensor], shape: tuple[int, int]) -> torch.LongTensor:
        """`draw()`'s tokens (of `shape`); when sampling on a spread target, rank 0's (one collective), so every rank
        keeps the same tokens whatever it would have drawn."""
        if not (self.agreement.spread and self.config.do_sample):
            return draw()
        size = shape[0] * shape[1]
        decision = self.agreement.decide("Sampling", lambda: draw().reshape(-1), size, everyone_computes=False)
        return decision.reshape(shape).to(self.rows.ids.device)

    def _check_stops(self) -> dict[int, int]:
        """Show the criteria the lengths every row now holds (`BatchRows.check`); {row: stop length} of the rows
        they stopped. On a spread target whose criteria can differ per rank, rank 0's criteria decide."""
        rows = self.rows
        if not self.agreement.spread or stops_alike(self.criteria):
            return rows.check(self.criteria, rows.scores_up_to)

        def checked() -> torch.Tensor:
            stops = rows.check(self.criteria, rows.scores_up_to)
            return torch.tensor([rows.checked, *(stops.get(row, -1) for row in range(rows.batch))])

        what = "Checking the stopping criteria"
        decision = self.agreement.decide(what, checked, 1 + rows.batch, everyone_computes=False)
        stops = {row: int(length) for row, length in enumerate(decision[1:].tolist()) if length >= 0}
        if not self.agreement.decides:
            rows.adopt(stops, int(decision[0]))
        return stops


def batch_lead(drafter: PreTrainedModel) -> int | None:
    """`drafter.generation_config.batch_max_lead`: committed tokens a row of a batch keeps past the batch's shortest
    run (unset: all it verified; 0: the shortest-run design, for comparison)."""
    lead = getattr(drafter.generation_config, "batch_max_lead", None)
    if lead is not None and (not isinstance(lead, int) or lead < 0):
        raise ValueError(f"`batch_max_lead` must be a non-negative int or None, got {lead!r}.")
    return lead


def batched_generate(
    original_generate, request, target: HyperConnectionTarget, cache: Cache, drafter, policy, stats, agreement
):
    """Run `request` (a `GenerateRequest` of several rows) through generate() with the batched loop as its decoding
    method, on `cache`; the cache is the family's stock one again afterwards."""
    repeats = request.generation_config.num_return_sequences or 1
    padding = left_padding(request.attention_mask).repeat_interleave(repeats)
    drafting = make_drafting(drafter, target, padding.tolist(), policy.max_draft)
    passed = request.cache is not None
    loop = BatchedSpeculativeLoop(target, drafting, None, policy, stats, batch_lead(drafter), passed, agreement)
    arguments = request.arguments | {"assistant_model": None}
    kwargs = request.kwargs | {CACHE_ARGUMENT: cache, "cache_implementation": None}
    try:
        with (
            target.capture(drafting.feature_layers) as capture,
            target.verify_as_decoding(request.input_ids.shape[1], request.positions_may_lag_cache, cache),
            call_scope.methods(target.model, _sample=loop),
        ):
            loop.capture = capture
            return original_generate(target.model, **arguments, **kwargs)
    finally:
        target.release_cache(cache)
