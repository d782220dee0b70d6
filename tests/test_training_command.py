"""`hyperdflash train` options (flags, config file, help) and a full single-process run, resumed and LoRA-tuned."""

import argparse
import json
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState
from transformers import AutoConfig, AutoModel, AutoTokenizer

from hf_hyperdflash import DeepseekV4DSparkForDrafting, HyperDFlashForDrafting, reference
from hf_hyperdflash.testing import tiny_deepseek_v4
from hf_hyperdflash.training.command import (
    DEFAULTS,
    _drafter_overrides,
    add_train_arguments,
    resolve_settings,
    run_train,
)
from hf_hyperdflash.training.curves import read_log
from hf_hyperdflash.training.data import reply_directories
from hf_hyperdflash.training.options import recipe_markov_rank
from hf_hyperdflash.training.trainer import build_drafter


def parse(argv: list[str]) -> argparse.Namespace:
    return add_train_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_flags_override_the_config_file_which_overrides_defaults(tmp_path):
    config = tmp_path / "train.json"
    config.write_text(
        json.dumps({"block_size": 8, "learning_rate": 1e-4, "output_dir": "from_file", "thinking": True})
    )
    settings = resolve_settings(parse(["--config", str(config), "--learning-rate", "5e-4", "--no-thinking"]))
    assert settings["block_size"] == 8 and settings["output_dir"] == "from_file"
    assert settings["learning_rate"] == 5e-4 and settings["thinking"] is False
    assert settings["kl_weight"] == DEFAULTS["kl_weight"]
    assert parse(["--target-layer-ids", "0,2", "--output-dir", "x"]).target_layer_ids == [0, 2]

    config.write_text(json.dumps({"blocksize": 8}))
    with pytest.raises(ValueError, match="Unknown keys"):
        resolve_settings(parse(["--config", str(config)]))
    with pytest.raises(ValueError, match="--output-dir"):
        resolve_settings(parse([]))


CONFIGS = Path(__file__).parents[1] / "configs"
ABLATED = {  # what each ablation config changes in configs/ablations/hyperdflash.json, besides its output
    "vanilla_dflash": {"drafter_kind"},
    "dense_pre_collapse": {"reducer"},
    "gate_intermediate": {"conditioning"},
    "vanilla_layers_1_2": {"drafter_kind", "target_layer_ids"},
    "no_kl": {"kl_weight"},
    "gated_teacher": {"teacher"},
    "block_4": {"block_size"},
    "block_16": {"block_size"},
    "sampled_replies": {"temperature", "data_dir"},
    # the reference drafter's 2,000 steps, so that it compares with the shipped drafter
    "distill_all_positions": {"kl_weight", "kl_positions", "teacher", "total_steps"},
    # against DSpark, at the reference drafter's 2,000 steps too (configs/reference_drafter_dspark.json: block 8)
    "dspark_block5": {"drafter_kind", "recipe", "block_size", "total_steps"},
    "dspark_pre_collapse": {"drafter_kind", "recipe", "conditioning", "total_steps"},
    "hyperdflash_heads": {"markov_rank", "total_steps"},
    # the best-drafter ablations (docs/results.md, "On the previous reference pair"), at 2,000 steps
    "heads_markov_only": {"markov_rank", "confidence_weight", "total_steps"},
    "heads_confidence_only": {"markov_rank", "markov_bias", "total_steps"},
    "l1": {"l1_weight", "total_steps"},
    "heads_l1": {"markov_rank", "l1_weight", "total_steps"},
    "heads_l1_sampled": {"markov_rank", "l1_weight", "temperature", "data_dir", "total_steps"},
    "heads_l1_mixed": {"markov_rank", "l1_weight", "temperature", "reply_weights", "data_dir", "total_steps"},
    "heads_l1x4": {"markov_rank", "l1_weight", "total_steps"},
    "heads_l1x16": {"markov_rank", "l1_weight", "total_steps"},
    "heads_l1x4_mixed": {"markov_rank", "l1_weight", "temperature", "reply_weights", "data_dir", "total_steps"},
    "heads_l1x4_t07": {"markov_rank", "l1_weight", "temperature", "reply_weights", "data_dir", "total_steps"},
    "heads_l1x4_mixed_w2": {"markov_rank", "l1_weight", "temperature", "reply_weights", "data_dir", "total_steps"},
    "heads_l1x4_mixed_w3": {"markov_rank", "l1_weight", "temperature", "reply_weights", "data_dir", "total_steps"},
    "heads_l1x4_mixed_w6": {"markov_rank", "l1_weight", "temperature", "reply_weights", "data_dir", "total_steps"},
    "heads_l1x4_mixed_argmax": {
        *("markov_rank", "l1_weight", "ce_label", "temperature", "reply_weights", "data_dir", "total_steps")
    },
    # the shipped hybrid recipe (heads_l1x4_mixed_w6) at block 4
    "hybrid_block_4": {
        *("markov_rank", "l1_weight", "temperature", "reply_weights", "data_dir", "total_steps", "block_size")
    },
    # DSpark on the same mixed replies as the hybrid recipe, at the reference drafters' steps
    "dspark_mixed_w6": {"drafter_kind", "recipe", "temperature", "reply_weights", "data_dir", "total_steps"},
}


def test_shipped_configs_resolve_and_each_ablation_changes_only_what_it_names():
    for path in CONFIGS.rglob("*.json"):  # each writes to its own directory, named after the kind or ablation
        output_dir = resolve_settings(parse(["--config", str(path)]))["output_dir"]
        assert output_dir.endswith(path.stem.removeprefix("reference_drafter_")), path
    base = resolve_settings(parse(["--config", str(CONFIGS / "ablations" / "hyperdflash.json")]))
    assert sorted(ABLATED) == sorted(p.stem for p in (CONFIGS / "ablations").glob("*.json") if p.stem != "hyperdflash")
    for name, changed in ABLATED.items():
        settings = resolve_settings(parse(["--config", str(CONFIGS / "ablations" / f"{name}.json")]))
        differences = {key for key in settings if settings[key] != base[key]} - {"output_dir"}
        assert differences == changed, name


def test_the_shipped_hyperdflash_drafter_trains_the_default_recipe_of_the_winning_ablation():
    shipped = resolve_settings(parse(["--config", str(CONFIGS / "reference_drafter_hyperdflash.json")]))
    ablation = resolve_settings(parse(["--config", str(CONFIGS / "ablations" / "heads_l1x4_mixed_w6.json")]))
    assert shipped["recipe"] == "hybrid" and ablation["recipe"] == "paper"
    hidden_size = AutoConfig.from_pretrained(reference.target_path()).hidden_size
    shipped["markov_rank"] = recipe_markov_rank(shipped, hidden_size)
    differences = {key for key in shipped if shipped[key] != ablation[key]}
    # the recipe named, not spelled out; the scaling curve's point (docs/results.md, "The drafter at scale"): more
    # prompts, twice the steps in two warm-restart cycles; no evaluation during training
    scale = {"num_prompts", "total_steps", "cycle_steps", "eval_every", "eval_prompts"}
    assert differences == {"recipe", "output_dir", "data_dir", *scale}
    assert (shipped["num_prompts"], shipped["total_steps"], shipped["cycle_steps"]) == (8000, 4000, 2000)


def test_every_option_has_a_flag_and_help():
    parser = add_train_arguments(argparse.ArgumentParser())
    actions = {action.dest: action for action in parser._actions}
    for name in DEFAULTS:
        assert name in actions and len(actions[name].help) > 10, name


def test_dspark_options_become_its_config_and_what_does_not_apply_is_refused():
    target = tiny_deepseek_v4(seed=0, pad_token_id=3)

    def built(flags: list[str]):
        return build_drafter(target, **_drafter_overrides(resolve_settings(parse(["--output-dir", "x", *flags]))))

    flags = ["--drafter-kind", "dspark", "--block-size", "6", "--num-layers", "2"]
    dspark = built(flags)
    config = dspark.config
    assert isinstance(dspark, DeepseekV4DSparkForDrafting) and config.num_hidden_layers == 2
    assert config.dspark_block_size == 5  # DeepSeek's 5 rows: a block of 6 with the anchor
    assert config.dspark_markov_rank == target.config.hidden_size // 16 and config.dspark_noise_token_id == 3
    assert config.dspark_conditioning == "stream_mean" and len(config.dspark_target_layer_ids) == 3
    hybrid = built([*flags, "--conditioning", "pre_collapse"])
    assert hybrid.config.dspark_target_layer_ids == [target.config.num_hidden_layers - 1]
    heads = built(["--markov-rank", "4"])
    assert isinstance(heads, HyperDFlashForDrafting) and heads.markov_w1.weight.shape[1] == 4
    for extra, message in (
        (["--reducer", "dense"], "do not apply to --drafter-kind dspark"),
        (["--conditioning", "intermediate"], "pre_collapse"),
        (["--context-window", "0"], "positive --context-window"),
        (["--block-size", "1"], "leaves no draft"),
    ):
        with pytest.raises(ValueError, match=message):
            built([*flags, *extra])


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("target")
    tiny_deepseek_v4(seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids).save_pretrained(
        path
    )
    return path


def test_train_command_runs_resumes_and_lora_tunes(target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(4)))
    common = ["--target", str(target_dir), "--tokenizer", str(reference.tokenizer_path())]
    common += ["--data", str(prompts), "--max-new-tokens", "12", "--eval-data", str(prompts), "--eval-prompts", "1"]
    common += ["--eval-max-new-tokens", "8", "--batch-size", "2", "--anchors-per-sequence", "4", "--warmup-steps", "1"]
    common += ["--log-every", "1", "--checkpoint-every", "2", "--eval-every", "2", "--total-steps", "2"]
    out = tmp_path / "out"
    config = tmp_path / "drafter.json"
    config.write_text(
        json.dumps({"block_size": 4, "num_layers": 1, "drafter_kind": "vanilla_dflash", "context_window": 8})
    )

    drafter_dir = run_train(parse([*common, "--config", str(config), "--output-dir", str(out)]))
    AcceleratorState._reset_state(reset_partial_state=True)
    drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)
    assert drafter.config.block_size == 4 and drafter.config.conditioning == "intermediate"
    assert drafter.config.context_window == 8
    settings = resolve_settings(parse(["--output-dir", "x", "--context-window", "0"]))
    assert _drafter_overrides(settings)["context_window"] is None  # 0: the whole context
    last_tau = [r["tau"] for r in read_log(out / "run" / "log.jsonl") if "tau" in r][-1]
    assert json.dumps({"value": last_tau})[1:-1] in (drafter_dir / "README.md").read_text()  # on the model card
    records = read_log(out / "run" / "log.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2] and any("tau" in r for r in records)
    assert json.loads((out / "train_settings.json").read_text())["num_processes"] == 1

    run_train(parse([*common, "--config", str(config), "--output-dir", str(out)]))  # resumes: nothing left to do
    AcceleratorState._reset_state(reset_partial_state=True)
    assert read_log(out / "run" / "log.jsonl") == records

    tuned = ["--init-from", str(drafter_dir), "--lora-rank", "2", "--data-dir", str(out / "data")]
    with pytest.raises(ValueError, match="only apply to a new drafter"):
        run_train(parse([*common, *tuned, "--block-size", "8", "--output-dir", str(tmp_path / "bad")]))
    AcceleratorState._reset_state(reset_partial_state=True)
    tuned_dir = run_train(parse([*common, *tuned, "--output-dir", str(tmp_path / "lora")]))
    AcceleratorState._reset_state(reset_partial_state=True)
    assert AutoModel.from_pretrained(tuned_dir, trust_remote_code=True).config.conditioning == "intermediate"


@pytest.mark.slow
def test_train_command_on_replies_from_a_serving_engine(target_dir, tmp_path):
    replies = tmp_path / "replies.jsonl"
    chat = [{"role": "user", "content": "Say something."}]
    replies.write_text("".join(json.dumps({"messages": chat, "reply": f"Reply {i}."}) + "\n" for i in range(4)))
    args = ["--target", str(target_dir), "--tokenizer", str(reference.tokenizer_path()), "--replies", str(replies)]
    args += ["--block-size", "4", "--num-layers", "1", "--batch-size", "2", "--anchors-per-sequence", "2"]
    args += ["--total-steps", "2", "--warmup-steps", "1", "--log-every", "1", "--output-dir", str(tmp_path / "out")]
    drafter_dir = run_train(parse(args))
    AcceleratorState._reset_state(reset_partial_state=True)
    assert (drafter_dir / "config.json").exists() and not (tmp_path / "out" / "data").exists()  # nothing generated
    assert [r["step"] for r in read_log(tmp_path / "out" / "run" / "log.jsonl") if "loss" in r] == [1, 2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": chat, "reply_ids": [10**6]}) + "\n")
    with pytest.raises(ValueError, match="line 1: reply token ids"):
        run_train(parse([*args[:4], "--replies", str(bad), "--output-dir", str(tmp_path / "bad")]))
    AcceleratorState._reset_state(reset_partial_state=True)


def test_reply_temperatures_are_one_or_more_distinct_numbers(tmp_path):
    assert resolve_settings(parse(["--output-dir", "x", "--recipe", "paper"]))["temperature"] == [0.0]
    assert resolve_settings(parse(["--output-dir", "x", "--temperature", "0", "1"]))["temperature"] == [0.0, 1.0]
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"temperature": 0.7, "output_dir": "x"}))  # one number, as older configs give it
    assert resolve_settings(parse(["--config", str(config)]))["temperature"] == [0.7]
    for bad, message in (([-1.0], ">= 0"), ([0.0, 0.0], "repeat"), ([], ">= 0"), (["hot"], ">= 0")):
        config.write_text(json.dumps({"temperature": bad, "output_dir": "x"}))
        with pytest.raises(ValueError, match=message):
            resolve_settings(parse(["--config", str(config)]))
    assert resolve_settings(parse(["--output-dir", "x", "--temperature", "0", "1"]))["reply_weights"] == [1, 1]
    weighted = parse(["--output-dir", "x", "--temperature", "0", "1", "--reply-weights", "3", "1"])
    assert resolve_settings(weighted)["reply_weights"] == [3, 1]
    for temperatures, weights in (([0.0, 1.0], [2]), ([0.0, 1.0], [0, 1]), ([0.0], [1.5])):
        config.write_text(json.dumps({"temperature": temperatures, "reply_weights": weights, "output_dir": "x"}))
        with pytest.raises(ValueError, match="one whole number >= 1 per temperature"):
            resolve_settings(parse(["--config", str(config)]))
    assert reply_directories(Path("d"), [0.0]) == {0.0: Path("d")}
    assert reply_directories(Path("d"), [0.0, 1.0]) == {0.0: Path("d/temperature-0"), 1.0: Path("d/temperature-1")}


def test_the_recipe_fills_what_the_run_leaves_out(tmp_path):
    """HyperDFlash trains with the hybrid recipe unless told otherwise; vanilla DFlash and DSpark as their papers."""
    hybrid = resolve_settings(parse(["--output-dir", "x"]))
    assert (hybrid["recipe"], hybrid["l1_weight"]) == ("hybrid", 4.0)
    assert (hybrid["temperature"], hybrid["reply_weights"]) == ([0.0, 1.0], [6, 1])
    assert recipe_markov_rank(hybrid, hidden_size=256) == 16 and recipe_markov_rank(hybrid, hidden_size=8) == 1
    paper = resolve_settings(parse(["--output-dir", "x", "--recipe", "paper"]))
    assert (paper["l1_weight"], paper["temperature"], paper["reply_weights"]) == (0.0, [0.0], [1])
    assert recipe_markov_rank(paper, hidden_size=256) is None
    vanilla = resolve_settings(parse(["--output-dir", "x", "--drafter-kind", "vanilla_dflash"]))
    assert (vanilla["recipe"], vanilla["temperature"]) == ("paper", [0.0])
    dspark = resolve_settings(parse(["--output-dir", "x", "--drafter-kind", "dspark"]))
    assert (dspark["recipe"], dspark["temperature"]) == (None, [0.0])
    assert recipe_markov_rank(dspark, hidden_size=256) is None, "DSpark's own rank is set when it is built"
    with pytest.raises(ValueError, match="drop --recipe"):
        resolve_settings(parse(["--output-dir", "x", "--drafter-kind", "dspark", "--recipe", "hybrid"]))
    # what the run gives wins; the recipe's weights go with the recipe's temperatures only
    given = ["--output-dir", "x", "--temperature", "0", "--l1-weight", "1", "--markov-rank", "4"]
    given = resolve_settings(parse(given))
    assert (given["temperature"], given["reply_weights"], given["l1_weight"]) == ([0.0], [1], 1.0)
    assert recipe_markov_rank(given, hidden_size=256) == 4
    tuned = resolve_settings(parse(["--output-dir", "x", "--init-from", "saved"]))
    assert recipe_markov_rank(tuned, hidden_size=256) is None, "a saved drafter keeps its own heads"
    served = resolve_settings(parse(["--output-dir", "x", "--replies", "replies.jsonl"]))
    assert (served["temperature"], served["reply_weights"], served["l1_weight"]) == ([0.0], [1], 4.0)


@pytest.mark.slow
def test_train_command_on_replies_at_two_temperatures(target_dir, tmp_path):
    """Greedy and sampled replies to the same prompts, each in its own folder, trained on together."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(3)))
    args = ["--target", str(target_dir), "--tokenizer", str(reference.tokenizer_path()), "--data", str(prompts)]
    args += ["--max-new-tokens", "6", "--temperature", "0", "1", "--block-size", "4", "--num-layers", "1"]
    args += ["--batch-size", "2", "--anchors-per-sequence", "2", "--total-steps", "2", "--warmup-steps", "1"]
    args += ["--eval-every", "0", "--output-dir", str(tmp_path / "out")]
    run_train(parse(args))
    AcceleratorState._reset_state(reset_partial_state=True)
    data = tmp_path / "out" / "data"
    for temperature in ("0", "1"):
        settings = json.loads((data / f"temperature-{temperature}" / "settings.json").read_text())
        assert settings["temperature"] == float(temperature)
        assert len((data / f"temperature-{temperature}" / "shard-000.jsonl").read_text().splitlines()) == 3


def test_cycle_steps_save_a_drafter_at_each_cycles_end(target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(2)))
    args = ["--target", str(target_dir), "--tokenizer", str(reference.tokenizer_path()), "--data", str(prompts)]
    args += ["--max-new-tokens", "6", "--temperature", "0", "--block-size", "4", "--num-layers", "1"]
    args += ["--batch-size", "2", "--anchors-per-sequence", "2", "--total-steps", "4", "--warmup-steps", "1"]
    args += ["--eval-every", "0", "--cycle-steps", "2", "--output-dir", str(tmp_path / "out")]
    final = run_train(parse(args))
    AcceleratorState._reset_state(reset_partial_state=True)
    assert sorted(p.name for p in (tmp_path / "out").glob("drafter*")) == ["drafter", "drafter-step-2"]
    snapshot = AutoModel.from_pretrained(tmp_path / "out" / "drafter-step-2", trust_remote_code=True)
    assert snapshot.config.block_size == AutoConfig.from_pretrained(final, trust_remote_code=True).block_size == 4
    for cycle in ("1", "-2"):
        with pytest.raises(ValueError, match="--cycle-steps"):
            run_train(parse([*args[:-4], "--cycle-steps", cycle, "--output-dir", str(tmp_path / "bad")]))
