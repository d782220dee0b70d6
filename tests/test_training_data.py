"""Training data: the target's own replies generated resumably, and the example loader."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.prompts import encode_prompt
from hf_hyperdflash.testing import tiny_deepseek_v4
from hf_hyperdflash.training.data import generate_replies, load_examples, load_weighted_examples

# Two prompts of each of three token lengths, so equal-length batches of two form.
WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "omega"]
PROMPTS = [[{"role": "user", "content": " ".join(WORDS[: 1 + i // 2 * 2]) + f" {i}"}] for i in range(6)]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(reference.tokenizer_path())


@pytest.fixture(scope="module")
def target(tokenizer):
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return tiny_deepseek_v4(seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids)


def records(data_dir) -> dict[int, dict]:
    rows = [
        json.loads(line) for shard in sorted(data_dir.glob("shard-*.jsonl")) for line in shard.read_text().splitlines()
    ]
    return {row["index"]: row for row in rows}


def generate(target, tokenizer, data_dir, **overrides):
    settings = dict(max_new_tokens=6, batch_size=2, enable_thinking=False)
    generate_replies(target, tokenizer, PROMPTS, data_dir, **{**settings, **overrides})


def test_replies_are_the_targets_own_and_generation_resumes_without_redoing_prompts(
    target, tokenizer, tmp_path, monkeypatch
):
    lengths = {len(encode_prompt(tokenizer, p, False)) for p in PROMPTS}
    assert len(lengths) == 3, "the fixture should give three prompt lengths"
    generate(target, tokenizer, tmp_path / "straight")
    expected = records(tmp_path / "straight")
    assert sorted(expected) == list(range(6))
    for index, row in expected.items():
        prompt_ids = encode_prompt(tokenizer, PROMPTS[index], False)
        assert row["input_ids"][: len(prompt_ids)] == prompt_ids
        assert row["loss_mask"] == [0] * len(prompt_ids) + [1] * (len(row["input_ids"]) - len(prompt_ids))
        alone = target.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False)[0].tolist()
        assert row["input_ids"] == alone, "equal-length batches reproduce unbatched greedy decoding exactly"

    calls, crash = [], [True]
    original = target.generate

    def crashing_generate(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        if crash[0] and len(calls) == 2:
            raise RuntimeError("interrupted")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, "generate", crashing_generate)
    with pytest.raises(RuntimeError, match="interrupted"):
        generate(target, tokenizer, tmp_path / "resumed")
    assert len(records(tmp_path / "resumed")) == 2
    calls.clear()
    crash[0] = False
    generate(target, tokenizer, tmp_path / "resumed")
    assert calls == [2, 2], "only the four unanswered prompts are generated"
    assert records(tmp_path / "resumed") == expected
    calls.clear()
    generate(target, tokenizer, tmp_path / "resumed")
    assert calls == []


def test_an_interrupted_append_is_dropped_and_regenerated(target, tokenizer, tmp_path):
    generate(target, tokenizer, tmp_path)
    shard = tmp_path / "shard-000.jsonl"
    lines = shard.read_text().splitlines()
    shard.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # the last record was cut mid-write
    assert len(load_examples(tmp_path)) == 5
    generate(target, tokenizer, tmp_path)
    assert [json.loads(line) for line in shard.read_text().splitlines()][-1] == json.loads(lines[-1])
    assert len(load_examples(tmp_path)) == 6


def test_settings_mismatch_and_sharded_ranks(target, tokenizer, tmp_path):
    generate(target, tokenizer, tmp_path / "a")
    with pytest.raises(ValueError, match="temperature"):
        generate(target, tokenizer, tmp_path / "a", temperature=0.7)
    generate(target, tokenizer, tmp_path / "sampled", temperature=0.7, seed=0)
    with pytest.raises(ValueError, match="seed"):
        generate(target, tokenizer, tmp_path / "sampled", temperature=0.7, seed=1)
    for rank in (0, 1):
        generate(target, tokenizer, tmp_path / "b", rank=rank, world_size=2)
    assert [len(p.read_text().splitlines()) for p in sorted((tmp_path / "b").glob("shard-*"))] == [3, 3]
    assert records(tmp_path / "b") == records(tmp_path / "a")


def test_greedy_replies_serve_every_seed_even_when_an_older_version_recorded_one(target, tokenizer, tmp_path):
    generate(target, tokenizer, tmp_path, seed=0)
    replies = records(tmp_path)
    settings_file = tmp_path / "settings.json"
    assert "seed" not in json.loads(settings_file.read_text())
    generate(target, tokenizer, tmp_path, seed=3)
    settings_file.write_text(json.dumps({**json.loads(settings_file.read_text()), "seed": 0}))  # older versions
    generate(target, tokenizer, tmp_path, seed=3)
    assert records(tmp_path) == replies
    assert len((tmp_path / "shard-000.jsonl").read_text().splitlines()) == len(PROMPTS), "a prompt was answered twice"


def test_mixed_length_batches_are_left_padded(target, tokenizer, tmp_path):
    generate(target, tokenizer, tmp_path / "exact")
    generate(target, tokenizer, tmp_path / "mixed", mixed_lengths=True, batch_size=6)
    exact, mixed = records(tmp_path / "exact"), records(tmp_path / "mixed")
    lengths = {i: len(encode_prompt(tokenizer, PROMPTS[i], False)) for i in range(6)}
    for index, row in mixed.items():
        assert row["input_ids"][: lengths[index]] == encode_prompt(tokenizer, PROMPTS[index], False)
        assert sum(row["loss_mask"]) == len(row["input_ids"]) - lengths[index] > 0
        if lengths[index] == max(lengths.values()):  # the unpadded rows decode as alone
            assert row == exact[index]


def test_sampled_replies_and_thinking_mode(target, tokenizer, tmp_path):
    generate(target, tokenizer, tmp_path / "greedy")
    generate(target, tokenizer, tmp_path / "sampled", temperature=1.0, seed=0)
    generate(target, tokenizer, tmp_path / "sampled_again", temperature=1.0, seed=0)
    assert records(tmp_path / "sampled") != records(tmp_path / "greedy")
    assert records(tmp_path / "sampled") == records(tmp_path / "sampled_again"), "seeded per batch"
    thinking = encode_prompt(tokenizer, PROMPTS[0], enable_thinking=True)
    plain = encode_prompt(tokenizer, PROMPTS[0], enable_thinking=False)
    assert tokenizer.decode(thinking).endswith("<think>") and tokenizer.decode(plain).endswith("</think>")


def test_sampling_ignores_the_targets_top_k(target, tokenizer, tmp_path, monkeypatch):
    """T=1 replies come from the whole distribution, as in `hyperdflash eval`: with the target's generation
    config asking for top_k=1, honouring it would make every sampled reply the greedy one."""
    monkeypatch.setattr(target.generation_config, "top_k", 1)
    generate(target, tokenizer, tmp_path / "greedy")
    generate(target, tokenizer, tmp_path / "sampled", temperature=1.0)
    greedy, sampled = records(tmp_path / "greedy"), records(tmp_path / "sampled")
    assert sum(sampled[i]["input_ids"] != greedy[i]["input_ids"] for i in greedy) >= len(greedy) // 2
    settings = json.loads((tmp_path / "sampled" / "settings.json").read_text())
    assert settings["truncation"] == "none"


def test_loader_cuts_to_max_length_and_drops_examples_without_reply(target, tokenizer, tmp_path):
    generate(target, tokenizer, tmp_path)
    shortest_prompt = min(len(encode_prompt(tokenizer, p, False)) for p in PROMPTS)
    examples = load_examples(tmp_path, max_length=shortest_prompt + 2)
    assert 0 < len(examples) < 6
    for example in examples:
        assert len(example["input_ids"]) <= shortest_prompt + 2 and example["loss_mask"][1:].any()
        assert example["input_ids"].dtype == torch.long and example["loss_mask"].dtype == torch.bool
    with pytest.raises(ValueError, match="No generated replies"):
        load_examples(tmp_path / "empty")


def test_two_jobs_on_one_data_dir_do_not_answer_a_prompt_twice(target, tokenizer, tmp_path):
    """The second job waits for the shard lock, then finds every prompt answered and writes nothing."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [pool.submit(generate, target, tokenizer, tmp_path) for _ in range(2)]
        for job in jobs:
            job.result()
    lines = (tmp_path / "shard-000.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["index"] for line in lines) == list(range(len(PROMPTS)))


def test_weighted_examples_repeat_each_folder_by_its_weight(target, tokenizer, tmp_path):
    generate(target, tokenizer, tmp_path / "greedy")
    generate(target, tokenizer, tmp_path / "sampled", temperature=1.0, seed=0)
    greedy, sampled = load_examples(tmp_path / "greedy"), load_examples(tmp_path / "sampled")
    weighted = load_weighted_examples([tmp_path / "greedy", tmp_path / "sampled"], [2, 1])
    assert len(weighted) == 2 * len(greedy) + len(sampled)
    for got, expected in zip(weighted, greedy + greedy + sampled, strict=True):
        assert torch.equal(got["input_ids"], expected["input_ids"])
    with pytest.raises(ValueError):
        load_weighted_examples([tmp_path / "greedy"], [1, 1])
