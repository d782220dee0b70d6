"""transformers' assisted loop (one row) on a spread target: each step's drafts, sampling verdict and stop flags are
rank 0's (`RankAgreement.decide`).

- Drafts: every rank drafts; rank 0's drafts and their length replace the others' before the verify forward (one
  collective; with it a digest of every rank's tokens, so ranks that parted raise, and for this package's drafters
  what rank 0's schedule learns from the step and whether its drafts were copied from the context, so every
  rank's schedule and stats stay rank 0's). A greedy step needs nothing more: its verdict is a function of the
  target's logits, which a tensor-parallel reduction hands every rank alike. After the last step the ranks compare
  their sequences once more (`agree_on_sequences`).
- Sampling verdict: rank 0 runs transformers' `_speculative_sampling` and every rank keeps its accepted tokens and
  bonus token (a second collective). Steps without drafts and drafts without drafter logits (prompt lookup) go the
  same way, with transformers' own rule for them, so no rank samples a token on its own.
- Stop flags: `stopping.PerTokenStopping` asks rank 0's criteria when one of them can differ per rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .rank_agreement import RankAgreement, TokenDigest, floats_as_int64, int64_as_floats


def packed(head: int, tokens: torch.LongTensor, size: int) -> torch.LongTensor:
    """`head`, then `tokens`, padded with -1 to `size` values: a decision's packet."""
    if 1 + tokens.numel() > size:
        raise RuntimeError(f"{tokens.numel()} tokens where at most {size - 1} were agreed for a step")
    return torch.cat([torch.tensor([head]), tokens.cpu().long(), torch.full((size - 1 - tokens.numel(),), -1)])


def _floats_packed(values: list[float], size: int) -> torch.LongTensor:
    """`values` (at most `size`), their count first, then their bits padded to `size`."""
    return torch.cat([torch.tensor([len(values)]), floats_as_int64(values + [0.0] * (size - len(values)))])


def _floats_unpacked(packet: torch.LongTensor) -> list[float]:
    return int64_as_floats(packet[1:])[: int(packet[0])].tolist()


def agree_on_drafts(generator, agreement: RankAgreement, most: int, sampling: bool) -> None:
    """Every rank's `generator.get_candidates` returns rank 0's drafts (at most `most`). When sampling, the drafter
    logits are never None, so transformers hands every step to `_speculative_sampling` (`rank_zero_verdict`): a rank
    whose drafts were replaced, or a step with none, gets logits with no vocabulary (rank 0 never reads them there).
    This package's generator also takes rank 0's step as its schedule learns from it (confidences, drafted token
    probabilities, drafter forwards)."""
    get_candidates = generator.get_candidates
    learns = hasattr(generator, "confidences")  # a stock generator (prompt lookup) keeps no schedule of its own
    size = 1 + most + (2 + 2 * (1 + most) if learns else 0)
    digest, hashed = TokenDigest(), [0]

    def candidates(input_ids: torch.LongTensor, *args, **kwargs):
        local: list = []

        def drafted() -> torch.Tensor:
            ids, logits = get_candidates(input_ids, *args, **kwargs)
            local[:] = [ids, logits]
            drafts = ids[0, input_ids.shape[1] :]
            head = packed(drafts.numel(), drafts, 1 + most)
            if not learns:
                return head
            step = [
                torch.tensor([generator.drafter_forwards, generator.copied]),
                _floats_packed(generator.confidences, most),
                _floats_packed(generator.token_probabilities, most),
            ]
            return torch.cat([head, *step])

        digest.add([input_ids[0, hashed[0] :].tolist()])
        hashed[0] = input_ids.shape[1]
        decision = agreement.decide("Drafting", drafted, size, state=digest.state([input_ids.shape[1]]))
        count = int(decision[0])
        if learns:
            rest = decision[1 + most :]
            generator.drafter_forwards, generator.copied, generator.last_proposed = int(rest[0]), bool(rest[1]), count
            generator.confidences = _floats_unpacked(rest[2 : 3 + most])
            generator.token_probabilities = _floats_unpacked(rest[3 + most :])
        drafts = decision[1 : 1 + count].to(input_ids.device)
        ids, logits = local
        if not torch.equal(ids[0, input_ids.shape[1] :], drafts):
            ids, logits = torch.cat([input_ids, drafts[None]], dim=-1), None
        if sampling and (logits is None or logits.shape[1] != count):
            logits = torch.zeros(1, count, 0, device=input_ids.device)
        return ids, logits

    generator.get_candidates = candidates


def rank_zero_verdict(agreement: RankAgreement, most: int) -> Callable:
    """A replacement for transformers' `_speculative_sampling` (`call_scope.functions`): rank 0's accepted tokens and
    bonus token on every rank. Without drafts, or without drafter logits (`agree_on_drafts` gives them no
    vocabulary), rank 0 applies transformers' rule for that case: a token from the target's distribution at each
    position, the drafts kept while they match."""

    def verify(original: Callable, candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
        def verdict() -> torch.Tensor:
            if candidate_logits.shape[-1]:
                valid, n_matches = original(
                    candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs
                )
            else:
                chosen = torch.multinomial(new_logits[0].softmax(dim=-1), num_samples=1).squeeze(1)[None]
                drafts = candidate_input_ids[:, candidate_input_ids.shape[1] - candidate_length :]
                n_matches = ((~(drafts == chosen[:, :-1])).cumsum(dim=-1) < 1).sum()
                valid = chosen[:, : n_matches + 1]
            tokens = valid[0].cpu()
            return packed(int(n_matches), tokens, 2 + most)

        decision = agreement.decide("Verifying", verdict, 2 + most, everyone_computes=False)
        count = int(decision[0])
        return decision[1 : 2 + count][None].to(new_logits.device), torch.tensor(count, device=new_logits.device)

    return verify


def agree_on_sequences(agreement: RankAgreement, sequences: torch.LongTensor) -> None:
    """After a call's last step: every rank returns the same sequences (else every rank raises)."""
    digest = TokenDigest()
    digest.add(sequences.tolist())
    state = digest.state(list(sequences.shape))
    agreement.compare("Finishing", state)
