"""`hyperdflash train --report-to`: live metrics through accelerate's trackers, read back from TensorBoard's event
file offline; the progress bar's throughput and time left; the help and the error for a missing tracker package."""

import argparse
import json
import re

import pytest
from accelerate.state import AcceleratorState
from transformers import AutoTokenizer

from hf_hyperdflash import cli, reference
from hf_hyperdflash.testing import tiny_deepseek_v4
from hf_hyperdflash.training import telemetry
from hf_hyperdflash.training.command import add_train_arguments, run_train
from hf_hyperdflash.training.curves import read_log


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one process-wide state (trackers included); each run starts from none."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_train_help_lists_report_to_and_every_family(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "--report-to {none,tensorboard,wandb,all}" in help_text
    assert "(DeepSeek-V4, HY-V4, GLM-5-Next or Qwen4-Exp)" in help_text


def test_a_missing_tracker_package_is_named_before_any_work(monkeypatch):
    assert telemetry.trackers("none") == []
    monkeypatch.setattr(telemetry, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="--report-to all needs tensorboard and wandb: pip install tensorboard wandb"):
        telemetry.trackers("all")
    with pytest.raises(ValueError, match="report_to must be one of"):
        telemetry.trackers("mlflow")  # a config file's value, which argparse's choices do not see


def test_tensorboard_gets_every_loss_term_the_lr_throughput_and_tau(tmp_path, capsys):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    target = tiny_deepseek_v4(seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids)
    target.save_pretrained(tmp_path / "target")
    chat = [{"role": "user", "content": "Say something."}]
    replies = tmp_path / "replies.jsonl"  # replies given, so nothing is generated before training
    replies.write_text("".join(json.dumps({"messages": chat, "reply": f"Reply {i}."}) + "\n" for i in range(4)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Question?"}) + "\n")
    out = tmp_path / "out"
    argv = ["--target", str(tmp_path / "target"), "--tokenizer", str(reference.tokenizer_path())]
    argv += ["--replies", str(replies), "--block-size", "4", "--num-layers", "1", "--batch-size", "2"]
    argv += ["--anchors-per-sequence", "2", "--total-steps", "2", "--warmup-steps", "1", "--log-every", "1"]
    argv += ["--eval-data", str(prompts), "--eval-prompts", "1", "--eval-max-new-tokens", "4", "--eval-every", "2"]
    argv += ["--output-dir", str(out), "--report-to", "tensorboard"]
    run_train(add_train_arguments(argparse.ArgumentParser()).parse_args(argv))

    records = read_log(out / "run" / "log.jsonl")
    logged = [record for record in records if "loss" in record]
    terms = set(logged[0]) - {"step"}
    assert {"loss", "ce", "kl", "acc", "lr", "grad_norm", "tokens_per_second"} <= terms
    events = event_accumulator.EventAccumulator(str(out / "run" / telemetry.PROJECT)).Reload()
    assert set(events.Tags()["scalars"]) == {f"train/{term}" for term in terms} | {"eval/tau"}
    for term in terms:  # every term at every logged step, with log.jsonl's values (TensorBoard keeps float32)
        scalars = events.Scalars(f"train/{term}")
        assert [scalar.step for scalar in scalars] == [1, 2], term
        assert [scalar.value for scalar in scalars] == pytest.approx([r[term] for r in logged], rel=1e-6), term
    tau = {record["step"]: record["tau"] for record in records if "tau" in record}
    assert {scalar.step: scalar.value for scalar in events.Scalars("eval/tau")} == pytest.approx(tau, rel=1e-6)
    assert list(tau) == [2]

    progress = capsys.readouterr().err  # tqdm's bar: [elapsed<time left, rate, loss=..., tok/s=...]
    assert re.search(r"\d\d:\d\d<\d\d:\d\d, .*loss=\d+\.\d+, tok/s=\d+\]", progress), progress[-500:]
