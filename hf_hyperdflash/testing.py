"""Tiny mHC targets (DeepSeek-V4, HY-V4, GLM-5-Next, Qwen4-Exp) for tests and CPU benchmarks, and the Hub path's
check: drafters saved as a user publishes them, decoded in a process that cannot import this library.

The stock `DeepseekV4ForCausalLM` is used unchanged; only the config is shrunk. The layer schedule
covers every attention type (sliding, CSA with its indexer, HCA) and both MoE kinds (hash, top-k),
with compression rates small enough that several windows close within a short prompt.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    Glm5NextConfig,
    Glm5NextForConditionalGeneration,
    HYV4Config,
    HYV4ForCausalLM,
    PreTrainedModel,
    Qwen4ExpConfig,
    Qwen4ExpForCausalLM,
    Qwen4ExpForConditionalGeneration,
    Qwen4ExpTextConfig,
)


def tiny_deepseek_v4_config(**overrides) -> DeepseekV4Config:
    """A 4-layer V4 config (sliding, CSA, HCA, CSA; hash-MoE then top-k MoE) that runs in milliseconds."""
    settings = dict(
        vocab_size=512,
        hidden_size=64,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        hc_mult=4,
        sliding_window=8,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        index_n_heads=16,  # with few heads, ReLU zeroes whole index scores and top-k must break exact ties
        index_head_dim=16,
        index_topk=4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    settings.update(overrides)
    return DeepseekV4Config(**settings)


def randomize_hash_table(model: DeepseekV4ForCausalLM, seed: int = 0) -> None:
    """Give every hash-MoE router a real token->expert table (the stock init leaves it all zeros)."""
    generator = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        router = layer.mlp.gate
        if hasattr(router, "tid2eid"):
            vocab, top_k = router.tid2eid.shape
            table = torch.stack(
                [torch.randperm(router.num_experts, generator=generator)[:top_k] for _ in range(vocab)]
            )
            router.tid2eid.copy_(table)


def tiny_deepseek_v4(seed: int = 0, **overrides) -> DeepseekV4ForCausalLM:
    """A randomly initialised tiny stock V4 model in fp32 eval mode, deterministic for a given seed."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_deepseek_v4_config(**overrides)).float().eval()
    randomize_hash_table(model, seed)
    return model


def tiny_hy_v4(seed: int = 0, **overrides) -> HYV4ForCausalLM:
    """A randomly initialised tiny stock HY-V4 (3 DSA layers, the last sharing the previous layer's top-k; a dense
    MLP then MoE), fp32 eval mode, 2 indexer heads keeping 4 of the cached tokens."""
    settings = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_topk=4,
        index_head_dim=16,
        index_n_heads=2,
        hc_mult=4,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    return HYV4ForCausalLM(HYV4Config(**settings)).float().eval()


def tiny_glm5_next(seed: int = 0, **overrides) -> Glm5NextForConditionalGeneration:
    """A tiny stock GLM-5-Next (KDA linear attention, then indexed attention, twice; 2 indexer heads choosing 2
    pools of 4 tokens; a one-block vision tower, image and video token ids the last six of the vocabulary), fp32 eval
    mode. Its text model is `model.model.language_model`."""
    text = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=0,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=2,
        index_kpool=4,
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "dense", "sparse", "sparse"],
        indexer_types=["full", "full", "full", "full"],
        linear_head_dim=16,
        linear_num_heads=2,
        linear_conv_kernel_dim=4,
        hc_mult=4,
        hc_sinkhorn_iters=3,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=2,
    )
    text.update(overrides)
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=64,
        projection_intermediate_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    vocab = text["vocab_size"]
    special = dict(image_token_id=vocab - 6, video_token_id=vocab - 5, image_start_token_id=vocab - 4)
    special |= dict(image_end_token_id=vocab - 3, video_start_token_id=vocab - 2, video_end_token_id=vocab - 1)
    torch.manual_seed(seed)
    config = Glm5NextConfig(text_config=text, vision_config=vision, **special)
    return Glm5NextForConditionalGeneration(config).float().eval()


def tiny_qwen4_exp(seed: int = 0, **overrides) -> Qwen4ExpForCausalLM:
    """A tiny stock Qwen4-Exp (GatedDeltaNet linear attention, then indexed attention, twice; PLE with n-gram
    embeddings on both linear layers; 2 indexer heads choosing 2 blocks of 4 tokens), fp32 eval mode."""
    settings = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        hc_count=4,
        hc_lowrank=16,
        ple_layer_ids=[1, 3],  # one-indexed: both linear layers
        ple_embed_dim=32,
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=1,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        max_position_embeddings=512,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    return Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**settings)).float().eval()


def tiny_qwen4_exp_composite(seed: int = 0, **overrides) -> Qwen4ExpForConditionalGeneration:
    """`tiny_qwen4_exp`'s text model (`overrides` set its config) inside the composite image-text class
    transformers' Qwen4-Exp tests build: a one-block vision tower, image and video token ids the last four of the
    vocabulary. Its text model is `model.model.language_model`."""
    text = tiny_qwen4_exp(seed, **overrides).config.to_dict()
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=14)
    vocab = text["vocab_size"]
    config = Qwen4ExpConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=vocab - 4,
        video_token_id=vocab - 3,
        vision_start_token_id=vocab - 2,
        vision_end_token_id=vocab - 1,
    )
    torch.manual_seed(seed)
    return Qwen4ExpForConditionalGeneration(config).float().eval()


# Every way of drafting the package serves: its own drafters, and transformers' own candidate generators through it
OWN_DRAFTER_KINDS = ("hyperdflash", "vanilla_dflash", "hyperdflash_heads", "mtp", "dspark")
DEEPSEEK_V4_ONLY_KINDS = ("mtp", "dspark")  # native MTP and DSpark are DeepSeek-V4's own
DRAFTING_KINDS = (*OWN_DRAFTER_KINDS, "prompt_lookup", "stock_assistant")


def new_drafter(target: PreTrainedModel, kind: str, block_size: int = 6, seed: int = 1) -> PreTrainedModel:
    """An untrained drafter of `kind` for `target`, in fp32 eval mode: one of the package's (`OWN_DRAFTER_KINDS`;
    the heads hybrid is HyperDFlash with DSpark's Markov and confidence heads), or, for "stock_assistant", a randomly
    initialised model of the target's own class and config drafting 2 tokens, for transformers' assisted loop."""
    from . import DeepseekV4DSparkForDrafting, DeepseekV4MTPForDrafting, HyperDFlashForDrafting

    torch.manual_seed(seed)
    if kind == "mtp":
        drafter = DeepseekV4MTPForDrafting.from_target(target)
    elif kind == "dspark":
        drafter = DeepseekV4DSparkForDrafting.from_target(target, dspark_noise_token_id=3)
    elif kind == "stock_assistant":
        drafter = type(target)(target.config).float()
        if isinstance(drafter, DeepseekV4ForCausalLM):
            randomize_hash_table(drafter, seed)
        drafter.generation_config.num_assistant_tokens = 2
    else:
        settings = {
            "hyperdflash": {},
            "vanilla_dflash": {"reducer": "dense", "conditioning": "intermediate"},
            "hyperdflash_heads": {"markov_rank": 8},
        }[kind]
        drafter = HyperDFlashForDrafting.from_target(target, block_size=block_size, **settings)
    return drafter.eval()


def drafting_arguments(target: PreTrainedModel, kind: str, block_size: int = 6) -> dict:
    """generate() keywords that draft by `kind` (prompt lookup: 3 tokens from 2-gram matches)."""
    if kind == "prompt_lookup":
        return {"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 2}
    return {"assistant_model": new_drafter(target, kind, block_size)}


def image_prompt(model: PreTrainedModel, seed: int, video: bool = False) -> dict:
    """generate() inputs of one prompt with one image (or a one-frame video) as the image-text targets' upstream
    testers build them: random pixel patches for a 4 x 4 patch grid (2 x 2 tokens after the 2 x 2 merge, so
    Qwen4-Exp's 3-D rope positions lag the token count), its placeholders between the family's start and end tokens,
    after 3 text tokens and before 5; Qwen4-Exp also gets its `mm_token_type_ids`."""
    config, vision = model.config, model.config.vision_config
    if config.model_type == "glm5_next":  # one placeholder id; the start and end tokens tell image from video
        placeholder = config.image_token_id
        start, end = config.image_start_token_id, config.image_end_token_id
        if video:
            start, end = config.video_start_token_id, config.video_end_token_id
    else:
        placeholder = config.video_token_id if video else config.image_token_id
        start, end = config.vision_start_token_id, config.vision_end_token_id
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(3, min(start, end, placeholder), (1, 8), generator=generator)
    grid = torch.tensor([[1, 4, 4]])
    vision_span = [start] + [placeholder] * (16 // vision.spatial_merge_size**2) + [end]
    input_ids = torch.cat([text[:, :3], torch.tensor([vision_span]), text[:, 3:]], dim=1)
    patch_size = vision.in_channels * vision.patch_size**2 * vision.temporal_patch_size
    pixels = torch.randn(16, patch_size, generator=generator)
    if video:
        inputs = {"input_ids": input_ids, "pixel_values_videos": pixels, "video_grid_thw": grid}
    else:
        inputs = {"input_ids": input_ids, "pixel_values": pixels, "image_grid_thw": grid}
    if config.model_type == "qwen4_exp":
        inputs["mm_token_type_ids"] = (input_ids == placeholder).long() * (2 if video else 1)
    return inputs


class OracleProposer:
    """A stand-in drafter that is right part of the time, to exercise full, partial and zero acceptance.

    It proposes the tokens of `reference` (e.g. the target's own greedy continuation) at the positions
    being drafted, each replaced by a random token with probability `corruption`. Its distribution q puts
    0.7 on that hint and spreads 0.3 uniformly, and tokens go through the generation's TokenPicker, so
    sampled drafts really come from q, as speculative sampling requires.
    """

    def __init__(
        self,
        vocab_size: int,
        reference: torch.LongTensor | None,
        corruption: float,
        seed: int = 0,
        padding: list[int] | None = None,
    ):
        """`padding`: each row's left padding in `reference`'s columns (batch rows draft from their own anchors)."""
        self.vocab_size, self.reference, self.corruption = vocab_size, reference, corruption
        self.generator = torch.Generator().manual_seed(seed)
        self.padding = padding

    def _hint(self, row: int, position: int) -> int:
        random_token = int(torch.randint(self.vocab_size, (1,), generator=self.generator))
        if self.reference is None or position >= self.reference.shape[-1]:
            return random_token
        corrupt = float(torch.rand(1, generator=self.generator)) < self.corruption
        return random_token if corrupt else int(self.reference[row, position])

    def propose(
        self, features, positions, input_ids, num_tokens, pick, schedule, context_mask=None, anchor_positions=None
    ):
        """A draft for every row of `input_ids` (a batch: `reference` holds a row per row, in the same columns)."""
        from .modeling.candidate_generator import Draft, _pick_sequentially, draft_confidences

        batch, start = input_ids.shape
        if anchor_positions is None:
            starts = [start] * batch
        else:
            padding = self.padding or [0] * batch
            starts = [int(anchor_positions[row, 0]) + padding[row] + 1 for row in range(batch)]
        hints = torch.tensor([[self._hint(row, starts[row] + k) for k in range(num_tokens)] for row in range(batch)])
        probs = torch.full((batch, num_tokens, self.vocab_size), 0.3 / self.vocab_size)
        probs.scatter_add_(-1, hints[..., None], torch.full((batch, num_tokens, 1), 0.7))
        tokens, logits = _pick_sequentially(input_ids, probs.log().to(input_ids.device), pick)
        return Draft(tokens, logits, draft_confidences(logits), 1)


@contextmanager
def oracle_drafting(oracle: OracleProposer) -> Iterator[OracleProposer]:
    """Route every block drafter's proposals through `oracle` for the duration of the block."""
    from .modeling.candidate_generator import BlockProposer

    original = BlockProposer.propose
    BlockProposer.propose = lambda self, *args, **kwargs: oracle.propose(*args, **kwargs)
    try:
        yield oracle
    finally:
        BlockProposer.propose = original


@contextmanager
def scripted_copying(choose: bool = True) -> Iterator[list[int]]:
    """Every call's steps take the context's chain on a fixed rotation, whatever it is expected to win, so copied
    chains of every kind are in the mix: one step copies without a drafter forward, the next after one (the drafter's
    drafts discarded), the third verifies the drafter's own drafts. Where the context has no earlier occurrence of
    the newest token, the chain repeats that token (random tiny targets rarely repeat themselves). Yields the count of
    chains it chose to copy, as a one-item list. `choose` False: only that fallback chain; the call's chooser
    decides."""
    from .modeling.context_copy import ChainChooser, SuffixIndex

    originals = ChainChooser.copies_first, ChainChooser.copies_after, SuffixIndex.continuation
    turn = [0]

    def continuation(self, length: int) -> tuple[list[int], int]:
        chain, suffix = originals[2](self, length)
        return (chain, suffix) if chain else ([self.tokens[-1]] * length, 1)

    copied = [0]

    def copies_first(self, chain_length: int, suffix: int, drafter_length: int) -> int:
        turn[0] += 1
        copies = chain_length and turn[0] % 3 == 0
        copied[0] += bool(copies)
        return chain_length if copies else 0

    def copies_after(self, first_confidence: float, drafter_length: int, chain_length: int, suffix: int) -> int:
        copies = chain_length and turn[0] % 3 == 1
        copied[0] += bool(copies)
        return chain_length if copies else 0

    if choose:
        ChainChooser.copies_first, ChainChooser.copies_after = copies_first, copies_after
    SuffixIndex.continuation = continuation
    try:
        yield copied
    finally:
        ChainChooser.copies_first, ChainChooser.copies_after, SuffixIndex.continuation = originals


def assert_same_outputs(ours, theirs, tolerance: float = 1e-5) -> None:
    """A speculative call's returned dict against plain decoding's: the same tokens; per new token the same scores,
    logits, every layer's hidden states and attentions, in plain decoding's shapes, within `tolerance`."""
    assert ours.sequences.tolist() == theirs.sequences.tolist()
    for name in ("scores", "logits", "hidden_states", "attentions"):
        steps_ours, steps_theirs = getattr(ours, name), getattr(theirs, name)
        assert len(steps_ours) == len(steps_theirs), name
        for step, (a, b) in enumerate(zip(steps_ours, steps_theirs, strict=True)):
            layers = zip(*((a, b) if isinstance(a, tuple) else ((a,), (b,))), strict=True)
            for index, (x, y) in enumerate(layers):
                where = f"{name} step {step} entry {index}"
                assert x.shape == y.shape, where
                torch.testing.assert_close(x, y, rtol=tolerance, atol=tolerance, msg=where)


def _assert_same_state(ours, theirs, where: str) -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.shape == theirs.shape, where
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=where)
    elif isinstance(theirs, dict | list | tuple):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        if isinstance(theirs, dict):
            assert ours.keys() == theirs.keys(), where
            ours, theirs = list(ours.values()), list(theirs.values())
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _assert_same_state(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, where


def assert_same_cache(ours, theirs) -> None:
    """A returned cache against plain decoding's: the same class, layer classes by exact type (what transformers'
    generation tester asks), and the same state in every layer."""
    assert type(ours) is type(theirs)
    assert [type(layer) for layer in ours.layers] == [type(layer) for layer in theirs.layers]
    for index, (layer, plain_layer) in enumerate(zip(ours.layers, theirs.layers, strict=True)):
        assert vars(layer).keys() == vars(plain_layer).keys(), f"layer {index}"
        for name, value in vars(plain_layer).items():
            _assert_same_state(vars(layer)[name], value, f"layer {index}.{name}")


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test; cells expecting < 5 samples are pooled (plus the next smallest until the pool expects 5)."""
    expected = probs * counts.sum()
    order = expected.argsort()
    pooled = int((expected < 5).sum())
    while 0 < pooled < len(order) and expected[order[:pooled]].sum() < 5:
        pooled += 1
    cell = torch.empty_like(order)
    cell[order] = (torch.arange(len(order)) - pooled + 1).clamp_min(0)  # the pool is cell 0 (empty if none pooled)
    observed_cells = torch.bincount(cell, weights=counts)
    expected_cells = torch.bincount(cell, weights=expected)
    keep = expected_cells > 0
    if keep.sum() < 2:
        raise ValueError(f"{int(counts.sum())} samples are too few: fewer than two cells expect 5 of them.")
    statistic = ((observed_cells[keep] - expected_cells[keep]) ** 2 / expected_cells[keep]).sum()
    dof = torch.tensor(int(keep.sum()) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


# Prepended to a child script: the process plays a user who never installed this library.
BLOCK_LIBRARY = """
import importlib.abc, sys, warnings
class BlockLibrary(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "hf_hyperdflash":
            raise ImportError(f"{name} is blocked: this process plays a user without the library")
sys.meta_path.insert(0, BlockLibrary())
try:
    import hf_hyperdflash
    raise SystemExit("the blocker did not block")
except ImportError:
    pass
warnings.simplefilter("error", FutureWarning)
warnings.simplefilter("error", DeprecationWarning)
"""

# argv[1]: JSON cases {"target", "target_class", "prompt", "drafters"}; prints one JSON list: a result per drafter
# (greedy identical to plain decoding, tau, and the new tokens of a seeded T=1 call), then whether the library loaded.
DECODE_EVERY_PAIR = """
import json, sys, torch, transformers
from transformers import AutoModel
results = []
for case in json.loads(sys.argv[1]):
    target_class = getattr(transformers, case.get("target_class", "AutoModelForCausalLM"))
    target = target_class.from_pretrained(case["target"], dtype=torch.float32).eval()
    prompt = torch.tensor([case["prompt"]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    for path in case["drafters"]:
        drafter = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
        speculative = target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False)
        stats = drafter.last_generation_stats
        torch.manual_seed(0)
        sampling = dict(max_new_tokens=24, min_new_tokens=24, do_sample=True)
        sampled = target.generate(prompt, assistant_model=drafter, **sampling)
        results.append({
            "drafter": path,
            "module": type(drafter).__module__,
            "identical": torch.equal(plain, speculative),
            "tau": stats.mean_accepted_length,
            "new_tokens": stats.new_tokens,
            "sampled_new_tokens": sampled.shape[1] - prompt.shape[1],
        })
results.append({"library_imported": "hf_hyperdflash" in sys.modules})
print(json.dumps(results))
"""


def free_port() -> int:
    """A TCP port free on the loopback now, for a `torchrun` rendezvous in a test."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_python(workdir: Path, script: str, *args: str) -> str:
    """Run `script` in a fresh interpreter (offline, its own remote-code cache under `workdir`); its stdout."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(Path(workdir) / "modules")}
    result = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0:
        raise RuntimeError(f"the child process failed:\n{result.stderr[-4000:]}")
    return result.stdout


def run_without_the_library(workdir: Path, script: str, *args: str) -> str:
    """`run_python` in a process where `import hf_hyperdflash` fails, and deprecation warnings are errors."""
    return run_python(workdir, BLOCK_LIBRARY + script, *args)


# Longer than the tiny targets' sliding windows, and several of V4's compression windows (rates 4 and 8)
HUB_PROMPT = [
    5,
    17,
    33,
    9,
    250,
    11,
    12,
    40,
    77,
    3,
    19,
    23,
    8,
    101,
    44,
    6,
    7,
    90,
    15,
    61,
    29,
    300,
    42,
    18,
    77,
    5,
    9,
    13,
]


def save_every_family(root: Path) -> list[dict]:
    """Tiny targets of every family with untrained drafters for them (DeepSeek-V4: HyperDFlash, vanilla DFlash and
    native MTP; the others: HyperDFlash), saved with `save_pretrained` under `root`; the cases `DECODE_EVERY_PAIR`
    decodes."""
    from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting

    root = Path(root).resolve()  # the child processes run elsewhere
    builders = {"deepseek_v4": tiny_deepseek_v4, "hy_v4": tiny_hy_v4, "glm5_next": tiny_glm5_next}
    builders["qwen4_exp"] = tiny_qwen4_exp
    cases = []
    for family, build in builders.items():
        target = build(seed=3)
        target.save_pretrained(root / family / "target")
        torch.manual_seed(0)
        drafters = {"hyperdflash": HyperDFlashForDrafting.from_target(target, block_size=4)}
        if family == "deepseek_v4":
            drafters["vanilla_dflash"] = HyperDFlashForDrafting.from_target(
                target, block_size=4, reducer="dense", conditioning="intermediate"
            )
            drafters["mtp"] = DeepseekV4MTPForDrafting.from_target(target)
        for kind, drafter in drafters.items():
            drafter.save_pretrained(root / family / kind)
        cases.append(
            {
                "target": str(root / family / "target"),
                "target_class": type(target).__name__,
                "prompt": HUB_PROMPT,
                "drafters": [str(root / family / kind) for kind in drafters],
            }
        )
    (root / "cases.json").write_text(json.dumps(cases, indent=1))
    return cases
