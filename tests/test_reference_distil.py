"""The reference target learns the teacher's replies: rows in its chat format, loss on the reply alone."""

import functools
import json

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, DeepseekV4ForCausalLM

from hf_hyperdflash import reference
from hf_hyperdflash.reference import build
from hf_hyperdflash.reference.distil import (
    HEAD_SCALE,
    IGNORE_INDEX,
    MAX_REPLY_TOKENS,
    calibrate_head,
    collate_rows,
    packed_rows,
    reply_example,
    reply_losses,
    teacher_examples,
)
from hf_hyperdflash.testing import tiny_deepseek_v4
from hf_hyperdflash.training.loop import LoopConfig


def tokenizer():
    return AutoTokenizer.from_pretrained(reference.tokenizer_path())


def test_a_row_is_the_prompt_in_the_chat_format_then_the_reply_with_labels_on_the_reply_only():
    tok = tokenizer()
    row = reply_example(tok, "Name a fruit.", "An apple.", ended=True)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name a fruit."}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert row["input_ids"][: len(prompt)].tolist() == list(prompt)
    assert (row["labels"][: len(prompt)] == IGNORE_INDEX).all()
    reply = row["labels"][len(prompt) :].tolist()
    assert reply[-1] == tok.eos_token_id  # an ended reply closes the turn
    assert tok.decode(reply[:-1]) == "An apple."
    assert row["input_ids"][len(prompt) :].tolist() == reply

    cut = reply_example(tok, "Name a fruit.", "An apple.", ended=False)
    assert cut["labels"][-1] != tok.eos_token_id  # a reply cut at the teacher's budget never learns to end there
    long = reply_example(tok, "Name a fruit.", "apple " * 1000, ended=True)
    assert (long["labels"] != IGNORE_INDEX).sum() == MAX_REPLY_TOKENS


def test_rows_pack_the_examples_in_order_and_keep_their_labels():
    examples = [
        {"input_ids": torch.arange(i * 10, i * 10 + 5), "labels": torch.tensor([IGNORE_INDEX] * 2 + [1, 2, 3])}
        for i in range(5)
    ]
    rows = packed_rows(examples, length=8)
    assert len(rows) == 3  # 25 tokens: 3 rows of 8, the last token dropped
    for key in ("input_ids", "labels"):
        assert torch.cat([r[key] for r in rows]).tolist() == torch.cat([e[key] for e in examples])[:24].tolist()
    batch = collate_rows(rows[:2])
    assert batch["num_tokens"] == (batch["labels"][:, 1:] != IGNORE_INDEX).sum() == 8


def test_the_loss_is_the_reply_tokens_cross_entropy(target):
    prompt, reply = [3, 5, 7, 2], [9, 4, 6]
    rows = [{"input_ids": torch.tensor(prompt + reply), "labels": torch.tensor([IGNORE_INDEX] * 4 + reply)}]
    batch = collate_rows(rows)
    logits = target(input_ids=batch["input_ids"]).logits[0, 3:-1]
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(reply))
    torch.testing.assert_close(reply_losses(target, batch)["lm_loss"], expected, rtol=1e-4, atol=1e-4)


def test_calibration_scales_every_logit_and_keeps_greedy_text():
    model = tiny_deepseek_v4(seed=3).eval()
    input_ids = torch.randint(3, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        before = model(input_ids=input_ids).logits
        after = calibrate_head(model, 1.2)(input_ids=input_ids).logits
    torch.testing.assert_close(after, 1.2 * before, rtol=1e-5, atol=1e-5)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


def test_examples_read_every_reply_and_skip_empty_ones(tmp_path):
    shard = tmp_path / "t0" / "shard_00000.jsonl"
    shard.parent.mkdir()
    records = [
        {"id": "a", "prompt": "Hi.", "reply": "Hello.", "ended": True, "temperature": 0.0},
        {"id": "b", "prompt": "Why?", "reply": "", "ended": True, "temperature": 0.0},
    ]
    shard.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    examples = teacher_examples(tokenizer(), tmp_path)
    assert len(examples) == 1


def test_the_build_distils_the_language_model_on_the_replies_and_ships_it(tmp_path, monkeypatch):
    tok = tokenizer()
    teacher_dir = tmp_path / "teacher"
    (teacher_dir / "t0").mkdir(parents=True)
    records = [
        {"id": str(i), "prompt": f"Question {i}?", "reply": "Answer " * 40, "ended": True, "temperature": 0.0}
        for i in range(8)
    ]
    (teacher_dir / "t0" / "shard_00000.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    work = tmp_path / "work"
    start = tiny_deepseek_v4(
        seed=5,
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    start.save_pretrained(work / "target")
    tok.save_pretrained(work / "tokenizer")
    loop = LoopConfig(total_steps=3, batch_size=1, learning_rate=1e-3, warmup_steps=1, checkpoint_every=3)
    monkeypatch.setattr(build, "distil_target", functools.partial(build.distil_target, loop=loop))

    build.main(
        [
            "--work-dir",
            str(work),
            "--stages",
            "distil",
            "--out",
            str(tmp_path / "out"),
            "--teacher-dir",
            str(teacher_dir),
        ]
    )
    log = [json.loads(line) for line in (work / "distil_run" / "log.jsonl").open()]
    assert [r["step"] for r in log] == [3]
    distilled = DeepseekV4ForCausalLM.from_pretrained(work / "target_distilled", dtype=torch.float32)
    embeddings = start.get_input_embeddings().weight, distilled.get_input_embeddings().weight
    change = (embeddings[1] - embeddings[0]).norm() / embeddings[0].norm()
    assert 0 < change < 0.5  # it learned from the replies, starting from the language-model stage
    trained_head = load_file(work / "distil_run" / "checkpoint" / "model.safetensors")["lm_head.weight"]
    torch.testing.assert_close(distilled.get_output_embeddings().weight, trained_head * HEAD_SCALE)  # calibrated
    shipped = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "out" / "target")  # the distilled target, as bf16
    for name, weight in distilled.state_dict().items():  # each weight rounded once to bf16
        torch.testing.assert_close(shipped.state_dict()[name].float(), weight.bfloat16().float(), rtol=0, atol=0)
