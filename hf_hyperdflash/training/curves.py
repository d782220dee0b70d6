"""PNG loss curves from a training log (`log.jsonl`, one JSON record per logged step)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NOT_CURVES = {"step", "lr", "grad_norm", "tokens_per_second"}
MAX_COLUMNS = 3
PANEL_INCHES = (4.5, 3.2)  # width, height of one panel
DPI = 110


def grid_shape(panels: int, max_columns: int = MAX_COLUMNS) -> tuple[int, int]:
    """(rows, columns) of a grid for `panels` panels: at most `max_columns` wide, as few rows as that allows, so
    the figure stays readable at normal size however many terms are logged."""
    columns = max(1, min(panels, max_columns))
    return max(1, math.ceil(panels / columns)), columns


def read_log(log_path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]


def plot_curves(log_paths: dict[str, str | Path], out_png: str | Path, title: str = "training") -> Path:
    """One panel per logged term, one line per run (label -> log path), in a grid of `grid_shape(terms)`."""
    runs = {label: read_log(path) for label, path in log_paths.items()}
    terms = sorted({k for records in runs.values() for r in records for k in r} - NOT_CURVES)
    rows, columns = grid_shape(len(terms))
    width, height = PANEL_INCHES
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False)
    for axis in axes.flat[len(terms) :]:  # the last row's empty cells
        axis.set_visible(False)
    for axis, term in zip(axes.flat, terms, strict=False):
        for label, records in runs.items():
            points = [(r["step"], r[term]) for r in records if term in r]
            if points:
                steps, values = zip(*points, strict=True)
                axis.plot(steps, values, label=label, marker="." if len(steps) < 30 else None)
        axis.set_title(term)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=DPI)
    plt.close(fig)
    return out_png
