"""The Hub path: a saved drafter carries the whole runtime, so a process that cannot import hf_hyperdflash gets
lossless speculative decoding through `AutoModel.from_pretrained(dir, trust_remote_code=True)` alone.

Each child process blocks `import hf_hyperdflash` with a `sys.meta_path` finder, turns FutureWarning and
DeprecationWarning into errors (transformers 5.24 deprecates `past_key_values`; our code must not use it), loads a
stock target and saved drafters, and compares speculative with plain greedy decoding.
"""

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, GenerationMixin
from transformers.dynamic_module_utils import get_class_from_dynamic_module

import hf_hyperdflash
from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting, reference
from hf_hyperdflash.modeling import integration
from hf_hyperdflash.testing import (
    DECODE_EVERY_PAIR,
    run_python,
    run_without_the_library,
    save_every_family,
    tiny_deepseek_v4,
)

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

RUNTIME_DIR = Path(hf_hyperdflash.modeling.__file__).parent
RUNTIME_FILES = {path.name for path in RUNTIME_DIR.glob("*.py")} - {"__init__.py"}
README = Path(__file__).parents[1] / "README.md"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A tiny stock V4 target and four drafters for it (one with DSpark's heads), and the shipped drafters, saved as a
    user would publish them."""
    root = tmp_path_factory.mktemp("hub")
    target = tiny_deepseek_v4(seed=3)
    target.save_pretrained(root / "target")
    torch.manual_seed(0)
    folders = {"target": root / "target"}
    drafters = {
        "hyperdflash": HyperDFlashForDrafting.from_target(target, block_size=4),
        "vanilla_dflash": HyperDFlashForDrafting.from_target(
            target, block_size=4, reducer="dense", conditioning="intermediate"
        ),
        "mtp": DeepseekV4MTPForDrafting.from_target(target),
        "hyperdflash_heads": HyperDFlashForDrafting.from_target(target, block_size=4, markov_rank=4),
    }
    for name, drafter in drafters.items():
        drafter.save_pretrained(root / name)
        folders[name] = root / name
    # The shipped reference drafters, published the same way: loaded with the library, saved with save_pretrained.
    shipped = {kind: reference.drafter_path(kind) for kind in reference.DRAFTER_KINDS}
    for name, source in (shipped | {"mtp": reference.mtp_path(), "dspark": reference.dspark_path()}).items():
        AutoModel.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(root / f"reference_{name}")
        folders[f"reference_{name}"] = root / f"reference_{name}"
    return folders


def test_save_pretrained_writes_the_whole_runtime(saved):
    """Every runtime module, written from the one source; the drafter class loads through `drafting.py`, which
    installs the generate() integration (the modeling files do not import it)."""
    for name in ("hyperdflash", "vanilla_dflash", "mtp", "hyperdflash_heads", "reference_mtp", "reference_dspark"):
        folder = saved[name]
        shipped = {path.name for path in folder.glob("*.py")}
        assert shipped == RUNTIME_FILES, name
        for file in shipped:  # copies of the one source, not kept by hand
            assert (folder / file).read_text() == (RUNTIME_DIR / file).read_text()
        config = json.loads((folder / "config.json").read_text())
        assert set(config["auto_map"]) == {"AutoConfig", "AutoModel"}
        assert config["auto_map"]["AutoModel"] == f"drafting.{config['architectures'][0]}"
        assert (folder / "README.md").exists()


def test_runtime_imports_only_torch_transformers_and_itself():
    allowed = {"torch", "transformers", "safetensors", "huggingface_hub", "__future__", *sys.stdlib_module_names}
    for file in RUNTIME_DIR.glob("*.py"):
        source = file.read_text()
        absolute = re.findall(r"^\s*(?:from|import)\s+(\w+)", source, flags=re.MULTILINE)
        assert set(absolute) <= allowed, (file.name, set(absolute) - allowed)


@pytest.mark.slow
def test_fresh_process_without_the_library_decodes_losslessly(saved, tmp_path):
    prompt = [5, 17, 33, 9, 250, 11, 12, 40, 77, 3, 19, 23, 8, 101, 44, 6, 7, 90]  # longer than the sliding window
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    messages = [{"role": "user", "content": "How do I make a good cup of coffee at home?"}]
    chat_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    cases = [
        {
            "target": str(saved["target"]),
            "prompt": prompt,
            "drafters": [str(saved[name]) for name in ("hyperdflash", "mtp", "hyperdflash_heads")],
        },
        {
            "target": str(reference.target_path()),
            "prompt": list(chat_prompt["input_ids"]),
            "drafters": [str(saved[f"reference_{k}"]) for k in ("hyperdflash", "vanilla_dflash", "mtp", "dspark")],
        },
    ]
    output = run_without_the_library(tmp_path, DECODE_EVERY_PAIR, json.dumps(cases))
    *results, status = json.loads(output.strip().splitlines()[-1])
    assert status == {"library_imported": False}
    assert len(results) == 7
    for result in results:
        assert result["module"].startswith("transformers_modules."), result
        assert result["identical"], result
        assert result["new_tokens"] == 24 and result["tau"] >= 1.0, result
    shipped_tau = {Path(r["drafter"]).name: r["tau"] for r in results}
    # the trained drafters really draft through the remote code
    assert shipped_tau["reference_hyperdflash"] > 1.5 and shipped_tau["reference_dspark"] > 1.5


@pytest.mark.slow
def test_every_family_and_drafter_kind_decodes_without_the_library(tmp_path):
    """Saved drafters for every family (all three kinds on DeepSeek-V4) give plain decoding's greedy tokens on a prompt
    past the sliding windows, and a seeded T=1 call completes, in a process that cannot import the library.
    `.ci/hub_across_versions.py` runs the same cases across transformers versions (saved under one, run under
    another)."""
    cases = save_every_family(tmp_path / "saved")
    output = run_without_the_library(tmp_path, DECODE_EVERY_PAIR, json.dumps(cases))
    *results, status = json.loads(output.splitlines()[-1])
    assert status == {"library_imported": False}
    assert len(results) == 6
    for result in results:
        assert result["module"].startswith("transformers_modules."), result
        assert result["identical"] and result["new_tokens"] == 24, result
        assert result["sampled_new_tokens"] == 24, result


@pytest.mark.slow
def test_readme_snippet_runs_without_the_library(saved, tmp_path):
    """The README's "Use it on your own target" code, as written, minus nothing: it has no library import."""
    text = README.read_text()
    section = text[text.index("## Use it on your own target") :]
    snippet = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL).group(1)
    assert "hf_hyperdflash" not in snippet
    prelude = textwrap.dedent(
        f"""
        import torch
        target_path, drafter_path = {str(saved["target"])!r}, {str(saved["hyperdflash"])!r}
        inputs = {{"input_ids": torch.tensor([[5, 17, 33, 9, 250, 11]])}}
        """
    )
    check = textwrap.dedent(
        """
        plain = target.generate(**inputs, max_new_tokens=256, do_sample=False)
        assert torch.equal(out, plain), "speculative output differs from plain decoding"
        assert drafter.last_generation_stats.new_tokens == out.shape[1] - 6
        print("ok")
        """
    )
    assert run_without_the_library(tmp_path, prelude + snippet + check).strip().endswith("ok")


def test_library_and_remote_drafters_share_one_integration(saved):
    """With the library imported, a remote-code drafter and a library drafter both work, under one wrapper.

    (AutoModel itself hands out the library class once the library is imported; the remote class is what a process
    that loaded remote code before importing the library holds.)"""
    target = AutoModelForCausalLM.from_pretrained(saved["target"], dtype=torch.float32).eval()
    local = AutoModel.from_pretrained(saved["hyperdflash"], trust_remote_code=True, dtype=torch.float32).eval()
    assert type(local) is HyperDFlashForDrafting
    remote_class = get_class_from_dynamic_module("modeling_hyperdflash.HyperDFlashForDrafting", saved["hyperdflash"])
    remote = remote_class.from_pretrained(saved["hyperdflash"], dtype=torch.float32).eval()
    assert remote_class.__module__.startswith("transformers_modules.")
    generate = GenerationMixin.generate
    assert generate._hyperdflash_integration == integration.__name__  # the library's copy took over
    assert not hasattr(generate.__wrapped__, "_hyperdflash_integration")  # wrapped once, not twice
    prompt = torch.tensor([[5, 17, 33, 9, 250, 11, 12, 40]])
    plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
    for drafter in (remote, local):
        assert torch.equal(target.generate(prompt, assistant_model=drafter, max_new_tokens=16, do_sample=False), plain)
        assert drafter.last_generation_stats.new_tokens == 16


@pytest.mark.slow
def test_library_takes_over_from_a_remote_code_integration(saved, tmp_path):
    script = textwrap.dedent(
        f"""
        from transformers import AutoModel, GenerationMixin
        AutoModel.from_pretrained({str(saved["mtp"])!r}, trust_remote_code=True)
        first = GenerationMixin.generate._hyperdflash_integration
        AutoModel.from_pretrained({str(saved["hyperdflash"])!r}, trust_remote_code=True)  # a second remote copy
        assert GenerationMixin.generate._hyperdflash_integration == first, "a second remote copy re-wrapped"
        import hf_hyperdflash
        generate = GenerationMixin.generate
        assert generate._hyperdflash_integration == "hf_hyperdflash.modeling.integration"
        assert not hasattr(generate.__wrapped__, "_hyperdflash_integration"), "wrapped twice"
        print(first)
        """
    )
    assert run_python(tmp_path, script).strip().startswith("transformers_modules.")
