"""The drafter a DeepSeek-V4 release ships, read from the target's own checkpoint (`from_target_checkpoint`).

The release is the shipped reference pair written as DeepSeek ships V4 (`hf_hyperdflash.deepseek_checkpoint`):
original key names, FP8 E4M3 linears with E8M0 block scales, MXFP4 routed experts, BF16 norms, F32 hyper-connection
parameters, three shards and an index; the MTP block under `mtp.0.*`. The target loads from it with transformers'
own `from_pretrained` (its FP8 quantizer dequantizes on this CPU), the MTP with `from_target_checkpoint`.
"""

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_hyperdflash import DeepseekV4DSparkForDrafting, DeepseekV4MTPForDrafting, reference
from hf_hyperdflash.deepseek_checkpoint import dspark_config_fields, dspark_tensors, mtp_tensors, write_release
from hf_hyperdflash.evaluation import command as eval_command
from hf_hyperdflash.evaluation.harness import load_drafter
from hf_hyperdflash.evaluation.report import REPORT_FILES
from hf_hyperdflash.testing import DECODE_EVERY_PAIR, HUB_PROMPT, run_without_the_library

FIXTURES = Path(__file__).parent / "fixtures"
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32)
    mtp = DeepseekV4MTPForDrafting.from_pretrained(reference.mtp_path(), dtype=torch.float32)
    return write_release(target, tmp_path_factory.mktemp("release"), mtp_tensors(mtp))


@pytest.fixture(scope="module")
def released_pair(release):
    # .float(): transformers 5.23 leaves a dequantized release's unquantized tensors BF16 whatever `dtype` asks
    target = AutoModelForCausalLM.from_pretrained(release, dtype=torch.float32).float().eval()
    return target, DeepseekV4MTPForDrafting.from_target_checkpoint(release, dtype=torch.float32)


def released_tensors(folder) -> dict[str, torch.Tensor]:
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for name, shard in weight_map.items():
        if name.startswith("mtp."):
            with safe_open(folder / shard, "pt") as file:
                tensors[name] = file.get_tensor(name)
    return tensors


def block_layout(num_experts: int) -> dict[str, str]:
    """A released V4 block's tensors and dtypes, as vLLM's loaders (`deepseek_v4_mtp.py`, `nvidia/dspark.py`) and
    DeepSeek's `inference/model.py` read them: 29 + 6 per routed expert."""
    layout = {"attn.attn_sink": "F32", "ffn.gate.bias": "F32", "ffn.gate.weight": "BF16"}
    layout |= {f"{norm}.weight": "BF16" for norm in ("attn.q_norm", "attn.kv_norm", "attn_norm", "ffn_norm")}
    fp8 = [f"attn.{name}" for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")]
    fp8 += [f"ffn.shared_experts.{w}" for w in ("w1", "w2", "w3")]
    layout |= {f"{linear}.weight": "F8_E4M3" for linear in fp8} | {f"{linear}.scale": "F8_E8M0" for linear in fp8}
    for expert in range(num_experts):
        for w in ("w1", "w2", "w3"):
            layout |= {f"ffn.experts.{expert}.{w}.weight": "I8", f"ffn.experts.{expert}.{w}.scale": "F8_E8M0"}
    for site in ("attn", "ffn"):
        layout |= {f"hc_{site}_{part}": "F32" for part in ("fn", "base", "scale")}
    return layout


HEAD_LAYOUT = {"norm.weight": "BF16"} | {f"hc_head_{part}": "F32" for part in ("fn", "base", "scale")}


def expected_mtp_layout(num_experts: int) -> dict[str, str]:
    """`mtp.0.*` of a V4 release with native MTP: the block, `e_proj` / `h_proj` (FP8), `enorm` / `hnorm`, the final
    norm and collapse head: 39 + 6 per routed expert (1,575 for V4-Flash's 256 experts)."""
    layout = block_layout(num_experts) | HEAD_LAYOUT | {"enorm.weight": "BF16", "hnorm.weight": "BF16"}
    layout |= {f"{linear}.{part}": dtype for linear in ("e_proj", "h_proj") for part, dtype in FP8_PARTS.items()}
    return {f"mtp.0.{name}": dtype for name, dtype in layout.items()}


def expected_dspark_layout(num_experts: int, num_stages: int = 3) -> dict[str, str]:
    """`mtp.{0,1,2}.*` of a V4 release with DSpark ("0731"): three blocks; `main_proj` (FP8) and `main_norm` on the
    first; the final norm, collapse head, Markov head and confidence head (BF16) on the last (1,568 / 1,565 / 1,572
    tensors for V4-Flash's 256 experts)."""
    layout = {f"mtp.{i}.{name}": dtype for i in range(num_stages) for name, dtype in block_layout(num_experts).items()}
    layout |= {f"mtp.0.main_proj.{part}": dtype for part, dtype in FP8_PARTS.items()} | {
        "mtp.0.main_norm.weight": "BF16"
    }
    last = {"markov_head.markov_w1.weight": "BF16", "markov_head.markov_w2.weight": "BF16"}
    last |= {"confidence_head.proj.weight": "BF16"} | HEAD_LAYOUT
    return layout | {f"mtp.{num_stages - 1}.{name}": dtype for name, dtype in last.items()}


FP8_PARTS = {"weight": "F8_E4M3", "scale": "F8_E8M0"}
DTYPE_NAMES = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int8: "I8",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
}


def test_the_release_holds_the_mtp_block_in_the_layout_the_public_loaders_read(release):
    config = json.loads((release / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and config["expert_dtype"] == "fp4"
    tensors = released_tensors(release)
    layout = {name: DTYPE_NAMES[tensor.dtype] for name, tensor in tensors.items()}
    assert layout == expected_mtp_layout(config["n_routed_experts"])
    hidden, intermediate = config["hidden_size"], config["moe_intermediate_size"]
    assert tensors["mtp.0.ffn.experts.0.w1.weight"].shape == (intermediate, hidden // 2)  # two E2M1 per byte
    assert tensors["mtp.0.ffn.experts.0.w1.scale"].shape == (intermediate, hidden // 32)
    assert tensors["mtp.0.e_proj.scale"].shape == (-(-hidden // 128), -(-hidden // 128))


def dequantized(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A released weight's values, read by hand: FP8 times its block's scale; MXFP4 nibbles (first in the low
    one) times their group's scale."""
    weight, scale = tensors[f"{name}.weight"], tensors[f"{name}.scale"].float()
    if weight.dtype == torch.int8:
        codes = weight.view(torch.uint8).long()
        values = torch.tensor(FP4_VALUES)[torch.stack([codes & 15, codes >> 4], dim=-1)].flatten(-2)
        return values * scale.repeat_interleave(32, dim=-1)
    rows, cols = weight.shape
    grid = scale.repeat_interleave(128, dim=0)[:rows].repeat_interleave(128, dim=1)[:, :cols]
    return weight.float() * grid


def test_the_loaded_mtp_holds_exactly_the_released_values(release, released_pair):
    _, mtp = released_pair
    tensors = released_tensors(release)
    assert torch.equal(mtp.e_proj.weight, dequantized(tensors, "mtp.0.e_proj"))
    assert torch.equal(mtp.block.self_attn.q_a_proj.weight, dequantized(tensors, "mtp.0.attn.wq_a"))
    first_expert = torch.cat([dequantized(tensors, f"mtp.0.ffn.experts.0.{w}") for w in ("w1", "w3")])
    assert torch.equal(mtp.block.mlp.experts.gate_up_proj[0], first_expert)
    assert torch.equal(mtp.norm.weight, tensors["mtp.0.norm.weight"].float())  # its own, not the target's norm
    assert torch.equal(mtp.hc_head.hc_fn, tensors["mtp.0.hc_head_fn"])
    assert mtp.config.target_name_or_path == str(release) and not hasattr(mtp, "lm_head")


def _prompts(count: int) -> list[torch.LongTensor]:
    """Lengths past the sliding window (64) and several compression windows of the reference target."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 8192, (1, 70 + 5 * i), generator=generator) for i in range(count)]


def _assert_lossless(target, mtp, prompts) -> int:
    accepted = 0
    for prompt in prompts:
        plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
        assert torch.equal(target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=mtp), plain)
        accepted += sum(mtp.last_generation_stats.accepted_per_step)
    return accepted


def test_generate_with_the_released_mtp_is_plain_greedy_decoding(released_pair):
    target, mtp = released_pair
    mtp.generation_config.num_assistant_tokens_schedule = "constant"  # every step drafts: rollbacks too
    assert _assert_lossless(target, mtp, _prompts(4)) > 0


@pytest.mark.slow
def test_generate_with_the_released_mtp_on_fifty_prompts(released_pair):
    target, mtp = released_pair
    mtp.generation_config.num_assistant_tokens_schedule = "constant"
    assert _assert_lossless(target, mtp, _prompts(50)) > 0


@pytest.mark.slow
def test_generate_with_the_released_dspark_on_fifty_prompts(dspark_release):
    target = AutoModelForCausalLM.from_pretrained(dspark_release, dtype=torch.float32).float().eval()
    dspark = DeepseekV4DSparkForDrafting.from_target_checkpoint(dspark_release, dtype=torch.float32)
    dspark.generation_config.num_assistant_tokens_schedule = "constant"
    _assert_lossless(target, dspark, _prompts(50))


def test_hyperdflash_eval_takes_a_release_as_its_mtp(release, released_pair):
    target, mtp = released_pair
    loaded = load_drafter("mtp", release, target, torch.float32)
    assert torch.equal(loaded.e_proj.weight, mtp.e_proj.weight)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_a_saved_release_drafter_decodes_in_a_process_without_the_package(request, kind, tmp_path):
    """Saved with `save_pretrained`, a drafter read from a release is an ordinary drafter: a process that cannot import
    the package decodes with it through `trust_remote_code` alone, greedy as plain decoding, and samples."""
    folder = request.getfixturevalue("release" if kind == "mtp" else "dspark_release")
    loader = DeepseekV4MTPForDrafting if kind == "mtp" else DeepseekV4DSparkForDrafting
    loader.from_target_checkpoint(folder, dtype=torch.float32).save_pretrained(tmp_path / kind)
    case = {"target": str(folder), "target_class": "DeepseekV4ForCausalLM", "prompt": HUB_PROMPT}
    case["drafters"] = [str(tmp_path / kind)]
    *results, status = json.loads(
        run_without_the_library(tmp_path, DECODE_EVERY_PAIR, json.dumps([case])).splitlines()[-1]
    )
    assert not status["library_imported"]
    assert results[0]["identical"] and results[0]["sampled_new_tokens"] == 24


def _altered(release, tmp_path, config_changes=None, drop=()) -> str:
    folder = tmp_path / "altered"
    shutil.copytree(release, folder)
    config = json.loads((folder / "config.json").read_text()) | (config_changes or {})
    (folder / "config.json").write_text(json.dumps(config))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: shard for name, shard in index["weight_map"].items() if not drop(name)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("v4.1", "a 'deepseek_v41' checkpoint, not DeepSeek-V4"),
        ("no drafter", r"ships no drafter \(no `mtp\.\*`\)"),
        ("partial", r"do not load: 1 missing \(block\.self_attn\.kv_proj\.weight\)"),
    ],
)
def test_a_release_without_a_loadable_mtp_is_refused_in_one_line(release, tmp_path, case, message):
    changes, drop = {}, lambda name: False
    if case == "v4.1":
        changes = {"model_type": "deepseek_v41", "text_config": {}}
    elif case == "no drafter":
        drop = lambda name: name.startswith("mtp.")  # noqa: E731
    else:
        drop = lambda name: name.startswith("mtp.0.attn.wkv.")  # noqa: E731
    with pytest.raises(ValueError, match=message) as error:
        DeepseekV4MTPForDrafting.from_target_checkpoint(_altered(release, tmp_path, changes, drop))
    assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def dspark_release(tmp_path_factory):
    """The reference target with an untrained DSpark (3 stages on its last three layers, Markov rank 32)."""
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32)
    torch.manual_seed(0)
    dspark = DeepseekV4DSparkForDrafting.from_target(target, dspark_noise_token_id=3, dspark_markov_rank=32)
    folder = tmp_path_factory.mktemp("dspark_release")
    return write_release(target, folder, dspark_tensors(dspark), dspark_config_fields(dspark))


def test_the_dspark_release_holds_its_stages_and_heads_in_the_released_layout(dspark_release):
    config = json.loads((dspark_release / "config.json").read_text())
    assert config["dspark_block_size"] == 5 and config["dspark_target_layer_ids"] == [1, 2, 3]
    tensors = released_tensors(dspark_release)
    layout = {name: DTYPE_NAMES[tensor.dtype] for name, tensor in tensors.items()}
    assert layout == expected_dspark_layout(config["n_routed_experts"])
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    assert tensors["mtp.2.markov_head.markov_w1.weight"].shape == (vocab, 32)
    assert tensors["mtp.2.markov_head.markov_w2.weight"].shape == (vocab, 32)
    assert tensors["mtp.2.confidence_head.proj.weight"].shape == (1, hidden + 32)
    assert tensors["mtp.0.main_proj.weight"].shape == (hidden, 3 * hidden)


def test_dspark_from_a_release_holds_its_values_and_decodes_as_plain_greedy(dspark_release):
    target = AutoModelForCausalLM.from_pretrained(dspark_release, dtype=torch.float32).float().eval()
    dspark = DeepseekV4DSparkForDrafting.from_target_checkpoint(dspark_release, dtype=torch.float32)
    tensors = released_tensors(dspark_release)
    assert torch.equal(dspark.main_proj.weight, dequantized(tensors, "mtp.0.main_proj"))
    assert torch.equal(dspark.layers[2].self_attn.kv_proj.weight, dequantized(tensors, "mtp.2.attn.wkv"))
    assert torch.equal(dspark.markov_w2.weight, tensors["mtp.2.markov_head.markov_w2.weight"].float())
    assert torch.equal(dspark.confidence_head.weight, tensors["mtp.2.confidence_head.proj.weight"].float())
    assert dspark.config.dspark_noise_token_id == 3 and dspark.config.num_hidden_layers == 3
    dspark.generation_config.num_assistant_tokens_schedule = "constant"
    _assert_lossless(target, dspark, _prompts(3))
    assert set(dspark.last_generation_stats.proposed_per_step) >= {5}  # whole blocks: every row drafts


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_each_loader_names_the_drafter_a_release_ships_instead(release, dspark_release, kind):
    loader, other = (
        (DeepseekV4MTPForDrafting, dspark_release) if kind == "mtp" else (DeepseekV4DSparkForDrafting, release)
    )
    with pytest.raises(ValueError, match="Load it with `DeepseekV4.*from_target_checkpoint`") as error:
        loader.from_target_checkpoint(other)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_hyperdflash_eval_runs_a_releases_drafters_beside_plain_decoding(release, dspark_release, tmp_path, capsys):
    """`--mtp` and `--dspark` take releases (the target's checkpoint): both rows run, every greedy output lossless."""
    argv = ["--target", str(dspark_release), "--tokenizer", str(reference.tokenizer_path())]
    argv += ["--mtp", str(release), "--mtp-steps", "2", "--dspark", str(dspark_release), "--no-reference-drafters"]
    argv += ["--datasets", f"gsm8k={FIXTURES / 'gsm8k.jsonl'}", "--num-prompts", "2", "--max-prompt-chars", "60"]
    argv += ["--max-new-tokens", "8", "--repeats", "1", "--temperatures", "0", "--output-dir", str(tmp_path)]
    args = eval_command.add_eval_arguments(argparse.ArgumentParser()).parse_args(argv)
    assert eval_command.run_eval(args) == 0
    data = json.loads((tmp_path / REPORT_FILES["json"]).read_text())
    assert data["run"]["methods"] == ["plain", "mtp-k2", "dspark"]
    assert all(m["lossless"] == m["compared"] == 2 for s in data["settings"] for m in s["methods"])
