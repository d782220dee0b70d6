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
stopping criteria each length once, crop, keep the features the drafter needs). What to draft and when is the call's
`SpeculativeCandidateGenerator`'s, as for one row: its draft budget, its target features, its proposers' schedule and
its stats. Host work per step does not grow with the rows: each part moves what it needs between host and device in
one transfer for the whole batch. Rows that stopped keep taking
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
from .batched_drafting import BatchDrafts, BlockDrafting, RowByRowDrafting, RowContexts, make_drafting
from .candidate_generator import SpeculativeCandidateGenerator, TokenPicker
from .draft_policy import BatchStepRecord, RowStep
from .rank_agreement import RankAgreement, TokenDigest, floats_as_int64, int64_as_floats, stops_alike
from .request_checks import left_padding
from .target_base import HyperConnectionTarget
from .transformers_compat import CACHE_ARGUMENT, STOCK_LINEAR_ATTENTION_ROLLBACK, cached_length

# How many positions past a whole block a verify forward may reach, so that rows ahead verify their drafts too (a row
# further ahead waits, fed what it committed): benchmarks/batch_design_sim.py and docs/batched.md weigh the choice.
EXTRA_VERIFY_WIDTH = 4
_OUTPUT_CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


def judge_greedy(
    processed: torch.Tensor, columns: torch.LongTensor, tokens: torch.LongTensor, lengths: torch.LongTensor
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Each row's verified tokens [B, k + 1] (the target's choice at `columns` [B, k + 1] of `processed` [B, width,
    V], from the row's anchor on) and accepted drafts [B] (of its first `lengths[r]` drafts `tokens` [B, k])."""
    chosen = processed.argmax(dim=-1).gather(1, columns)
    k = tokens.shape[1]
    drafted = torch.arange(k, device=chosen.device)[None] < lengths[:, None]
    matches = (tokens.to(chosen.device) == chosen[:, :k]) & drafted
    return chosen, matches.long().cumprod(dim=1).sum(dim=1)


def judge_sampled(
    processed: torch.Tensor,
    columns: torch.LongTensor,
    tokens: torch.LongTensor,
    logits: torch.Tensor,
    lengths: torch.LongTensor,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Speculative sampling per row (the target's distributions at `columns` of `processed`, as for `judge_greedy`;
    q from the drafter's processed `logits` [B, k, V]): draft j is kept with probability min(1, p/q) while the ones
    before it were; the first rejected one is replaced by a draw from max(p - q, 0), and a row that kept all its
    drafts draws its bonus token from p. Returns each row's tokens [B, k + 1] (valid up to its accepted drafts + 1)
    and accepted [B]."""
    k = tokens.shape[1]
    p = processed.softmax(dim=-1)
    q = logits.to(p.device).softmax(dim=-1)
    tokens = tokens.to(p.device)
    rows = torch.arange(p.shape[0], device=p.device)
    p_drafted = p[rows[:, None], columns[:, :k], tokens]
    q_drafted = q.gather(-1, tokens[..., None]).squeeze(-1)
    drafted = torch.arange(k, device=p.device)[None] < lengths[:, None]
    kept = (torch.rand_like(p_drafted) <= p_drafted / q_drafted) & drafted
    accepted = kept.long().cumprod(dim=1).sum(dim=1)
    target_next = p[rows, columns[rows, accepted]]
    rejected = accepted < lengths
    residual = (target_next - q[rows, accepted.clamp(max=k - 1)]).clamp(min=0)  # k >= 1: a step with drafts
    residual = torch.where(rejected[:, None] & (residual.sum(dim=-1, keepdim=True) > 0), residual, target_next)
    next_tokens = torch.multinomial(residual / residual.sum(dim=-1, keepdim=True), num_samples=1).squeeze(1)
    verified = torch.cat([tokens, tokens.new_zeros(p.shape[0], 1)], dim=1)
    verified[rows, accepted] = next_tokens
    return verified, accepted


@dataclass
class Step:
    """One verify step: its width, each row's committed columns past the cache when it began (`uncached`, the anchor
    included: 1 means the row feeds only its anchor), each row's anchor column, and the drafter forwards spent."""

    width: int
    uncached: list[int]
    anchors: list[int]
    drafter_forwards: int

    def fed(self, row: int) -> int:
        """Committed tokens the row feeds before its drafts."""
        return min(self.uncached[row], self.width)

    def fresh(self, row: int) -> bool:
        """The row's newest token is in the forward, so the step judges its drafts and commits new tokens."""
        return self.uncached[row] <= self.width


def _pick(processed: torch.Tensor, do_sample: bool) -> torch.LongTensor:
    return torch.multinomial(processed.softmax(-1), 1) if do_sample else processed.argmax(-1, keepdim=True)


class BatchedSpeculativeLoop:
    """generate()'s decoding method for a batch with a drafter, in place of the target's `_sample` for the call.

    `generator`: the call's candidate logic (its proposer drafts rows: `batched_drafting.py`). `cache_passed`: the
    caller passed the cache in, so it sees it afterwards. On a spread target (`agreement`) every step is rank 0's:
    its drafts, width and confidences (one collective a step, which also checks that every rank committed the same
    tokens, and once more after the last step), its sampled tokens, and its stops when a criterion can differ per
    rank."""

    def __init__(
        self,
        target: HyperConnectionTarget,
        generator: SpeculativeCandidateGenerator,
        cache_passed: bool = False,
        agreement: RankAgreement | None = None,
    ):
        self.target, self.generator = target, generator
        self.policy, self.stats = generator.policy, generator.stats
        self.agreement = agreement or RankAgreement(None)
        self.cache_passed = cache_passed
        self.digest = TokenDigest()
        chooser = generator.chooser
        self.contexts = None if chooser is None else RowContexts(chooser, generator.proposer.padding)

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
            cache.activate_past_recording(recurrent_states_to_keep=self.policy.max_draft + EXTRA_VERIFY_WIDTH)
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
        self.generator.pick = TokenPicker(logits_processor, bool(config.do_sample))
        self.drafts = BatchDrafts(rows.batch, self.policy.max_draft, input_ids.device, self.pad_id, config.do_sample)

        cache_length, model_kwargs = self._prefill(model, input_ids, model_kwargs)
        with model._optimize_model_for_decode():  # as transformers' decoding loops (batched_mm on CUDA MoE)
            # Once every row holds its output, one more forward fills the cache (and the last scores) as plain decoding
            # leaves them, only where the caller sees them
            cache_seen = self.cache_passed or bool(config.return_dict_in_generate)
            while not rows.complete(cache_length, cache_seen):
                step = self._draft(cache_length)
                outputs, candidates = self._verify(model, step, cache_length, model_kwargs)
                logits = self._step_logits(outputs, step.width, input_ids.device)
                processed = self._process(logits, candidates, cache_length)
                verified, accepted = self._judge(step, processed)
                cache_length, model_kwargs = self._advance(
                    model, step, cache_length, verified, accepted, processed, logits, outputs, model_kwargs
                )
                del outputs
        self._agree_on_tokens("Finishing the batch")
        self.stats.row_taus = rows.row_taus()
        final = rows.final_length
        sequences = rows.sequences(final)
        if not config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=rows.scores.up_to(final - rows.prompt_width) if keep[0] else None,
            logits=rows.raw_logits.up_to(final - rows.prompt_width) if keep[1] else None,
            **{_OUTPUT_CACHE_FIELD: cache},
        )

    def _prefill(self, model: PreTrainedModel, input_ids: torch.LongTensor, model_kwargs: dict) -> tuple[int, dict]:
        """The prompt's forward, each row's first new token and the features the drafter starts from; the cache
        length and the model's inputs after it."""
        rows, config = self.rows, self.config
        self.generator.start(cached_length(model_kwargs[CACHE_ARGUMENT]))
        outputs = model._prefill(input_ids, config, model_kwargs)
        self.stats.target_forwards += 1
        model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
        logits = outputs.logits[:, -1].to(torch.float32, copy=True).to(input_ids.device)
        processed = self.logits_processor(input_ids, logits)
        tokens = self._drawn_on_rank_zero(lambda: _pick(processed, bool(config.do_sample)), (rows.batch, 1))
        self.generator.keep_forward_features()
        del outputs
        self._commit(tokens, [1] * rows.batch)
        for row in range(rows.batch):
            rows.record(row, processed[row : row + 1], logits[row : row + 1])
        self._check_stops()
        cache_length = input_ids.shape[1]
        self.context_end = [cache_length] * rows.batch  # per row: its target features are valid before this column
        return cache_length, model_kwargs

    def _draft(self, cache_length: int) -> Step:
        """The step's drafts and width: this process's (`_draft_here`), or on a spread target rank 0's, with the
        confidences its width was chosen from (so every rank's schedule learns alike)."""
        if not self.agreement.spread:
            return self._draft_here(cache_length)
        rows, drafts = self.rows, self.drafts
        mine: list[Step] = []

        def drafted() -> torch.Tensor:  # the cut's confidences: each row's first `lengths[r]` of the table
            mine.append(step := self._draft_here(cache_length))
            usable = [drafts.usable(r, step.anchors[r]) for r in range(rows.batch)]
            lengths = [len(confidences) for confidences in drafts.cut_confidences]
            head = torch.tensor([step.width, *usable, *lengths, *drafts.copied])
            return torch.cat([head, drafts.tokens.cpu().reshape(-1), floats_as_int64(drafts.confidences)])

        head = 1 + 3 * rows.batch
        size = head + drafts.tokens.numel() + drafts.confidences.numel()
        decision = self.agreement.decide("Drafting", drafted, size, state=self.digest.state(rows.committed))
        step = mine[0]
        step.width = int(decision[0])
        usable = decision[1 : 1 + rows.batch].tolist()
        lengths = decision[1 + rows.batch : 1 + 2 * rows.batch].tolist()
        copied = [bool(flag) for flag in decision[1 + 2 * rows.batch : head].tolist()]
        tokens_end = head + drafts.tokens.numel()
        drafts.adopt(decision[head:tokens_end].reshape(drafts.tokens.shape), usable, step.anchors, copied)
        table = int64_as_floats(decision[tokens_end:]).reshape(drafts.confidences.shape).tolist()
        drafts.cut_confidences = [row[:n] for row, n in zip(table, lengths, strict=True)]
        return step

    def _draft_here(self, cache_length: int) -> Step:
        """Redraft the rows whose anchor moved, and choose the verify width."""
        rows, generator = self.rows, self.generator
        uncached = rows.uncached(cache_length)
        anchors = [cache_length if rows.ended(r) else rows.committed[r] - 1 for r in range(rows.batch)]
        self.drafts.cut_confidences = [[] for _ in range(rows.batch)]
        final = rows.final_length
        if final is not None and min(rows.committed) >= final:  # every column is known: feed the rest, no drafts
            return Step(final - 1 - cache_length, uncached, anchors, 0)
        room = self.config.max_length - 2 - cache_length  # no row may commit past max_length
        most, runs_drafter = generator.draft_budget(room)
        # A batch copies only on the steps its policy drafts: a row's copy gains the batch nothing until its slowest
        # row gains too, and every drafted position costs every row (docs/batched.md)
        if not runs_drafter:
            if most > 0:
                generator.skip()
            return Step(1, uncached, anchors, 0)
        needs = [
            not rows.ended(r) and self.context_end[r] == anchors[r] and self.drafts.stale(r, anchors[r])
            for r in range(rows.batch)
        ]
        copies = self._copies_first(anchors, needs, most) if self.contexts is not None else {}
        drafting = [need and r not in copies for r, need in enumerate(needs)]
        forwards = 0
        if any(drafting):
            drafted = generator.draft_rows(anchors, rows.ids, drafting, most, cache_length, self.pad_id)
            self.drafts.store(drafted, anchors)
            forwards = drafted.drafter_forwards
            if self.contexts is not None:
                copies |= self._copies_after(drafted, drafting, most)
        if copies:
            offers, chooser = self.contexts.offers, generator.chooser
            chains = {row: offers[row].chain[:n] for row, n in copies.items()}
            chances = {row: chooser.copy_acceptance(offers[row].suffix, n) for row, n in copies.items()}
            self.drafts.store_copies(chains, chances, anchors)
        limiting = [not rows.ended(r) for r in range(rows.batch)]
        width = 1 + self.drafts.cut(self.policy, uncached, anchors, limiting, min(most + EXTRA_VERIFY_WIDTH, room))
        return Step(width, uncached, anchors, forwards)

    def _copies_first(self, anchors: list[int], needs: list[bool], most: int) -> dict[int, int]:
        """Each row that needs new drafts is offered the context's chain at its anchor; {row: copied drafts to verify}
        of those whose copy the chooser takes before the drafter's forward."""
        rows, contexts, chooser = self.rows, self.contexts, self.generator.chooser
        contexts.catch_up(rows.ids, rows.committed, [not rows.ended(r) for r in range(rows.batch)])
        copies = {}
        for row in (r for r, need in enumerate(needs) if need):
            offer = contexts.offer(row, anchors[row], most)
            copied = chooser.copies_first(len(offer.chain), offer.suffix, most)
            if copied:
                copies[row] = copied
        return copies

    def _copies_after(self, drafted, drafting: list[bool], most: int) -> dict[int, int]:
        """{row: copied drafts to verify} of the rows that drafted and whose copy the chooser takes over the drafter's
        chain, judged from the chain's first confidence."""
        first = drafted.confidences[:, :1].tolist()  # [] for every row when the drafter's heads cut all blocks
        tokens = drafted.tokens.tolist()
        copies = {}
        for row in (r for r, drafts in enumerate(drafting) if drafts):
            offer = self.contexts.offers[row]
            offer.drafted = tokens[row][: drafted.lengths[row]]
            confidence = first[row][0] if offer.drafted else None
            offer.first_confidence = confidence or 0.0
            copied = self.generator.chooser.copies_after(confidence, most, len(offer.chain), offer.suffix)
            if copied:
                copies[row] = copied
        return copies

    def _verify(self, model: PreTrainedModel, step: Step, cache_length: int, model_kwargs: dict):
        """One target forward over each row's committed tokens past the cache, then its drafts; and the ids it saw."""
        ids, batch = self.rows.ids, self.rows.batch
        block = ids[:, cache_length : cache_length + step.width].clone()
        usable = [self.drafts.usable(r, step.anchors[r]) for r in range(batch)]
        if max(usable):
            fed_and_usable = torch.tensor([[step.fed(r) for r in range(batch)], usable], device=ids.device)
            offsets = torch.arange(step.width, device=ids.device)[None] - fed_and_usable[0][:, None]
            in_draft = (offsets >= 0) & (offsets < fed_and_usable[1][:, None])
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
        self.generator.forward_start = cache_length
        return model(**inputs, return_dict=True), candidates

    def _step_logits(self, outputs, width: int, device: torch.device) -> torch.Tensor:
        """The verify forward's logits at its `width` positions, in fp32 on the ids' device: a view when they are
        already (the scores kept point into them); a copy when the model returned more positions, so what is kept
        does not hold the rest alive."""
        logits = outputs.logits
        copy = logits.shape[1] != width
        return logits[:, -width:].to(device=device, dtype=torch.float32, copy=copy)

    def _process(self, logits: torch.Tensor, candidates: torch.LongTensor, cache_length: int) -> torch.Tensor:
        """The logits processors at every position, each seeing the batch's tokens before it: in place, unless the
        raw logits are kept too (one copy then)."""
        if not len(self.logits_processor):
            return logits
        processed = logits.clone() if self.rows.keep_logits else logits
        for i in range(logits.shape[1]):
            processed[:, i] = self.logits_processor(candidates[:, : cache_length + 1 + i], processed[:, i])
        return processed

    def _judge(self, step: Step, processed: torch.Tensor) -> tuple[torch.LongTensor, torch.LongTensor]:
        """Each fresh row's verified tokens from its anchor on [B, k + 1] and accepted drafts [B]."""
        batch, device = self.rows.batch, processed.device
        fed = [step.fed(r) for r in range(batch)]
        lengths = self._judged_drafts(step)
        k = max(lengths)

        def judged() -> torch.LongTensor:
            fed_and_lengths = torch.tensor([fed, lengths], device=device)
            columns = (fed_and_lengths[0][:, None] - 1 + torch.arange(k + 1, device=device)[None]).clamp(
                max=step.width - 1
            )
            tokens = self.drafts.tokens[:, :k]
            if not k:
                anchor_scores = processed[torch.arange(batch, device=device), columns[:, 0]]
                verified = _pick(anchor_scores, bool(self.config.do_sample))
                accepted = torch.zeros(batch, dtype=torch.long, device=device)
            elif self.config.do_sample:
                logits = self.drafts.q_logits(k, processed.shape[-1])
                verified, accepted = judge_sampled(processed, columns, tokens, logits, fed_and_lengths[1])
            else:
                verified, accepted = judge_greedy(processed, columns, tokens, fed_and_lengths[1])
            return torch.cat([accepted[:, None], verified], dim=1)

        both = self._drawn_on_rank_zero(judged, (batch, k + 2))
        return both[:, 1:], both[:, 0]

    def _advance(self, model, step, cache_length, verified, accepted, processed, logits, outputs, model_kwargs):
        """Commit each fresh row's verified tokens, show the criteria the new lengths, roll the cache back to the
        shortest run of committed inputs, record scores, and keep the features the drafter needs next."""
        rows, width = self.rows, step.width
        accepted_list = accepted.tolist()
        learns = width > 1 or step.drafter_forwards  # the policy learns from every step it drafted or verified for
        generating = [row for row in range(rows.batch) if not rows.stopped(row)] if learns else []
        slowest = rows.slowest(generating) if generating else None  # the batch's pace is its slowest row's
        judged = [step.fresh(row) and not rows.ended(row) for row in range(rows.batch)]
        self._count_sources(step, accepted_list)
        self._commit(verified, [a + 1 if fresh else 0 for a, fresh in zip(accepted_list, judged, strict=True)])
        # per row: positions of this forward whose inputs (and all before) the row committed
        reach = [step.fed(row) + accepted_list[row] if judged[row] else width for row in range(rows.batch)]
        for row in range(rows.batch):
            self._record(row, cache_length + reach[row], processed, logits, cache_length)
        for row, stop in self._check_stops().items():
            if rows.ended(row):  # padding from `stop` on: inputs past its stop token are not the row's
                reach[row] = min(reach[row], stop - cache_length)
        shortest = min(reach)
        new_length = cache_length + shortest
        final = rows.final_length
        if final is not None and min(rows.committed) >= final:
            new_length = min(new_length, final - 1)
        for row in range(rows.batch):
            self.context_end[row] = min(cache_length + reach[row], rows.committed[row] - 1)
        if new_length < cache_length + width:
            model_kwargs[CACHE_ARGUMENT].crop(new_length - cache_length - width)
        self.generator.keep_forward_features()
        model_kwargs = model._update_model_kwargs_for_generation(
            outputs, model_kwargs, num_new_tokens=new_length - cache_length
        )
        rows.history.append(list(rows.committed))
        record = None
        if learns:
            advanced = shortest if slowest is None else rows.slowest(generating) - slowest
            record = self._step_record(step, accepted_list, advanced)
        self.generator.record_rows(width - 1, shortest - 1, record)
        return new_length, model_kwargs

    def _commit(self, tokens: torch.LongTensor, counts: list[int]) -> None:
        """Commit each row's first `counts[r]` of `tokens` (on a spread target, into the ranks' digest too)."""
        self.rows.commit(tokens, counts)
        if self.agreement.spread:
            held = tokens.tolist()
            self.digest.add([row[:count] for row, count in zip(held, counts, strict=True)])

    def _step_record(self, step: Step, accepted: list[int], advanced: int) -> BatchStepRecord:
        """Per row still drafting: the confidences the width was chosen from, its drafts verified and accepted; and
        how far the batch's slowest row advanced (`advanced`: the batch ends with that row, so a row's lead counts
        only once the others catch up)."""
        records = []
        for row, confidences in enumerate(self.drafts.cut_confidences):
            if self.rows.ended(row) or not step.fresh(row):
                continue
            verified = min(len(confidences), step.width - step.uncached[row])
            if verified:
                copied = self.drafts.copied[row]  # a copied chain's chances are no drafter confidences
                records.append(RowStep([] if copied else confidences, verified, accepted[row]))
        return BatchStepRecord(records, advanced, step.width - 1, step.drafter_forwards)

    def _judged_drafts(self, step: Step) -> list[int]:
        """Per row, the drafts the step judges: those of a fresh row that fit in the forward after its fed tokens."""
        return [
            min(step.width - step.fed(r), self.drafts.usable(r, step.anchors[r])) if step.fresh(r) else 0
            for r in range(self.rows.batch)
        ]

    def _count_sources(self, step: Step, accepted: list[int]) -> None:
        """Each judged row's accepted drafts under where they came from (`GenerationStats.accepted_by_source`)."""
        for row, judged in enumerate(self._judged_drafts(step)):
            if judged and not self.rows.ended(row):
                source = "context" if self.drafts.copied[row] else "drafter"
                self.stats.accepted_by_source[source].append(accepted[row])

    def _record(self, row: int, reach: int, processed: torch.Tensor, logits: torch.Tensor, cache_length: int) -> None:
        """Scores of the row's new columns up to `reach`, from positions whose inputs it committed."""
        rows = self.rows
        last = min(reach, rows.committed[row] - 1)
        first = rows.recorded(row) + 1
        if (rows.keep_scores or rows.keep_logits) and first <= last:
            span = slice(first - 1 - cache_length, last - cache_length)
            rows.record(row, processed[row, span], logits[row, span])

    def _drawn_on_rank_zero(self, draw: Callable[[], torch.LongTensor], shape: tuple[int, int]) -> torch.LongTensor:
        """`draw()`'s tokens (of `shape`, greedy or sampled); when sampling on a spread target, rank 0's (one
        collective), so every rank keeps the same tokens whatever it would have drawn."""
        if not (self.agreement.spread and self.config.do_sample):
            return draw()
        size = shape[0] * shape[1]
        decision = self.agreement.decide("Sampling", lambda: draw().reshape(-1), size, everyone_computes=False)
        return decision.reshape(shape).to(self.rows.ids.device)

    def _agree_on_tokens(self, what: str) -> None:
        """On a spread target: every rank committed the same tokens (else every rank raises)."""
        if self.agreement.spread:
            state = self.digest.state(self.rows.committed)
            self.agreement.compare(what, state)

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


def rows_drafting(drafter, target: HyperConnectionTarget, request, max_draft: int) -> BlockDrafting | RowByRowDrafting:
    """The drafting of `request`'s rows (a `GenerateRequest` of several, left-padded, repeated for
    `num_return_sequences`)."""
    repeats = request.generation_config.num_return_sequences or 1
    padding = left_padding(request.attention_mask).repeat_interleave(repeats)
    return make_drafting(drafter, target, padding.tolist(), max_draft)


def batched_generate(
    original_generate,
    request,
    target: HyperConnectionTarget,
    cache: Cache,
    generator: SpeculativeCandidateGenerator,
    agreement: RankAgreement,
):
    """Run `request` (a `GenerateRequest` of several rows) through generate() with the batched loop as its decoding
    method, on `cache`, with `generator` (its proposer: `rows_drafting`); the cache is the family's stock one again
    afterwards."""
    loop = BatchedSpeculativeLoop(target, generator, request.cache is not None, agreement)
    arguments = request.arguments | {"assistant_model": None}
    kwargs = request.kwargs | {CACHE_ARGUMENT: cache, "cache_implementation": None}
    try:
        with (
            target.capture(generator.proposer.feature_layers) as capture,
            target.verify_as_decoding(request.input_ids.shape[1], request.positions_may_lag_cache, cache),
            call_scope.methods(target.model, _sample=loop),
        ):
            generator.capture = capture
            return original_generate(target.model, **arguments, **kwargs)
    finally:
        target.release_cache(cache)
