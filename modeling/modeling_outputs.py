"""What a drafter forward returns (one class for every drafter, with transformers 5.24's field name `cache`)."""

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput


@dataclass
class DrafterOutput(ModelOutput):
    """`last_hidden_state` (final-normed) feeds the target's `lm_head`.

    `residual` is the hidden state before the final norm: native MTP's pre-collapse output, which feeds its next step,
    and the confidence head's input for DSpark and a HyperDFlash drafter with heads. `cache` is the drafter's own
    cache, updated in place.
    """

    last_hidden_state: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    cache: object | None = None
