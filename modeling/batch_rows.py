"""What each row of a batched speculative call has committed, beyond the cache all rows share.

Invariants (`batched_decoding.py` relies on them):
- The target cache holds `cache_length` positions for every row, and at each one the row's committed token: the token
  plain batched decoding holds at that index.
- Row r has committed `committed[r]` columns (prompt included), at least `cache_length + 1`: the ones past the cache
  are fed again, ahead of the row's drafts, in the next verify forward; they are never judged again.
- The stopping criteria see the batch as plain decoding shows it to them: once per length, in order, each time with
  every row holding that many columns and their scores (`checked`).
- A row that stopped while the generation has an end-of-sequence id holds padding from its stop on, as plain decoding
  pads it; it holds every column then (`ended`, `committed` the whole width), so it never holds the batch back.
- `scores` / `raw_logits` hold, per new column in order, what the target gave each row for it from a forward whose
  inputs up to it were the row's committed tokens (`ColumnRecord`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class ColumnRecord:
    """Per new column, every row's entry ([V] scores or logits), as plain decoding returns them: rows add theirs in
    order, each at its own pace; a column is stacked into one [B, V] tensor once, when first read, and its rows'
    entries (views of their steps' logits) are let go then."""

    def __init__(self, batch: int):
        self.rows: list[list[torch.Tensor]] = [[] for _ in range(batch)]  # per row: entries not stacked yet
        self.columns: list[torch.Tensor] = []  # stacked columns, in order

    def held(self, row: int) -> int:
        return len(self.columns) + len(self.rows[row])

    def add(self, row: int, entries: torch.Tensor) -> None:
        self.rows[row].extend(entries.unbind(0))

    def drop_from(self, row: int, column: int) -> None:
        """Forget the row's entries from new column `column` on (never one already stacked)."""
        if column < len(self.columns):
            raise RuntimeError(f"Column {column} was already shown to the stopping criteria; it cannot be dropped.")
        del self.rows[row][column - len(self.columns) :]

    def up_to(self, count: int) -> tuple[torch.Tensor, ...]:
        """The first `count` columns, stacked (every row must hold them)."""
        missing = count - len(self.columns)
        if missing > 0:
            self.columns += [torch.stack(column) for column in zip(*(row[:missing] for row in self.rows), strict=True)]
            for row in self.rows:
                del row[:missing]
        return tuple(self.columns[:count])


class BatchRows:
    def __init__(self, input_ids: torch.LongTensor, max_length: int, pad_id: int, has_eos: bool, keep: tuple):
        batch, self.prompt_width = input_ids.shape
        self.ids = input_ids.new_full((batch, max_length + 1), pad_id)
        self.ids[:, : self.prompt_width] = input_ids
        self.pad_id, self.has_eos = pad_id, has_eos
        self.keep_scores, self.keep_logits = keep
        self.committed = [self.prompt_width] * batch
        self.padded = [False] * batch  # rows stopped and padded from their stop on
        self.checked = self.prompt_width  # lengths the criteria have seen
        self.stopped_at: list[int | None] = [None] * batch  # the length at which the criteria stopped each row
        self.history: list[list[int]] = []  # every row's committed length after each verify step
        self.scores, self.raw_logits = ColumnRecord(batch), ColumnRecord(batch)

    @property
    def batch(self) -> int:
        return len(self.committed)

    def ended(self, row: int) -> bool:
        """The row stopped and holds padding in every column past its stop."""
        return self.padded[row]

    def stopped(self, row: int) -> bool:
        return self.stopped_at[row] is not None

    @property
    def final_length(self) -> int | None:
        """The length of every output row once all rows stopped: where the last of them stopped, as plain decoding
        ends."""
        if not all(self.stopped(row) for row in range(self.batch)):
            return None
        return max(self.stopped_at)

    def complete(self, cache_length: int, cache_seen: bool) -> bool:
        """Every row stopped and holds every column of the output; when the caller sees the cache (or the scores),
        the cache holds all but the last one, as plain decoding leaves it."""
        final = self.final_length
        if final is None or min(self.committed) < final:
            return False
        return cache_length >= final - 1 or not cache_seen

    def slowest(self, rows: list[int]) -> int:
        """The shortest length among `rows`, a stopped row's counted where it stopped."""
        return min(self.stopped_at[row] if self.stopped(row) else self.committed[row] for row in rows)

    def uncached(self, cache_length: int) -> list[int]:
        """Per row: its committed columns past the cache, the newest included (1: only its anchor)."""
        return [committed - cache_length for committed in self.committed]

    def commit(self, tokens: torch.LongTensor, counts: list[int]) -> None:
        """Append each row's first `counts[r]` of `tokens` [B, n] to what it committed (one indexed write)."""
        rows = [row for row, count in enumerate(counts) for _ in range(count)]
        if not rows:
            return
        steps = [step for count in counts for step in range(count)]
        columns = [self.committed[row] + step for row, step in zip(rows, steps, strict=True)]
        index = torch.tensor([rows, steps, columns], device=self.ids.device)
        self.ids[index[0], index[2]] = tokens[index[0], index[1]].to(self.ids.device)
        for row, count in enumerate(counts):
            self.committed[row] += count

    def check(self, criteria: Callable, scores_so_far: Callable[[int], tuple | None]) -> dict[int, int]:
        """Show the criteria every length that all rows not padded now hold (with their scores), while a row still
        generates. A row they stop is padded from its stop on when the generation has an end-of-sequence id; what it
        committed past the stop goes, with the scores of those columns. Returns {row: stop length} of the rows
        stopped here."""
        stops: dict[int, int] = {}
        while not all(self.stopped(row) for row in range(self.batch)):
            held = min(self.committed)
            if self.keep_scores:  # and the scores of the columns before it (the criteria are shown them)
                held = min(held, *(self.recorded(row) + 1 for row in range(self.batch)))
            if self.checked >= held:
                break
            self.checked += 1
            verdict = criteria(self.ids[:, : self.checked], scores_so_far(self.checked)).tolist()
            for row in [row for row in range(self.batch) if verdict[row] and not self.stopped(row)]:
                stops[row] = self.checked
                self._stop(row, self.checked)
        return stops

    def adopt(self, stops: dict[int, int], checked: int) -> None:
        """What another process's `check` found (a spread target's rank 0): the rows it stopped, and how far it
        checked."""
        for row, length in stops.items():
            self._stop(row, length)
        self.checked = checked

    def _stop(self, row: int, length: int) -> None:
        self.stopped_at[row] = length
        if self.has_eos:
            self.ids[row, length:] = self.pad_id
            self.committed[row], self.padded[row] = self.ids.shape[1], True
            kept = length + 1 - self.prompt_width  # the column after the stop scores the stop token
            self.scores.drop_from(row, kept)
            self.raw_logits.drop_from(row, kept)

    def record(self, row: int, processed: torch.Tensor, logits: torch.Tensor) -> None:
        """Scores (and raw logits) of the row's next new columns, in order."""
        if self.keep_scores:
            self.scores.add(row, processed)
        if self.keep_logits:
            self.raw_logits.add(row, logits)

    def recorded(self, row: int) -> int:
        """The last column whose score the row holds (what it keeps of scores and raw logits, both alike)."""
        record = self.scores if self.keep_scores else self.raw_logits
        return self.prompt_width - 1 + record.held(row)

    def scores_up_to(self, length: int) -> tuple[torch.Tensor, ...] | None:
        """The batch's scores of the new columns before `length`, as plain decoding shows them to the criteria."""
        return self.scores.up_to(length - self.prompt_width) if self.keep_scores else None

    def sequences(self, length: int) -> torch.LongTensor:
        return self.ids[:, :length].clone()

    def row_taus(self) -> list[float]:
        """Per row: tokens it committed per verify step while it generated (up to its stop; not counting the first
        new token, which the prefill gives)."""
        taus = []
        for row in range(self.batch):
            stop = self.stopped_at[row]
            steps = next((i + 1 for i, step in enumerate(self.history) if step[row] >= stop), len(self.history))
            taus.append((stop - self.prompt_width - 1) / steps if steps else float("nan"))
        return taus
