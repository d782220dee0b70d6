"""Batched speculative decoding: several prompts in one `generate(..., assistant_model=drafter)` call.

Every row must be what plain batched `generate()` gives for the same batch (greedy, float32): rows left-padded to
different lengths, rows that stop early, `num_return_sequences`, images, and a conversation continued on the
returned cache. Block drafts come from an oracle that is right most of the time, so rows accept different numbers
of drafts in the same step; native MTP and DSpark draft for themselves, row by row. The statistical tests of batched
sampling are in `test_batched_sampling.py`.
"""

import re
from contextlib import nullcontext

import pytest
import torch
from test_lossless import CONTINUED, DRAFTER_EXACT, EVERY_OUTPUT, EXACT, IMAGES, PARITY_DOC, REFUSED
from test_lossless import FAMILIES as BUILDERS
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria

import hf_hyperdflash  # noqa: F401  (installs the generate() integration)
from hf_hyperdflash import reference
from hf_hyperdflash.modeling.draft_policy import DraftCosts
from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT
from hf_hyperdflash.testing import (
    DEEPSEEK_V4_ONLY_KINDS,
    OWN_DRAFTER_KINDS,
    OracleProposer,
    assert_same_cache,
    image_prompt,
    new_drafter,
    oracle_drafting,
    tiny_glm5_next,
    tiny_qwen4_exp_composite,
)

pytestmark = pytest.mark.compat  # runs generate()'s own preparation with its internals: `pytest -m compat`

FAMILIES = {name: BUILDERS[name] for name in ("deepseek_v4", "hy_v4", "glm5_next", "qwen4_exp")}
# Rows below, inside and beyond the windows and indexer budgets, so left padding reaches into all of them
ROW_LENGTHS = (5, 40, 13)
NEW_TOKENS = 14
PAD = 0
BLOCK_KINDS = ("hyperdflash", "vanilla_dflash", "hyperdflash_heads")  # their drafts come from the oracle


@pytest.fixture(scope="module", name="targets")
def built_targets():
    """The tiny target of each family, built once per module (test_batched_rows.py shares it)."""
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = FAMILIES[family](0).eval()
        return built[family]

    return get


def left_padded_batch(vocab_size: int, lengths=ROW_LENGTHS, seed: int = 0) -> dict:
    """Random prompts of `lengths`, left-padded with token 0 as tokenizers pad for generation."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(3, vocab_size, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def drafter_for(target, kind: str):
    """A drafter that drafts every step (the default schedule verifies little from an untrained one)."""
    drafter = new_drafter(target, kind)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    return drafter


def padding_of(inputs: dict, reference_ids) -> list[int] | None:
    """Each row's left padding, where the oracle follows a reference."""
    if reference_ids is None or "attention_mask" not in inputs:
        return None
    return (inputs["attention_mask"] == 0).sum(dim=1).tolist()


def speculative(target, kind, drafter, reference_ids, inputs, corruption=0.3, seed=0, **kwargs):
    """generate() with `drafter`; block drafts come from an oracle over `reference_ids` (one row per row)."""
    vocab = target.config.get_text_config().vocab_size
    with (
        oracle_drafting(OracleProposer(vocab, reference_ids, corruption, seed, padding_of(inputs, reference_ids)))
        if kind in BLOCK_KINDS
        else nullcontext()
    ):
        return target.generate(**inputs, assistant_model=drafter, pad_token_id=PAD, **kwargs)


CASES = [
    (family, kind)
    for family in FAMILIES
    for kind in OWN_DRAFTER_KINDS
    if family == "deepseek_v4" or kind not in DEEPSEEK_V4_ONLY_KINDS
]


@pytest.mark.parametrize(("family", "kind"), CASES)
def test_every_row_is_plain_batched_decodings(targets, family, kind):
    target = targets(family)
    inputs = left_padded_batch(target.config.get_text_config().vocab_size)
    greedy = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
    expected = target.generate(**inputs, pad_token_id=PAD, **greedy)
    drafter = drafter_for(target, kind)
    got = speculative(target, kind, drafter, expected, inputs, **greedy)
    assert torch.equal(got, expected)
    stats = drafter.last_generation_stats
    assert stats.new_tokens == NEW_TOKENS
    if kind in BLOCK_KINDS:  # the oracle is right often enough that every row keeps drafts
        assert max(stats.accepted_per_step) >= 1
        assert min(stats.row_taus) > 1


def test_rows_that_stop_early_are_padded_as_plain_decoding_pads_them(targets):
    """An end-of-sequence token one row emits early (and another later or never) stops that row alone."""
    target = targets("deepseek_v4")
    inputs = left_padded_batch(target.config.vocab_size)
    free = target.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    eos = int(free[1, -NEW_TOKENS + 3])  # row 1's fourth new token
    greedy = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "eos_token_id": eos}
    expected = target.generate(**inputs, pad_token_id=PAD, **greedy)
    assert (expected[:, -1] == PAD).any() and expected.shape[1] > free.shape[1] - NEW_TOKENS + 4
    for kind in ("hyperdflash", "mtp"):
        got = speculative(target, kind, drafter_for(target, kind), expected, inputs, corruption=0.1, **greedy)
        assert torch.equal(got, expected), kind


def test_stop_strings_stop_each_row_where_plain_decoding_does():
    """With the shipped byte-level tokenizer and target: a stop string one row emits stops that row, the others go
    on; the per-step scores and the returned cache are plain decoding's."""
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path(), padding_side="left")
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    chats = [
        [{"role": "user", "content": "How do I make a good cup of coffee at home?"}],
        [{"role": "user", "content": "Name three rivers."}],
    ]
    texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    inputs = dict(tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False))
    width = inputs["input_ids"].shape[1]
    full = target.generate(**inputs, max_new_tokens=30, do_sample=False)
    stop = tokenizer.decode(full[0, width + 7]).strip()
    assert stop
    options = {"stop_strings": [stop], "tokenizer": tokenizer, "return_dict_in_generate": True, "output_scores": True}
    expected = target.generate(**inputs, max_new_tokens=30, do_sample=False, **options)
    torch.manual_seed(1)
    drafter = new_drafter(target, "hyperdflash", block_size=8)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    with oracle_drafting(OracleProposer(len(tokenizer), full, corruption=0.1, seed=0)):
        got = target.generate(**inputs, max_new_tokens=30, do_sample=False, assistant_model=drafter, **options)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores)
    for ours, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert getattr(got, CACHE_ARGUMENT).get_seq_length() == got.sequences.shape[1] - 1


@pytest.mark.parametrize("kind", ["hyperdflash", "dspark"])
def test_the_returned_cache_continues_a_batched_conversation(targets, kind):
    """The cache a batched speculative call returns is plain decoding's, by class and state; a second turn on it,
    with a drafter or without, is plain decoding's second turn on plain decoding's cache. (On DeepSeek-V4 a left-padded
    batch continued on its cache differs from one decoded over the whole conversation: the compressors pooled the
    first turn's padding. Plain decoding's own continuation is the reference.)"""
    target = targets("deepseek_v4")
    inputs = left_padded_batch(target.config.vocab_size)
    turn = {"max_new_tokens": 8, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    plain_first = target.generate(**inputs, pad_token_id=PAD, **turn)
    drafter = drafter_for(target, kind)
    first = speculative(target, kind, drafter, plain_first.sequences, inputs, **turn)
    assert torch.equal(first.sequences, plain_first.sequences)
    assert len(first.logits) == len(plain_first.logits) == 8
    for ours, theirs in zip(first.logits, plain_first.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert_same_cache(getattr(first, CACHE_ARGUMENT), getattr(plain_first, CACHE_ARGUMENT))
    conversation = {
        "input_ids": torch.cat([plain_first.sequences, torch.tensor([[7, 8, 9]]).expand(3, -1)], dim=1),
        "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(3, 8 + 3, dtype=torch.long)], dim=1),
    }
    second = {"max_new_tokens": 8, "do_sample": False}
    plain_cache = {CACHE_ARGUMENT: getattr(plain_first, CACHE_ARGUMENT)}
    expected = target.generate(**conversation, **second, **plain_cache, pad_token_id=PAD)
    for drafting in (True, False):
        cache = getattr(speculative(target, kind, drafter, plain_first.sequences, inputs, **turn), CACHE_ARGUMENT)
        if drafting:
            got = speculative(target, kind, drafter, expected, conversation | {CACHE_ARGUMENT: cache}, **second)
        else:
            got = target.generate(**conversation, **second, **{CACHE_ARGUMENT: cache}, pad_token_id=PAD)
        assert torch.equal(got, expected), "with a drafter" if drafting else "plain"


def test_num_return_sequences_samples_each_row_and_a_seeded_call_repeats(targets):
    target = targets("deepseek_v4")
    inputs = left_padded_batch(target.config.vocab_size, lengths=(6, 11))
    sampling = {"max_new_tokens": NEW_TOKENS, "do_sample": True, "num_return_sequences": 3}
    for kind in ("hyperdflash", "mtp"):
        drafter = drafter_for(target, kind)
        runs = []
        for _ in range(2):
            torch.manual_seed(5)
            runs.append(speculative(target, kind, drafter, None, inputs, **sampling))
        assert runs[0].shape == (6, 11 + NEW_TOKENS)
        assert torch.equal(runs[0], runs[1])
        assert torch.equal(runs[0][:, :11], inputs["input_ids"].repeat_interleave(3, dim=0))
        assert len({tuple(row) for row in runs[0][:3, 11:].tolist()}) > 1  # rows of one prompt sample apart
    # greedy with several sequences per prompt: refused as plain decoding refuses it
    greedy = {"max_new_tokens": 4, "do_sample": False, "num_return_sequences": 2}
    with pytest.raises(ValueError, match="num_return_sequences"):
        target.generate(**inputs, pad_token_id=PAD, **greedy)
    with pytest.raises(ValueError, match="num_return_sequences"):
        speculative(target, "hyperdflash", drafter_for(target, "hyperdflash"), None, inputs, **greedy)


@pytest.mark.parametrize("family", ["glm5_next", "qwen4_exp_composite"])
def test_a_batch_of_image_prompts_decodes_as_plain_decoding(family):
    target = (tiny_glm5_next() if family == "glm5_next" else tiny_qwen4_exp_composite()).eval()
    prompts = [image_prompt(target, seed) for seed in (0, 1)]
    inputs = {name: torch.cat([prompt[name] for prompt in prompts]) for name in prompts[0]}
    greedy = {"max_new_tokens": 10, "do_sample": False}
    expected = target.generate(**inputs, pad_token_id=PAD, **greedy)
    got = speculative(target, "hyperdflash", drafter_for(target, "hyperdflash"), expected, inputs, **greedy)
    assert torch.equal(got, expected)


def _wrong_devices(inputs: dict) -> dict:
    return inputs | {"attention_mask": inputs["attention_mask"].to("meta")}


BAD_BATCHES = {
    "padded on the right": (
        lambda inputs: inputs | {"attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])},
        "padding_side = 'left'",
    ),
    "a hole in a row": (
        lambda inputs: inputs | {"attention_mask": torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])},
        "between real tokens",
    ),
    "inputs on two devices": (_wrong_devices, "different devices"),
    "a row of padding only": (
        lambda inputs: inputs | {"attention_mask": torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])},
        "all padding",
    ),
}


@pytest.mark.parametrize("case", BAD_BATCHES)
def test_a_batch_it_cannot_serve_is_refused_before_any_forward(targets, case, monkeypatch):
    target = targets("deepseek_v4")
    inputs = {"input_ids": torch.randint(3, 50, (2, 5)), "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    make, message = BAD_BATCHES[case]
    monkeypatch.setattr(type(target), "forward", lambda *a, **k: pytest.fail("the target ran a forward"))
    with pytest.raises(ValueError, match=message):
        target.generate(**make(inputs), assistant_model=drafter_for(target, "hyperdflash"), max_new_tokens=4)


@pytest.mark.parametrize(
    "option", [{"output_attentions": True}, {"output_hidden_states": True}, {"streamer": object()}]
)
def test_per_step_attentions_hidden_states_and_streamers_are_refused_for_a_batch(targets, option, monkeypatch):
    target = targets("deepseek_v4")
    inputs = left_padded_batch(target.config.vocab_size)
    monkeypatch.setattr(type(target), "forward", lambda *a, **k: pytest.fail("the target ran a forward"))
    with pytest.raises(ValueError, match="batched speculative call"):
        target.generate(
            **inputs,
            assistant_model=drafter_for(target, "hyperdflash"),
            max_new_tokens=4,
            return_dict_in_generate=True,
            **option,
        )


def test_a_batch_pays_each_drafted_position_as_one_row_does_and_row_by_row_drafting_more():
    costs = DraftCosts(draft_cost=0.49, verify_cost=0.09)
    alone = costs.for_batch(1, drafts_row_by_row=True)
    assert (alone.draft_cost, alone.verify_cost) == pytest.approx((costs.draft_cost, costs.verify_cost))
    for rows in (2, 4, 8, 16):
        batched = costs.for_batch(rows, drafts_row_by_row=False)
        assert (batched.draft_cost, batched.verify_cost) == pytest.approx((costs.draft_cost, costs.verify_cost))
        by_row = costs.for_batch(rows, drafts_row_by_row=True).draft_cost
        assert costs.draft_cost < by_row < rows * costs.draft_cost
    growing = DraftCosts(draft_cost=0.49, verify_cost=0.09, draft_row_cost=0.02)
    assert growing.for_batch(16, drafts_row_by_row=False).draft_cost == pytest.approx(0.49 + 15 * 0.02)


def test_the_schedule_drafts_less_where_rows_accept_less(targets):
    """Under the default schedule: drafts right most of the time are verified deeper than drafts right about a
    third of the time, in a batch as for one row."""
    target = targets("hy_v4")
    inputs = left_padded_batch(target.config.vocab_size, lengths=(12,) * 4, seed=3)
    greedy = {"max_new_tokens": 30, "do_sample": False}
    expected = target.generate(**inputs, pad_token_id=PAD, **greedy)
    drafted = []
    for corruption in (0.05, 0.7):
        drafter = new_drafter(target, "hyperdflash")
        got = speculative(target, "hyperdflash", drafter, expected, inputs, corruption=corruption, **greedy)
        assert torch.equal(got, expected)
        drafted.append(drafter.last_generation_stats.drafted_per_step)
    assert drafted[1] < drafted[0]


def test_the_schedule_judges_a_batch_by_its_slowest_row(targets):
    """Three rows whose drafts are always right and one whose drafts never are: the batch ends with that row, which
    gains one token a drafted step at more than a plain step's cost, so under the default schedule drafting stops
    paying at once, however much the other rows verify, and the batch decodes most steps without the drafter."""
    target = targets("hy_v4")
    inputs = left_padded_batch(target.config.vocab_size, lengths=(12,) * 4, seed=3)
    greedy = {"max_new_tokens": 40, "do_sample": False}
    expected = target.generate(**inputs, pad_token_id=PAD, **greedy)
    hints = expected.clone()
    hints[0] = (expected[0] + 1) % target.config.vocab_size  # row 0's drafts: never the target's token
    drafter = new_drafter(target, "hyperdflash")
    assert drafter.generation_config.num_assistant_tokens_schedule == "adaptive"
    drafter.generation_config.draft_from_context = False  # the drafter's pace alone (copies: test_context_copy.py)
    got = speculative(target, "hyperdflash", drafter, hints, inputs, corruption=0.0, **greedy)
    assert torch.equal(got, expected)
    stats = drafter.last_generation_stats
    assert stats.decoding_steps - stats.skipped_steps <= 3  # the first step, and a probe or two


# Every row of docs/generate_parity.md, on a batch: options the batch-1 matrix (`test_lossless.py`) runs and that a
# batch takes are run here too, the others refused (or refused with a drafter at any batch size)
REFUSED_ON_A_BATCH = {
    "attention_mask with zeros": "zeros between real tokens (a hole): a batch takes left padding only",
    "output_hidden_states": "per-step outputs of every layer",
    "output_attentions": "per-step outputs of every layer",
    "streamer": "transformers' streamers take one row",
    "assistant_confidence_threshold": "a per-row threshold",
}
EXACT_ON_A_BATCH = [option for option in EXACT if option not in REFUSED_ON_A_BATCH]
OPTION_KINDS = ("hyperdflash", "mtp", "vanilla_dflash", "dspark", "hyperdflash_heads")


def _option_case(index: int) -> tuple[str, str]:
    """The (family, kind) of an option case, each taken in turn (native MTP and DSpark on DeepSeek-V4)."""
    kind = OPTION_KINDS[index % len(OPTION_KINDS)]
    family = "deepseek_v4" if kind in DEEPSEEK_V4_ONLY_KINDS else list(FAMILIES)[index % len(FAMILIES)]
    return family, kind


@pytest.mark.parametrize("option", EXACT_ON_A_BATCH + ["output_scores", "output_logits"])
def test_every_option_a_batch_takes_is_plain_batched_decodings(targets, option):
    family, kind = _option_case((EXACT_ON_A_BATCH + ["output_scores", "output_logits"]).index(option))
    target = targets(family)
    inputs = left_padded_batch(target.config.get_text_config().vocab_size, seed=len(option))
    width = inputs["input_ids"].shape[1]
    free = target.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    if option in EXACT:
        settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False} | EXACT[option](free[:1, width:], width)
    else:
        settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "return_dict_in_generate": True, option: True}
    settings = {"pad_token_id": PAD} | settings
    torch.manual_seed(0)
    expected = target.generate(**inputs, **settings)
    drafter = drafter_for(target, kind)
    vocab = target.config.get_text_config().vocab_size
    reference_ids = expected if isinstance(expected, torch.Tensor) else expected.sequences
    torch.manual_seed(0)
    with oracle_drafting(OracleProposer(vocab, reference_ids, 0.3, 0)) if kind in BLOCK_KINDS else nullcontext():
        got = target.generate(**inputs, assistant_model=drafter, **settings)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected)
        return
    assert torch.equal(got.sequences, expected.sequences)
    for name in ("scores", "logits"):
        ours, theirs = getattr(got, name), getattr(expected, name)
        assert (ours is None) == (theirs is None), name
        for a, b in zip(ours or (), theirs or (), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class StopAfterToken(StoppingCriteria):
    """Stops a row the step after it emits `token`; counts its calls."""

    def __init__(self, token: int):
        self.token, self.calls = token, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return input_ids[:, -2] == self.token


def test_a_custom_stopping_criterion_sees_each_new_token_once(targets):
    target = targets("hy_v4")
    inputs = left_padded_batch(target.config.vocab_size)
    free = target.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    token = int(free[2, -NEW_TOKENS + 4])
    criteria = [StopAfterToken(token), StopAfterToken(token)]
    greedy = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "eos_token_id": 1}
    expected = target.generate(**inputs, pad_token_id=PAD, stopping_criteria=[criteria[0]], **greedy)
    got = speculative(
        target,
        "hyperdflash",
        drafter_for(target, "hyperdflash"),
        expected,
        inputs,
        0.1,
        stopping_criteria=[criteria[1]],
        **greedy,
    )
    assert torch.equal(got, expected)
    assert criteria[1].calls == criteria[0].calls


def test_the_documented_batched_column_is_the_tested_one():
    rows = re.findall(r"^\| `([^`]+)` \| (exact|refused) \| (exact|refused) \|", PARITY_DOC.read_text(), re.M)
    batched = {name: verdict for name, _, verdict in rows}
    every_row = {*EXACT, *DRAFTER_EXACT, *EVERY_OUTPUT, CONTINUED, ", ".join(IMAGES), *REFUSED}
    every_row |= {"stop_strings", "stopping_criteria", "streamer", "num_return_sequences"}
    assert set(batched) == every_row
    refused = {*REFUSED_ON_A_BATCH, *REFUSED}
    assert {name for name, verdict in batched.items() if verdict == "refused"} == refused
