"""A call whose draft schedule waits 16 steps or more runs the wait in plain decoding's own loop (a plain stretch)
and resumes the assisted loop after it: the joined result is plain decoding's on every family, with every per-step
output and the returned cache, the streamer sees each token once, stopping criteria and `min_new_tokens` count over
the whole call, and the drafter takes in every position a plain stretch decoded. The waits are forced: after every
drafted step the schedule waits `WAIT` steps."""

import pytest
import torch
from test_generation_tester import assert_same_cache, assert_similar_outputs, family_target, generation_kwargs
from test_threads import _concurrently
from transformers import GenerationConfig, GenerationMixin, StoppingCriteria, StoppingCriteriaList

from hf_hyperdflash import DeepseekV4MTPForDrafting, HyperDFlashForDrafting
from hf_hyperdflash.modeling.candidate_generator import BlockProposer
from hf_hyperdflash.modeling.draft_policy import AdaptiveDraftPolicy
from hf_hyperdflash.modeling.stretches import MIN_PLAIN_STRETCH
from hf_hyperdflash.modeling.targets import get_target_adapter
from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT

pytestmark = pytest.mark.compat  # touches transformers internals: `pytest -m compat`

WAIT = 20
NEW_TOKENS = 60
FAMILIES = ["deepseek_v4", "hy_v4", "glm5_next", "qwen4_exp", "qwen4_exp_composite"]


def _force_waits(monkeypatch, wait: int = WAIT) -> list[str]:
    """After every drafted step the schedule waits `wait` steps. Returns the loops the calls run, in order: "A" for
    transformers' assisted loop, "P" for plain decoding's."""
    record = AdaptiveDraftPolicy.record

    def record_then_wait(self, step):
        record(self, step)
        if step.drafter_forwards:
            self.plain_steps_left = wait

    monkeypatch.setattr(AdaptiveDraftPolicy, "record", record_then_wait)
    loops = []
    for name, mark in (("_assisted_decoding", "A"), ("_sample", "P")):
        original = getattr(GenerationMixin, name)

        def logged(*args, _original=original, _mark=mark, **kwargs):
            loops.append(_mark)
            return _original(*args, **kwargs)

        monkeypatch.setattr(GenerationMixin, name, logged)
    return loops


def _drafter(target, kind: str = "hyperdflash"):
    torch.manual_seed(0)
    if kind == "mtp":
        drafter = DeepseekV4MTPForDrafting.from_target(target)
    else:
        drafter = HyperDFlashForDrafting.from_target(target, block_size=4)
    drafter.generation_config.num_assistant_tokens_schedule = "adaptive_transient"
    return drafter.eval()


def _prompt(target, seed: int = 0) -> torch.Tensor:
    vocab = target.config.get_text_config().vocab_size
    return torch.randint(3, vocab, (1, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_with_waits_returns_plain_decodings_outputs_and_cache(family, monkeypatch):
    """Every per-step output the mixin compares (scores, logits, hidden states, eager attentions), under the
    repetition-penalty / bad-words processors, and the returned cache by type and state."""
    target = family_target(family, seed=0)
    prompt = _prompt(target)
    options = generation_kwargs() | {"max_new_tokens": NEW_TOKENS, "attention_mask": torch.ones_like(prompt)}
    plain = target.generate(prompt, **options)
    kinds = ["hyperdflash", "mtp"] if family == "deepseek_v4" else ["hyperdflash"]
    for kind in kinds:
        loops = _force_waits(monkeypatch)
        drafter = _drafter(target, kind)
        stretched = target.generate(prompt, assistant_model=drafter, **options)
        assert loops.count("P") >= 2 and loops[:2] == ["A", "P"], kind
        stats = drafter.last_generation_stats  # each forward makes a token at least; the waits' steps are skipped
        assert stats.new_tokens == NEW_TOKENS and stats.target_forwards <= NEW_TOKENS
        assert stats.skipped_steps >= 2 * WAIT
        assert_similar_outputs(stretched, plain)
        assert_same_cache(getattr(stretched, CACHE_ARGUMENT), getattr(plain, CACHE_ARGUMENT))
        monkeypatch.undo()


def test_streamer_criteria_and_min_new_tokens_count_over_the_whole_call(monkeypatch):
    """The streamer gets the prompt, each new token and `end()` once; a stateful criterion is called once per token
    (it stops the call at its 45th call, in a stretch after several switches); `min_new_tokens` holds EOS back from
    the call's start, not each stretch's; an EOS in a plain stretch ends the call."""
    target = family_target("deepseek_v4", seed=1)
    prompt = _prompt(target, seed=1)
    reference = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt.shape[1] :]
    eos = int(reference[30:].mode().values)  # a token the target also makes before the 30th new token, or not

    class Streamer:
        def __init__(self):
            self.tokens, self.ends = [], 0

        def put(self, value):
            self.tokens.append(value.reshape(-1))

        def end(self):
            self.ends += 1

    class StopAtCall(StoppingCriteria):
        def __init__(self, calls: int):
            self.calls, self.seen = calls, 0

        def __call__(self, input_ids, scores, **kwargs):
            self.seen += 1
            return torch.full((input_ids.shape[0],), self.seen >= self.calls, dtype=torch.bool)

    for options in (
        {"stopping_criteria": lambda: StoppingCriteriaList([StopAtCall(45)])},
        {"eos_token_id": lambda: eos, "min_new_tokens": lambda: 30},
    ):
        outputs = []
        for drafting in (False, True):
            loops = _force_waits(monkeypatch)
            streamer = Streamer()
            assistant = {"assistant_model": _drafter(target)} if drafting else {}
            made = {name: make() for name, make in options.items()}
            out = target.generate(
                prompt, max_new_tokens=NEW_TOKENS, do_sample=False, streamer=streamer, **made, **assistant
            )
            assert torch.equal(torch.cat(streamer.tokens), out[0]) and streamer.ends == 1
            if drafting:
                assert loops.count("P") >= 2
            outputs.append(out)
            monkeypatch.undo()
        plain, stretched = outputs
        assert torch.equal(stretched, plain) and plain.shape[1] < prompt.shape[1] + NEW_TOKENS


def test_sampling_with_waits_samples_from_the_target(monkeypatch):
    """top_k=1 makes sampling deterministic: the stretched call's samples are the target's."""
    target = family_target("glm5_next", seed=0)
    prompt = _prompt(target, seed=2)
    options = {"max_new_tokens": NEW_TOKENS, "do_sample": True, "top_k": 1}
    plain = target.generate(prompt, **options)
    loops = _force_waits(monkeypatch)
    stretched = target.generate(prompt, assistant_model=_drafter(target), **options)
    assert loops.count("P") >= 2 and torch.equal(stretched, plain)


def test_the_drafter_takes_in_every_position_a_plain_stretch_decoded(monkeypatch):
    """The positions of the context the drafter's forwards take in tile the sequence from the prompt on, with no
    gap where a plain stretch ran: the stretch's features reach the drafter's next forward."""
    target = family_target("deepseek_v4", seed=0)
    positions = []
    propose = BlockProposer.propose

    def spy(self, features, context_positions, *args, **kwargs):
        assert features.shape[1] == context_positions.shape[1]
        positions.extend(context_positions[0].tolist())
        return propose(self, features, context_positions, *args, **kwargs)

    monkeypatch.setattr(BlockProposer, "propose", spy)
    loops = _force_waits(monkeypatch)
    target.generate(_prompt(target), assistant_model=_drafter(target), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert loops.count("P") >= 2
    assert positions == list(range(len(positions))) and len(positions) > 12 + 2 * WAIT


def test_a_stretch_that_ends_the_call_leaves_the_target_unhooked_and_still_counts_its_steps(monkeypatch):
    """No drafted step follows the stretch that ends the call, so it neither hooks the collapse head (a hooked
    module leaves torch's fast call path) nor keeps features, while the stretches the drafter resumes after keep the
    hook; every stretch's forwards count in the stats, and the output is plain decoding's."""
    target = family_target("deepseek_v4", seed=0)
    prompt = _prompt(target)
    plain = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    loops = _force_waits(monkeypatch)
    collapse_head = get_target_adapter(target).collapse_head
    hooked, sample = [], GenerationMixin._sample

    def spy(*args, **kwargs):
        hooked.append(bool(collapse_head._forward_pre_hooks))
        return sample(*args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "_sample", spy)
    forwards = []
    counter = target.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    drafter = _drafter(target)
    try:
        out = target.generate(prompt, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False)
    finally:
        counter.remove()
    assert loops[-1] == "P" and loops.count("P") >= 2
    assert hooked[:-1] == [True] * (len(hooked) - 1) and hooked[-1] is False
    assert not collapse_head._forward_pre_hooks  # nor after the call
    stats = drafter.last_generation_stats
    assert stats.target_forwards == len(forwards) and stats.skipped_steps >= 2 * WAIT
    assert torch.equal(out, plain)


def test_a_wait_shorter_than_a_plain_stretch_stays_in_the_assisted_loop(monkeypatch):
    """Waits of 15 steps skip drafting in the assisted loop (at least two of them in 60 tokens); only one that
    reaches the call's end runs plain decoding's loop."""
    target = family_target("deepseek_v4", seed=0)
    prompt = _prompt(target)
    loops = _force_waits(monkeypatch, wait=MIN_PLAIN_STRETCH - 1)
    drafter = _drafter(target)
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert loops in (["A"], ["A", "P"]) and drafter.last_generation_stats.skipped_steps >= 2 * (MIN_PLAIN_STRETCH - 1)
    monkeypatch.undo()
    assert torch.equal(out, target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False))


def test_concurrent_calls_with_waits_each_give_plain_decoding(monkeypatch):
    """Two threads on one target, each call switching loops (its shared processors, criteria and hooks are its
    own): each output is serial plain decoding's."""
    target = family_target("deepseek_v4", seed=0)
    prompts = [_prompt(target, seed=seed)[:, : 8 + 4 * seed] for seed in range(2)]
    expected = [target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False) for prompt in prompts]
    drafters = [_drafter(target) for _ in prompts]
    loops = _force_waits(monkeypatch)
    calls = [
        lambda prompt=prompt, drafter=drafter: target.generate(
            prompt, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False
        )
        for prompt, drafter in zip(prompts, drafters, strict=True)
    ]
    for _ in range(3):
        outputs = _concurrently(calls)
        assert all(torch.equal(out, plain) for out, plain in zip(outputs, expected, strict=True))
    assert loops.count("P") >= 12


def test_later_stretches_take_the_callers_generation_config_and_the_targets_defaults(monkeypatch):
    """Options from a `generation_config` argument hold in every stretch, and a target whose generation config says
    `cache_implementation="dynamic"` (some Hub checkpoints) still continues from the call's cache."""
    target = family_target("deepseek_v4", seed=0)
    prompt = _prompt(target, seed=3)
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3
    )
    plain = target.generate(prompt, generation_config=config)
    monkeypatch.setattr(target.generation_config, "cache_implementation", "dynamic")
    loops = _force_waits(monkeypatch)
    stretched = target.generate(prompt, generation_config=config, assistant_model=_drafter(target))
    assert loops.count("P") >= 2 and torch.equal(stretched, plain)


def test_a_call_that_starts_with_a_wait_times_its_prefill_in_plain_decodings_loop(monkeypatch):
    """A wait carried into a call makes its first stretch plain, so the prefill runs there: the call's stats still
    time it."""
    target = family_target("deepseek_v4", seed=0)
    begin_call = AdaptiveDraftPolicy.begin_call

    def begin_waiting(self):
        begin_call(self)
        self.plain_steps_left = WAIT

    monkeypatch.setattr(AdaptiveDraftPolicy, "begin_call", begin_waiting)
    loops = _force_waits(monkeypatch)
    drafter = _drafter(target)
    drafter.generation_config.num_assistant_tokens_schedule = "adaptive"  # the schedule that carries waits over
    target.generate(_prompt(target), assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False)
    stats = drafter.last_generation_stats
    assert loops[:2] == ["P", "A"] and stats.prefill_seconds > 0 and stats.skipped_steps >= WAIT
