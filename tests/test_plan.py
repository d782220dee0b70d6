"""`hyperdflash plan`: sizes from the meta device agree with real models and caches; the speedup formula."""

import json

import pytest
import torch

from hf_hyperdflash import HyperDFlashForDrafting
from hf_hyperdflash.cli import main
from hf_hyperdflash.plan import expected_speedup, layer_timings, sizes, target_bytes_per_process


def test_sizes_match_real_models_and_a_filled_cache(target):
    report = sizes(target.config, {"block_size": 4, "context_window": 6}, "float32", batch=2, seq_len=32)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=4, context_window=6)
    assert report["target_parameters"] == sum(p.numel() for p in target.parameters())
    assert report["drafter"]["parameters"] == sum(p.numel() for p in drafter.parameters())
    assert report["drafter"]["bytes"] == 4 * report["drafter"]["parameters"]
    cache = drafter.make_context_cache()
    with torch.no_grad():
        drafter(
            torch.randn(1, 1, 64), torch.randn(1, 20, 4, 64), torch.arange(20)[None], torch.tensor([[20]]), cache=cache
        )
    kept = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers) * 4
    assert kept == 6 * report["drafter_kv_bytes_per_context_token"]  # the window, not the 20 positions
    assert report["drafter_kv_bytes_at_context"]["8192"]["windowed"] == kept
    assert report["captured_feature_bytes_per_token"] == 4 * 64 * 4
    training = report["training_bytes_per_process"]
    parts = ("target_weights", "drafter_weights_grads_adam_fp32", "captured_features", "draft_logits_fp32")
    assert training["total"] == sum(training[name] for name in parts)


def test_expected_speedup_formula():
    timings = {"k": 3, "target_layer_1": 1.0, "target_layer_4": 1.5, "draft_layer_step": 0.5}
    timings |= {"lm_head_1": 2.0, "lm_head_3": 2.5, "lm_head_4": 3.0}
    expected = expected_speedup(timings, num_target_layers=10, num_draft_layers=2, tau=3.0)
    step, verify, draft = 10 * 1.0 + 2.0, 10 * 1.5 + 3.0, 2 * 0.5 + 2.5
    assert expected["speedup"] == pytest.approx(3.0 * step / (verify + draft))
    assert expected["verify_over_step"] == pytest.approx(verify / step)


def test_plan_command_on_a_saved_config(target, tmp_path, capsys):
    target.config.save_pretrained(tmp_path)
    timings = layer_timings(target.config, {"block_size": 4})
    assert timings["k"] == 3 and all(timings[key] > 0 for key in ("target_layer_1", "target_layer_4", "lm_head_3"))
    assert main(["plan", "--target-config", str(tmp_path / "config.json"), "--block-size", "4", "--no-timing"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target_parameters"] == sum(p.numel() for p in target.parameters())
    assert main(["plan", "--target-config", str(tmp_path), "--block-size", "4", "--tau", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["expected"]["tau"] == 2.0  # exact: the --tau value passed through
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--target-config", str(tmp_path / "missing.json")])
    assert exit_info.value.code == 2


def test_bytes_per_process_split_what_each_plan_names_and_keep_the_rest_whole(target):
    """The tiny V4's TP plan names the shared experts, the embedding and the LM head, its EP plan the routed
    experts."""
    config = target.config
    whole = sum(p.numel() for p in target.parameters()) * 4
    assert target_bytes_per_process(config, 1, "float32") == {"processes": 1, "tp": whole, "ep": whole, "tp+ep": whole}
    routed = sum(p.numel() for n, p in target.named_parameters() if ".mlp.experts." in f"{n}.") * 4
    shared = sum(p.numel() for n, p in target.named_parameters() if ".mlp.shared_experts." in n) * 4
    split = shared + (target.lm_head.weight.numel() + target.model.embed_tokens.weight.numel()) * 4
    spread = target_bytes_per_process(config, 2, "float32")
    assert spread["ep"] == whole - routed // 2
    assert spread["tp"] == whole - split // 2
    assert spread["tp+ep"] == whole - (routed + split) // 2
