"""The teacher's replies for the reference target: batched, seeded, written in shards a rerun resumes from."""

import json

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hf_hyperdflash import reference
from hf_hyperdflash.reference.teacher import generate_replies, read_replies

PROMPTS = [(f"p{i}", text) for i, text in enumerate(["Hi there.", "Name a fruit.", "Count to three.", "Why?", "Ok."])]


def tiny_teacher():
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path(), padding_side="left")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval(), tokenizer


def run(out_dir, model, tokenizer):
    generate_replies(model, tokenizer, PROMPTS, out_dir, [0.0, 1.0], batch_size=2, max_new_tokens=6, seed=3)


def test_replies_are_seeded_sharded_and_a_rerun_resumes_where_it_stopped(tmp_path):
    model, tokenizer = tiny_teacher()
    run(tmp_path / "a", model, tokenizer)
    shards = sorted((tmp_path / "a" / "t1").glob("shard_*.jsonl"))
    assert len(shards) == 3  # 5 prompts, 2 a batch
    replies = {t: read_replies(tmp_path / "a", t) for t in (0.0, 1.0)}
    assert [r["id"] for r in replies[1.0]] == [i for i, _ in PROMPTS]
    assert all(r["reply"] and r["temperature"] == 1.0 for r in replies[1.0])

    kept = {path: path.stat().st_mtime_ns for path in shards if path.name != "shard_00001.jsonl"}
    (tmp_path / "a" / "t1" / "shard_00001.jsonl").unlink()  # interrupted after two shards
    run(tmp_path / "a", model, tokenizer)
    assert {path: path.stat().st_mtime_ns for path in kept} == kept  # finished shards are not redone
    assert read_replies(tmp_path / "a", 1.0) == replies[1.0]  # the redone shard is what it was: seeded per shard

    run(tmp_path / "b", model, tokenizer)  # a fresh run with the same seed writes the same replies
    assert [json.loads(line) for line in (tmp_path / "b" / "t1" / "shard_00002.jsonl").open()] == replies[1.0][4:]
