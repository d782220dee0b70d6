"""Drafters in transformers' text-generation pipeline, for every drafter kind. Given when the pipeline is built,
transformers compares the vocabulary and special token ids of target and assistant configs, so drafter configs carry
the target's; given at call time or streamed, nothing is compared. Every text equals the pipeline's own without an
assistant (greedy, fp32). Named by path, a drafter loads through the library's hook on transformers' assistant loader
(`hf_hyperdflash/pipeline_assistants.py`); without the library it cannot work, since transformers hands that loader
no `trust_remote_code` (the error says what to do).
"""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    TextIteratorStreamer,
    pipeline,
)
from transformers.pipelines import Pipeline

from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting, reference
from hf_hyperdflash.modeling.modeling_hyperdflash import SPECIAL_TOKEN_IDS
from hf_hyperdflash.testing import tiny_deepseek_v4, tiny_glm5_next, tiny_hy_v4, tiny_qwen4_exp
from hf_hyperdflash.training.trainer import build_drafter

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

SHIPPED = {
    "hyperdflash": reference.drafter_path("hyperdflash"),
    "vanilla_dflash": reference.drafter_path("vanilla_dflash"),
    "mtp": reference.mtp_path(),
}
MESSAGES = [{"role": "user", "content": "Explain what a hash table is."}]
GREEDY = {"max_new_tokens": 40, "do_sample": False}
TINY_PROMPT = "t5 t17 t33 t9 t250 t12 t77 t401 t3 t64 t128"  # longer than the tiny V4's sliding window (8)


def _reply(pipe: Pipeline, **kwargs) -> str:
    return pipe(MESSAGES, **GREEDY, **kwargs)[0]["generated_text"][-1]["content"]


def _shipped(kind: str) -> PreTrainedModel:
    return AutoModel.from_pretrained(SHIPPED[kind], dtype=torch.float32)


def _drafted(drafter: PreTrainedModel) -> bool:
    """Whether the last generate() with `drafter` ran speculative decoding (no silent fall back to plain decoding)."""
    stats = getattr(drafter, "last_generation_stats", None)
    return stats is not None and stats.new_tokens > 0


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(reference.tokenizer_path())


@pytest.fixture(scope="module")
def target() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32)


@pytest.fixture(scope="module")
def plain_text(target, tokenizer) -> str:
    return _reply(pipeline("text-generation", model=target, tokenizer=tokenizer))


@pytest.mark.parametrize("kind", SHIPPED)
def test_shipped_drafter_configs_carry_the_targets_special_token_ids(kind):
    target = json.loads((reference.target_path() / "config.json").read_text())
    drafter = json.loads((SHIPPED[kind] / "config.json").read_text())
    assert {name: drafter[name] for name in SPECIAL_TOKEN_IDS} == {name: target[name] for name in SPECIAL_TOKEN_IDS}


@pytest.mark.parametrize("kind", SHIPPED)
def test_drafter_given_when_the_pipeline_is_built(target, tokenizer, plain_text, kind):
    drafter = _shipped(kind)
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    assert pipe.assistant_model is drafter and pipe.assistant_tokenizer is None  # recognised as the same tokenizer
    assert _reply(pipe) == plain_text
    assert _drafted(drafter)


@pytest.mark.parametrize("kind", SHIPPED)
def test_drafter_given_at_call_time(target, tokenizer, plain_text, kind):
    drafter = _shipped(kind)
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    assert _reply(pipe, assistant_model=drafter) == plain_text
    assert _drafted(drafter)


def _streamed(pipe: Pipeline, tokenizer: PreTrainedTokenizerFast) -> str:
    """What a TextIteratorStreamer yields while `pipe` runs in another thread (its error, if any, re-raised here)."""
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=120)
    errors = []

    def run() -> None:
        try:
            pipe(MESSAGES, streamer=streamer, **GREEDY)
        except Exception as error:  # end the stream, so the reader below does not wait for the timeout
            errors.append(error)
            streamer.end()

    thread = threading.Thread(target=run)
    thread.start()
    text = "".join(streamer)
    thread.join()
    if errors:
        raise errors[0]
    return text


def test_streaming_through_a_pipeline_with_a_drafter(target, tokenizer, plain_text):
    """The streamer receives several tokens per verify step; what it yields is the plain pipeline's stream."""
    drafter = _shipped("hyperdflash")
    plain = _streamed(pipeline("text-generation", model=target, tokenizer=tokenizer), tokenizer)
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    assert _streamed(pipe, tokenizer) == plain
    assert plain == plain_text
    assert drafter.last_generation_stats.mean_accepted_length > 1  # blocks of tokens reached the streamer


@pytest.fixture(scope="module")
def word_tokenizer() -> PreTrainedTokenizerFast:
    """For the tiny targets: token i is the word `t{i}`."""
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _untrained_drafters(target: PreTrainedModel) -> dict[str, PreTrainedModel]:
    torch.manual_seed(0)
    drafters = {
        "hyperdflash": HyperDFlashForDrafting.from_target(target, block_size=4),
        "vanilla_dflash": HyperDFlashForDrafting.from_target(
            target, block_size=4, reducer="dense", conditioning="intermediate"
        ),
    }
    if target.config.model_type == "deepseek_v4":
        drafters["mtp"] = DeepseekV4MTPForDrafting.from_target(target)
    return drafters


@pytest.mark.parametrize("build", [tiny_deepseek_v4, tiny_hy_v4, tiny_glm5_next, tiny_qwen4_exp])
def test_from_target_copies_the_special_token_ids_of_the_text_config(build):
    """The text config is what the pipeline compares (GLM-5-Next's ids live there; Qwen4-Exp's bos is None)."""
    target = build()
    expected = {name: getattr(target.config.get_text_config(), name) for name in SPECIAL_TOKEN_IDS}
    for drafter in _untrained_drafters(target).values():
        assert {name: getattr(drafter.config, name) for name in SPECIAL_TOKEN_IDS} == expected


@pytest.mark.parametrize("build", [tiny_deepseek_v4, tiny_hy_v4, tiny_qwen4_exp])
def test_untrained_drafters_in_a_pipeline_on_tiny_targets(build, word_tokenizer, tmp_path):
    target = build()
    arguments = {"max_new_tokens": 16, "do_sample": False, "return_full_text": False}
    plain = pipeline("text-generation", model=target, tokenizer=word_tokenizer)(TINY_PROMPT, **arguments)
    for kind, drafter in _untrained_drafters(target).items():
        drafter.save_pretrained(tmp_path / kind)  # the ids survive save and load
        drafter = AutoModel.from_pretrained(tmp_path / kind)
        pipe = pipeline("text-generation", model=target, tokenizer=word_tokenizer, assistant_model=drafter)
        assert pipe(TINY_PROMPT, **arguments) == plain, kind
        assert _drafted(drafter), kind


def test_training_from_a_drafter_saved_without_special_token_ids_adds_the_targets(tmp_path):
    """`hyperdflash train --init-from` with a drafter saved before configs carried the ids: the trained drafter it
    exports carries the target's."""
    target = tiny_deepseek_v4()
    HyperDFlashForDrafting.from_target(target, block_size=4).save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({k: v for k, v in config.items() if k not in SPECIAL_TOKEN_IDS}))
    assert not hasattr(HyperDFlashForDrafting.from_pretrained(tmp_path).config, "eos_token_id")
    drafter = build_drafter(target, init_from=tmp_path)
    for name in SPECIAL_TOKEN_IDS:
        assert getattr(drafter.config, name) == getattr(target.config, name), name


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """The shipped HyperDFlash drafter saved as a user publishes it: with its remote code and `auto_map`."""
    folder = tmp_path_factory.mktemp("published")
    _shipped("hyperdflash").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", [*SHIPPED, "published"])
def test_drafter_named_by_path_when_the_library_is_imported(target, tokenizer, plain_text, published, kind):
    path = published if kind == "published" else SHIPPED[kind]
    pipe = pipeline(
        "text-generation", model=target, tokenizer=tokenizer, assistant_model=str(path), trust_remote_code=True
    )
    assert pipe.assistant_model.dtype == torch.float32 and pipe.assistant_tokenizer is None
    assert _reply(pipe) == plain_text
    assert _drafted(pipe.assistant_model)


WITHOUT_LIBRARY = """
import json, pathlib, sys, torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline
tokenizer_dir, target_dir, drafter_dir, messages, greedy, report = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
def reply(**assistant):
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer, **assistant)
    return pipe(json.loads(messages), **json.loads(greedy))[0]["generated_text"][-1]["content"]
plain = reply()
drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True, dtype=torch.float32)
loaded = reply(assistant_model=drafter)
try:
    reply(assistant_model=drafter_dir, trust_remote_code=True)
    named = None
except ValueError as error:
    named = str(error)
pathlib.Path(report).write_text(json.dumps({
    "identical": loaded == plain,
    "drafted": drafter.last_generation_stats.mean_accepted_length > 1,
    "named": named,
    "library_imported": "hf_hyperdflash" in sys.modules,
}))
"""


@pytest.mark.slow
def test_without_the_library_a_drafter_loaded_with_remote_code_works_in_a_pipeline(published, tmp_path):
    """A Hub user's process: the drafter loaded with `trust_remote_code=True` works in a pipeline. Named by path it
    cannot: transformers passes neither the pipeline's `trust_remote_code` nor anything else to the assistant's
    loader, and its error asks for `trust_remote_code=True` (docs/own_target.md: load the drafter, pass the object)."""
    folders = [reference.tokenizer_path(), reference.target_path(), published]
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_LIBRARY, *map(str, folders), json.dumps(MESSAGES), json.dumps(GREEDY), report],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")},
        stdin=subprocess.DEVNULL,  # transformers asks whether to trust the code; no answer is a no
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads(report.read_text())
    assert outcome["identical"] and outcome["drafted"] and not outcome["library_imported"]
    assert "trust_remote_code=True" in outcome["named"]
