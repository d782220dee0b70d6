"""`hyperdflash train` against a target spread over processes by transformers' tensor-parallel plan (torchrun, gloo):
the loss curve against single-process training, and an exact resume.

- 2 processes, one copy of the target over both (`--target-parallel tp`): both see the whole batch, so the curve is
  single-process training's, up to the order of the tensor-parallel sums (relative tolerance `CURVE_TOLERANCE`).
- 4 processes as a 2 x 2 mesh (`--target-parallel-size 2`): two copies, each its own half of the batch, the drafter's
  gradients averaged over them; the curve is that of 2 plain data-parallel processes, within the same tolerance.
- The 2-process run stopped after a checkpoint and run again resumes to the uninterrupted curve, exactly.
- A feature store built over the 2 processes (the first writes it) trains as the spread target does.
- Sampled replies and the tau evaluation on a spread target: both processes sample the same replies (the first
  writes them) and take part in every evaluation's generate() calls.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.testing import free_port, tiny_deepseek_v4

pytestmark = pytest.mark.slow

CURVE_TOLERANCE = 1e-3  # relative, per logged loss
STEPS = 12
PROMPTS = [f"Question {i}: how do {topic} work?" for i, topic in enumerate(["tides", "bees", "clocks", "lungs"] * 2)]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A saved tiny V4 target over the reference tokenizer's vocabulary, and a prompt file."""
    root = tmp_path_factory.mktemp("spread_training")
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    target = tiny_deepseek_v4(seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids)
    target.save_pretrained(root / "target")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


def train_command(work: Path, out: Path, processes: int, *flags: str) -> list[str]:
    launch = [sys.executable, "-m", "hf_hyperdflash.training.command"]
    if processes > 1:
        torchrun = ["torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", str(free_port())]
        launch = [sys.executable, "-m", *torchrun, "-m", "hf_hyperdflash.training.command"]
    settings = ["--target", str(work / "target"), "--tokenizer", str(reference.tokenizer_path())]
    settings += ["--data", str(work / "prompts.jsonl"), "--max-new-tokens", "16", "--generation-batch-size", "4"]
    settings += ["--block-size", "4", "--num-layers", "1", "--anchors-per-sequence", "6", "--max-length", "96"]
    settings += ["--total-steps", str(STEPS), "--learning-rate", "3e-3", "--warmup-steps", "2", "--log-every", "1"]
    settings += ["--checkpoint-every", "4", "--eval-prompts", "0", "--output-dir", str(out)]
    settings += ["--recipe", "paper"]  # greedy replies in one folder (the two-process benchmark runs the hybrid)
    return [*launch, *settings, *flags]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}


def train(work: Path, out: Path, processes: int, *flags: str) -> list[float]:
    command = train_command(work, out, processes, *flags)
    run = subprocess.run(command, env=ENV, cwd=work, capture_output=True, timeout=900)
    assert run.returncode == 0, run.stderr.decode()[-4000:]
    return losses(out)


def losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "run" / "log.jsonl").read_text().splitlines()]
    return [record["loss"] for record in records if "loss" in record]


def assert_same_curve(curve: list[float], reference_curve: list[float]) -> None:
    assert len(curve) == len(reference_curve) == STEPS
    assert curve == pytest.approx(reference_curve, rel=CURVE_TOLERANCE)


def shard_sizes(out: Path) -> dict[str, int]:
    return {path.name: len(path.read_text().splitlines()) for path in sorted((out / "data").glob("shard-*.jsonl"))}


def test_one_copy_over_two_processes_trains_as_one_process(work):
    """Both processes of the copy answer the prompts together and the first writes the one shard; one process then
    trains on the same replies (the tensor-parallel sums may round a greedy reply differently)."""
    spread = train(work, work / "tp2", 2, "--batch-size", "4", "--target-parallel", "tp")
    assert shard_sizes(work / "tp2") == {"shard-000.jsonl": len(PROMPTS)}
    single = train(work, work / "single", 1, "--batch-size", "4", "--data-dir", str(work / "tp2" / "data"))
    assert_same_curve(spread, single)


def test_two_copies_of_two_processes_train_as_two_data_parallel_processes(work):
    """Each copy answers half the prompts into its shard, and trains on its half of each batch."""
    flags = ("--batch-size", "2", "--target-parallel", "tp", "--target-parallel-size", "2")
    mesh = train(work, work / "mesh", 4, *flags)
    assert shard_sizes(work / "mesh") == {"shard-000.jsonl": len(PROMPTS) // 2, "shard-001.jsonl": len(PROMPTS) // 2}
    plain = train(work, work / "dp2", 2, "--batch-size", "2", "--data-dir", str(work / "mesh" / "data"))
    assert_same_curve(mesh, plain)


def test_a_feature_store_built_over_two_processes_trains_as_the_spread_target(work):
    """Both processes run the target over the replies and the first writes the store (one shard, every reply once);
    training from it over two processes gives the curve of training against the spread target."""
    flags = ("--batch-size", "4", "--target-parallel", "tp")
    online = train(work, work / "online", 2, *flags)
    store, data = work / "store", work / "online" / "data"
    torchrun = ["torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    command = [
        sys.executable,
        "-m",
        *torchrun,
        "-m",
        "hf_hyperdflash.cli",
        "features",
        "--target",
        str(work / "target"),
    ]
    command += ["--target-parallel", "tp", "--data-dir", str(data), "--output-dir", str(store), "--max-length", "96"]
    run = subprocess.run(command, env=ENV, cwd=work, capture_output=True, timeout=900)
    assert run.returncode == 0, run.stderr.decode()[-4000:]
    shards = json.loads((store / "index.json").read_text())["shards"]
    assert list(shards) == ["shard-00000.safetensors"] and len(shards["shard-00000.safetensors"]["keys"]) == len(
        PROMPTS
    )
    assert sorted(path.name for path in store.iterdir()) == ["index.json", "shard-00000.safetensors"]
    assert_same_curve(
        train(work, work / "stored", 2, *flags, "--data-dir", str(data), "--feature-store", str(store)), online
    )


def test_a_stopped_spread_run_resumes_exactly(work):
    flags = ("--batch-size", "4", "--target-parallel", "tp")
    whole = train(work, work / "whole", 2, *flags)
    out = work / "stopped"
    run = subprocess.Popen(train_command(work, out, 2, *flags), env=ENV, cwd=work, start_new_session=True)
    state = out / "run" / "checkpoint" / "loop_state.json"
    while run.poll() is None and not state.exists():
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    stopped_at = json.loads(state.read_text())["step"]
    assert stopped_at < STEPS, "the run finished before it could be stopped"
    assert losses(out) == whole[: len(losses(out))]
    assert train(work, out, 2, *flags) == whole


def test_sampled_replies_and_evaluation_on_a_spread_target(work):
    out = work / "sampled"
    flags = ("--batch-size", "4", "--target-parallel", "tp", "--temperature", "1", "--eval-prompts", "2")
    flags += ("--eval-every", "6", "--max-new-tokens", "8")
    train(work, out, 2, *flags)
    assert shard_sizes(out) == {"shard-000.jsonl": len(PROMPTS)}
    records = [json.loads(line) for line in (out / "run" / "log.jsonl").read_text().splitlines()]
    taus = [record["tau"] for record in records if "tau" in record]
    assert len(taus) == STEPS // 6 and all(tau >= 1 for tau in taus)
