"""DSpark's two heads, which a HyperDFlash drafter can carry too (`markov_rank` > 0).

- The Markov head adds a low-rank bias from the token before each draft to its logits:
  `markov_w2(markov_w1(previous token))`, so a block's drafts, drawn left to right, see the ones before them.
- The confidence head predicts whether a draft is accepted given that the ones before it were:
  `sigmoid(confidence_head([pre-norm hidden state; markov_w1(previous token)]))`.

The parameter names are DSpark's own (`markov_w1`, `markov_w2`, `confidence_head`), so a release's weights load
under them.
"""

import torch
from torch import nn


class DraftHeadsMixin:
    """Adds the Markov and confidence heads to a drafter module (`add_draft_heads`) and computes them."""

    markov_w1: nn.Embedding
    markov_w2: nn.Linear
    confidence_head: nn.Linear

    def add_draft_heads(self, hidden_size: int, vocab_size: int, rank: int) -> None:
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self.confidence_head = nn.Linear(hidden_size + rank, 1, bias=False)

    def markov(self, previous_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Markov bias on the next token's logits `[.., V]` (fp32) and the previous token's low-rank embedding."""
        embedding = self.markov_w1(previous_ids)
        return nn.functional.linear(embedding.float(), self.markov_w2.weight.float()), embedding

    def confidence_logit(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        """The logit of P(this draft is accepted | the ones before it were), from the pre-norm hidden state and the
        Markov embedding of the previous token."""
        features = torch.cat([hidden, markov_embedding.to(hidden.dtype)], dim=-1)
        return self.confidence_head(features.to(self.confidence_head.weight.dtype)).float().squeeze(-1)

    def confidence(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.confidence_logit(hidden, markov_embedding))
