"""Targets of every supported mHC family through one interface (`targets.py`): DeepSeek-V4, HY-V4, GLM-5-Next and
Qwen4-Exp. Lossless decoding on every family is `tests/test_lossless.py`; here the inherited gate reproduces the
family's collapse, HY-V4's indexer ties would break verification without the fix, train and eval run, and what a
family cannot do is refused up front.
"""

import argparse
import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import AutoTokenizer
from transformers.models.hy_v4.modeling_hy_v4 import HYV4Indexer

from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting, reference
from hf_hyperdflash.evaluation.command import add_eval_arguments, run_eval
from hf_hyperdflash.evaluation.report import REPORT_FILES
from hf_hyperdflash.modeling.targets import TARGET_FAMILIES, get_target_adapter
from hf_hyperdflash.testing import (
    OracleProposer,
    oracle_drafting,
    tiny_deepseek_v4,
    tiny_glm5_next,
    tiny_hy_v4,
    tiny_qwen4_exp,
    tiny_qwen4_exp_composite,
)
from hf_hyperdflash.training.command import add_train_arguments, run_train

FIXTURES = Path(__file__).parent / "fixtures"
BUILDERS = {
    "hy_v4": tiny_hy_v4,
    "glm5_next": tiny_glm5_next,
    "qwen4_exp_text": tiny_qwen4_exp,
    "qwen4_exp": tiny_qwen4_exp_composite,  # the composite class, on its text path
}
PROMPT_TOKENS = 40  # 10 times HY-V4's indexer budget (4 tokens), 5 times GLM-5-Next's and Qwen4-Exp's (8)
NEW_TOKENS = 24
OUTPUTS = dict(return_dict_in_generate=True)


def _eager(target):
    """Attentions need eager attention (GLM-5-Next and Qwen4-Exp default to sdpa, which returns none)."""
    target.set_attn_implementation("eager")
    return target


def _pairs(family: str, seeds):
    """(plain, speculative) greedy outputs per seed on tiny targets of `family`, drafts from an oracle."""
    for seed in seeds:
        target = _eager(BUILDERS[family](seed=seed))
        drafter = HyperDFlashForDrafting.from_target(target, block_size=8).eval()
        drafter.generation_config.num_assistant_tokens_schedule = "constant"
        prompt = torch.randint(3, 512, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed))
        plain = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **OUTPUTS)
        with oracle_drafting(OracleProposer(512, plain.sequences, corruption=0.15, seed=seed)):
            speculative = target.generate(
                prompt, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False, **OUTPUTS
            )
        yield plain, speculative


def test_hy_v4_stock_tie_breaking_makes_verification_differ(monkeypatch):
    """Negative control: HY-V4's indexer ties also differ between verify and one-token forwards without the fix."""
    monkeypatch.setattr(HYV4Indexer, "forward", HYV4Indexer.forward.__wrapped__)
    pairs = _pairs("hy_v4", seeds=range(4))
    assert any(not torch.equal(p.sequences, s.sequences) for p, s in pairs)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_the_inherited_gate_reproduces_the_family_collapse(family):
    """HY-V4: a copy of its head; GLM-5-Next: a V4-form head set to its parameter-free mean; Qwen4-Exp: a copy of
    its gated-residual mixer over flat streams."""
    target = BUILDERS[family](seed=0)
    adapter = get_target_adapter(target)
    assert isinstance(adapter, TARGET_FAMILIES[target.config.model_type])
    drafter = HyperDFlashForDrafting.from_target(target).eval()
    residual = torch.randn(2, 5, adapter.hc_mult, adapter.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(drafter.reducer(residual), adapter.collapse(residual), rtol=1e-6, atol=1e-6)
    assert drafter.config.target_model_type == adapter.config.model_type


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_native_mtp_is_refused_on_a_family_without_it(family):
    target = BUILDERS[family](seed=0)
    with pytest.raises(ValueError, match="DeepSeek-V4's MTP block"):
        DeepseekV4MTPForDrafting.from_target(target)
    v4_mtp = DeepseekV4MTPForDrafting.from_target(tiny_deepseek_v4(seed=0, hc_mult=4, hidden_size=64))
    forwards = []
    hook = target.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=f"a {get_target_adapter(target).family} target has none"):
            target.generate(torch.tensor([[5, 6, 7]]), assistant_model=v4_mtp, max_new_tokens=4)
    finally:
        hook.remove()
    assert not forwards


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_train_and_eval_commands(family, tmp_path):
    """`hyperdflash train` builds and trains a drafter for the target through the family interface, and
    `hyperdflash eval` checks it decodes exactly (it exits 1 on any greedy difference)."""
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    target = BUILDERS[family](seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids)
    target.save_pretrained(tmp_path / "target")
    replies = tmp_path / "replies.jsonl"
    chat = [{"role": "user", "content": "Say something."}]
    replies.write_text("".join(json.dumps({"messages": chat, "reply": f"Reply number {i}."}) + "\n" for i in range(4)))
    models = ["--target", str(tmp_path / "target"), "--tokenizer", str(reference.tokenizer_path())]
    train = [*models, "--replies", str(replies), "--block-size", "4", "--num-layers", "1", "--batch-size", "2"]
    train += ["--anchors-per-sequence", "2", "--total-steps", "2", "--warmup-steps", "1", "--log-every", "1"]
    parser = add_train_arguments(argparse.ArgumentParser())
    drafter_dir = run_train(parser.parse_args([*train, "--output-dir", str(tmp_path / "train")]))
    AcceleratorState._reset_state(reset_partial_state=True)
    target_model_type = get_target_adapter(target).config.model_type
    assert json.loads((drafter_dir / "config.json").read_text())["target_model_type"] == target_model_type

    evaluate = [*models, "--mtp", "none", "--drafter", f"{family}={drafter_dir}", "--num-prompts", "2"]
    evaluate += [
        "--datasets",
        f"gsm8k={FIXTURES / 'gsm8k.jsonl'}",
        "--max-prompt-chars",
        "60",
        "--max-new-tokens",
        "8",
    ]
    evaluate += ["--repeats", "1", "--temperatures", "0", "--modes", "non-thinking", "--output-dir", str(tmp_path)]
    assert run_eval(add_eval_arguments(argparse.ArgumentParser()).parse_args(evaluate)) == 0
    results = json.loads((tmp_path / REPORT_FILES["json"]).read_text())
    (method,) = [m for m in results["settings"][0]["methods"] if m["name"] == family]
    assert method["lossless"] == method["compared"] == 2


def test_a_glm5_next_drafter_card_loads_the_target_with_its_auto_class(tmp_path):
    HyperDFlashForDrafting.from_target(tiny_glm5_next(seed=0)).save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "target = AutoModelForImageTextToText.from_pretrained(" in card and "glm5_next_text" in card
