"""Targets of every supported mHC family through one interface (`targets.py`): DeepSeek-V4 (the rest of the suite)
and HY-V4 here. Greedy speculative output equals plain decoding on prompts longer than the indexer budget, with
2 indexer heads; per-step outputs match; the inherited gate reproduces the family's collapse; what a family cannot
do is refused up front.
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
from hf_hyperdflash.modeling.targets import HYV4Target, get_target_adapter
from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT
from hf_hyperdflash.testing import OracleProposer, oracle_drafting, tiny_deepseek_v4, tiny_hy_v4
from hf_hyperdflash.training.command import add_train_arguments, run_train

FIXTURES = Path(__file__).parent / "fixtures"

SEEDS = range(10)
PROMPT_TOKENS = 40  # 10 times the indexer's budget (index_topk 4)
NEW_TOKENS = 24
OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_hidden_states=True, output_attentions=True)


def _pairs(seeds=SEEDS, reducer: str = "inherited_gate"):
    """(plain, speculative) greedy outputs per seed on tiny HY-V4 targets, drafts mostly accepted."""
    for seed in seeds:
        target = tiny_hy_v4(seed=seed)
        drafter = HyperDFlashForDrafting.from_target(target, block_size=8, reducer=reducer).eval()
        drafter.generation_config.num_assistant_tokens_schedule = "constant"
        prompt = torch.randint(3, 512, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed))
        plain = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **OUTPUTS)
        with oracle_drafting(OracleProposer(512, plain.sequences, corruption=0.15, seed=seed)):
            speculative = target.generate(
                prompt, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False, **OUTPUTS
            )
        yield plain, speculative


def test_hy_v4_greedy_speculation_and_its_outputs_match_plain_decoding():
    for plain, speculative in _pairs():
        assert torch.equal(plain.sequences, speculative.sequences)
        for name in ("scores", "hidden_states", "attentions"):
            ours, theirs = getattr(speculative, name), getattr(plain, name)
            assert len(ours) == len(theirs) == NEW_TOKENS
            for step_ours, step_theirs in zip(ours, theirs, strict=True):
                pairs = [(step_ours, step_theirs)] if name == "scores" else zip(step_ours, step_theirs, strict=True)
                for a, b in pairs:
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_hy_v4_vanilla_dflash_drafter_is_lossless_too():
    for plain, speculative in _pairs(seeds=range(3), reducer="dense"):
        assert torch.equal(plain.sequences, speculative.sequences)


def test_hy_v4_stock_tie_breaking_makes_verification_differ(monkeypatch):
    """Negative control: HY-V4's indexer ties also differ between verify and one-token forwards without the fix."""
    monkeypatch.setattr(HYV4Indexer, "forward", HYV4Indexer.forward.__wrapped__)
    assert any(not torch.equal(p.sequences, s.sequences) for p, s in _pairs(seeds=range(4)))


def test_hy_v4_sampling_under_a_fixed_seed_with_top_k_1():
    target = tiny_hy_v4(seed=3)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=8).eval()
    prompt = torch.randint(3, 512, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(3))
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=1)
    torch.manual_seed(0)
    plain = target.generate(prompt, **options)
    with oracle_drafting(OracleProposer(512, plain, corruption=0.15, seed=3)):
        torch.manual_seed(0)
        assert torch.equal(target.generate(prompt, assistant_model=drafter, **options), plain)


def test_the_inherited_gate_reproduces_the_hy_v4_collapse():
    target = tiny_hy_v4(seed=0)
    assert isinstance(get_target_adapter(target), HYV4Target)
    drafter = HyperDFlashForDrafting.from_target(target).eval()
    residual = torch.randn(2, 5, target.config.hc_mult, target.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(drafter.reducer(residual), target.model.hc_head(residual))
    assert drafter.config.target_model_type == "hy_v4"


def test_continuing_a_hy_v4_conversation_on_the_returned_cache():
    target = tiny_hy_v4(seed=1)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=8).eval()
    prompt = torch.randint(3, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    first = target.generate(
        prompt, max_new_tokens=8, do_sample=False, assistant_model=drafter, return_dict_in_generate=True
    )
    follow_up = torch.cat([first.sequences, prompt[:, :6]], dim=1)
    cache = {CACHE_ARGUMENT: getattr(first, CACHE_ARGUMENT)}
    continued = target.generate(follow_up, max_new_tokens=10, do_sample=False, assistant_model=drafter, **cache)
    assert torch.equal(continued, target.generate(follow_up, max_new_tokens=10, do_sample=False))


def test_native_mtp_is_refused_on_a_family_without_it():
    target = tiny_hy_v4(seed=0)
    with pytest.raises(ValueError, match="DeepSeek-V4's MTP block"):
        DeepseekV4MTPForDrafting.from_target(target)
    v4_mtp = DeepseekV4MTPForDrafting.from_target(tiny_deepseek_v4(seed=0, hc_mult=4, hidden_size=64))
    forwards = []
    hook = target.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="a hy_v4 target has none"):
            target.generate(torch.tensor([[5, 6, 7]]), assistant_model=v4_mtp, max_new_tokens=4)
    finally:
        hook.remove()
    assert not forwards


def test_train_and_eval_commands_on_a_hy_v4_target(tmp_path):
    """`hyperdflash train` builds and trains a drafter for a HY-V4 target through the family interface, and
    `hyperdflash eval` checks it decodes exactly (it exits 1 on any greedy difference)."""
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    tiny_hy_v4(seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids).save_pretrained(
        tmp_path / "target"
    )
    replies = tmp_path / "replies.jsonl"
    chat = [{"role": "user", "content": "Say something."}]
    replies.write_text("".join(json.dumps({"messages": chat, "reply": f"Reply number {i}."}) + "\n" for i in range(4)))
    models = ["--target", str(tmp_path / "target"), "--tokenizer", str(reference.tokenizer_path())]
    train = [*models, "--replies", str(replies), "--block-size", "4", "--num-layers", "1", "--batch-size", "2"]
    train += ["--anchors-per-sequence", "2", "--total-steps", "2", "--warmup-steps", "1", "--log-every", "1"]
    parser = add_train_arguments(argparse.ArgumentParser())
    drafter_dir = run_train(parser.parse_args([*train, "--output-dir", str(tmp_path / "train")]))
    AcceleratorState._reset_state(reset_partial_state=True)
    assert json.loads((drafter_dir / "config.json").read_text())["target_model_type"] == "hy_v4"

    evaluate = [*models, "--mtp", "none", "--drafter", f"hy_v4={drafter_dir}", "--num-prompts", "2"]
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
    (method,) = [m for m in results["settings"][0]["methods"] if m["name"] == "hy_v4"]
    assert method["lossless"] == method["compared"] == 2
