"""Target features recorded by forward hooks, for the drafter to condition on."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FeatureCapture:
    """The latest target features seen by forward hooks: pre-collapse residual or chosen layer outputs.

    Hooks keep references (no copies); V4 computes out of place, so a captured tensor stays valid
    until the next forward replaces it.
    """

    def __init__(self, layer_ids: Sequence[int] | None):
        self.layer_ids = list(layer_ids) if layer_ids is not None else None
        self._latest: dict[int | str, torch.Tensor] = {}

    def record(self, key: int | str, tensor: torch.Tensor) -> None:
        self._latest[key] = tensor

    def features(self) -> torch.Tensor:
        """[B, S, streams, D]: the pre-collapse residual, or the chosen layers stacked on the stream axis."""
        if self.layer_ids is None:
            if "pre_collapse" not in self._latest:
                raise RuntimeError("No target forward has run since the capture started.")
            return self._latest["pre_collapse"]
        missing = [i for i in self.layer_ids if i not in self._latest]
        if missing:
            raise RuntimeError(f"No output captured yet for target layers {missing}.")
        return torch.cat([self._latest[i] for i in self.layer_ids], dim=2)
