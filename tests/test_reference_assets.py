"""The shipped reference set: loadable offline, mutually consistent, bf16, within budget, code in sync."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel

from hf_hyperdflash import DeepseekV4DSparkForDrafting, HyperDFlashForDrafting, reference
from hf_hyperdflash.modeling.target_architecture import target_fingerprint
from hf_hyperdflash.reference.build import export_drafters, train_language_model
from hf_hyperdflash.testing import tiny_deepseek_v4
from hf_hyperdflash.training.loop import LoopConfig

ASSET_DIRS = [
    reference.target_path(),
    reference.mtp_path(),
    reference.dspark_path(),
    *map(reference.drafter_path, reference.DRAFTER_KINDS),
]


def test_shipped_weights_are_bf16_and_within_the_budget():
    total = sum(f.stat().st_size for f in reference.ASSETS.rglob("*") if f.is_file())
    assert total <= 40 * 1024**2
    for directory in ASSET_DIRS:
        with safe_open(directory / "model.safetensors", "pt") as weights:
            float_dtypes = {weights.get_slice(k).get_dtype() for k in weights.keys()} - {"I64"}
        assert float_dtypes == {"BF16"}, directory


@pytest.mark.parametrize("directory", ASSET_DIRS[1:], ids=lambda d: d.name)
def test_shipped_drafters_hold_weights_and_config_only(directory):
    """No copy of the runtime in the package data: the library loads them through its registered classes."""
    assert {path.name for path in directory.iterdir()} == {"config.json", "model.safetensors"}
    assert "auto_map" not in json.loads((directory / "config.json").read_text())
    drafter = AutoModel.from_pretrained(directory, trust_remote_code=True)
    assert type(drafter).__module__.startswith("hf_hyperdflash.modeling.")
    assert drafter.config.target_fingerprint == target_fingerprint(AutoConfig.from_pretrained(reference.target_path()))


def test_drafters_fit_the_shipped_target():
    target = AutoConfig.from_pretrained(reference.target_path())
    for directory in ASSET_DIRS[1:]:
        drafter = AutoConfig.from_pretrained(directory, trust_remote_code=True)
        assert (drafter.hidden_size, drafter.hc_mult, drafter.vocab_size) == (
            target.hidden_size,
            target.hc_mult,
            target.vocab_size,
        )


def test_unknown_drafter_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown drafter kind"):
        reference.drafter_path("medusa")


def test_tokenizer_has_the_chat_format_the_target_expects():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoConfig.from_pretrained(reference.target_path())
    assert len(tokenizer) == target.vocab_size
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id) == (target.eos_token_id, target.bos_token_id)
    messages = [{"role": "user", "content": "hi"}]
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    opened = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    assert closed.endswith("<think></think>") and opened.endswith("<think>")
    assert torch.tensor(tokenizer(closed).input_ids).max() < target.vocab_size


def test_drafters_stage_ships_trained_drafters_as_bf16(tmp_path):
    with pytest.raises(ValueError, match="hyperdflash train --config configs/reference_drafter_hyperdflash.json"):
        export_drafters(tmp_path / "runs", tmp_path / "assets")
    target = tiny_deepseek_v4()
    trained = {}
    for kind, conditioning in zip(reference.DRAFTER_KINDS, ["pre_collapse", "intermediate"], strict=True):
        trained[f"drafter_{kind}"] = HyperDFlashForDrafting.from_target(
            target, conditioning=conditioning, block_size=4
        )
        trained[f"drafter_{kind}"].config.target_name_or_path = str(reference.target_path().resolve())
        trained[f"drafter_{kind}"].save_pretrained(tmp_path / "runs" / kind / "drafter")
    with pytest.raises(ValueError, match="configs/reference_drafter_dspark.json"):
        export_drafters(tmp_path / "runs", tmp_path / "assets")
    trained["dspark"] = DeepseekV4DSparkForDrafting.from_target(target, num_hidden_layers=1, dspark_markov_rank=4)
    trained["dspark"].save_pretrained(tmp_path / "runs" / "dspark" / "drafter")
    export_drafters(tmp_path / "runs", tmp_path / "assets")
    for name, drafter in trained.items():
        shipped = type(drafter).from_pretrained(tmp_path / "assets" / name)
        assert {path.name for path in (tmp_path / "assets" / name).iterdir()} == {"config.json", "model.safetensors"}
        with safe_open(tmp_path / "assets" / name / "model.safetensors", "pt") as weights:
            assert {weights.get_slice(k).get_dtype() for k in weights.keys()} == {"BF16"}, name
        assert getattr(shipped.config, "conditioning", None) == getattr(drafter.config, "conditioning", None)
        if name != "dspark":  # trained against the shipped target: named by its place in the package
            assert shipped.config.target_name_or_path == "hf_hyperdflash/reference/assets/target"
        for key, value in drafter.state_dict().items():
            torch.testing.assert_close(shipped.state_dict()[key].to(torch.bfloat16), value.to(torch.bfloat16))


def test_drafters_stage_replaces_only_the_drafters_asked_for(tmp_path):
    target = tiny_deepseek_v4()
    for seed, runs in enumerate(["first", "second"]):
        torch.manual_seed(seed)
        for kind in reference.DRAFTER_KINDS:
            drafter = HyperDFlashForDrafting.from_target(target, block_size=4)
            drafter.save_pretrained(tmp_path / runs / kind / "drafter")
    (tmp_path / "first" / "dspark").mkdir()  # no trained DSpark: the full export would refuse
    export_drafters(tmp_path / "first", tmp_path / "assets", ["hyperdflash", "vanilla_dflash"])
    before = {
        kind: load_file(tmp_path / "assets" / f"drafter_{kind}" / "model.safetensors")
        for kind in reference.DRAFTER_KINDS
    }
    export_drafters(tmp_path / "second", tmp_path / "assets", ["hyperdflash"])
    after = {
        kind: load_file(tmp_path / "assets" / f"drafter_{kind}" / "model.safetensors")
        for kind in reference.DRAFTER_KINDS
    }
    assert not (tmp_path / "assets" / "dspark").exists()
    assert after["vanilla_dflash"].keys() == before["vanilla_dflash"].keys()
    assert all(torch.equal(after["vanilla_dflash"][k], before["vanilla_dflash"][k]) for k in before["vanilla_dflash"])
    assert not all(torch.equal(after["hyperdflash"][k], before["hyperdflash"][k]) for k in before["hyperdflash"])
    with pytest.raises(ValueError, match="Unknown drafters \\['medusa'\\]"):
        export_drafters(tmp_path / "second", tmp_path / "assets", ["medusa"])


def test_language_model_training_lowers_the_loss_and_plots_it(tmp_path):
    torch.manual_seed(0)
    chunks = torch.randint(3, 40, (8, 16)).repeat(1, 2)  # each row repeats itself: learnable in a few steps
    target = tiny_deepseek_v4(seed=0)
    loop = LoopConfig(total_steps=12, batch_size=4, learning_rate=3e-3, warmup_steps=1, log_every=1)
    train_language_model(target, chunks, tmp_path / "run", loop, title="tiny")
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    lm_losses = [row["lm_loss"] for row in log if "lm_loss" in row]
    assert len(lm_losses) == 12 and lm_losses[-1] < lm_losses[0]
    assert (tmp_path / "run" / "loss.png").read_bytes().startswith(b"\x89PNG")
