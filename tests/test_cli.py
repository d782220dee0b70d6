"""The `hyperdflash` command line: --help without torch, user mistakes as one line with status 2, wrong model paths
named with their fix at every entry point (Python API, eval --drafter/--mtp/--target, train --init-from/--target),
and the demo's announced duration."""

import json
import re
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from accelerate.state import AcceleratorState

from hf_hyperdflash import HyperDFlashForDrafting, cli, demo
from hf_hyperdflash.evaluation.harness import load_drafter
from hf_hyperdflash.testing import tiny_deepseek_v4
from hf_hyperdflash.training.trainer import build_drafter

HEAVY = ("torch", "transformers", "accelerate")

PARSER_IN_A_FRESH_PROCESS = """
import json, sys
import hf_hyperdflash.cli
parser = hf_hyperdflash.cli.build_parser()
for command in ([], ["demo"], ["train"], ["eval"]):
    try:
        parser.parse_args([*command, "--help"])
    except SystemExit:
        pass
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_parser_and_help_import_neither_torch_nor_transformers():
    result = subprocess.run(
        [sys.executable, "-c", PARSER_IN_A_FRESH_PROCESS], capture_output=True, text=True, timeout=120, check=True
    )
    *help_text, modules = result.stdout.splitlines()
    assert not set(HEAVY) & set(json.loads(modules))
    help_text = "\n".join(help_text)
    for option in ("--init-from", "--teacher {mean_pool,gated}", "--drafter NAME=DIR", "--tau-ratio NUM/DEN"):
        assert option in help_text  # train and eval --help printed their options


def test_train_and_eval_help_come_from_the_light_option_modules(capsys):
    for command in ("train", "eval"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])
        assert exit_info.value.code == 0
        assert f"`hyperdflash {command}`:" in capsys.readouterr().out  # the command's description


def failed_run(capsys, argv: list) -> tuple[str, str]:
    """(the one stderr line, stdout) of a `hyperdflash` run that must fail with status 2, argparse's status for
    usage errors, and no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(arg) for arg in argv])
    AcceleratorState._reset_state(reset_partial_state=True)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0], captured.out


def run_cli(capsys, argv: list) -> str:
    return failed_run(capsys, argv)[0]


def test_a_user_mistake_is_one_line_with_status_2(capsys, monkeypatch, tmp_path):
    line = run_cli(capsys, ["train"])
    assert line == "hyperdflash train: error: Pass --output-dir (or 'output_dir' in the config file)."
    missing = tmp_path / "missing.json"
    line = run_cli(capsys, ["train", "--config", missing])
    assert line == f"hyperdflash train: error: No config file at {missing}; check the --config path."
    (tmp_path / "bad.json").write_text("{'block_size': 8}")
    line = run_cli(capsys, ["train", "--config", tmp_path / "bad.json"])
    assert line.startswith(f"hyperdflash train: error: The config file {tmp_path / 'bad.json'} is not valid JSON (")

    def fails(args):
        raise ValueError("first line\nsecond line:\n  indented detail")

    monkeypatch.setattr("hf_hyperdflash.evaluation.command.run_eval", fails)
    assert run_cli(capsys, ["eval", "--output-dir", tmp_path]) == (
        "hyperdflash eval: error: first line second line: indented detail"
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A saved tiny target; a valid drafter; a `hyperdflash train` output dir; an empty folder; a drafter save
    without its weights file."""
    root = tmp_path_factory.mktemp("models")
    target = tiny_deepseek_v4(seed=0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    target.save_pretrained(root / "target")
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=4)
    drafter.save_pretrained(root / "drafter")
    drafter.save_pretrained(root / "train_output" / "drafter")
    (root / "train_output" / "run").mkdir()
    (root / "empty").mkdir()
    drafter.save_pretrained(root / "no_weights")
    (root / "no_weights" / "model.safetensors").unlink()
    return {name: root / name for name in ("target", "drafter", "train_output", "empty", "no_weights")}


def path_mistakes(models: dict[str, Path], tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each wrong drafter path and the message check_drafter_path gives for it."""
    missing = tmp_path / "nonexistent"
    return {
        "missing": (
            missing,
            f"No drafter at {missing}: the path does not exist. Check it, or pass a Hub id (org/name).",
        ),
        "training output": (
            models["train_output"],
            f"{models['train_output']} is a `hyperdflash train` output directory; the drafter is its subfolder "
            f"{models['train_output'] / 'drafter'}.",
        ),
        "empty": (
            models["empty"],
            f"{models['empty']} holds no drafter (no config.json); pass a folder written by save_pretrained() or "
            "`hyperdflash train` (OUTPUT_DIR/drafter).",
        ),
        "no weights": (
            models["no_weights"],
            f"{models['no_weights']} has a drafter config but no weights file (model.safetensors): the save is "
            "incomplete; save the drafter again.",
        ),
        "a target": (
            models["target"],
            f"{models['target']} holds a 'deepseek_v4' model, not a drafter (model_type one of ('hyperdflash', "
            "'deepseek_v4_mtp', 'deepseek_v4_dspark')); pass the drafter's folder, not the target's.",
        ),
    }


def test_python_api_names_the_wrong_drafter_path(models, tmp_path):
    for case, (path, message) in path_mistakes(models, tmp_path).items():
        with pytest.raises(ValueError) as error:
            HyperDFlashForDrafting.from_pretrained(path)
        assert str(error.value) == message, case
        assert "corrupt" not in str(error.value)


def test_eval_names_the_wrong_drafter_or_mtp_path(models, tmp_path, capsys):
    common = ["eval", "--target", models["target"], "--output-dir", tmp_path / "out"]
    for case, (path, message) in path_mistakes(models, tmp_path).items():
        line = run_cli(capsys, [*common, "--drafter", f"mine={path}"])
        assert line == f"hyperdflash eval: error: Drafter 'mine': {message}", case
        if case == "a target":  # for --mtp, a V4 target is a release that may ship its MTP block: this one ships none
            message = (
                f"{path} ships no drafter (no `mtp.*`), not DeepSeek-V4's native MTP block (`mtp.0.e_proj.weight`)."
            )
        line = run_cli(capsys, [*common, "--mtp", path])
        assert line == f"hyperdflash eval: error: Drafter 'mtp': {message}", case
    assert not (tmp_path / "out").exists()  # refused before any model loaded or report was written


def test_train_names_the_wrong_init_from_path(models, tmp_path, capsys):
    common = ["train", "--target", models["target"], "--tokenizer", models["target"]]
    common += ["--output-dir", tmp_path / "out"]
    for case, (path, message) in path_mistakes(models, tmp_path).items():
        assert run_cli(capsys, [*common, "--init-from", path]) == f"hyperdflash train: error: {message}", case
    assert not (tmp_path / "out").exists()


def test_wrong_target_and_tokenizer_paths_are_named(models, tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    cases = {
        (missing, None): f"No target at {missing}: the path does not exist. Check it, or pass a Hub id (org/name).",
        (models["empty"], None): f"{models['empty']} holds no model (no config.json); pass the folder of a saved "
        "mHC target, or a Hub id.",
        (models["drafter"], None): f"{models['drafter']} holds a drafter ('hyperdflash'), not a target; pass the "
        "target model's folder.",
        (models["target"], missing): f"No tokenizer at {missing}: the path does not exist. Check it, or pass a Hub "
        "id (org/name).",
    }
    for command in (["train"], ["eval", "--mtp", "none"]):
        for (target, tokenizer), message in cases.items():
            argv = [*command, "--output-dir", tmp_path / "out", "--target", target]
            argv += ["--tokenizer", tokenizer] if tokenizer else []
            assert run_cli(capsys, argv) == f"hyperdflash {command[0]}: error: {message}"


def test_demo_says_how_long_it_takes_before_it_starts(capsys, monkeypatch):
    assert re.fullmatch(
        r"128 tokens x 3 repeats, plain and speculative; about \d+ s on 2 CPU cores", demo.expected_duration()
    )
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    assert "about" in capsys.readouterr().out.split("options:")[0]  # the description, before the options

    def not_shipped(drafter):
        raise FileNotFoundError("No reference drafter is shipped with this installation.")

    monkeypatch.setattr(demo, "load_reference_pair", not_shipped)
    line, out = failed_run(capsys, ["demo", "--max-new-tokens", "16", "--repeats", "1"])
    assert line == "hyperdflash demo: error: No reference drafter is shipped with this installation."
    assert re.fullmatch(
        r"Loading the reference pair and decoding 16 tokens x 1 repeat, plain and speculative; "
        r"about \d+ s on 2 CPU cores\.",
        out.strip(),
    )


def test_a_hub_id_that_cannot_be_fetched_is_neither_a_traceback_nor_corrupt(monkeypatch, tmp_path):
    """`runs/typo` is shaped like a Hub id, so it passes the path check and fails at the Hub (here: offline)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    target = tiny_deepseek_v4(seed=0)
    loads = {
        "eval": lambda: load_drafter("mine", "runs/typo", target, torch.float32),
        "train": lambda: build_drafter(target, init_from="runs/typo"),
    }
    for entry, load in loads.items():
        with pytest.raises(ValueError) as error:
            load()
        message = str(error.value)
        assert "runs/typo is not a local folder, and loading it as a Hub id failed" in message, entry
        assert message.endswith("Check the path, or the Hub id and your connection.") and "corrupt" not in message
