"""`hyperdflash eval` end to end on a saved tiny target with its own tiny chat tokenizer, plus --help and defaults."""

import argparse
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting, reference
from hf_hyperdflash.evaluation import command
from hf_hyperdflash.evaluation.report import REPORT_FILES
from hf_hyperdflash.modeling.cache_deepseek_v4 import RewindableDeepseekV4Cache
from hf_hyperdflash.testing import tiny_deepseek_v4

FIXTURES = Path(__file__).parent / "fixtures"
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>"
    "{% if not enable_thinking | default(false) %}</think>{% endif %}{% endif %}"
)


def tiny_chat_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level, one token per byte (264 ids with the specials), with a chat template that knows thinking."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    )


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_models")
    tokenizer = tiny_chat_tokenizer()
    target = tiny_deepseek_v4(seed=0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    torch.manual_seed(1)
    HyperDFlashForDrafting.from_target(target, block_size=4).save_pretrained(root / "hyperdflash")
    DeepseekV4MTPForDrafting.from_target(target).save_pretrained(root / "mtp")
    return root


def parse(argv: list[str]) -> argparse.Namespace:
    return command.add_eval_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        command.main(["--help"])
    assert exit_info.value.code == 0
    assert "hyperdflash eval" in capsys.readouterr().out
    parser = command.add_eval_arguments(argparse.ArgumentParser())
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"


def test_flags_are_checked_when_parsed():
    bad_flags = (["--drafter", "nodir"], ["--drafter", "a+b=dir"], ["--datasets", "gsm9k"], ["--repeats", "0"])
    bad_flags += (["--temperatures", "-1"],)
    for bad in (*bad_flags, ["--tau-ratio", "hyperdflash"], ["--tau-ratio", "/mtp-k3"]):
        with pytest.raises(SystemExit):
            parse([*bad, "--output-dir", "out"])
    args = parse(["--output-dir", "out", "--datasets", "gsm8k=x.jsonl", "humaneval", "--draft-tokens", "a=3"])
    assert args.datasets == [("gsm8k", "x.jsonl"), ("humaneval", None)] and args.draft_tokens == [("a", 3)]
    ratios = parse(["--output-dir", "out", "--tau-ratio", "a/b", "--tau-ratio", "a/c", "--tau-ratio", "a/b"]).tau_ratio
    assert command._ratio_pairs(ratios, ["plain", "a", "b", "c"]) == [("a", "b"), ("a", "c")]  # repeats once
    with pytest.raises(ValueError, match="compares a method with itself"):
        command._ratio_pairs([("a", "a")], ["plain", "a"])
    assert command._ratio_pairs([("a+b", "c")], ["plain", "a", "b", "c"]) == [("a+b", "c")]
    with pytest.raises(ValueError, match="compares a method with itself"):
        command._ratio_pairs([("a+b", "b+c")], ["plain", "a", "b", "c"])
    with pytest.raises(ValueError, match=r"no speculative method named \['d'\]"):
        command._ratio_pairs([("a+d", "c")], ["plain", "a", "b", "c"])


def test_missing_shipped_models_are_skipped_with_a_note(monkeypatch, tmp_path):
    def missing(*_):
        raise FileNotFoundError("not installed")

    monkeypatch.setattr(reference, "target_path", lambda: tmp_path / "target")
    monkeypatch.setattr(reference, "tokenizer_path", lambda: tmp_path / "tokenizer")
    monkeypatch.setattr(reference, "mtp_path", missing)
    monkeypatch.setattr(reference, "dspark_path", lambda: tmp_path / "dspark")
    monkeypatch.setattr(
        reference, "drafter_path", lambda kind: tmp_path / kind if kind == "hyperdflash" else missing()
    )
    notes = []
    _, _, mtp, drafters = command._models(parse(["--output-dir", "out"]), notes)
    assert mtp is None and drafters == {"hyperdflash": tmp_path / "hyperdflash", "dspark": tmp_path / "dspark"}
    assert notes == [
        "skipped mtp: the shipped reference mtp is not installed",
        "skipped vanilla_dflash: the shipped reference vanilla_dflash is not installed",
    ]
    notes.clear()
    _, _, mtp, drafters = command._models(parse(["--output-dir", "out", "--dspark", "none"]), notes)
    assert "dspark" not in drafters
    notes.clear()
    _, _, mtp, drafters = command._models(parse(["--output-dir", "out", "--target", "t"]), notes)
    assert mtp is None and drafters == {} and notes == ["no native MTP: pass --mtp DIR for --target"]


def _eval_args(model_dirs, output_dir, *extra: str) -> argparse.Namespace:
    return parse(
        [
            "--target", str(model_dirs / "target"),
            "--mtp", str(model_dirs / "mtp"),
            "--mtp-steps", "2",
            "--drafter", f"hyperdflash={model_dirs / 'hyperdflash'}",
            "--datasets", f"gsm8k={FIXTURES / 'gsm8k.jsonl'}",
            "--num-prompts", "2",
            "--max-prompt-chars", "60",
            "--max-new-tokens", "6",
            "--repeats", "1",
            "--output-dir", str(output_dir),
            *extra,
        ]
    )  # fmt: skip


def test_end_to_end_run_writes_the_report_and_passes(model_dirs, tmp_path, capsys):
    assert command.run_eval(_eval_args(model_dirs, tmp_path)) == 0
    printed = capsys.readouterr().out
    assert "| hyperdflash | 3 |" in printed and "| mtp-k2 | 2 |" in printed
    assert "every greedy output equals plain decoding" in printed
    assert all((tmp_path / name).exists() for name in REPORT_FILES.values())
    data = json.loads((tmp_path / REPORT_FILES["json"]).read_text())
    settings = {(s["temperature"], s["thinking"]) for s in data["settings"]}
    assert settings == {(0.0, False), (0.0, True), (1.0, False), (1.0, True)}
    assert data["run"]["methods"] == ["plain", "mtp-k2", "hyperdflash"]
    assert "| hyperdflash / mtp-k2 |" in printed  # the default paired ratio
    for setting in data["settings"]:
        assert [(r["numerator"], r["denominator"], r["prompts"]) for r in setting["tau_ratios"]] == [
            ("hyperdflash", "mtp-k2", 2)
        ]
        for method in setting["methods"]:
            assert method["prompts"] == 2
            assert method["lossless"] == method["compared"] == (2 if setting["temperature"] == 0 else 0)


def test_a_greedy_output_that_differs_fails_the_command(model_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(RewindableDeepseekV4Cache, "crop", lambda self, max_length: None)  # rollback broken
    args = _eval_args(model_dirs, tmp_path, "--temperatures", "0", "--modes", "non-thinking", "--max-new-tokens", "12")
    args.schedules = ["constant"]  # every step drafts (the default schedule soon stops drafting with these drafters)
    assert command.run_eval(args) == 1
    assert "NOT LOSSLESS: mtp-k2-constant (gsm8k, T=0, non-thinking), hyperdflash-constant" in capsys.readouterr().out


def test_a_tau_ratio_of_an_unknown_method_is_refused_before_decoding(model_dirs, tmp_path):
    args = _eval_args(model_dirs, tmp_path, "--tau-ratio", "hyperdflash/vanilla_dflash")
    with pytest.raises(ValueError, match=r"no speculative method named \['vanilla_dflash'\]; choose from"):
        command.run_eval(args)
    assert not (tmp_path / REPORT_FILES["json"]).exists()


def test_prompt_lookup_rows_run_beside_the_drafters_with_the_same_lossless_check(model_dirs, tmp_path, capsys):
    """transformers' own prompt lookup as peer rows: one method per k, interleaved with the others, its greedy output
    checked against plain decoding; no per-step acceptance is reported for it (transformers keeps none)."""
    args = _eval_args(
        model_dirs, tmp_path, "--prompt-lookup", "2", "4", "--temperatures", "0", "--modes", "non-thinking"
    )
    assert command.run_eval(args) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / REPORT_FILES["json"]).read_text())
    assert data["run"]["methods"] == ["plain", "mtp-k2", "hyperdflash", "prompt-lookup-k2", "prompt-lookup-k4"]
    (setting,) = data["settings"]
    lookup = {m["name"]: m for m in setting["methods"] if m["name"].startswith("prompt-lookup")}
    for name, k in (("prompt-lookup-k2", 2), ("prompt-lookup-k4", 4)):
        assert lookup[name]["lossless"] == lookup[name]["compared"] == 2
        assert lookup[name]["num_draft_tokens"] == k and lookup[name]["tau"] is None
        assert 0 < lookup[name]["forwards_per_token"] <= 1
        assert f"| {name} | {k} | – |" in printed


def test_a_plain_control_times_plain_decoding_again_beside_the_others(model_dirs, tmp_path, capsys):
    """--plain-control adds plain decoding once more, interleaved like any method: its speed over plain decoding's
    is the run's own noise, reported with the speedups; it is no speculative method to take a tau ratio of."""
    args = _eval_args(model_dirs, tmp_path, "--plain-control", "--temperatures", "0", "--modes", "non-thinking")
    assert command.run_eval(args) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / REPORT_FILES["json"]).read_text())
    assert data["run"]["methods"] == ["plain", "plain-control", "mtp-k2", "hyperdflash"]
    (setting,) = data["settings"]
    control = next(m for m in setting["methods"] if m["name"] == "plain-control")
    assert control["lossless"] == control["compared"] == 2 and control["tau"] is None
    assert control["tokens_per_second"] > 0
    speed = [(r["numerator"], r["denominator"]) for r in setting["speed_ratios"]]
    assert speed[0] == ("plain-control", "plain") and "| plain-control / plain |" in printed
    assert [(r["numerator"], r["denominator"]) for r in setting["tau_ratios"]] == [("hyperdflash", "mtp-k2")]
    refused = _eval_args(model_dirs, tmp_path, "--plain-control", "--tau-ratio", "hyperdflash/plain-control")
    with pytest.raises(ValueError, match="no speculative method named \\['plain-control'\\]"):
        command.run_eval(refused)
