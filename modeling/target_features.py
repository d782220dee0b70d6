"""The target's features by column, kept from the verify forwards until the drafter has read them.

Each verify forward writes the features of the columns it fed, from the column it started at; what an earlier forward
wrote from there on is replaced (those columns held drafts the target rejected, or tokens fed again). Pieces are kept
as the forwards gave them and joined once, when the drafter reads them, so a step costs no copy of its features.
"""

from __future__ import annotations

import torch


class TargetFeatures:
    """Features [B, n, ...] of the columns `start` to `end` (exclusive)."""

    def __init__(self, start: int):
        self.start = start
        self.pieces: list[torch.Tensor] = []

    @property
    def end(self) -> int:
        return self.start + sum(piece.shape[1] for piece in self.pieces)

    def write(self, column: int, features: torch.Tensor) -> None:
        """The features of a forward that fed columns from `column` on (at most `end`: no gap is left)."""
        if not self.start <= column <= self.end:
            raise RuntimeError(
                f"Features written at column {column}, outside the kept columns {self.start}-{self.end}"
            )
        kept, at = [], self.start
        for piece in self.pieces:
            if at >= column:
                break
            kept.append(piece[:, : column - at])
            at += piece.shape[1]
        self.pieces = [*kept, features]

    def read(self, end: int | None = None) -> torch.Tensor:
        """The features from `start` to `end` (default: all kept), as one tensor."""
        if len(self.pieces) > 1:
            self.pieces = [torch.cat(self.pieces, dim=1)]
        return self.pieces[0][:, : None if end is None else end - self.start]

    def drop_before(self, column: int) -> None:
        """Forget the columns before `column` (the drafter has them)."""
        if column <= self.start:
            return
        self.pieces = [self.read()[:, column - self.start :]]
        self.start = column
