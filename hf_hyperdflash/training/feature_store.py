"""The feature store: what drafter training reads from the frozen target, computed once and kept on disk.

Online training runs the target over every batch. For many epochs over the same replies, `build_feature_store` runs
it once per token sequence instead and stores, for each:

- `residual`: the final pre-collapse residual `[length, hc_mult, hidden]`. HyperDFlash conditions on it, and both KL
  teachers and the every-slot logits (L1 term, confidence label, argmax labels) are derived from it exactly, through
  the target's collapse, final norm and `lm_head` (`losses.teacher_logits`), which training still runs;
- `layers`: with `layer_ids`, those layers' outputs stacked on the stream axis `[length, layers * hc_mult, hidden]`
  (vanilla DFlash's and DSpark's conditioning).

Tensors keep the dtype the target computes in. A sequence is keyed by a digest of its token ids, so training finds
the features of its examples whichever reply folders and weights they came from. Shards (`shard-00000.safetensors`,
...) are written to a temporary file and renamed, then listed in `index.json` (also replaced atomically), so an
interrupted build resumes with the sequences not yet listed. The index records the target's fingerprint, its dtype
and the layers, and training from a store built for another target, dtype or layers is refused.

The features are those of unpadded rows: trailing padding is unseen by a causal target, so right-padded online
batches read the same features, but a left-padded DeepSeek-V4 row's differ (`left_padding.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..modeling.rank_agreement import RankAgreement, text_fingerprint, weights_fingerprint
from ..modeling.target_base import HyperConnectionTarget
from ..modeling.targets import get_target_adapter
from .collator import BlockCollator
from .left_padding import target_inputs

INDEX_FILE = "index.json"
FORMAT_VERSION = 1
# Batch keys the stored tensors travel under, next to a `BlockCollator`'s (the trainer's forward takes them)
RESIDUAL_KEY = "target_residual"
LAYERS_KEY = "target_layers"


def sequence_key(input_ids: torch.Tensor) -> str:
    """The store's key of a token sequence: a digest of its ids."""
    return hashlib.sha256(input_ids.to(torch.int64).numpy().tobytes()).hexdigest()[:32]


def target_fingerprint(target: HyperConnectionTarget) -> str:
    """A digest of the target's text config and of its collapse head's and final norm's weights (another checkpoint
    of the same architecture differs there), cheap to compute for a target of any size."""
    config = target.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    heads = weights_fingerprint(target.collapse_head) + weights_fingerprint(target.final_norm)
    return text_fingerprint(json.dumps(config, sort_keys=True, default=str) + heads)


def target_dtype(target: HyperConnectionTarget) -> str:
    """The dtype the target's activations (and so its stored features) have: its embedding's."""
    return str(target.embed_tokens.weight.dtype).removeprefix("torch.")


def target_features(
    target: HyperConnectionTarget,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    layer_ids: Sequence[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(final pre-collapse residual, conditioning features) of one frozen target forward run as generate()'s prefill
    runs it (`left_padding.target_inputs`); the conditioning is the residual itself when `layer_ids` is None."""
    with target.capture() as final, target.capture(layer_ids) as conditioning:
        target.model.model(**target_inputs(input_ids, attention_mask), use_cache=False)
    return final.features(), conditioning.features()


def batch_features(
    target: HyperConnectionTarget,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    layer_ids: Sequence[int] | None,
    residual: torch.Tensor | None = None,
    layers: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A training batch's (final pre-collapse residual, conditioning features): the store's (`residual`, `layers`)
    where the batch carries them (`StoredFeatureCollator`), else from one frozen target forward (`target_features`)."""
    if residual is None:
        return target_features(target, input_ids, attention_mask, layer_ids)
    return residual, residual if layer_ids is None else layers


def _new_index(target: HyperConnectionTarget, layer_ids: Sequence[int] | None) -> dict:
    return {
        "version": FORMAT_VERSION,
        "target": target_fingerprint(target),
        "dtype": target_dtype(target),
        "hc_mult": target.hc_mult,
        "hidden_size": target.hidden_size,
        "layer_ids": None if layer_ids is None else list(layer_ids),
        "shards": {},
    }


def read_index(store_dir: Path) -> dict:
    """The store's index; a clear error where there is none, or one of another format."""
    path = store_dir / INDEX_FILE
    if not path.exists():
        raise ValueError(f"No feature store at {store_dir} (no {INDEX_FILE}); build one with `hyperdflash features`.")
    index = json.loads(path.read_text())
    if index.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"The feature store at {store_dir} has format {index.get('version')}, this version reads "
            f"{FORMAT_VERSION}; rebuild it with `hyperdflash features` into a new folder."
        )
    return index


def check_target(index: dict, store_dir: Path, target: HyperConnectionTarget) -> None:
    """Refuse a store built for the target in another dtype, or for another target (the fingerprint covers weights in
    the dtype they were loaded in, so the dtype is checked first)."""
    if index["dtype"] != target_dtype(target):
        raise ValueError(
            f"The feature store at {store_dir} holds the target's features in {index['dtype']}, and the target runs "
            f"in {target_dtype(target)} here: pass --target-dtype {index['dtype']}, or rebuild the store."
        )
    if index["target"] != target_fingerprint(target):
        raise ValueError(
            f"The feature store at {store_dir} was built for another target (its config or collapse-head weights "
            "differ); build a store for this target with `hyperdflash features --target ...`."
        )


def _write_atomically(path: Path, write) -> None:
    """`write(temporary path)`, then a rename over `path`: readers see the old file or the whole new one."""
    partial = path.with_name(path.name + ".partial")
    write(partial)
    os.replace(partial, path)


def _write_shard(store_dir: Path, index: dict, rows: dict[str, dict[str, torch.Tensor]]) -> None:
    """Write `rows` (key -> tensors) as the next shard, then list it in the index."""
    name = f"shard-{len(index['shards']):05d}.safetensors"
    tensors = {f"{key}.{kind}": tensor for key, row in rows.items() for kind, tensor in row.items()}
    _write_atomically(store_dir / name, lambda path: save_file(tensors, str(path)))
    tokens = sum(row["residual"].shape[0] for row in rows.values())
    index["shards"][name] = {"keys": list(rows), "tokens": tokens}
    _write_atomically(store_dir / INDEX_FILE, lambda path: path.write_text(json.dumps(index)))


def _open_for_writing(store_dir: Path, target: HyperConnectionTarget, layer_ids: Sequence[int] | None) -> dict:
    """The index to extend: the stored one (checked: same target, dtype and layers), or a new one."""
    store_dir.mkdir(parents=True, exist_ok=True)
    if not (store_dir / INDEX_FILE).exists():
        return _new_index(target, layer_ids)
    index = read_index(store_dir)
    check_target(index, store_dir, target)
    wanted = None if layer_ids is None else list(layer_ids)
    if index["layer_ids"] != wanted:
        raise ValueError(
            f"The feature store at {store_dir} holds target layers {index['layer_ids']}, not {wanted}: pass "
            f"--layers {','.join(map(str, index['layer_ids'] or []))} to extend it, or build into another folder."
        )
    return index


def _pending(examples: Sequence[dict[str, torch.Tensor]], index: dict) -> list[tuple[str, torch.Tensor]]:
    """(key, input_ids) of each distinct sequence not stored yet, shortest first (batches pad little)."""
    stored = {key for shard in index["shards"].values() for key in shard["keys"]}
    pending = {}
    for example in examples:
        key = sequence_key(example["input_ids"])
        if key not in stored:
            pending[key] = example["input_ids"]
    return sorted(pending.items(), key=lambda item: (len(item[1]), item[0]))


def build_feature_store(
    target: PreTrainedModel,
    examples: Sequence[dict[str, torch.Tensor]],
    store_dir: str | Path,
    layer_ids: Sequence[int] | None = None,
    batch_size: int = 8,
    shard_bytes: int = 1 << 30,
) -> dict:
    """Store the target's features of every distinct `examples` sequence not stored yet in `store_dir`; returns the
    index. `layer_ids`: also the outputs of these layers (for drafters conditioned on intermediate layers).

    Sequences run `batch_size` at a time, right-padded (unseen by the causal target); a shard is written once it
    holds `shard_bytes`, and at the end. A target spread over processes runs every batch on all of them; the first
    process reads the index and writes.
    """
    store_dir = Path(store_dir)
    adapter = get_target_adapter(target)
    agreement = RankAgreement.of(target)
    index = agreement.first_decides(
        "Reading the feature store's index", lambda: _open_for_writing(store_dir, adapter, layer_ids)
    )
    pending = _pending(examples, index)
    device = target.get_input_embeddings().weight.device
    rows: dict[str, dict[str, torch.Tensor]] = {}
    held = 0
    progress = tqdm(total=len(pending), desc="target features", unit="seq", disable=not agreement.decides)
    for start in range(0, len(pending), batch_size):
        batch = pending[start : start + batch_size]
        input_ids = pad_sequence([ids for _, ids in batch], batch_first=True).to(device)
        attention_mask = pad_sequence([torch.ones_like(ids, dtype=torch.bool) for _, ids in batch], batch_first=True)
        with torch.no_grad():
            residual, layers = target_features(adapter, input_ids, attention_mask.to(device), layer_ids)
        progress.update(len(batch))
        if not agreement.decides:
            continue
        for row, (key, ids) in enumerate(batch):
            tensors = {"residual": residual[row, : len(ids)]}
            if layer_ids is not None:
                tensors["layers"] = layers[row, : len(ids)]
            # Copies: a view would keep the whole padded batch alive until the shard is written
            rows[key] = {
                kind: tensor.to("cpu", copy=True, memory_format=torch.contiguous_format)
                for kind, tensor in tensors.items()
            }
            held += sum(tensor.nbytes for tensor in rows[key].values())
        if held >= shard_bytes:
            _write_shard(store_dir, index, rows)
            rows, held = {}, 0
    progress.close()
    if rows:
        _write_shard(store_dir, index, rows)
    return index


class FeatureStore:
    """A built store, read memory-mapped: each shard is opened once (`safe_open`) and tensors are read on demand."""

    def __init__(self, store_dir: str | Path):
        self.store_dir = Path(store_dir)
        self.index = read_index(self.store_dir)
        self._shard_of = {key: name for name, shard in self.index["shards"].items() for key in shard["keys"]}
        self._open: dict[str, object] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._shard_of

    def check(self, target: HyperConnectionTarget, layer_ids: Sequence[int] | None) -> None:
        """Refuse a store that does not hold what a drafter conditioned on `layer_ids` (None: the residual) of
        `target` reads."""
        check_target(self.index, self.store_dir, target)
        stored = self.index["layer_ids"] or []
        missing = sorted(set(layer_ids or []) - set(stored))
        if missing:
            wanted = ",".join(map(str, layer_ids))
            raise ValueError(
                f"The drafter conditions on target layers {list(layer_ids)}, and the feature store at "
                f"{self.store_dir} holds {stored or 'none'}: build a store with `hyperdflash features --layers "
                f"{wanted}`."
            )

    def check_covers(self, examples: Sequence[dict[str, torch.Tensor]]) -> None:
        """Refuse to train on examples the store lacks."""
        missing = sum(sequence_key(example["input_ids"]) not in self for example in examples)
        if missing:
            raise ValueError(
                f"The feature store at {self.store_dir} lacks {missing} of the {len(examples)} training sequences: "
                "build it from the same replies and --max-length (`hyperdflash features` adds what is missing)."
            )

    def _tensor(self, key: str, kind: str) -> torch.Tensor:
        name = self._shard_of[key]
        if name not in self._open:
            self._open[name] = safe_open(str(self.store_dir / name), framework="pt")
        return self._open[name].get_tensor(f"{key}.{kind}")

    def residual(self, key: str) -> torch.Tensor:
        """[length, hc_mult, hidden]: the sequence's final pre-collapse residual."""
        return self._tensor(key, "residual")

    def layers(self, key: str, layer_ids: Sequence[int]) -> torch.Tensor:
        """[length, len(layer_ids) * hc_mult, hidden]: the outputs of `layer_ids`, stacked on the stream axis as
        `FeatureCapture.features` stacks them."""
        stored = self._tensor(key, "layers").unflatten(1, (len(self.index["layer_ids"]), -1))
        picked = [self.index["layer_ids"].index(layer) for layer in layer_ids]
        return stored[:, picked].flatten(1, 2)


class StoredFeatureCollator:
    """A `BlockCollator`'s batches plus each row's stored target tensors, right-padded with zeros to the batch's
    width as the collator pads the token ids (padded columns are masked out of the drafter's context and give no
    label, so their values never reach a loss)."""

    def __init__(self, collate: BlockCollator, store: FeatureStore, layer_ids: Sequence[int] | None):
        if collate.left_padding[0]:
            raise ValueError(
                "The feature store holds the features of unpadded rows, and a left-padded DeepSeek-V4 row's differ: "
                "train from the store with --left-padding-share 0, or online (without --feature-store)."
            )
        self.collate = collate
        self.store = store
        self.layer_ids = None if layer_ids is None else list(layer_ids)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.collate(rows)
        keys = [sequence_key(row["input_ids"]) for row in rows]
        batch[RESIDUAL_KEY] = pad_sequence([self.store.residual(key) for key in keys], batch_first=True)
        if self.layer_ids is not None:
            layers = [self.store.layers(key, self.layer_ids) for key in keys]
            batch[LAYERS_KEY] = pad_sequence(layers, batch_first=True)
        return batch
