"""Drafter training on a frozen tiny target: learning, exact resume, LoRA, bf16, vanilla DFlash, bitsandbytes."""

import json
import sys

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors import safe_open
from transformers import AutoModel

import hf_hyperdflash  # noqa: F401  (generate() integration for the tau evaluation)
from hf_hyperdflash import DeepseekV4DSparkForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.loading import load_target
from hf_hyperdflash.testing import tiny_deepseek_v4
from hf_hyperdflash.training.collator import IGNORE_INDEX, BlockCollator
from hf_hyperdflash.training.curves import read_log
from hf_hyperdflash.training.loop import LoopConfig
from hf_hyperdflash.training.losses import LossConfig
from hf_hyperdflash.training.options import CE_LABELS
from hf_hyperdflash.training.trainer import (
    DrafterWithFrozenTarget,
    build_drafter,
    optimizer_factory,
    train_drafter,
    without_markov_bias,
)

PROMPT_LENGTH = 6


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one process-wide state; tests with other precisions need it cleared."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def target():
    return tiny_deepseek_v4(seed=0).requires_grad_(False)


@pytest.fixture(scope="module")
def examples(target):
    """The target's own greedy replies to four random prompts."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(4):
        prompt = torch.randint(3, target.config.vocab_size, (1, PROMPT_LENGTH), generator=generator)
        with torch.no_grad():
            ids = target.generate(prompt, max_new_tokens=24, do_sample=False)[0]
        rows.append({"input_ids": ids, "loss_mask": torch.arange(len(ids)) >= PROMPT_LENGTH})
    return rows


def new_drafter(target, **overrides) -> HyperDFlashForDrafting:
    torch.manual_seed(0)
    return HyperDFlashForDrafting.from_target(target, block_size=4, num_hidden_layers=1, **overrides)


def loop(**overrides) -> LoopConfig:
    settings = dict(total_steps=6, batch_size=2, learning_rate=3e-3, warmup_steps=1, log_every=1, checkpoint_every=3)
    return LoopConfig(**{**settings, **overrides})


def losses_by_step(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(run_dir / "log.jsonl") if "loss" in r}


def test_training_learns_the_overfit_set_and_logs_tau_and_curves(target, examples, tmp_path, capsys):
    config = loop(total_steps=30, log_every=5, checkpoint_every=30, eval_every=30)
    prompts = [row["input_ids"][:PROMPT_LENGTH].tolist() for row in examples[:2]]
    train_drafter(
        new_drafter(target), target, examples, tmp_path, config, anchors_per_sequence=8, eval_prompts=prompts
    )
    records = read_log(tmp_path / "log.jsonl")
    train = [r for r in records if "loss" in r]
    assert {"loss", "ce", "kl", "acc", "acc_1", "acc_2", "tau_forced", "tokens_per_second"} <= set(train[0])
    assert train[-1]["ce"] < train[0]["ce"] - 0.3
    assert train[-1]["acc"] > train[0]["acc"] + 0.15
    taus = [r["tau"] for r in records if "tau" in r]
    assert len(taus) == 1 and taus[0] >= 1.0
    assert f"step 30: tau {taus[0]:.2f}" in capsys.readouterr().out.splitlines()  # printed at each evaluation
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_interrupted_then_resumed_run_matches_an_uninterrupted_one(target, examples, tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    train_drafter(new_drafter(target), target, examples, straight, loop(), anchors_per_sequence=4)

    def stop(step: int) -> None:
        raise KeyboardInterrupt(f"interrupted after step {step}")

    with pytest.raises(KeyboardInterrupt):
        train_drafter(
            new_drafter(target), target, examples, interrupted, loop(), anchors_per_sequence=4, on_checkpoint=stop
        )
    assert sorted(losses_by_step(interrupted)) == [1, 2, 3]
    with open(interrupted / "log.jsonl", "a") as handle:  # a record written after the checkpoint, before the crash
        handle.write(json.dumps({"step": 4, "loss": 99.0}) + "\n")
    # A differently initialised drafter: the checkpoint must restore weights, optimizer, schedule and anchors.
    torch.manual_seed(123)
    fresh = HyperDFlashForDrafting.from_target(target, block_size=4, num_hidden_layers=1)
    train_drafter(fresh, target, examples, interrupted, loop(), anchors_per_sequence=4)

    expected, resumed = losses_by_step(straight), losses_by_step(interrupted)
    assert sorted(resumed) == list(range(1, 7))
    for step, loss in expected.items():
        assert resumed[step] == pytest.approx(loss, abs=1e-5), step
    with safe_open(str(interrupted / "checkpoint" / "model.safetensors"), "pt") as checkpoint:
        assert all(key.startswith("drafter.") for key in checkpoint.keys()), "the frozen target stays out"


@pytest.mark.slow  # a training run; CI runs it (`-m slow`)
def test_training_against_a_target_offloaded_to_disk(target, examples, tmp_path):
    """A target dispatched by accelerate (part on CPU, part on disk): the same losses as the in-memory target, and
    an interrupted run resumes exactly."""
    target.save_pretrained(tmp_path / "target")
    offloaded = load_target(
        tmp_path / "target",
        "cpu",
        "float32",
        device_map="auto",
        max_memory={"cpu": "1MB"},
        offload_folder=tmp_path / "o",
    )
    assert {"cpu", "disk"} <= set(offloaded.hf_device_map.values())
    train_drafter(new_drafter(target), target, examples, tmp_path / "memory", loop(), anchors_per_sequence=4)
    train_drafter(new_drafter(target), offloaded, examples, tmp_path / "disk", loop(), anchors_per_sequence=4)
    in_memory, on_disk = losses_by_step(tmp_path / "memory"), losses_by_step(tmp_path / "disk")
    assert sorted(on_disk) == list(range(1, 7)) and on_disk[6] < on_disk[1]
    for step, loss in in_memory.items():
        assert on_disk[step] == pytest.approx(loss, abs=1e-5), step

    def stop(step: int) -> None:
        raise KeyboardInterrupt(f"interrupted after step {step}")

    run = tmp_path / "disk_resumed"
    with pytest.raises(KeyboardInterrupt):
        train_drafter(
            new_drafter(target), offloaded, examples, run, loop(), anchors_per_sequence=4, on_checkpoint=stop
        )
    train_drafter(new_drafter(target), offloaded, examples, run, loop(), anchors_per_sequence=4)
    resumed = losses_by_step(run)
    assert all(resumed[step] == pytest.approx(loss, abs=1e-5) for step, loss in on_disk.items())
    with pytest.raises(ValueError, match="only apply with a `device_map`"):
        load_target(tmp_path / "target", "cpu", max_memory={"cpu": "1MB"})


def test_lora_finetune_saves_a_plain_drafter_that_loads(target, examples, tmp_path):
    base_dir = tmp_path / "base"
    new_drafter(target).save_pretrained(base_dir)
    wrapped = build_drafter(target, init_from=base_dir, lora_rank=4, lora_alpha=8)
    trainable = {name for name, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)

    merged = train_drafter(wrapped, target, examples, tmp_path / "run", loop(total_steps=3), anchors_per_sequence=4)
    assert type(merged) is HyperDFlashForDrafting
    assert not any("lora" in key for key in merged.state_dict())
    base = HyperDFlashForDrafting.from_pretrained(base_dir)
    q_proj = "layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged.state_dict()[q_proj], base.state_dict()[q_proj]), "LoRA update merged"
    # Exact: frozen under LoRA and untouched by the merge, so the saved bits come back
    assert torch.equal(merged.state_dict()["mask_embedding"], base.state_dict()["mask_embedding"])

    merged.save_pretrained(tmp_path / "merged")
    loaded = AutoModel.from_pretrained(tmp_path / "merged", trust_remote_code=True)
    for key, value in merged.state_dict().items():  # exact: a safetensors round trip copies the bits
        assert torch.equal(loaded.state_dict()[key], value), key

    with pytest.raises(ValueError, match="only apply to a new drafter"):
        build_drafter(target, init_from=base_dir, block_size=8)
    with pytest.raises(ValueError, match="existing drafter"):
        build_drafter(target, lora_rank=4)


def test_vanilla_dflash_trains_on_intermediate_layers_in_bf16_with_accumulation(target, examples, tmp_path):
    drafter = new_drafter(target, reducer="dense", conditioning="intermediate", target_layer_ids=[1, 2])
    input_ids = examples[0]["input_ids"][None]
    features = DrafterWithFrozenTarget(drafter, target, LossConfig())._target_pass(
        input_ids, torch.ones_like(input_ids, dtype=torch.bool), torch.tensor([[PROMPT_LENGTH]])
    )[0]
    with torch.no_grad():
        layer_outputs = target.model(input_ids=input_ids, output_hidden_states=True).hidden_states
    # Two target forwards (hooks with use_cache=False vs output_hidden_states with a cache): float tolerance
    expected = torch.cat([layer_outputs[2], layer_outputs[3]], dim=2)
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"layers 1, 2: {m}")

    before = drafter.reducer.proj.weight.detach().clone()
    config = loop(total_steps=2, mixed_precision="bf16", gradient_accumulation_steps=2)
    train_drafter(drafter, target, examples, tmp_path, config, anchors_per_sequence=4)
    records = [r for r in read_log(tmp_path / "log.jsonl") if "loss" in r]
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert not torch.equal(drafter.reducer.proj.weight, before), "the dense reducer over 2 layers x 4 streams trains"


def test_bitsandbytes_options_fail_clearly_when_unavailable(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as when it is not installed
    with pytest.raises(ValueError, match=r"bitsandbytes.*hf-hyperdflash\[quantization\]"):
        optimizer_factory("adamw_8bit")
    with pytest.raises(ValueError, match=r"4bit target.*bitsandbytes"):
        load_target(tmp_path, "cpu", quantization="4bit")
    with pytest.raises(ValueError, match="must be one of"):
        load_target(tmp_path, "cpu", quantization="3bit")


def peaked_target_and_examples():
    """A target with peaked next-token distributions (the stock init's are near uniform, nothing for DSpark's L1 and
    confidence terms to learn) and its greedy replies to four prompts."""
    target = tiny_deepseek_v4(seed=0).requires_grad_(False)
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)
    generator, examples = torch.Generator().manual_seed(0), []
    for _ in range(4):
        prompt = torch.randint(3, target.config.vocab_size, (1, PROMPT_LENGTH), generator=generator)
        ids = target.generate(prompt, max_new_tokens=24, do_sample=False)[0]
        examples.append({"input_ids": ids, "loss_mask": torch.arange(len(ids)) >= PROMPT_LENGTH})
    return target, examples


def assert_heads_learn_and_decode_losslessly(target, examples, drafter, run_dir) -> list[dict]:
    """The confidence and CE terms fall on the overfit set, and the trained drafter decodes as plain decoding."""
    train_drafter(drafter, target, examples, run_dir, loop(total_steps=30, log_every=5), anchors_per_sequence=8)
    train = [r for r in read_log(run_dir / "log.jsonl") if "loss" in r]
    assert {"loss", "ce", "l1", "confidence", "acc", "tau_forced"} <= set(train[0])
    assert train[-1]["ce"] < train[0]["ce"] - 2 and train[-1]["confidence"] < train[0]["confidence"]
    prompt = examples[0]["input_ids"][None, :PROMPT_LENGTH]
    plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=drafter), plain)
    return train


@pytest.mark.slow  # a training run; CI runs it (`-m slow`)
@pytest.mark.parametrize("conditioning", ["stream_mean", "pre_collapse"])
def test_dspark_trains_with_deepspecs_objective_and_its_confidence_learns_the_acceptance(tmp_path, conditioning):
    """DeepSpec's terms (CE, the L1 distance to the target, the confidence head against 1 - L1 / 2) fall, with
    DSpark's own conditioning and with the final pre-collapse residual through a gate copied from the target's."""
    target, examples = peaked_target_and_examples()
    torch.manual_seed(0)
    drafter = DeepseekV4DSparkForDrafting.from_target(
        target,
        num_hidden_layers=1,
        dspark_block_size=3,
        dspark_markov_rank=8,
        dspark_noise_token_id=3,
        dspark_conditioning=conditioning,
    )
    if conditioning == "pre_collapse":
        assert drafter.config.dspark_target_layer_ids == [target.config.num_hidden_layers - 1]
        assert torch.equal(drafter.context_hc_head.hc_fn, target.model.hc_head.hc_fn)
    train = assert_heads_learn_and_decode_losslessly(target, examples, drafter, tmp_path)
    assert train[-1]["l1"] < train[0]["l1"] - 0.2


@pytest.mark.slow  # a training run; CI runs it (`-m slow`)
def test_hyperdflash_with_dsparks_heads_trains_them_beside_its_own_objective(tmp_path):
    """markov_rank > 0: HyperDFlash's CE and KL on the Markov-biased logits, plus the confidence head's loss."""
    target, examples = peaked_target_and_examples()
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=4, num_hidden_layers=1, markov_rank=8)
    before = drafter.markov_w2.weight.clone()
    train = assert_heads_learn_and_decode_losslessly(target, examples, drafter, tmp_path)
    assert "kl" in train[-1] and not torch.equal(drafter.markov_w2.weight, before)


@pytest.mark.slow  # a training run; CI runs it (`-m slow`)
def test_the_l1_term_enters_the_loss_by_its_weight_and_pulls_the_draft_to_the_target(tmp_path):
    """`l1_weight`: the acceptance-aligned term on a drafter without heads, added to CE + KL by its weight (0: not
    computed), and it falls when trained."""
    target, examples = peaked_target_and_examples()

    rows = [example | {"epoch": 0, "index": index} for index, example in enumerate(examples[:2])]
    batch = BlockCollator(4, 8, pad_token_id=0, seed=0)(rows)
    batch.pop("num_tokens", None)
    drafter = new_drafter(target)
    logged, weighted = (
        DrafterWithFrozenTarget(drafter, target, LossConfig(l1_weight=weight))(**batch) for weight in (0.0, 0.5)
    )
    assert torch.allclose(logged["loss"], logged["ce"] + 0.1 * logged["kl"])
    assert "l1" not in logged and torch.allclose(weighted["loss"], logged["loss"] + 0.5 * weighted["l1"])
    assert 0 < float(weighted["l1"]) <= 2
    losses = LossConfig(l1_weight=1.0)
    train_drafter(drafter, target, examples, tmp_path, loop(total_steps=30, log_every=5), losses, 8)
    train = [r for r in read_log(tmp_path / "log.jsonl") if "loss" in r]
    assert train[-1]["l1"] < train[0]["l1"] - 0.2


def test_argmax_labels_are_the_targets_greedy_tokens_whatever_the_reply(tmp_path):
    """ce_label="argmax": on the target's greedy replies the CE equals the reply's; with other reply tokens as labels
    (a sampled reply's) it does not move, where the reply-labelled CE does."""
    target, examples = peaked_target_and_examples()
    rows = [example | {"epoch": 0, "index": index} for index, example in enumerate(examples[:2])]
    batch = BlockCollator(4, 8, pad_token_id=0, seed=0)(rows)
    batch.pop("num_tokens", None)
    drafter = new_drafter(target)
    reply, argmax = (DrafterWithFrozenTarget(drafter, target, LossConfig(ce_label=label)) for label in CE_LABELS)
    assert torch.allclose(reply(**batch)["ce"], argmax(**batch)["ce"], atol=1e-5), "greedy replies: the same labels"
    labelled = batch["labels"] != IGNORE_INDEX
    other = batch | {"labels": torch.where(labelled, (batch["labels"] + 1) % target.config.vocab_size, IGNORE_INDEX)}
    assert torch.allclose(argmax(**other)["ce"], argmax(**batch)["ce"], atol=1e-5)
    assert not torch.allclose(reply(**other)["ce"], reply(**batch)["ce"], atol=1e-3)
    with pytest.raises(ValueError, match="ce_label"):
        LossConfig(ce_label="sampled")


@pytest.mark.slow  # a training run; CI runs it (`-m slow`)
def test_each_head_alone_trains_the_other_off(tmp_path):
    """The heads' ablations: confidence_weight=0 freezes the confidence head as it started (the Markov bias alone);
    `without_markov_bias` keeps the bias at zero through training (the confidence head alone)."""
    target, examples = peaked_target_and_examples()
    torch.manual_seed(0)
    markov_only = HyperDFlashForDrafting.from_target(target, block_size=4, num_hidden_layers=1, markov_rank=8)
    confidence = markov_only.confidence_head.weight.clone()
    train_drafter(markov_only, target, examples, tmp_path / "markov", loop(), LossConfig(confidence_weight=0.0), 8)
    assert torch.equal(markov_only.confidence_head.weight, confidence)
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=4, num_hidden_layers=1, markov_rank=8)
    confidence_only = without_markov_bias(drafter)
    train_drafter(confidence_only, target, examples, tmp_path / "confidence", loop(), anchors_per_sequence=8)
    assert not confidence_only.markov_w2.weight.any()
    assert not torch.equal(confidence_only.confidence_head.weight, confidence)
    with pytest.raises(ValueError, match="--markov-rank"):
        without_markov_bias(new_drafter(target))


def test_each_warm_restart_cycle_gives_the_drafter_a_run_of_that_length_gives(target, examples, tmp_path):
    """With cycles of 3 steps, the drafter at step 3 is the one a 3-step run trains, bit for bit, and training goes
    on from it (under LoRA too: the snapshot is a merged copy, the run keeps its adapters)."""
    snapshots = {}

    def keep(drafter, step):
        assert type(drafter) is HyperDFlashForDrafting
        snapshots[step] = {name: value.clone() for name, value in drafter.state_dict().items()}

    cycled = train_drafter(
        new_drafter(target), target, examples, tmp_path / "cycled", loop(cycle_steps=3), on_cycle_end=keep
    )
    short = train_drafter(new_drafter(target), target, examples, tmp_path / "short", loop(total_steps=3))
    assert list(snapshots) == [3]  # the last cycle's drafter is the run's own
    for name, value in short.state_dict().items():
        assert torch.equal(snapshots[3][name], value), name
    assert any(not torch.equal(snapshots[3][n], v) for n, v in cycled.state_dict().items()), "trained on after it"

    base_dir = tmp_path / "base"
    new_drafter(target).save_pretrained(base_dir)
    snapshots.clear()
    wrapped = build_drafter(target, init_from=base_dir, lora_rank=4, lora_alpha=8)
    train_drafter(wrapped, target, examples, tmp_path / "lora", loop(cycle_steps=3), on_cycle_end=keep)
    assert list(snapshots) == [3] and not any("lora" in name for name in snapshots[3])
