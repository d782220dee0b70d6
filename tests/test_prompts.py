"""Prompt sources: chats up to the first user turn from JSONL files and ShareGPT, and the errors for bad ones."""

import json
import sys

import pytest

from hf_hyperdflash.prompts import load_prompts


def test_prompt_sources(tmp_path, monkeypatch):
    chats = tmp_path / "chats.jsonl"
    lines = [
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A"},
            ]
        },
        {"prompt": "Q2"},
        {"messages": [{"role": "assistant", "content": "no user turn"}]},
        {"conversations": [{"from": "human", "value": "Q3"}, {"from": "gpt", "value": "A3"}]},
    ]
    chats.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert load_prompts(str(chats)) == [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}],
        [{"role": "user", "content": "Q2"}],
        [{"role": "user", "content": "Q3"}],
    ]
    assert len(load_prompts(str(chats), limit=2)) == 2
    held_out = load_prompts("sharegpt", "held_out", limit=3)
    assert len(held_out) == 3 and all(p[-1]["role"] == "user" for p in held_out)
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match="pip install datasets"):
        load_prompts("some-org/some-dataset")
