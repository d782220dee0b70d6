"""The feature store: training from it gives online training's losses, the build resumes, and a store that does not
fit the run is refused."""

import json

import pytest
import torch
from accelerate.state import AcceleratorState
from test_training_command import target_dir  # noqa: F401  (a saved tiny target with the reference vocabulary)

from hf_hyperdflash import HyperDFlashForDrafting, reference
from hf_hyperdflash.cli import main as cli_main
from hf_hyperdflash.modeling.targets import get_target_adapter
from hf_hyperdflash.testing import tiny_deepseek_v4
from hf_hyperdflash.training.collator import BlockCollator
from hf_hyperdflash.training.curves import read_log
from hf_hyperdflash.training.feature_store import (
    INDEX_FILE,
    FeatureStore,
    StoredFeatureCollator,
    build_feature_store,
)
from hf_hyperdflash.training.loop import LoopConfig
from hf_hyperdflash.training.losses import LossConfig
from hf_hyperdflash.training.trainer import new_dspark, train_drafter

# fp32 throughout: the store's tensors are the online forward's, but the online batch runs its rows together (other
# matrix shapes), so the losses agree to float rounding, not bit for bit
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
STEPS = 4


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def target():
    return tiny_deepseek_v4(seed=0).requires_grad_(False)


@pytest.fixture(scope="module")
def examples(target):
    """The target's greedy replies to prompts of four lengths, so that batches pad their shorter rows."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length in (5, 6, 7, 8):
        prompt = torch.randint(3, target.config.vocab_size, (1, length), generator=generator)
        with torch.no_grad():
            ids = target.generate(prompt, max_new_tokens=16, do_sample=False)[0]
        rows.append({"input_ids": ids, "loss_mask": torch.arange(len(ids)) >= length})
    return rows


def drafter_of(target, kind: str):
    torch.manual_seed(0)
    if kind == "dspark":
        return new_dspark(target, dspark_block_size=3, num_hidden_layers=1)
    if kind == "vanilla_dflash":
        return HyperDFlashForDrafting.from_target(
            target,
            block_size=4,
            num_hidden_layers=1,
            reducer="dense",
            conditioning="intermediate",
            target_layer_ids=[0, 2],
        )
    return HyperDFlashForDrafting.from_target(target, block_size=4, num_hidden_layers=1, markov_rank=4)


def train_losses(target, examples, run_dir, kind: str, feature_store=None) -> list[dict]:
    """Every loss term at each of `STEPS` steps (one batch of two sequences each)."""
    loop = LoopConfig(total_steps=STEPS, batch_size=2, learning_rate=3e-3, warmup_steps=1, log_every=1)
    losses = LossConfig(l1_weight=1.0, teacher="gated")  # every teacher path: KL, L1, the confidence head's label
    drafter = drafter_of(target, kind)
    train_drafter(
        drafter, target, examples, run_dir, loop, losses, anchors_per_sequence=4, feature_store=feature_store
    )
    AcceleratorState._reset_state(reset_partial_state=True)
    records = [record for record in read_log(run_dir / "log.jsonl") if "loss" in record]
    return [{name: value for name, value in r.items() if name not in ("tokens_per_second", "lr")} for r in records]


@pytest.mark.parametrize(
    ("kind", "layers"),
    [
        ("hyperdflash", None),
        pytest.param("vanilla_dflash", [0, 1, 2], marks=pytest.mark.slow),  # layers 0 and 2 of the three stored
        pytest.param("dspark", [1, 2, 3], marks=pytest.mark.slow),
    ],
)
def test_training_from_the_store_gives_the_online_losses(target, examples, tmp_path, kind, layers):
    build_feature_store(target, examples, tmp_path / "store", layer_ids=layers, batch_size=3)
    online = train_losses(target, examples, tmp_path / "online", kind)
    stored = train_losses(target, examples, tmp_path / "stored", kind, feature_store=tmp_path / "store")
    assert len(online) == STEPS and set(online[0]) == set(stored[0])
    for step, (ours, theirs) in enumerate(zip(stored, online, strict=True), start=1):
        for name in theirs:
            expected = torch.tensor(theirs[name], dtype=torch.float64)
            message = f"step {step}, {name}: {ours[name]} from the store, {theirs[name]} online"
            torch.testing.assert_close(
                torch.tensor(ours[name], dtype=torch.float64), expected, **TOLERANCE, msg=message
            )


def stored_files(store) -> dict[str, int]:
    return {path.name: path.stat().st_mtime_ns for path in store.iterdir()}


def test_the_build_resumes_and_a_rerun_adds_nothing(target, examples, tmp_path):
    store = tmp_path / "store"
    build_feature_store(target, examples[:2], store, batch_size=1, shard_bytes=1)  # a shard per sequence
    first = stored_files(store)
    assert sorted(first) == [INDEX_FILE, "shard-00000.safetensors", "shard-00001.safetensors"]
    (store / "shard-00002.safetensors.partial").write_bytes(b"a write cut short")  # an interrupted run's leftover
    build_feature_store(target, examples + examples[:1], store, batch_size=2, shard_bytes=1)
    index = json.loads((store / INDEX_FILE).read_text())
    assert len(index["shards"]) == 3 and sum(len(shard["keys"]) for shard in index["shards"].values()) == 4
    assert sum(shard["tokens"] for shard in index["shards"].values()) == sum(len(e["input_ids"]) for e in examples)
    resumed = stored_files(store)
    assert all(resumed[name] == first[name] for name in first if name != INDEX_FILE)  # earlier shards untouched
    build_feature_store(target, examples, store)
    assert stored_files(store) == {name: time for name, time in resumed.items() if not name.endswith(".partial")}
    FeatureStore(store).check_covers(examples)


def test_a_store_that_does_not_fit_the_run_is_refused(target, examples, tmp_path):
    store = tmp_path / "store"
    build_feature_store(target, examples[:3], store, layer_ids=[1])
    opened = FeatureStore(store)
    with pytest.raises(ValueError, match=r"lacks 1 of the 4 training sequences"):
        opened.check_covers(examples)
    with pytest.raises(ValueError, match=r"conditions on target layers \[0, 1\].*--layers 0,1"):
        opened.check(get_target_adapter(target), [0, 1])
    with pytest.raises(ValueError, match="built for another target"):
        opened.check(get_target_adapter(tiny_deepseek_v4(seed=1)), None)
    with pytest.raises(ValueError, match="runs in bfloat16 here: pass --target-dtype float32"):
        opened.check(get_target_adapter(tiny_deepseek_v4(seed=0).to(torch.bfloat16)), None)
    with pytest.raises(ValueError, match=r"holds target layers \[1\], not None: pass --layers 1"):
        build_feature_store(target, examples, store)
    with pytest.raises(ValueError, match="--left-padding-share 0"):
        StoredFeatureCollator(BlockCollator(4, 2, left_padding=(0.5, 3)), opened, None)
    with pytest.raises(ValueError, match="No feature store at"):
        FeatureStore(tmp_path / "nothing")


def test_train_from_the_features_command_store_gives_the_online_losses(target_dir, tmp_path, capsys):  # noqa: F811
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(4)))
    target = ["--target", str(target_dir), "--target-dtype", "float32"]
    common = [*target, "--tokenizer", str(reference.tokenizer_path()), "--data", str(prompts)]
    common += ["--max-new-tokens", "12", "--eval-prompts", "0", "--batch-size", "2", "--anchors-per-sequence", "4"]
    common += ["--block-size", "4", "--num-layers", "1", "--warmup-steps", "1", "--log-every", "1"]
    common += ["--total-steps", "3", "--data-dir", str(tmp_path / "data"), "--temperature", "0"]
    assert cli_main(["train", *common, "--output-dir", str(tmp_path / "online")]) == 0
    AcceleratorState._reset_state(reset_partial_state=True)

    store = tmp_path / "store"
    assert cli_main(["features", *target, "--data-dir", str(tmp_path / "data"), "--output-dir", str(store)]) == 0
    assert f"feature store written to {store}" in capsys.readouterr().out
    AcceleratorState._reset_state(reset_partial_state=True)
    assert cli_main(["train", *common, "--output-dir", str(tmp_path / "stored"), "--feature-store", str(store)]) == 0

    online, stored = (read_log(tmp_path / run / "run" / "log.jsonl") for run in ("online", "stored"))
    assert [r["step"] for r in stored] == [1, 2, 3]
    for ours, theirs in zip(stored, online, strict=True):
        torch.testing.assert_close(ours["loss"], theirs["loss"], **TOLERANCE)
