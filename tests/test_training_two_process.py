"""A real two-process training run (accelerate launch, gloo on CPU), through benchmarks/two_process_training.py."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a two-process training run (CI runs it)

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "two_process_training.py"


def test_two_process_cpu_training_shards_data_syncs_and_saves(tmp_path):
    """Both ranks answer half the prompts, DDP trains with one cosine schedule, rank 0 measures tau and saves."""
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--work-dir", str(tmp_path), "--steps", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + _worker_tracebacks(run.stderr)
    assert "checks: all passed" in run.stdout


def _worker_tracebacks(stderr: str) -> str:
    """Every Python traceback in the launch's output: the failing rank's comes first, the launcher's last."""
    blocks = stderr.split("Traceback (most recent call last):")[1:]
    return "\n".join("Traceback (most recent call last):" + block[:4000] for block in blocks) or stderr[-6000:]
