"""Several threads calling generate() on one target at once (a chat server): each call's output is what serial plain
decoding gives, with one shared drafter, with two drafters, and beside a plain call; on DeepSeek-V4 (the shipped
pair: drafts are often accepted, so steps accept, reject and roll back) and on a linear-attention family (GLM-5-Next,
whose rollback replays recorded kernel calls). Prompts of different lengths, so a call that saw another's state
would fail on shapes or give other tokens."""

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting, reference
from hf_hyperdflash.modeling.call_scope import CallHooks
from hf_hyperdflash.testing import image_prompt, tiny_glm5_next, tiny_qwen4_exp_composite

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

ROUNDS = 5
NEW_TOKENS = 32


def _concurrently(calls: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
    """Run `calls` in threads released together; a call's exception is raised here."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], torch.Tensor]) -> torch.Tensor:
        barrier.wait()
        with torch.no_grad():
            return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(run, call) for call in calls]
        return [future.result() for future in futures]


@pytest.fixture(scope="module")
def deepseek_v4():
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    drafters = [
        HyperDFlashForDrafting.from_pretrained(reference.drafter_path("hyperdflash"), dtype=torch.float32).eval(),
        DeepseekV4MTPForDrafting.from_pretrained(reference.mtp_path(), dtype=torch.float32).eval(),
    ]
    return target, drafters


@pytest.fixture(scope="module")
def glm5_next():
    target = tiny_glm5_next(seed=0)
    torch.manual_seed(0)
    drafters = [HyperDFlashForDrafting.from_target(target, block_size=4) for _ in range(2)]
    return target, drafters


FAST_CASE = ("deepseek_v4", "one_shared_drafter")
# One case on the fast path; the others, a few seconds each, in CI (`-m slow`)
CONCURRENT_CASES = [
    pytest.param(family, pairing, marks=() if (family, pairing) == FAST_CASE else pytest.mark.slow)
    for family in ("deepseek_v4", "glm5_next")
    for pairing in ("one_shared_drafter", "two_drafters", "speculative_and_plain")
]


@pytest.mark.parametrize(("family", "pairing"), CONCURRENT_CASES)
def test_concurrent_calls_on_one_target_each_give_serial_plain_decoding(request, family, pairing):
    target, drafters = request.getfixturevalue(family)
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(len(pairing))
    for round_ in range(ROUNDS):
        prompts = [torch.randint(3, vocab, (1, length), generator=generator) for length in (17 + round_, 29)]
        expected = [target.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False) for p in prompts]
        assistants = {
            "one_shared_drafter": [drafters[0], drafters[0]],
            "two_drafters": drafters,
            "speculative_and_plain": [drafters[round_ % 2], None],
        }[pairing]
        calls = [
            lambda p=p, a=a: target.generate(p, assistant_model=a, max_new_tokens=NEW_TOKENS, do_sample=False)
            for p, a in zip(prompts, assistants, strict=True)
        ]
        outputs = _concurrently(calls)
        for output, plain in zip(outputs, expected, strict=True):
            assert torch.equal(output, plain), f"round {round_}"


@pytest.mark.parametrize("build", [tiny_glm5_next, tiny_qwen4_exp_composite], ids=["glm5_next", "qwen4_exp"])
def test_concurrent_calls_with_image_prompts_each_give_serial_plain_decoding(build):
    """Two threads with different images (one an image, one a video) and one shared drafter on an image-text target:
    each call's pixels, and Qwen4-Exp's 3-D positions, stay its own."""
    target = build(seed=0)
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=4)
    for round_ in range(2):
        prompts = [image_prompt(target, seed=2 * round_), image_prompt(target, seed=2 * round_ + 1, video=True)]
        expected = [target.generate(**p, max_new_tokens=NEW_TOKENS, do_sample=False) for p in prompts]
        calls = [
            lambda p=p: target.generate(**p, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False)
            for p in prompts
        ]
        for output, plain in zip(_concurrently(calls), expected, strict=True):
            assert torch.equal(output, plain), f"round {round_}"


def test_a_call_leaves_nothing_on_the_shared_target(deepseek_v4):
    """After a speculative call the target's instance and class read as stock: the guard lifted for the call only,
    no instance attributes, no hooks."""
    target, drafters = deepseek_v4
    prompt = torch.tensor([[5, 17, 33, 9, 250, 11, 12, 40]])
    target.generate(prompt, assistant_model=drafters[0], max_new_tokens=8, do_sample=False)
    assert getattr(target, "_is_stateful", True) is True  # before 5.25: the class's guard, lifted for the call only
    assert not {"_is_stateful", "_get_candidate_generator", "_get_stopping_criteria"} & set(vars(target))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in target.modules())


def test_call_hooks_run_only_in_their_call():
    """A call's hooks run only for forwards of the call that registered them, never another thread's, and are
    removed when it ends."""
    module = torch.nn.Linear(2, 2)
    seen = []
    with CallHooks() as hooks:
        hooks.before(module, lambda *_: seen.append("before"))
        hooks.after(module, lambda *_: seen.append("after"))
        module(torch.ones(2))
        assert seen == ["before", "after"]
        with ThreadPoolExecutor(1) as pool:
            pool.submit(module, torch.ones(2)).result()
        assert seen == ["before", "after"]
    assert not module._forward_pre_hooks and not module._forward_hooks


def test_concurrent_batched_calls_each_give_plain_batched_decoding(deepseek_v4):
    """Two threads, each a left-padded batch through the shipped drafters (one batched in one forward, one row by
    row), beside a plain batched call: each as its serial plain batched decoding."""
    target, drafters = deepseek_v4
    prompts = [torch.randint(10, 500, (2, 12), generator=torch.Generator().manual_seed(seed)) for seed in (0, 1)]
    mask = torch.tensor([[0, 0, 0] + [1] * 9, [1] * 12])
    batches = [
        {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "pad_token_id": 0} for ids in prompts
    ]
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
    expected = [target.generate(**batch, **settings) for batch in batches]
    calls = [
        lambda: target.generate(**batches[0], **settings, assistant_model=drafters[0]),
        lambda: target.generate(**batches[1], **settings, assistant_model=drafters[1]),
        lambda: target.generate(**batches[0], **settings),
    ]
    for _ in range(2):
        got = _concurrently(calls)
        assert (
            torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[0])
        )
