"""Live training metrics (`hyperdflash train --report-to`) through accelerate's trackers.

The loop sends every log.jsonl record to the accelerator's trackers too (`train/<term>` every `--log-every` steps,
`eval/tau` at each evaluation), a no-op when there are none. This module picks the trackers and checks their
packages before any work starts: accelerate itself drops a tracker whose package is missing without a word.
"""

from __future__ import annotations

from importlib.util import find_spec

from .options import REPORT_TO

PROJECT = "hyperdflash"  # the TensorBoard folder inside OUTPUT_DIR/run, and the W&B project
SUPPORTED = ("tensorboard", "wandb")  # what --report-to all starts; each is both the tracker's and its package's name


def trackers(report_to: str) -> list[str]:
    """The accelerate trackers `report_to` names; a missing package is an error that names it."""
    if report_to not in REPORT_TO:
        raise ValueError(f"report_to must be one of {list(REPORT_TO)}, got {report_to!r}.")
    names = {"none": [], "all": list(SUPPORTED)}.get(report_to, [report_to])
    missing = [name for name in names if find_spec(name) is None]
    if missing:
        raise ValueError(
            f"--report-to {report_to} needs {' and '.join(missing)}: pip install {' '.join(missing)} "
            "(or the `telemetry` extra: pip install 'hf-hyperdflash[telemetry]')."
        )
    return names


def tracker_config(settings: dict) -> dict:
    """The run's settings as the trackers store them: TensorBoard's hparams take only numbers, strings, booleans and
    None, so paths, lists and device maps go as text."""
    scalar = (bool, int, float, str, type(None))
    return {name: value if isinstance(value, scalar) else str(value) for name, value in settings.items()}
