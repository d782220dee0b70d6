"""Publishing: save_pretrained writes a model card with model-index front matter, and push_to_hub uploads exactly
the folder save_pretrained writes (checked offline, with the Hub client replaced by a recorder)."""

import json
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml

from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.modeling.target_architecture import target_fingerprint
from hf_hyperdflash.testing import tiny_deepseek_v4


@pytest.fixture(scope="module")
def target():
    model = tiny_deepseek_v4(seed=0)
    model.config.name_or_path = "deepseek-ai/DeepSeek-V4-Flash"  # as if loaded from the Hub
    return model


def read_card(folder):
    text = (folder / "README.md").read_text()
    _, front, body = text.split("---\n", 2)
    return yaml.safe_load(front), body


def test_card_describes_the_drafter_and_its_target(target, tmp_path):
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=6, conditioning="intermediate", reducer="dense")
    drafter.save_pretrained(tmp_path / "my-dflash")
    front, body = read_card(tmp_path / "my-dflash")
    assert front["library_name"] == "transformers"
    assert front["base_model"] == "deepseek-ai/DeepSeek-V4-Flash"
    assert {"speculative-decoding", "deepseek_v4"} <= set(front["tags"])
    (entry,) = front["model-index"]
    assert entry["name"] == "my-dflash" and entry["results"][0]["metrics"] == []  # no tau measured, none claimed
    for row in ("| block size | 6 |", "| reducer | dense |", "| conditioning | intermediate |"):
        assert row in body
    assert f"outputs of target layers {drafter.config.target_layer_ids}" in body
    assert 'AutoModel.from_pretrained("my-dflash", trust_remote_code=True' in body
    assert "assistant_model=drafter" in body and "import hf_hyperdflash" not in body
    config = json.loads((tmp_path / "my-dflash" / "config.json").read_text())
    assert config["target_name_or_path"] == "deepseek-ai/DeepSeek-V4-Flash"
    assert config["target_fingerprint"] == target_fingerprint(target.config)


def test_card_reports_tau_when_measured(target, tmp_path):
    drafter = DeepseekV4MTPForDrafting.from_target(target)
    drafter.measured_tau = 2.345
    drafter.save_pretrained(tmp_path / "mtp")
    front, body = read_card(tmp_path / "mtp")
    metrics = front["model-index"][0]["results"][0]["metrics"]
    assert metrics == [{"type": "mean_accepted_length", "name": "tau", "value": 2.345}]
    assert "2.35" in body and "native DeepSeek-V4 MTP module" in body


def test_push_to_hub_uploads_what_save_pretrained_writes(target, monkeypatch):
    uploads = []

    class RecordingApi:
        def __init__(self, token=None):
            self.token = token

        def create_repo(self, repo_id, private=None, exist_ok=False):
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(self, repo_id, folder_path, commit_message, **options):
            files = {path.name: path.read_bytes() for path in Path(folder_path).iterdir()}
            uploads.append({"repo_id": repo_id, "files": files, "message": commit_message, **options})
            return "commit"

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=4)
    assert drafter.push_to_hub("org/hyperdflash-tiny", commit_message="first") == "commit"
    (upload,) = uploads
    assert upload["repo_id"] == "org/hyperdflash-tiny" and upload["message"] == "first"
    files = upload["files"]
    expected = {"config.json", "generation_config.json", "model.safetensors", "README.md", "modeling_hyperdflash.py"}
    assert expected | {"drafting.py", "integration.py", "draft_policy.py"} <= set(files)
    card = files["README.md"].decode()
    assert "name: org/hyperdflash-tiny" in card or '"name": "org/hyperdflash-tiny"' in card
    assert 'AutoModel.from_pretrained("org/hyperdflash-tiny", trust_remote_code=True' in card
    assert "auto_map" in json.loads(files["config.json"])
