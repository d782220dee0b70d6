"""PNG loss curves from a training log (`log.jsonl`, one JSON record per logged step)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NOT_CURVES = {"step", "lr", "grad_norm", "tokens_per_second"}


def read_log(log_path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]


def plot_curves(log_paths: dict[str, str | Path], out_png: str | Path, title: str = "training") -> Path:
    """One panel per logged term, one line per run (label -> log path)."""
    runs = {label: read_log(path) for label, path in log_paths.items()}
    terms = sorted({k for records in runs.values() for r in records for k in r} - NOT_CURVES)
    fig, axes = plt.subplots(1, len(terms), figsize=(4.5 * len(terms), 3.5), squeeze=False)
    for axis, term in zip(axes[0], terms, strict=False):
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
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
