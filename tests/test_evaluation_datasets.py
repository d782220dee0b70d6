"""Evaluation prompt sets: raw Hub rows and ready prompts from JSONL fixtures, the offline sets, clear errors."""

import sys
import types
from pathlib import Path

import pytest

from hf_hyperdflash.evaluation.datasets import COPY_TASKS, MATH_INSTRUCTION, PROMPT_SETS, load_prompt_set
from hf_hyperdflash.evaluation.prompts import held_out_prompts
from hf_hyperdflash.sharegpt import load_conversations

FIXTURES = Path(__file__).parent / "fixtures"


def _user_text(chats: list) -> list[str]:
    for chat in chats:
        assert chat[-1]["role"] == "user"
    return [chat[-1]["content"] for chat in chats]


@pytest.mark.parametrize(
    "name, first_contains",
    [
        ("gsm8k", ["Natalia sold clips", MATH_INSTRUCTION]),
        ("math500", ["Convert the point $(0,3)$", MATH_INSTRUCTION]),
        ("aime25", ["integer bases $b>9$", MATH_INSTRUCTION]),
        ("mbpp", ["shared elements", "Your code should pass these tests:", "assert set(similar_elements"]),
        ("livecodebench", ["### Question:\nThere are three cards", "# YOUR CODE HERE", "### Answer:"]),
        ("mtbench", ["Compose an engaging travel blog post about a recent trip to Hawaii."]),
    ],
)
def test_raw_hub_rows_from_a_local_file_go_through_the_set_template(name, first_contains):
    texts = _user_text(load_prompt_set(name, FIXTURES / f"{name}.jsonl"))
    assert len(texts) == sum(1 for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines() if line.strip())
    for fragment in first_contains:
        assert fragment in texts[0]


def test_template_details_per_set():
    mbpp = _user_text(load_prompt_set("mbpp", FIXTURES / "mbpp.jsonl"))
    assert mbpp[1].startswith("Write a python function to remove")  # the `full` config's "text" field
    livecodebench = _user_text(load_prompt_set("livecodebench", FIXTURES / "livecodebench.jsonl"))
    assert "class Solution:" in livecodebench[1] and "# YOUR CODE HERE" not in livecodebench[1]
    mtbench = _user_text(load_prompt_set("mtbench", FIXTURES / "mtbench.jsonl"))
    assert all("Rewrite your previous response" not in text for text in mtbench)  # the first turn only


def test_ready_prompts_pass_through_with_limit_and_cut():
    chats = load_prompt_set("gsm8k", FIXTURES / "generic.jsonl")  # no `question` field: used as written
    assert chats[0] == [{"role": "user", "content": "Explain speculative decoding in one paragraph."}]
    assert chats[1] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    assert len(chats) == 3  # the record without prompt fields is skipped
    short = load_prompt_set("gsm8k", FIXTURES / "generic.jsonl", limit=2, max_chars=7)
    assert _user_text(short) == ["Explain", "What is"]


def test_humaneval_is_offline_and_wrapped_as_a_completion_request():
    chats = load_prompt_set("humaneval", limit=3)
    texts = _user_text(chats)
    assert len(texts) == 3
    assert texts[0].startswith("Complete the following Python function")
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in texts[0]
    assert len(load_prompt_set("humaneval")) == 164


def test_sharegpt_is_the_held_out_split_first_user_turn():
    chats = load_prompt_set("sharegpt", limit=5, max_chars=2000)
    expected = [c.first_prompt[:2000] for c in load_conversations("held_out")[:5]]
    assert _user_text(chats) == expected
    assert held_out_prompts(5) == expected


def test_copyedit_quotes_a_held_out_reply_in_each_task_in_turn():
    texts = _user_text(load_prompt_set("copyedit", limit=8))
    for number, text in enumerate(texts):
        task, passage = text.split("\n\n", 1)
        assert task == COPY_TASKS[number % len(COPY_TASKS)]
        assert 300 <= len(passage) <= 900
    replies = {m["content"] for c in load_conversations("held_out") for m in c.messages if m["role"] == "assistant"}
    assert all(text.split("\n\n", 1)[1] in replies for text in texts)


def test_hub_sets_stream_the_documented_dataset(monkeypatch):
    calls = []

    def load_dataset(path, name=None, split=None, data_files=None, streaming=False):
        calls.append((path, name, split, data_files, streaming))
        return iter([{"question": "What is 2 + 2?", "answer": "4"}] * 5)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    texts = _user_text(load_prompt_set("gsm8k", limit=2))
    assert texts == [f"What is 2 + 2?\n{MATH_INSTRUCTION}"] * 2
    assert calls == [("openai/gsm8k", "main", "test", None, True)]

    calls.clear()
    with pytest.raises(ValueError, match="No usable livecodebench prompts"):
        load_prompt_set("livecodebench", limit=1)  # the fake rows lack question_content / prompt fields
    path, _, split, data_files, streaming = calls[0]
    assert (path, split, streaming) == ("json", "train", True)
    assert data_files[0].endswith("livecodebench/code_generation_lite/resolve/main/test.jsonl")


def test_unavailable_sets_say_how_to_provide_them(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    for name in ("gsm8k", "math500", "aime25", "mbpp", "livecodebench", "mtbench"):
        with pytest.raises(ValueError, match=rf"pip install datasets.*{name}=PATH"):
            load_prompt_set(name, limit=1)

    def unreachable(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=unreachable))
    with pytest.raises(ValueError, match=r"ConnectionError: no network.*math500=PATH"):
        load_prompt_set("math500", limit=1)


def test_bad_names_and_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="Unknown prompt set 'gsm9k'"):
        load_prompt_set("gsm9k")
    with pytest.raises(ValueError, match="does not exist"):
        load_prompt_set("gsm8k", tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"unrelated": 1}\n')
    with pytest.raises(ValueError, match=r"No usable aime25 prompts.*'problem'"):
        load_prompt_set("aime25", empty)
    assert set(PROMPT_SETS) == {
        "gsm8k",
        "math500",
        "aime25",
        "mbpp",
        "livecodebench",
        "mtbench",
        "humaneval",
        "sharegpt",
        "copyedit",
    }
